"""How many onnxruntime threads a rank gets, and whether they may spin.

Ranks that share a machine share its cores. A rank's cores are the ones the launcher bound
it to (``os.sched_getaffinity``: mpiexec's ``-bind-to core``, Slurm's ``--cpu-bind``); when
it bound none, every rank sees the whole machine and the cores are divided among the ranks
that work there (idle ranks only wait). onnxruntime's pool threads spin between runs by
default: a rank waiting in MPI while its own and its neighbours' threads spin on the same
cores slows every rank of the machine (a 117 MB decode step on 16 cores took 33–84 ms on
1x2 with spinning, 1.26 ms without). Cores of its own were not enough either: on a 16-core
machine whose ranks were each bound to cores of their own, the same step took 5.0–5.4 ms on
1x2 and 2.6–3.2 ms on 1x4 with spinning, 1.70–1.72 and 1.61–1.66 ms without. What 2 cores
show puts the cause within each rank: its program is cut at its collectives into segments,
each an onnxruntime session with a pool of its own, and the pools of the sessions that do
not run spin beside the one that does (``benchmarks/segment_pools.py``: one process running
the five sessions of that 1x2 rank with 2 threads, 20.0 ms a step with a spinning pool
each, 1.48 ms with pools that do not spin, 1.04 ms on one spinning pool shared by them). So a rank
with cores of its own spins on one pool (``one_pool``): its one session's, or, in a process
that is the rank's own, onnxruntime's process-wide pool shared by all its sessions
(``providers.share_one_pool``; on 16 cores, that rank with 8 threads: 1.05 ms on one pool,
1.36 on pools that do not spin, 22.4 on spinning pools). Where neither can be (several
sessions in a process that is not the rank's), its pools do not spin.

Where the launcher bound none (every working rank of a machine sees the same cores: MPICH's
mpiexec by default), the ranks bind themselves (``plan_threads``): the machine's physical
cores (hyperthread siblings kept together, ``physical_cores``) are cut into one contiguous
share per working rank, each rank sets its affinity to its share before onnxruntime makes
its threads, and runs one thread per physical core of it (spinning on one pool, as above).
Only where every rank gets two physical cores or more (with one, a rank's onnxruntime has
no pool threads, and a 1x2 decode step on 2 cores was no faster bound, 0.872 of
onnxruntime-genai's speed against 0.887 unbound; ranks on shared cores keep the old rule).

A rank with cores of its own (alone on its machine, or bound by meshplan) also pins each of
its threads to one core: the calling thread to the first, onnxruntime's pool threads to the
others (``session.intra_op_thread_affinities``), so that the scheduler does not move them
between cores (a decode step of the 398 MB float32 Llama on 2 cores: 0.938 of
onnxruntime-genai's speed unpinned, 0.968 pinned, in interleaved blocks); the process-wide
pool's threads cannot be pinned from Python: they run on the rank's cores, unpinned.
Only the commands pin and share one pool (``set_binding(..., pin=True)``): they own their process.
``--no-bind-cores`` (``set_binding``) keeps the launcher's affinity as it is and pins nothing.
``MESHPLAN_SPINNING=0`` (or ``1``) in a rank's environment turns its pool threads' spinning off
(or on) whatever the rule says, with a pool per session: to measure what spinning does on a
machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from meshplan.rank_layout import own_cores


_binding = [True]
_pinning = [False]
_own_process = [False]


def set_binding(enabled: bool, pin: bool = False) -> None:
    """Whether ranks the launcher left unbound bind themselves to a share of their machine's
    cores (``plan_threads``), and whether a rank with cores of its own pins each thread to
    one (``pin``: for a process that is the rank's own, as the commands' are; a ``Job`` made
    in someone else's process pins nothing, since the threads that process makes later would
    inherit its thread's one core; nor does it share one pool between its sessions: ``one_pool``).
    Set once per process, before the job starts (every rank parses the same command line)."""
    _binding[0] = bool(enabled)
    _pinning[0] = bool(enabled and pin)
    _own_process[0] = bool(pin)


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    spinning: bool
    cores: int          # the cores the rank may run on
    working: int        # ranks that work on its machine, itself included
    bound: bool         # bound to cores no other working rank has
    self_bound: bool = False   # ... by meshplan (the launcher bound none)
    pinned: bool = False       # each thread pinned to a core of its own (``pins``)
    pins: tuple = field(default=(), compare=False)   # each thread's CPUs, the calling thread's first
    shared_pool: bool = False  # its sessions share the process's one pool (``one_pool``)

    @property
    def why(self) -> str:
        if self.working == 1:
            return f"alone on its {self.cores} core(s)"
        if self.self_bound:
            return f"bound by meshplan to {self.cores} core(s) of its own: the launcher bound none"
        if self.bound:
            return f"bound by the launcher to {self.cores} core(s) of its own"
        return f"{self.cores} core(s) shared by {self.working} working ranks"

    @property
    def oversubscribed(self) -> bool:
        """More working ranks than cores on its machine: they take turns on the cores."""
        return not self.bound and self.working > self.cores

    def describe(self) -> str:
        pinned = ", one core each" if self.pinned and self.threads > 1 else ""
        pool = ", one pool for all its sessions" if self.shared_pool else ""
        return (f"{self.threads} onnxruntime thread(s){pinned}{pool}, spinning {'on' if self.spinning else 'off'} "
                f"({self.why})")

    ROW = 8   # integers in ``row``

    def row(self) -> list[int]:
        """As integers, for a buffer-based gather (``from_row`` reads it back, ``pins`` aside)."""
        return [self.threads, int(self.spinning), self.cores, self.working, int(self.bound), int(self.self_bound),
                int(self.pinned), int(self.shared_pool)]

    @classmethod
    def from_row(cls, row) -> "ThreadChoice":
        threads, spinning, cores, working, bound, self_bound, pinned, shared_pool = (int(v) for v in row)
        return cls(threads, bool(spinning), cores, working, bool(bound), bool(self_bound), bool(pinned),
                   shared_pool=bool(shared_pool))

    def pool_affinities(self) -> str | None:
        """onnxruntime's ``session.intra_op_thread_affinities`` for the pool threads (its
        processor numbers count from 1), None where the threads are not pinned."""
        if not self.pinned or len(self.pins) != self.threads or self.threads < 2:
            return None
        return ";".join(",".join(str(cpu + 1) for cpu in cpus) for cpus in self.pins[1:])


def choose_threads(working_here: int, cores: set[int] | None = None, machine_cores: int | None = None,
                   others: list[set[int]] | None = None) -> ThreadChoice:
    """The choice for a rank that works on a machine where ``working_here`` ranks work
    (itself included). ``cores``: its affinity (default: this process's); ``machine_cores``:
    the machine's core count; ``others``: the affinities of the other working ranks there,
    where known (a launcher that bound each rank to its own cores)."""
    cores = own_cores() if cores is None else set(cores)
    count = max(1, len(cores))
    machine_cores = machine_cores or os.cpu_count() or count
    working_here = max(1, working_here)
    if working_here == 1:
        return ThreadChoice(count, True, count, 1, False)
    if others is not None and count < machine_cores and all(not (cores & o) for o in others):
        return ThreadChoice(count, False, count, working_here, True)
    return ThreadChoice(max(1, count // working_here), False, count, working_here, False)


def physical_cores(cpus: set[int], root: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """The logical CPUs of ``cpus`` grouped by physical core (hyperthread siblings together,
    as the kernel lists them under ``root``: ``cpuN/topology/core_cpus_list``,
    ``thread_siblings_list`` on older kernels), in order of their first CPU; a CPU whose
    topology cannot be read is a core of its own."""
    groups: dict[tuple, list[int]] = {}
    for cpu in sorted(cpus):
        siblings = None
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                with open(f"{root}/cpu{cpu}/topology/{name}") as listed:
                    siblings = tuple(sorted(_cpu_list(listed.read())))
                break
            except (OSError, ValueError):
                continue
        groups.setdefault(siblings if siblings and cpu in siblings else (cpu,), []).append(cpu)
    return sorted(groups.values())


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list ("0-3,8-11")."""
    found = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


SPINNING = "MESHPLAN_SPINNING"


def plan_threads(working: list[set[int]], index: int, machine_cores: int | None = None,
                 groups: list[list[int]] | None = None, bind: bool | None = None,
                 pin: bool | None = None) -> tuple[ThreadChoice, set[int] | None]:
    """The choice for working rank ``index`` of a machine whose working ranks have the
    affinities ``working``, and the cores it should bind itself to (None: keep its own).
    ``groups``: the machine's cores grouped by physical core (default: ``physical_cores`` of
    its affinity, read here); ``bind``, ``pin``: whether it may bind itself, and pin its
    threads (default: ``set_binding``'s). ``MESHPLAN_SPINNING`` (0 or 1) sets the spinning."""
    choice, share = _plan_threads(working, index, machine_cores, groups, bind, pin)
    forced = os.environ.get(SPINNING, "").strip()
    if forced in ("0", "1") and choice.spinning != (forced == "1"):
        choice = replace(choice, spinning=forced == "1")
    return choice, share


def _plan_threads(working: list[set[int]], index: int, machine_cores: int | None, groups: list[list[int]] | None,
                  bind: bool | None, pin: bool | None) -> tuple[ThreadChoice, set[int] | None]:
    cores = set(working[index])
    count = len(working)
    may = (_binding[0] if bind is None else bind) and hasattr(os, "sched_setaffinity")
    pins = may and (_pinning[0] if pin is None else pin)
    if may and count > 1 and all(set(a) == cores for a in working):
        groups = physical_cores(cores) if groups is None else [g for g in groups if set(g) <= cores]
        per = len(groups) // count
        if per >= 2:
            mine = groups[index * per:(index + 1) * per]
            share = {cpu for group in mine for cpu in group}
            return ThreadChoice(per, False, len(share), count, True, True, pins,
                                tuple(tuple(g) for g in mine) if pins else ()), share
    others = [set(a) for i, a in enumerate(working) if i != index]
    choice = choose_threads(count, cores, machine_cores, others)
    if pins and count == 1:   # alone: its threads one per CPU
        return ThreadChoice(choice.threads, choice.spinning, choice.cores, 1, False, False, True,
                            tuple((cpu,) for cpu in sorted(cores))[:choice.threads]), None
    return choice, None


def one_pool(choice: ThreadChoice, sessions: int, existing: int = 0) -> ThreadChoice:
    """The choice for a rank whose program runs as ``sessions`` onnxruntime sessions one after
    another (its segments): a rank with cores of its own (alone on its machine, or bound) and
    threads to spin spins on one pool: its one session's, or, with several and a process that
    is its own (``set_binding(..., pin=True)``), the process's pool shared by them
    (``shared_pool``, its threads unpinned: the caller makes it with
    ``providers.share_one_pool`` before it opens a session, and keeps ``choice`` where that is
    refused). Otherwise, or where ``MESHPLAN_SPINNING`` says, ``choice`` as it is. Where the
    process has a pool already (``existing`` threads: onnxruntime sizes it once), every
    session runs on that one, whatever the rule."""
    if existing:
        return replace(choice, threads=existing, spinning=True, shared_pool=True, pinned=False, pins=())
    if choice.threads < 2 or not (choice.bound or choice.working == 1):
        return choice
    if os.environ.get(SPINNING, "").strip() in ("0", "1"):
        return choice
    if sessions <= 1:
        return replace(choice, spinning=True)
    if not _own_process[0]:
        return choice
    return replace(choice, spinning=True, shared_pool=True, pinned=False, pins=())


def pin_calling_thread(choice: ThreadChoice) -> bool:
    """The calling thread runs on the first of ``choice``'s pinned cores from now on (the
    pool threads are onnxruntime's to pin: ``pool_affinities``); False where nothing is
    pinned or the system refuses."""
    if not choice.pinned or not choice.pins:
        return False
    try:
        os.sched_setaffinity(0, set(choice.pins[0]))
    except OSError:
        return False
    return True


def rank_cores(choice: ThreadChoice | None) -> set[int] | None:
    """Every core of a rank whose threads are pinned (None where nothing is): where a thread
    or process made after ``pin_calling_thread``, which inherited its one core, may run."""
    if choice is not None and choice.pinned and choice.pins:
        return {cpu for cpus in choice.pins for cpu in cpus}
    return None


def with_idle_cores(working: list[set[int]], idle: list[set[int]],
                    groups: list[list[int]] | None = None) -> list[set[int]]:
    """The affinities of a machine's working ranks, each widened by a share of the CPUs that
    only the plan's idle ranks there may run on (a launcher that bound every rank to cores of
    its own, as Open MPI does by default, leaves those cores unused while the idle ranks
    sleep): split by physical core (``groups``, default ``physical_cores``), in order, the
    first ranks taking one more where they do not divide. Unchanged where there are none, as
    where the launcher bound no rank (every rank may run on every core). Every rank works
    this out from the same gathered affinities, so each knows the others' widened cores."""
    taken = set().union(*working) if working else set()
    spare = set().union(*idle) - taken if idle else set()
    if not spare or not working:
        return [set(a) for a in working]
    groups = physical_cores(spare) if groups is None else [[c for c in g if c in spare] for g in groups]
    groups = [g for g in groups if g]
    per, extra = divmod(len(groups), len(working))
    widened, start = [], 0
    for index, cores in enumerate(working):
        count = per + (1 if index < extra else 0)
        widened.append(set(cores) | {cpu for group in groups[start:start + count] for cpu in group})
        start += count
    return widened


def may_bind() -> bool:
    """Whether ranks may bind themselves (``set_binding``; ``--no-bind-cores`` says no)."""
    return _binding[0] and hasattr(os, "sched_setaffinity")


def bind_to(cores: set[int]) -> bool:
    """This process (and the threads it makes from now on) runs on ``cores`` only; False
    where the system refuses (the process keeps its cores)."""
    try:
        os.sched_setaffinity(0, cores)
    except OSError:
        return False
    return True
