"""Where the ranks of an MPI job really run, against the hosts × devices a plan assumes.

A plan (and a profile) numbers its devices host by host: rank = host · M + local rank,
for H hosts of M devices. The launcher decides where ranks really go: MPICH's hydra
fills each host's slots in turn (``-ppn M`` or ``host:M`` lines), Open MPI maps by slot
or by node, Slurm by ``--distribution``. A job whose ranks of one planned host are spread
over several machines would run the plan's intra-host collectives over the slow network,
so start-up refuses it and says how to launch.

Several planned hosts on one machine are fine: that is how a plan for 2×4 devices is
tried on one 8-GPU (or CPU) machine, and their links are only faster than planned.

``gather_layout`` is collective (every rank of the communicator calls it);
``layout_mismatch`` is a pure function of what it gathered, so every rank reaches the
same verdict without another exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RankLayout:
    """Which machine every rank runs on: ``machine[r]`` is the lowest rank on r's machine
    (from a shared-memory split of the communicator); ``names[r]`` its processor name."""

    machine: tuple[int, ...]
    names: tuple[str, ...]
    local_rank: int
    local_size: int

    @property
    def machines(self) -> int:
        return len(set(self.machine))


def gather_layout(comm, MPI) -> RankLayout:
    """Every rank learns every rank's machine and processor name (collective)."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        lowest = np.array([comm.rank], dtype=np.int64)
        leader = np.empty_like(lowest)
        local.Allreduce(lowest, leader, op=MPI.MIN)
        local_rank, local_size = local.rank, local.size
    finally:
        local.Free()
    machine = np.empty(comm.size, dtype=np.int64)
    comm.Allgather(leader, machine)
    name = MPI.Get_processor_name().encode()[:255]
    mine = np.zeros(256, dtype=np.uint8)
    mine[: len(name)] = np.frombuffer(name, dtype=np.uint8)
    every = np.empty((comm.size, 256), dtype=np.uint8)
    comm.Allgather(mine, every)
    names = tuple(bytes(row).rstrip(b"\0").decode(errors="replace") for row in every)
    return RankLayout(tuple(int(m) for m in machine), names, local_rank, local_size)


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def launch_advice(per_host: int) -> str:
    """How to start M ranks per host, host by host, with the common launchers."""
    return (f"start {per_host} rank(s) per host in rank order: mpiexec -ppn {per_host} -f HOSTFILE (MPICH), "
            f"mpirun --map-by ppr:{per_host}:node --hostfile HOSTFILE (Open MPI), "
            f"srun --ntasks-per-node={per_host} --distribution=block (Slurm)")


def layout_mismatch(layout: RankLayout, hosts: int, per_host: int, working: set[int] | None = None) -> str | None:
    """None when every planned host's ranks share one machine, else one line that says
    which planned host is spread over which machines. ``working``: the ranks a plan gives
    work (default all); idle ranks only wait for the job's broadcasts, so they may run
    anywhere."""
    size = len(layout.machine)
    if size != hosts * per_host:
        return None   # the rank-count check reports this
    for host in range(hosts):
        ranks = [r for r in range(host * per_host, (host + 1) * per_host) if working is None or r in working]
        where: dict[int, list[int]] = {}
        for rank in ranks:
            where.setdefault(layout.machine[rank], []).append(rank)
        if len(where) > 1:
            spread = "; ".join(f"{_ranks_text(rs)} on {layout.names[m] or f'machine of rank {m}'}"
                               for m, rs in where.items())
            return (f"the ranks are not laid out as planned: {hosts} host(s) x {per_host} device(s), "
                    f"rank = host*{per_host} + local rank, but planned host {host} ({_ranks_text(ranks)}) "
                    f"is spread over {len(where)} machines ({spread})")
    return None


AFFINITY_BYTES = 1024   # a bitmap of up to 8192 cores


def own_cores() -> set[int]:
    """The cores this process may run on (the launcher's binding, if any)."""
    import os

    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):      # not Linux
        return set(range(os.cpu_count() or 1))


def gather_affinities(comm) -> list[set[int]]:
    """Every rank's cores (``own_cores``), as every rank sees them (collective)."""
    bits = np.zeros(AFFINITY_BYTES * 8, dtype=np.uint8)
    bits[[c for c in own_cores() if c < bits.size]] = 1
    mine = np.packbits(bits)
    every = np.empty((comm.size, AFFINITY_BYTES), dtype=np.uint8)
    comm.Allgather(mine, every)
    return [set(int(c) for c in np.flatnonzero(np.unpackbits(row))) for row in every]
