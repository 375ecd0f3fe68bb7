"""Run under mpiexec -n 4: every collective kind on a 2x2 and a 1x4 logical mesh through
the runtime's per-axis communicators, compared on each rank with the in-memory executor
(the reference semantics the in-process runs use). Prints one line per case; exit 1 on
any mismatch.

``run_steps(comm, buffers)`` is also used by device_path_case.py with device buffers.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from meshplan.plan_format import Stage  # noqa: E402
from meshplan.reshard.steps import Step, apply_steps  # noqa: E402
from meshplan.runtime.buffers import HOST  # noqa: E402
from meshplan.runtime.transport import MeshCommunicators  # noqa: E402
from meshplan.sharding import LogicalMesh  # noqa: E402
from tests.mpi_scripts.reshard_case import report  # noqa: E402

STEPS = [
    Step("all_reduce", 0), Step("all_reduce", 1), Step("all_reduce", 2),
    Step("all_gather", 0, 1), Step("all_gather", 1, 0), Step("all_gather", 2, 2),
    Step("reduce_scatter", 0, 0), Step("reduce_scatter", 1, 2), Step("reduce_scatter", 2, 1),
    Step("all_to_all", 0, 0, 1), Step("all_to_all", 1, 2, 0), Step("all_to_all", 2, 1, 2),
]


class _Plan:   # the one field MeshCommunicators reads
    def __init__(self, shape):
        self.stages = [Stage(0, [], [0, 1], list(range(4)), list(shape), list(shape), [], [], 0.0, 0.0)]


# float16 moves as bytes and sums in float32 (not every MPI has it): within a rounding or two.
TOLERANCE = {np.dtype(np.float64): 1e-12, np.dtype(np.float16): 4e-3}


def run_steps(comm, buffers=HOST, dtypes=(np.float64,)) -> tuple[int, int]:
    """Every step on both meshes with tensors of ``buffers``' kind; (cases passed, cases)."""
    passed = total = 0
    for dtype in map(np.dtype, dtypes):
        for shape in ((2, 2), (1, 4)):
            mesh = LogicalMesh(shape, (0, 1, 2, 3))
            communicators = MeshCommunicators(_Plan(shape), comm, MPI, buffers)
            locals_ = {mesh.coord(r): np.random.default_rng(r).standard_normal((4, 8, 4)).astype(dtype) for r in range(4)}
            for step in STEPS:
                expected = apply_steps(locals_, [step], mesh)[mesh.coord(comm.rank)]
                got = buffers.to_host(communicators(step, buffers.from_host(locals_[mesh.coord(comm.rank)])))
                tol = TOLERANCE[dtype]
                ok = got.shape == expected.shape and got.dtype == dtype and np.allclose(got, expected, rtol=tol, atol=tol)
                passed += report(comm, f"{dtype} {shape[0]}x{shape[1]} {step}", ok)
                total += 1
                if step.kind.name == "all_reduce" and buffers is HOST:   # a spare input summed where it lies
                    mine = np.array(locals_[mesh.coord(comm.rank)])
                    got = communicators(step, mine, True)
                    ok = np.allclose(got, expected, rtol=tol, atol=tol) and (got is mine or dtype == np.float16)
                    passed += report(comm, f"{dtype} {shape[0]}x{shape[1]} {step} in place", ok)
                    total += 1
    return passed, total


if __name__ == "__main__":
    passed, total = run_steps(MPI.COMM_WORLD, dtypes=(np.float64, np.float16))
    sys.exit(0 if passed == total else 1)
