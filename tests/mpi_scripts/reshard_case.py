"""Cross-mesh resharding under mpiexec (4 ranks): every rank checks its result.

Run as ``mpiexec -n 4 python tests/mpi_scripts/reshard_case.py``. Each case moves a
deterministic tensor between two meshes of the 4 ranks; every destination rank compares
what it got with the slice its spec names. Rank 0 prints one line per case; the exit
status is 0 only if every case matched on every rank.
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
from meshplan.runtime.cross_mesh_mpi import CrossMeshResharder  # noqa: E402
from meshplan.sharding import LogicalMesh  # noqa: E402

# name, shape, (A shape, A ranks, spec), (B shape, B ranks, spec), local all-gather, algorithm, dtype
CASES = [
    ("1x2->1x2 same spec", (6, 8), ((1, 2), (0, 1), "RS1"), ((1, 2), (2, 3), "RS1"), False, "randomized_greedy", np.float32),
    ("1x2->1x2 bcast", (6, 8), ((1, 2), (0, 1), "RS1"), ((1, 2), (2, 3), "RR"), False, "randomized_greedy", np.float32),
    ("1x2->1x2 scatter+allgather", (6, 8), ((1, 2), (0, 1), "RR"), ((1, 2), (2, 3), "RR"), True, "dfs", np.float32),
    ("1x2->2x1 send/recv", (4, 6), ((1, 2), (0, 1), "RS1"), ((2, 1), (2, 3), "S0R"), False, "naive", np.float32),
    ("2x1->1x2 bcast", (4, 6, 2), ((2, 1), (1, 0), "S0RR"), ((1, 2), (3, 2), "RRR"), False, "load_balance", np.float64),
    ("1x1->1x3 bcast", (6, 4), ((1, 1), (0,), "RR"), ((1, 3), (1, 2, 3), "RR"), False, "randomized_greedy", np.float32),
    ("1x1->1x3 local allgather", (6, 4), ((1, 1), (0,), "RR"), ((1, 3), (1, 2, 3), "RR"), True, "randomized_greedy", np.int32),
    ("1x1->1x3 split", (5, 6), ((1, 1), (3,), "RR"), ((1, 3), (0, 1, 2), "RS1"), False, "dfs", np.float32),
    ("1x3->1x1 gather", (6, 3), ((1, 3), (1, 2, 3), "S1R"), ((1, 1), (0,), "RR"), False, "randomized_greedy", np.float32),
]


def main() -> int:
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 4:
        if comm.Get_rank() == 0:
            print(f"needs 4 ranks, got {comm.Get_size()}", file=sys.stderr)
        return 1
    rank = comm.Get_rank()
    cluster = make_cluster((2, 2))
    built = []
    for name, shape, (sa, ra, xa), (sb, rb, xb), allgather, algorithm, dtype in CASES:
        rs = plan_resharding(shape, xa, LogicalMesh(sa, ra), xb, LogicalMesh(sb, rb), np.dtype(dtype).itemsize,
                             allow_local_allgather=allgather)
        schedule = schedule_tasks(rs.tasks, cluster, algorithm, trials=8, polish=16)
        built.append((name, rs, CrossMeshResharder(rs, schedule, comm, dtype), dtype))   # collective, same order
    failures = 0
    for name, rs, resharder, dtype in built:
        full = np.arange(math.prod(rs.shape), dtype=dtype).reshape(rs.shape) * 3 + 1
        local = None
        if rank in rs.src_mesh.ranks:
            coord = rs.src_mesh.coord(rank)
            local = np.ascontiguousarray(full[rs.src_spec.local_slices(rs.shape, rs.src_mesh, coord)])
        result = resharder.run(local)
        ok = True
        if rank in rs.dst_mesh.ranks:
            want = full[rs.dst_spec.local_slices(rs.shape, rs.dst_mesh, rs.dst_mesh.coord(rank))]
            ok = result is not None and result.dtype == want.dtype and np.array_equal(result, want)
        else:
            ok = result is None
        bad = np.array([0 if ok else 1], dtype=np.int64)
        total = np.zeros_like(bad)
        comm.Allreduce(bad, total, op=MPI.SUM)
        failures += int(total[0] > 0)
        if rank == 0:
            print(f"{'ok  ' if total[0] == 0 else 'FAIL'} {name} ({len(rs.tasks)} tasks, {len(rs.allgathers)} all-gathers)"
                  + ("" if total[0] == 0 else f": {total[0]} ranks wrong"), flush=True)
    for _, _, resharder, _ in built:
        resharder.free()
    if rank == 0:
        print(f"{len(CASES) - failures}/{len(CASES)} cases passed", flush=True)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
