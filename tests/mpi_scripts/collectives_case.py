"""Run under mpiexec -n 4: every collective kind on a 2x2 and a 1x4 logical mesh through
the runtime's per-axis communicators, compared on each rank with the in-memory executor
(the reference semantics the in-process runs use). Prints one line per case; exit 1 on
any mismatch."""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from meshplan.plan import Stage
from meshplan.resharding import Step, apply_steps
from meshplan.runtime.mpi_runner import MeshCommunicators
from meshplan.sharding import LogicalMesh

comm = MPI.COMM_WORLD
STEPS = [
    Step("all_reduce", 0), Step("all_reduce", 1), Step("all_reduce", 2),
    Step("all_gather", 0, 1), Step("all_gather", 1, 0), Step("all_gather", 2, 2),
    Step("reduce_scatter", 0, 0), Step("reduce_scatter", 1, 2), Step("reduce_scatter", 2, 1),
    Step("all_to_all", 0, 0, 1), Step("all_to_all", 1, 2, 0), Step("all_to_all", 2, 1, 2),
]


class _Plan:   # the one field MeshCommunicators reads
    def __init__(self, shape):
        self.stages = [Stage(0, [], [0, 1], list(range(4)), list(shape), list(shape), [], [], 0.0, 0.0)]


failed = False
for shape in ((2, 2), (1, 4)):
    mesh = LogicalMesh(shape, (0, 1, 2, 3))
    communicators = MeshCommunicators(_Plan(shape), comm, MPI)
    locals_ = {mesh.coord(r): np.random.default_rng(r).standard_normal((4, 8, 4)) for r in range(4)}
    for step in STEPS:
        expected = apply_steps(locals_, [step], mesh)[mesh.coord(comm.rank)]
        got = communicators(step, locals_[mesh.coord(comm.rank)])
        ok = got.shape == expected.shape and np.allclose(got, expected, rtol=1e-12, atol=1e-12)
        flags = comm.allgather(ok)
        if comm.rank == 0:
            print(f"{'ok' if all(flags) else 'FAIL'} {shape[0]}x{shape[1]} {step}", flush=True)
        failed |= not all(flags)
sys.exit(1 if failed else 0)
