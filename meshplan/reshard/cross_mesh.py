"""Cross-mesh resharding: unit tasks, their schedule, and a simulator to compare schedules.

A tensor of shape ``shape`` laid out as ``src_spec`` on logical mesh A is needed as
``dst_spec`` on mesh B (disjoint ranks; the shapes of A and B may differ). Following
Zhuang et al., "On Optimizing the Communication of Model Parallelism" (MLSys 2023):

1. **Unit tasks.** Intersecting every device box of A with every device box of B gives
   the coarsest common refinement of the two layouts; each piece becomes a
   :class:`UnitTask`: the slice, the A ranks that hold all of it (``senders``) and the B
   ranks that need it (``receivers``). With ``allow_local_allgather=True`` the tasks
   deliver a finer spec on B (a replicated B axis becomes a split one), so a slice that
   every replica along that axis needs is sent in pieces, one piece per replica, and an
   intra-B all-gather (:class:`AllGatherStep`) completes the layout: Megatron's
   scatter + all-gather for equal meshes, the "local all-gather" for unequal ones.
2. **Execution.** A task picks ONE sender, which broadcasts the slice to all receivers
   (a plain send/recv when there is one receiver).
3. **Scheduling.** Tasks that share a sender or a receiver cannot overlap; the schedule
   is an order and a sender per task, executed as soon as possible (each rank runs its
   tasks in that order). Algorithms: ``naive``, ``load_balance``, ``dfs`` (exact
   branch and bound, budgeted) and ``randomized_greedy`` (the default).
4. **Simulation.** :func:`simulate` runs a schedule on the cluster model: a task first
   pays its latency, then streams its bytes at the rate of the slowest link it crosses;
   tasks that leave or enter a host share that host's inter-host bandwidth (max-min
   fair). :func:`lower_bound` bounds every schedule's makespan from below.
5. **Rearranging inside A first.** With a ``send_spec`` the source ranks first reshard
   the tensor among themselves (``CrossMeshTransfer.prepare``: intra-mesh collectives
   from ``resharding.reshard_steps``, typically over fast intra-host links) into a
   layout whose pieces line up better with B, e.g. fewer, larger slices per receiver;
   the tasks then send slices of ``send_spec`` shards. :func:`best_resharding` picks
   the send spec and whether to use the local all-gather, minimising prepare +
   makespan + all-gathers.

Everything here is pure planning (no MPI); ``meshplan.runtime.cross_mesh_mpi`` executes
a :class:`CrossMeshTransfer` with its :class:`Schedule`.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Sequence

from meshplan.cost.cluster import Cluster
from meshplan.reshard.steps import CollectiveModel, Step, reshard_seconds, reshard_steps
from meshplan.sharding import R, S0, S01, S1, LogicalMesh, ShardingSpec

SCHEDULE_VERSION = 1
ALGORITHMS = ("naive", "load_balance", "dfs", "randomized_greedy")
DEFAULT_ALGORITHM = "randomized_greedy"

Box = tuple[tuple[int, int], ...]   # (start, stop) per tensor dimension, full-tensor coordinates


# --- unit tasks -----------------------------------------------------------------------


@dataclass(frozen=True)
class UnitTask:
    """One data slice, who holds it on A and who needs it on B."""

    slice: Box
    senders: tuple[int, ...]      # A ranks holding the whole slice, in mesh order
    receivers: tuple[int, ...]    # B ranks needing it, in mesh order
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.slice)

    def __str__(self) -> str:
        box = ",".join(f"{a}:{b}" for a, b in self.slice)
        return f"[{box}] {list(self.senders)}->{list(self.receivers)} {self.nbytes}B"

    def to_dict(self) -> dict:
        return {"slice": [list(p) for p in self.slice], "senders": list(self.senders),
                "receivers": list(self.receivers), "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, data: dict) -> "UnitTask":
        return cls(tuple((int(a), int(b)) for a, b in data["slice"]), tuple(data["senders"]),
                   tuple(data["receivers"]), int(data["nbytes"]))


@dataclass(frozen=True)
class AllGatherStep:
    """All-gather inside B along mesh ``axis`` over tensor ``dim``: ``before`` → ``after``.

    The members of each group (``dst_mesh.axis_groups(axis)``, in that order) hold
    consecutive pieces of ``dim``; afterwards each holds their concatenation.
    """

    axis: int
    dim: int
    before: ShardingSpec
    after: ShardingSpec

    def to_dict(self) -> dict:
        return {"axis": self.axis, "dim": self.dim, "before": str(self.before), "after": str(self.after)}

    @classmethod
    def from_dict(cls, data: dict) -> "AllGatherStep":
        return cls(int(data["axis"]), int(data["dim"]), ShardingSpec.parse(data["before"]), ShardingSpec.parse(data["after"]))


@dataclass(frozen=True)
class CrossMeshTransfer:
    """The whole transfer: the problem, the rearrangement inside A, the spec the tasks
    deliver on B, the all-gathers.

    Before the tasks, the source ranks may run ``prepare`` (intra-A resharding steps,
    ``src_spec`` → ``send_spec``); the tasks send slices of ``send_spec`` shards. With no
    rearrangement ``send_spec`` is ``src_spec`` and ``prepare`` is empty.
    """

    shape: tuple[int, ...]
    itemsize: int
    src_spec: ShardingSpec
    src_mesh: LogicalMesh
    dst_spec: ShardingSpec
    dst_mesh: LogicalMesh
    sent_spec: ShardingSpec                 # what the tasks deliver (dst_spec, or finer)
    allgathers: tuple[AllGatherStep, ...]   # in execution order, sent_spec → dst_spec
    tasks: tuple[UnitTask, ...]
    send_spec: ShardingSpec | None = None   # what the senders hold (None: src_spec)
    prepare: tuple[Step, ...] = ()          # intra-A steps, src_spec → send_spec

    def __post_init__(self):
        if self.send_spec is None:
            object.__setattr__(self, "send_spec", self.src_spec)
        object.__setattr__(self, "prepare", tuple(self.prepare))

    def src_box(self, rank: int) -> Box:
        return device_box(self.src_spec, self.shape, self.src_mesh, rank)

    def send_box(self, rank: int) -> Box:
        """What source ``rank`` holds after ``prepare``: the box its tasks slice from."""
        return device_box(self.send_spec, self.shape, self.src_mesh, rank)

    def sent_box(self, rank: int) -> Box:
        return device_box(self.sent_spec, self.shape, self.dst_mesh, rank)

    def dst_box(self, rank: int) -> Box:
        return device_box(self.dst_spec, self.shape, self.dst_mesh, rank)

    def to_dict(self) -> dict:
        return {
            "shape": list(self.shape), "itemsize": self.itemsize,
            "src_spec": str(self.src_spec), "src_mesh": _mesh_dict(self.src_mesh),
            "dst_spec": str(self.dst_spec), "dst_mesh": _mesh_dict(self.dst_mesh),
            "sent_spec": str(self.sent_spec), "allgathers": [s.to_dict() for s in self.allgathers],
            "tasks": [t.to_dict() for t in self.tasks],
            "send_spec": str(self.send_spec), "prepare": [_step_dict(s) for s in self.prepare],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "CrossMeshTransfer":
        """The inverse of :meth:`to_dict`; a dict without ``send_spec`` / ``prepare`` (an
        older plan) is a transfer without rearrangement."""
        src_spec = ShardingSpec.parse(data["src_spec"])
        send_spec = ShardingSpec.parse(data["send_spec"]) if "send_spec" in data else src_spec
        return cls(
            tuple(data["shape"]), int(data["itemsize"]),
            src_spec, _mesh_from(data["src_mesh"]),
            ShardingSpec.parse(data["dst_spec"]), _mesh_from(data["dst_mesh"]),
            ShardingSpec.parse(data["sent_spec"]), tuple(AllGatherStep.from_dict(s) for s in data["allgathers"]),
            tuple(UnitTask.from_dict(t) for t in data["tasks"]),
            send_spec, tuple(_step_from(s) for s in data.get("prepare", ())),
        )


def _step_dict(step: Step) -> dict:
    return {"kind": step.kind, "axis": step.axis, "dim": step.dim, "to_dim": step.to_dim}


def _step_from(data: dict) -> Step:
    def number(key):
        value = data.get(key)
        return None if value is None else int(value)

    return Step(str(data["kind"]), int(data["axis"]), number("dim"), number("to_dim"))


def _mesh_dict(mesh: LogicalMesh) -> dict:
    return {"shape": list(mesh.shape), "ranks": list(mesh.ranks)}


def _mesh_from(data: dict) -> LogicalMesh:
    return LogicalMesh(tuple(data["shape"]), tuple(data["ranks"]))


def device_box(spec: ShardingSpec, shape: Sequence[int], mesh: LogicalMesh, rank: int) -> Box:
    """The (start, stop) ranges of the full tensor that ``rank`` holds under ``spec``."""
    return tuple((s.start, s.stop) for s in spec.local_slices(tuple(shape), mesh, mesh.coord(rank)))


def box_slices(box: Box, within: Box | None = None) -> tuple[slice, ...]:
    """numpy slices of ``box``, in full-tensor coordinates or relative to ``within``."""
    if within is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(box, within))


def _as_spec(spec: ShardingSpec | str) -> ShardingSpec:
    return ShardingSpec.parse(spec) if isinstance(spec, str) else spec


def plan_resharding(shape: Sequence[int], src_spec: ShardingSpec | str, src_mesh: LogicalMesh,
                    dst_spec: ShardingSpec | str, dst_mesh: LogicalMesh, itemsize: int = 4, *,
                    allow_local_allgather: bool = False,
                    allgather_axes: Sequence[int] | None = None,
                    send_spec: ShardingSpec | str | None = None) -> CrossMeshTransfer:
    """Unit tasks (and, with ``allow_local_allgather``, the intra-B all-gathers) for moving
    a tensor from ``src_spec`` on ``src_mesh`` to ``dst_spec`` on ``dst_mesh``.

    ``allgather_axes`` limits which B mesh axes may be gathered over (default: every
    replicated axis of size > 1; pass ``(1,)`` to gather only inside hosts).
    ``send_spec`` (default ``src_spec``) rearranges the tensor inside A first: the
    transfer records the intra-A steps ``src_spec`` → ``send_spec`` as ``prepare`` and
    its tasks send slices of ``send_spec`` shards (see :func:`best_resharding`).
    """
    shape = tuple(int(s) for s in shape)
    src_spec, dst_spec = _as_spec(src_spec), _as_spec(dst_spec)
    send_spec = src_spec if send_spec is None else _as_spec(send_spec)
    for name, spec, mesh in (("source", src_spec, src_mesh), ("destination", dst_spec, dst_mesh),
                             ("send", send_spec, src_mesh)):
        if spec.partial:
            raise ValueError(f"cross-mesh resharding needs a non-partial {name} spec, got {spec}")
        if not spec.is_valid_for(shape, mesh):
            raise ValueError(f"{name} spec {spec} does not divide shape {shape} on mesh {mesh.shape}")
    common = set(src_mesh.ranks) & set(dst_mesh.ranks)
    if common:
        raise ValueError(f"source and destination meshes share ranks {sorted(common)}")
    if itemsize < 1:
        raise ValueError(f"itemsize must be positive, got {itemsize}")
    prepare: tuple[Step, ...] = ()
    if send_spec != src_spec:
        try:
            prepare = reshard_steps(src_spec, send_spec)
        except ValueError as exc:
            raise ValueError(f"cannot rearrange {src_spec} into send spec {send_spec} inside the source mesh: {exc}") from exc
    sent_spec, steps = dst_spec, ()
    if allow_local_allgather:
        sent_spec, steps = _gather_plan(shape, dst_spec, dst_mesh, allgather_axes)
    tasks = _unit_tasks(shape, itemsize, send_spec, src_mesh, sent_spec, dst_mesh)
    return CrossMeshTransfer(shape, itemsize, src_spec, src_mesh, dst_spec, dst_mesh, sent_spec, steps, tuple(tasks),
                             send_spec, prepare)


def cross_mesh_tasks(shape: Sequence[int], src_spec: ShardingSpec | str, src_mesh: LogicalMesh,
                     dst_spec: ShardingSpec | str, dst_mesh: LogicalMesh, itemsize: int = 4, *,
                     allow_local_allgather: bool = False,
                     allgather_axes: Sequence[int] | None = None) -> list[UnitTask]:
    """The unit tasks of :func:`plan_resharding` (which also records the all-gathers)."""
    return list(plan_resharding(shape, src_spec, src_mesh, dst_spec, dst_mesh, itemsize,
                                allow_local_allgather=allow_local_allgather, allgather_axes=allgather_axes).tasks)


def _unit_tasks(shape, itemsize, src_spec, src_mesh, dst_spec, dst_mesh) -> list[UnitTask]:
    src_boxes = {r: device_box(src_spec, shape, src_mesh, r) for r in src_mesh.ranks}
    dst_boxes = {r: device_box(dst_spec, shape, dst_mesh, r) for r in dst_mesh.ranks}
    intervals, holders, needers = [], [], []
    for d, size in enumerate(shape):
        cuts = sorted({0, size} | {p for b in (*src_boxes.values(), *dst_boxes.values()) for p in b[d]})
        pieces = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        intervals.append(pieces)
        # An A box and a B box intersect in exactly one piece of the refinement per
        # dimension, so the pieces are what intersecting all the boxes pairwise gives.
        holders.append([frozenset(r for r, box in src_boxes.items() if box[d][0] <= a and b <= box[d][1]) for a, b in pieces])
        needers.append([frozenset(r for r, box in dst_boxes.items() if box[d][0] <= a and b <= box[d][1]) for a, b in pieces])
    tasks = []
    for combo in itertools.product(*(range(len(p)) for p in intervals)):
        senders = frozenset(src_mesh.ranks).intersection(*(holders[d][k] for d, k in enumerate(combo)))
        receivers = frozenset(dst_mesh.ranks).intersection(*(needers[d][k] for d, k in enumerate(combo)))
        box = tuple(intervals[d][k] for d, k in enumerate(combo))
        assert senders and receivers, f"uncovered piece {box}"
        nbytes = prod(b - a for a, b in box) * itemsize
        tasks.append(UnitTask(box, tuple(r for r in src_mesh.ranks if r in senders),
                              tuple(r for r in dst_mesh.ranks if r in receivers), nbytes))
    return tasks


_REFINE = {(R, 0): S0, (R, 1): S1, (S0, 1): S01}   # (placement, axis added) → finer placement


def _gather_plan(shape, dst_spec, dst_mesh, axes) -> tuple[ShardingSpec, tuple[AllGatherStep, ...]]:
    """Split the first dimension that can take it along every replicated B axis; the
    all-gathers undo those splits (the last split first)."""
    spec, steps = dst_spec, []
    used = dst_spec.split_axes()
    for axis in (0, 1):
        if axis in used or dst_mesh.axis_size(axis) < 2 or (axes is not None and axis not in axes):
            continue
        for d, placement in enumerate(spec.dims):
            finer = _REFINE.get((placement, axis))
            if finer is None:
                continue
            candidate = ShardingSpec(spec.dims[:d] + (finer,) + spec.dims[d + 1:])
            if candidate.is_valid_for(shape, dst_mesh) and shape[d] // candidate.shards(d, dst_mesh) > 0:
                steps.append(AllGatherStep(axis, d, candidate, spec))
                spec = candidate
                break
    return spec, tuple(reversed(steps))


def as_send_recv(tasks: Sequence[UnitTask]) -> list[UnitTask]:
    """The same transfer without broadcast: one task per (slice, receiver)."""
    return [UnitTask(t.slice, t.senders, (r,), t.nbytes) for t in tasks for r in t.receivers]


# --- cost model and simulator ---------------------------------------------------------


@dataclass(frozen=True)
class _Cost:
    latency: float            # seconds before bytes flow
    rate: float               # bytes/s on an idle cluster (slowest link crossed)
    nbytes: int
    nics: tuple[int, ...]     # shared resources: 2*host (egress), 2*host+1 (ingress)

    @property
    def seconds(self) -> float:
        return self.latency + self.nbytes / self.rate


def task_cost(task: UnitTask, sender: int, cluster: Cluster) -> _Cost:
    """Time of one task sent by ``sender`` on an idle cluster, and the NICs it loads.

    A broadcast is a pipelined chain: sender's host first, then the receivers' hosts in
    order; every host but the last sends the bytes out once, every host but the first
    takes them in once. Latency ``α·⌈log2(group size)⌉`` of the slowest link crossed;
    one receiver is a send/recv (``α + bytes/bandwidth``).
    """
    home = cluster.host_of(sender)
    hosts = [home] + sorted({cluster.host_of(r) for r in task.receivers} - {home})
    link = cluster.intra_host if len(hosts) == 1 else cluster.inter_host
    rate = link.bandwidth if len(hosts) == 1 else min(cluster.inter_host.bandwidth, cluster.intra_host.bandwidth)
    latency = link.latency * max(1, math.ceil(math.log2(1 + len(task.receivers))))
    nics = tuple(2 * h for h in hosts[:-1]) + tuple(2 * h + 1 for h in hosts[1:])
    return _Cost(latency, rate, task.nbytes, nics)


class _Model:
    """Costs of every (task, sender) pair on one cluster, and the fluid simulator."""

    def __init__(self, tasks: Sequence[UnitTask], cluster: Cluster):
        self.tasks = list(tasks)
        self.cluster = cluster
        self.nic_bandwidth = cluster.inter_host.bandwidth
        self.cost = [{s: task_cost(t, s, cluster) for s in t.senders} for t in self.tasks]
        self.min_seconds = [min(c.seconds for c in costs.values()) for costs in self.cost]

    def devices(self, i: int, sender: int) -> tuple[int, ...]:
        return (sender,) + self.tasks[i].receivers

    def run(self, senders: Sequence[int], order: Sequence[int]) -> tuple[list[float], list[float]]:
        """Start and end time of every task when each rank runs its tasks in ``order``,
        each starting as soon as all its ranks are free; NICs shared max-min fairly."""
        n = len(self.tasks)
        starts, ends = [0.0] * n, [0.0] * n
        waiting = [0] * n
        successors: list[list[int]] = [[] for _ in range(n)]
        last: dict[int, int] = {}
        for i in order:
            preds = {last[d] for d in self.devices(i, senders[i]) if d in last}
            waiting[i] = len(preds)
            for p in preds:
                successors[p].append(i)
            for d in self.devices(i, senders[i]):
                last[d] = i
        costs = [self.cost[i][senders[i]] for i in range(n)]
        in_latency: dict[int, float] = {}    # task → time its latency ends
        streaming: dict[int, float] = {}     # task → bytes left
        now = 0.0
        finished: list[int] = []

        def start(i: int) -> None:
            starts[i] = now
            if costs[i].latency > 0:
                in_latency[i] = now + costs[i].latency
            elif costs[i].nbytes > 0:
                streaming[i] = float(costs[i].nbytes)
            else:
                finished.append(i)

        for i in order:
            if waiting[i] == 0:
                start(i)
        while True:
            while finished:
                i = finished.pop()
                ends[i] = now
                for j in successors[i]:
                    waiting[j] -= 1
                    if waiting[j] == 0:
                        start(j)
            if not in_latency and not streaming:
                break
            rates = self._rates(streaming, costs)
            horizon = min(in_latency.values(), default=math.inf)
            for i, left in streaming.items():
                horizon = min(horizon, now + left / rates[i])
            tolerance = 1e-12 * max(horizon, 1e-9)
            step = horizon - now
            for i in list(streaming):
                if now + streaming[i] / rates[i] <= horizon + tolerance:
                    del streaming[i]
                    finished.append(i)
                else:
                    streaming[i] -= rates[i] * step
            now = horizon
            for i in [i for i, t in in_latency.items() if t <= horizon + tolerance]:
                del in_latency[i]
                if costs[i].nbytes > 0:
                    streaming[i] = float(costs[i].nbytes)
                else:
                    finished.append(i)
        return starts, ends

    def _rates(self, streaming: dict[int, float], costs: list[_Cost]) -> dict[int, float]:
        """Max-min fair rates by progressive filling over the NICs, capped per task."""
        rates: dict[int, float] = {}
        pending = []
        users: dict[int, int] = defaultdict(int)
        for i in streaming:
            if costs[i].nics:
                pending.append(i)
                for nic in costs[i].nics:
                    users[nic] += 1
            else:
                rates[i] = costs[i].rate
        left = {nic: self.nic_bandwidth for nic in users}
        while pending:
            shares = {nic: left[nic] / count for nic, count in users.items() if count > 0}
            level = min(min(shares.values()), min(costs[i].rate for i in pending))
            cut = level * (1 + 1e-12)
            frozen = [i for i in pending if costs[i].rate <= cut or any(shares[nic] <= cut for nic in costs[i].nics)]
            for i in frozen:
                rates[i] = level
                for nic in costs[i].nics:
                    left[nic] -= level
                    users[nic] -= 1
            pending = [i for i in pending if i not in rates]
        return rates

    def makespan(self, senders: Sequence[int], order: Sequence[int]) -> float:
        return max(self.run(senders, order)[1], default=0.0)


def lower_bound(tasks: Sequence[UnitTask], cluster: Cluster) -> float:
    """A makespan no schedule can beat.

    The largest of: each task's fastest time; per receiving device, the sum of its tasks'
    fastest times (they cannot overlap), and the same per sending device for tasks it
    alone can send; per host, the bytes that must enter it (a receiver there, no sender
    there) or leave it (every sender there, a receiver elsewhere) over its inter-host
    bandwidth, plus the shortest latency among those tasks (no byte flows before it).
    """
    if not tasks:
        return 0.0
    model = _Model(tasks, cluster)
    device: dict[int, float] = defaultdict(float)
    nic_bytes: dict[tuple[str, int], int] = defaultdict(int)
    nic_start: dict[tuple[str, int], float] = defaultdict(lambda: math.inf)
    for t, costs, seconds in zip(model.tasks, model.cost, model.min_seconds):
        for r in t.receivers:
            device[r] += seconds
        if len(t.senders) == 1:
            device[t.senders[0]] += seconds
        sender_hosts = {cluster.host_of(s) for s in t.senders}
        receiver_hosts = {cluster.host_of(r) for r in t.receivers}
        latency = min(c.latency for c in costs.values())
        needs = [("in", h) for h in receiver_hosts - sender_hosts]
        if len(sender_hosts) == 1 and receiver_hosts - sender_hosts:
            needs.append(("out", next(iter(sender_hosts))))
        for key in needs:
            nic_bytes[key] += t.nbytes
            nic_start[key] = min(nic_start[key], latency)
    nic = max([nic_start[k] + b / cluster.inter_host.bandwidth for k, b in nic_bytes.items()], default=0.0)
    return max(max(model.min_seconds), max(device.values()), nic)


# --- schedules ------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduledTask:
    task: int         # index into Schedule.tasks
    sender: int
    start: float      # seconds, simulated
    end: float


@dataclass(frozen=True)
class Schedule:
    """A sender and a start time for every task; ``entries`` are in execution order
    (every rank runs its own tasks in this order). Times are simulated seconds."""

    algorithm: str
    tasks: tuple[UnitTask, ...]
    entries: tuple[ScheduledTask, ...]
    makespan: float
    stats: dict = field(default_factory=dict, compare=False)

    @property
    def senders(self) -> list[int]:
        out = [0] * len(self.tasks)
        for e in self.entries:
            out[e.task] = e.sender
        return out

    @property
    def order(self) -> list[int]:
        return [e.task for e in self.entries]

    def to_dict(self) -> dict:
        return {
            "version": SCHEDULE_VERSION,
            "algorithm": self.algorithm,
            "makespan": self.makespan,
            "tasks": [t.to_dict() for t in self.tasks],
            "entries": [[e.task, e.sender, e.start, e.end] for e in self.entries],
            "stats": dict(self.stats),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Schedule":
        version = data.get("version")
        if version != SCHEDULE_VERSION:
            raise ValueError(f"cross-mesh schedule version {version!r} is not {SCHEDULE_VERSION} (re-run the planner)")
        return cls(data["algorithm"], tuple(UnitTask.from_dict(t) for t in data["tasks"]),
                   tuple(ScheduledTask(int(i), int(s), float(a), float(b)) for i, s, a, b in data["entries"]),
                   float(data["makespan"]), dict(data.get("stats", {})))


def simulate(schedule: Schedule | Sequence[UnitTask], cluster: Cluster, senders: Sequence[int] | None = None,
             order: Sequence[int] | None = None) -> float:
    """Makespan of a schedule on ``cluster`` (see :meth:`_Model.run`); given tasks instead,
    ``senders`` defaults to each task's first sender and ``order`` to the task order."""
    if isinstance(schedule, Schedule):
        tasks, senders, order = schedule.tasks, schedule.senders, schedule.order
    else:
        tasks = list(schedule)
        senders = list(senders) if senders is not None else [t.senders[0] for t in tasks]
        order = list(order) if order is not None else list(range(len(tasks)))
    if sorted(order) != list(range(len(tasks))) or len(senders) != len(tasks):
        raise ValueError("a schedule needs every task exactly once in its order and one sender per task")
    if any(s not in t.senders for s, t in zip(senders, tasks)):
        raise ValueError("a task's sender must be one of the ranks that hold its slice")
    if not tasks:
        return 0.0
    return _Model(tasks, cluster).makespan(senders, order)


def _build(algorithm: str, model: _Model, senders: Sequence[int], order: Sequence[int], stats: dict) -> Schedule:
    starts, ends = model.run(senders, order)
    entries = tuple(ScheduledTask(i, senders[i], starts[i], ends[i]) for i in order)
    return Schedule(algorithm, tuple(model.tasks), entries, max(ends, default=0.0), stats)


def schedule_tasks(tasks: Sequence[UnitTask], cluster: Cluster, algorithm: str = DEFAULT_ALGORITHM, *,
                   seed: int = 0, trials: int = 64, polish: int = 256, time_budget: float = 5.0,
                   node_budget: int = 200_000) -> Schedule:
    """Choose a sender and an order for every task.

    ``naive``: each task's first sender, task order. ``load_balance``: task order, the
    sender whose device has the least work so far (ties: on a receiver's host, then the
    least-loaded NIC). ``dfs``: branch and bound over orders and senders, pruned by lower
    bounds, started from the two above; exact when ``stats["complete"]``, otherwise the
    best found within ``node_budget`` nodes / ``time_budget`` seconds.
    ``randomized_greedy``: ``trials`` rounds (at most ``time_budget`` seconds) of
    random task orders, each cut into maximal sets of non-conflicting tasks with
    load-aware senders; the best simulated one is kept, then improved by ``polish`` local
    moves (move a task in the order, or change its sender), each kept if it does not
    lengthen the simulated makespan. Deterministic for a ``seed`` unless ``time_budget`` cuts it short.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown cross-mesh scheduling algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    model = _Model(tasks, cluster)
    if not model.tasks:
        return Schedule(algorithm, (), (), 0.0, {})
    if algorithm == "naive":
        return _build(algorithm, model, [t.senders[0] for t in model.tasks], range(len(model.tasks)), {})
    if algorithm == "load_balance":
        return _build(algorithm, model, _load_balance(model), range(len(model.tasks)), {})
    if algorithm == "dfs":
        return _dfs(model, time_budget, node_budget)
    return _randomized_greedy(model, seed, trials, polish, time_budget)


def _load_balance(model: _Model) -> list[int]:
    cluster = model.cluster
    load: dict[int, float] = defaultdict(float)
    nic_load: dict[int, float] = defaultdict(float)
    senders = []
    for i, t in enumerate(model.tasks):
        hosts = {cluster.host_of(r) for r in t.receivers}

        def key(s, i=i, hosts=hosts):
            c = model.cost[i][s]
            return (load[s] + c.seconds, cluster.host_of(s) not in hosts, max((nic_load[n] for n in c.nics), default=0.0))

        s = min(t.senders, key=key)
        senders.append(s)
        load[s] += model.cost[i][s].seconds
        for n in model.cost[i][s].nics:
            nic_load[n] += model.cost[i][s].nbytes / model.nic_bandwidth
    return senders


def _randomized_greedy(model: _Model, seed: int, trials: int, polish: int, time_budget: float) -> Schedule:
    rng = random.Random(seed)
    deadline = time.perf_counter() + time_budget
    n = len(model.tasks)
    best: tuple[float, list[int], list[int]] | None = None
    done = 0
    for trial in range(max(1, trials)):
        if trial and time.perf_counter() > deadline:
            break
        senders, order = _greedy_rounds(model, rng, explore=0.0 if trial == 0 else 0.25, largest_first=trial == 0)
        span = model.makespan(senders, order)
        done += 1
        if best is None or span < best[0]:
            best = (span, senders, order)
    assert best is not None and len(best[2]) == n
    span, senders, order = best
    steps = 0
    floor = lower_bound(model.tasks, model.cluster) * (1 + 1e-9)
    movable = [i for i, t in enumerate(model.tasks) if len(t.senders) > 1]
    while steps < polish and n > 1 and span > floor and time.perf_counter() <= deadline:
        steps += 1
        new_senders, new_order = senders, list(order)
        if movable and rng.random() < 0.3:
            i = rng.choice(movable)
            new_senders = list(senders)
            new_senders[i] = rng.choice(model.tasks[i].senders)
        else:
            new_order.insert(rng.randrange(n), new_order.pop(rng.randrange(n)))
        new_span = model.makespan(new_senders, new_order)
        if new_span <= span:
            span, senders, order = new_span, new_senders, new_order
    return _build("randomized_greedy", model, senders, order, {"trials": done, "polish": steps, "seed": seed})


def _greedy_rounds(model: _Model, rng: random.Random, explore: float, largest_first: bool) -> tuple[list[int], list[int]]:
    """One randomized greedy pass: shuffle the remaining tasks, take a maximal set of
    tasks with no rank in common, append it to the order, repeat.

    Each task gets the free sender that would finish it earliest by a running estimate
    in which ranks run their tasks back to back and every NIC streams one task at a time
    (or, with probability ``explore``, a random free sender).
    """
    n = len(model.tasks)
    senders = [0] * n
    order: list[int] = []
    ready: dict[int, float] = defaultdict(float)   # estimated time each rank is free
    nic: dict[int, float] = defaultdict(float)     # estimated time each NIC is free
    bandwidth = model.nic_bandwidth
    remaining = list(range(n))

    def estimate(i: int, s: int) -> tuple[float, float]:
        c = model.cost[i][s]
        begin = max([ready[s], *(ready[r] for r in model.tasks[i].receivers)])
        finish = begin + c.seconds
        for x in c.nics:
            finish = max(finish, max(nic[x], begin + c.latency) + c.nbytes / bandwidth)
        return finish, begin

    while remaining:
        rng.shuffle(remaining)
        if largest_first:
            remaining.sort(key=lambda i: -model.tasks[i].nbytes)
        busy: set[int] = set()
        chosen, rest = [], []
        for i in remaining:
            task = model.tasks[i]
            free = [s for s in task.senders if s not in busy]
            if not free or any(r in busy for r in task.receivers):
                rest.append(i)
                continue
            if explore and rng.random() < explore:
                s = rng.choice(free)
            else:
                rng.shuffle(free)
                s = min(free, key=lambda s, i=i: estimate(i, s)[0])
            finish, begin = estimate(i, s)
            c = model.cost[i][s]
            for d in (s, *task.receivers):
                ready[d] = finish
            for x in c.nics:
                nic[x] = max(nic[x], begin + c.latency) + c.nbytes / bandwidth
            senders[i] = s
            busy.add(s)
            busy.update(task.receivers)
            chosen.append(i)
        order.extend(chosen)
        remaining = rest
    return senders, order


class _OutOfBudget(Exception):
    pass


def _dfs(model: _Model, time_budget: float, node_budget: int) -> Schedule:
    """Depth-first branch and bound over (next task, its sender) sequences.

    A prefix is timed at idle-cluster durations, which no real execution beats, so
    ``max(device free time + remaining work that must run there)`` and the static
    :func:`lower_bound` bound every completion; leaves are timed by the simulator. Two
    orders that only swap neighbouring tasks with no rank in common run identically, so
    a task may follow an independent one only if its index is larger; unused senders on
    one host that can send the same tasks are interchangeable, so one of them is tried.
    """
    tasks, cluster = model.tasks, model.cluster
    n = len(tasks)
    deadline = time.perf_counter() + time_budget
    incumbents = [([t.senders[0] for t in tasks], list(range(n))), (_load_balance(model), list(range(n)))]
    best_span, best_senders, best_order = min((model.makespan(s, o), s, o) for s, o in incumbents)
    static = lower_bound(tasks, cluster)
    can_send: dict[int, frozenset] = defaultdict(frozenset)
    for i, t in enumerate(tasks):
        for s in t.senders:
            can_send[s] = can_send[s] | {i}
    must = defaultdict(float)               # remaining work that must run on a rank
    for i, t in enumerate(tasks):
        for d in t.receivers + (t.senders if len(t.senders) == 1 else ()):
            must[d] += model.min_seconds[i]
    free: dict[int, float] = defaultdict(float)
    used: dict[int, int] = defaultdict(int)
    remaining = set(range(n))
    senders = [0] * n
    order: list[int] = []
    nodes = 0
    complete = True

    def bound() -> float:
        return max([static, *(free[d] + must[d] for d in must)])

    def visit(last: tuple[int, int] | None) -> None:
        nonlocal nodes, best_span, best_senders, best_order
        nodes += 1
        if nodes > node_budget or (nodes % 256 == 0 and time.perf_counter() > deadline):
            raise _OutOfBudget
        if not remaining:
            span = model.makespan(senders, order)
            if span < best_span * (1 - 1e-12):
                best_span, best_senders, best_order = span, list(senders), list(order)
            return
        last_devices = set(model.devices(*last)) if last else set()
        options = []
        for i in remaining:
            t = tasks[i]
            recv_ready = max(free[r] for r in t.receivers)
            seen = set()
            for s in t.senders:
                devs = (s,) + t.receivers
                if last and i < last[0] and last_devices.isdisjoint(devs):
                    continue
                if used[s] == 0:
                    signature = (cluster.host_of(s), can_send[s])
                    if signature in seen:
                        continue
                    seen.add(signature)
                begin = max(recv_ready, free[s])
                options.append((begin + model.cost[i][s].seconds, begin, i, s))
        options.sort()
        for finish, begin, i, s in options:
            t = tasks[i]
            devs = (s,) + t.receivers
            saved = [(d, free[d]) for d in devs]
            for d in devs:
                free[d] = finish
            share = model.min_seconds[i]
            loaded = t.receivers + (t.senders if len(t.senders) == 1 else ())
            for d in loaded:
                must[d] -= share
            remaining.discard(i)
            used[s] += 1
            senders[i] = s
            order.append(i)
            if bound() < best_span * (1 - 1e-9):
                visit((i, s))
            order.pop()
            used[s] -= 1
            remaining.add(i)
            for d in loaded:
                must[d] += share
            for d, value in saved:
                free[d] = value

    try:
        if best_span > static * (1 + 1e-9):
            visit(None)
    except _OutOfBudget:
        complete = False
    return _build("dfs", model, best_senders, best_order, {"nodes": nodes, "complete": complete})


def allgather_seconds(transfer: CrossMeshTransfer, cluster: Cluster) -> float:
    """Time of the intra-B all-gathers on an idle cluster: a ring over each group,
    ``(k - 1)`` steps of ``α + piece/bandwidth``; groups that span hosts share each
    host's inter-host bandwidth among their members on it."""
    total = 0.0
    mesh = transfer.dst_mesh
    for step in transfer.allgathers:
        groups = mesh.axis_groups(step.axis)
        k = len(groups[0])
        piece = prod(b - a for a, b in device_box(step.before, transfer.shape, mesh, groups[0][0])) * transfer.itemsize
        spanning = [g for g in groups if len({cluster.host_of(r) for r in g}) > 1]
        if spanning:
            per_host: dict[int, int] = defaultdict(int)
            for g in spanning:
                for r in g:
                    per_host[cluster.host_of(r)] += 1
            bandwidth = min(cluster.intra_host.bandwidth, cluster.inter_host.bandwidth / max(per_host.values()))
            latency = cluster.inter_host.latency
        else:
            bandwidth, latency = cluster.intra_host.bandwidth, cluster.intra_host.latency
        total += (k - 1) * (latency + piece / bandwidth)
    return total


# --- rearranging inside A first -------------------------------------------------------


def source_links(mesh: LogicalMesh, cluster: Cluster) -> dict:
    """The link each axis of ``mesh`` uses on ``cluster``: ``inter_host`` when one of the
    axis's groups spans hosts (from the mesh's actual ranks), else ``intra_host``."""
    links = {}
    for axis in (0, 1):
        crosses = any(len({cluster.host_of(r) for r in group}) > 1 for group in mesh.axis_groups(axis))
        links[axis] = cluster.inter_host if crosses else cluster.intra_host
    return links


def prepare_seconds(transfer: CrossMeshTransfer, cluster: Cluster) -> float:
    """Time of the transfer's rearrangement inside A (``resharding.reshard_seconds``,
    alpha-beta per mesh axis with the links of :func:`source_links`)."""
    if not transfer.prepare:
        return 0.0
    model = CollectiveModel(source_links(transfer.src_mesh, cluster))
    return reshard_seconds(transfer.src_spec, transfer.send_spec, transfer.shape, transfer.itemsize,
                           transfer.src_mesh, model)


def _normalised(spec: ShardingSpec, mesh: LogicalMesh) -> ShardingSpec:
    """The same layout without splits along mesh axes of size 1."""
    n, m = mesh.shape

    def placement(p: str) -> str:
        axes = [a for a, q in ((0, S0), (1, S1)) if (p == q or p == S01) and mesh.shape[a] > 1]
        return {(): R, (0,): S0, (1,): S1, (0, 1): S01}[tuple(axes)]

    if n > 1 and m > 1:
        return spec
    return ShardingSpec(tuple(placement(p) for p in spec.dims), spec.partial)


def send_spec_candidates(shape: Sequence[int], src_spec: ShardingSpec | str, mesh: LogicalMesh) -> list[ShardingSpec]:
    """``src_spec`` first, then every other layout a tensor of ``shape`` can take on
    ``mesh`` without partial sums: each mesh axis of size > 1 splits one dimension or
    none (both axes on one dimension: S01), every split dividing evenly. Layouts equal
    to ``src_spec`` (it may split along an axis of size 1) are left out."""
    shape = tuple(int(s) for s in shape)
    src_spec = _as_spec(src_spec)
    ndim = len(shape)
    out = [src_spec]
    seen = {_normalised(src_spec, mesh)}
    choices = [[None, *range(ndim)] if mesh.shape[axis] > 1 else [None] for axis in (0, 1)]
    for d0, d1 in itertools.product(*choices):
        dims = [R] * ndim
        if d0 is not None:
            dims[d0] = S0
        if d1 is not None:
            dims[d1] = S01 if d1 == d0 else S1
        spec = ShardingSpec(tuple(dims))
        if spec not in seen and spec.is_valid_for(shape, mesh):
            seen.add(spec)
            out.append(spec)
    return out


@dataclass(frozen=True)
class ReshardChoice:
    """What :func:`best_resharding` chose: the transfer (with its ``send_spec`` and
    ``prepare``), its schedule, and the estimated time of each part."""

    transfer: CrossMeshTransfer
    schedule: Schedule
    prepare_seconds: float
    allgather_seconds: float
    stats: dict = field(default_factory=dict, compare=False)

    @property
    def makespan(self) -> float:
        return self.schedule.makespan

    @property
    def seconds(self) -> float:
        """Rearrangement in A, then the tasks, then the all-gathers in B."""
        return self.prepare_seconds + self.schedule.makespan + self.allgather_seconds


def best_resharding(shape: Sequence[int], src_spec: ShardingSpec | str, src_mesh: LogicalMesh,
                    dst_spec: ShardingSpec | str, dst_mesh: LogicalMesh, itemsize: int, cluster: Cluster,
                    algorithm: str = DEFAULT_ALGORITHM, *, allgather_axes: Sequence[int] | None = None,
                    local_allgather: bool | None = None, rearrange: bool = True, finalists: int = 2,
                    **schedule_options) -> ReshardChoice:
    """The send spec (and use of the local all-gather in B) that moves the tensor fastest.

    Candidates: every send spec of :func:`send_spec_candidates` (only ``src_spec`` with
    ``rearrange=False``), each with and without the local all-gather
    (``local_allgather=None``; ``True`` / ``False`` fixes it). Every candidate is timed
    as prepare seconds + a ``load_balance`` schedule's makespan + all-gather seconds.
    The candidates without rearrangement, then the ``finalists`` best of the others,
    are scheduled with ``algorithm`` (``schedule_options`` go to
    :func:`schedule_tasks`), each unless its :func:`lower_bound` plus its fixed costs
    cannot beat the best so far; the fastest wins (ties: the earlier one, so no
    rearrangement first). Never slower than the transfer without rearrangement under
    the same scheduler; deterministic whenever the scheduler is. Results are cached:
    treat them as read-only.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown cross-mesh scheduling algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    key = (tuple(int(s) for s in shape), _as_spec(src_spec), src_mesh, _as_spec(dst_spec), dst_mesh, int(itemsize),
           cluster, algorithm, None if allgather_axes is None else tuple(allgather_axes), local_allgather,
           bool(rearrange), int(finalists), tuple(sorted(schedule_options.items())))
    return _best_resharding(*key)


@lru_cache(maxsize=1024)
def _best_resharding(shape, src_spec, src_mesh, dst_spec, dst_mesh, itemsize, cluster, algorithm, allgather_axes,
                     local_allgather, rearrange, finalists, options) -> ReshardChoice:
    started = time.perf_counter()
    specs = send_spec_candidates(shape, src_spec, src_mesh) if rearrange else [src_spec]
    gathers = (False, True) if local_allgather is None else (bool(local_allgather),)
    candidates: list[CrossMeshTransfer] = []
    seen = set()
    for spec in specs:
        for gather in gathers:
            transfer = plan_resharding(shape, src_spec, src_mesh, dst_spec, dst_mesh, itemsize,
                                       allow_local_allgather=gather, allgather_axes=allgather_axes, send_spec=spec)
            signature = (transfer.send_spec, transfer.sent_spec)
            if signature not in seen:      # the all-gather plan may find nothing to split
                seen.add(signature)
                candidates.append(transfer)
    fixed = [prepare_seconds(t, cluster) + allgather_seconds(t, cluster) for t in candidates]
    finals = [k for k, t in enumerate(candidates) if t.send_spec == src_spec]   # always scheduled in full
    screened = 0
    quick = []
    for k, t in enumerate(candidates):
        if k not in finals:
            quick.append((fixed[k] + schedule_tasks(t.tasks, cluster, "load_balance").makespan, k))
            screened += 1
    finals += [k for _, k in sorted(quick)[:max(0, finalists)]]
    best: tuple[float, int, Schedule] | None = None
    scheduled = 0
    for k in finals:
        tasks = candidates[k].tasks
        if best is not None and fixed[k] + lower_bound(tasks, cluster) >= best[0]:
            continue                   # cannot beat the best so far
        schedule = schedule_tasks(tasks, cluster, algorithm, **dict(options))
        scheduled += 1
        total = fixed[k] + schedule.makespan
        if best is None or total < best[0]:
            best = (total, k, schedule)
    assert best is not None
    _, k, schedule = best
    stats = {"candidates": len(candidates), "screened": screened, "scheduled": scheduled,
             "seconds": time.perf_counter() - started}
    return ReshardChoice(candidates[k], schedule, prepare_seconds(candidates[k], cluster),
                         allgather_seconds(candidates[k], cluster), stats)
