"""How many onnxruntime threads a rank gets, and whether they may spin.

Ranks that share a machine share its cores. A rank's cores are the ones the launcher bound
it to (``os.sched_getaffinity``: mpiexec's ``-bind-to core``, Slurm's ``--cpu-bind``); when
it bound none, every rank sees the whole machine and the cores are divided among the ranks
that work there (idle ranks only wait). onnxruntime's pool threads spin between runs by
default: a rank waiting in MPI while its own and its neighbours' threads spin on the same
cores slows every rank of the machine (a 117 MB decode step on 16 cores took 33–84 ms on
1x2 with spinning, 1.26 ms without). So spinning stays on only where a rank has its cores to
itself: alone on the machine, or bound by the launcher to cores no other rank was given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from meshplan.rank_layout import own_cores


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    spinning: bool
    cores: int          # the cores the rank may run on
    working: int        # ranks that work on its machine, itself included
    bound: bool         # the launcher bound it to cores no other working rank has

    @property
    def why(self) -> str:
        if self.working == 1:
            return f"alone on its {self.cores} core(s)"
        if self.bound:
            return f"bound by the launcher to {self.cores} core(s) of its own"
        return f"{self.cores} core(s) shared by {self.working} working ranks"

    @property
    def oversubscribed(self) -> bool:
        """More working ranks than cores on its machine: they take turns on the cores."""
        return not self.bound and self.working > self.cores

    def describe(self) -> str:
        return f"{self.threads} onnxruntime thread(s), spinning {'on' if self.spinning else 'off'} ({self.why})"

    def row(self) -> list[int]:
        """As integers, for a buffer-based gather (``from_row`` reads it back)."""
        return [self.threads, int(self.spinning), self.cores, self.working, int(self.bound)]

    @classmethod
    def from_row(cls, row) -> "ThreadChoice":
        threads, spinning, cores, working, bound = (int(v) for v in row)
        return cls(threads, bool(spinning), cores, working, bool(bound))


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
        return ThreadChoice(count, True, count, working_here, True)
    return ThreadChoice(max(1, count // working_here), False, count, working_here, False)
