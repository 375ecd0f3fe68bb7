"""The device path's data movement under mpiexec (4 ranks): OrtValue buffers handed to
MPI through ``__cuda_array_interface__`` (in host memory here, with the CPU provider).

Runs every cross-mesh case of reshard_case.py and every collective of
collectives_case.py with ``DeviceBuffers``; each rank compares its result with the
slice its spec names / the in-memory executor. Rank 0 prints one line per case; the
exit status is 0 only if every case matched on every rank.
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from meshplan.cluster import make_cluster  # noqa: E402
from meshplan.cross_mesh import plan_resharding, schedule_tasks  # noqa: E402
from meshplan.plan import Stage  # noqa: E402
from meshplan.providers import CPU  # noqa: E402
from meshplan.resharding import Step, apply_steps  # noqa: E402
from meshplan.runtime.buffers import DeviceBuffers, DeviceTensor  # noqa: E402
from meshplan.runtime.cross_mesh_mpi import CrossMeshResharder  # noqa: E402
from meshplan.runtime.mpi_runner import MeshCommunicators  # noqa: E402
from meshplan.sharding import LogicalMesh  # noqa: E402
from tests.mpi_scripts.reshard_case import CASES  # noqa: E402

STEPS = [
    Step("all_reduce", 1), Step("all_reduce", 2),
    Step("all_gather", 0, 1), Step("all_gather", 1, 0), Step("all_gather", 2, 2),
    Step("reduce_scatter", 0, 0), Step("reduce_scatter", 1, 2),
    Step("all_to_all", 0, 0, 1), Step("all_to_all", 1, 2, 0), Step("all_to_all", 2, 1, 2),
]


class _Plan:   # the one field MeshCommunicators reads
    def __init__(self, shape):
        self.stages = [Stage(0, [], [0, 1], list(range(4)), list(shape), list(shape), [], [], 0.0, 0.0)]


def _report(comm, name: str, ok: bool) -> bool:
    bad = np.array([0 if ok else 1], dtype=np.int64)
    total = np.zeros_like(bad)
    comm.Allreduce(bad, total, op=MPI.SUM)
    if comm.rank == 0:
        print(f"{'ok  ' if total[0] == 0 else 'FAIL'} {name}", flush=True)
    return total[0] == 0


def main() -> int:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    buffers = DeviceBuffers("cpu", 0, [CPU])
    cluster = make_cluster((2, 2))
    passed = total = 0
    for name, shape, (sa, ra, xa), (sb, rb, xb), allgather, algorithm, dtype in CASES:
        rs = plan_resharding(shape, xa, LogicalMesh(sa, ra), xb, LogicalMesh(sb, rb), np.dtype(dtype).itemsize,
                             allow_local_allgather=allgather)
        resharder = CrossMeshResharder(rs, schedule_tasks(rs.tasks, cluster, algorithm, trials=8, polish=16), comm,
                                       dtype, buffers=buffers)
        full = np.arange(math.prod(rs.shape), dtype=dtype).reshape(rs.shape) * 3 + 1
        local = None
        if rank in rs.src_mesh.ranks:
            local = buffers.from_host(full[rs.src_spec.local_slices(rs.shape, rs.src_mesh, rs.src_mesh.coord(rank))])
        result = resharder.run(local)
        if rank in rs.dst_mesh.ranks:
            want = full[rs.dst_spec.local_slices(rs.shape, rs.dst_mesh, rs.dst_mesh.coord(rank))]
            got = buffers.to_host(result) if isinstance(result, DeviceTensor) else None
            ok = got is not None and got.dtype == want.dtype and np.array_equal(got, want)
        else:
            ok = result is None
        resharder.free()
        passed += _report(comm, f"cross-mesh {name}", ok)
        total += 1
    for shape in ((2, 2), (1, 4)):
        mesh = LogicalMesh(shape, (0, 1, 2, 3))
        communicators = MeshCommunicators(_Plan(shape), comm, MPI, buffers)
        locals_ = {mesh.coord(r): np.random.default_rng(r).standard_normal((4, 8, 4)).astype(np.float32)
                   for r in range(4)}
        for step in STEPS:
            expected = apply_steps(locals_, [step], mesh)[mesh.coord(rank)]
            got = buffers.to_host(communicators(step, buffers.from_host(locals_[mesh.coord(rank)])))
            ok = got.shape == expected.shape and np.allclose(got, expected, rtol=1e-6, atol=1e-6)
            passed += _report(comm, f"collective {shape[0]}x{shape[1]} {step}", ok)
            total += 1
    if rank == 0:
        print(f"{passed}/{total} cases passed", flush=True)
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
