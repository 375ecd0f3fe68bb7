"""Cross-mesh resharding with a rearrangement inside the source mesh, under mpiexec (4 ranks).

Run as ``mpiexec -n 4 python tests/mpi_scripts/reshard_prepare_case.py``. Each case
forces a send spec, so the source ranks first run the transfer's ``prepare`` steps (an
all-to-all, all-gather or slice inside A) and then the unit tasks; every destination
rank compares what it got with the slice its spec names. Rank 0 prints one line per
case with the prepare steps; the exit status is 0 only if every case matched on every
rank.
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
from meshplan.runtime.cross_mesh_mpi import CrossMeshResharder, reshard_in_memory  # noqa: E402
from meshplan.sharding import LogicalMesh  # noqa: E402

# name, shape, (A shape, A ranks, spec), send spec, (B shape, B ranks, spec), local all-gather, dtype
CASES = [
    ("1x2->1x2 all_to_all", (4, 6), ((1, 2), (0, 1), "RS1"), "S1R", ((1, 2), (2, 3), "RS1"), False, np.float32),
    ("1x2->2x1 all_gather", (4, 6), ((1, 2), (0, 1), "S1R"), "RR", ((2, 1), (3, 2), "S0R"), False, np.float32),
    ("2x1->1x2 all_to_all axis 0", (4, 6, 2), ((2, 1), (1, 0), "S0RR"), "RS0R", ((1, 2), (2, 3), "RRR"), True,
     np.float64),
    ("1x2->2x1 slice", (4, 6), ((1, 2), (2, 3), "RR"), "S1R", ((2, 1), (0, 1), "RS0"), False, np.int32),
    ("1x3->1x1 all_to_all", (6, 3), ((1, 3), (1, 2, 3), "S1R"), "RS1", ((1, 1), (0,), "RR"), False, np.float32),
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
    for name, shape, (sa, ra, xa), send, (sb, rb, xb), allgather, dtype in CASES:
        rs = plan_resharding(shape, xa, LogicalMesh(sa, ra), xb, LogicalMesh(sb, rb), np.dtype(dtype).itemsize,
                             allow_local_allgather=allgather, send_spec=send)
        schedule = schedule_tasks(rs.tasks, cluster, "randomized_greedy", trials=8, polish=16)
        built.append((name, rs, schedule, CrossMeshResharder(rs, schedule, comm, dtype), dtype))  # collective, same order
    failures = 0
    for name, rs, schedule, resharder, dtype in built:
        full = np.arange(math.prod(rs.shape), dtype=dtype).reshape(rs.shape) * 3 + 1
        local = None
        if rank in rs.src_mesh.ranks:
            coord = rs.src_mesh.coord(rank)
            local = np.ascontiguousarray(full[rs.src_spec.local_slices(rs.shape, rs.src_mesh, coord)])
        result = resharder.run(local)
        ok = bool(rs.prepare)
        if rank in rs.dst_mesh.ranks:
            want = full[rs.dst_spec.local_slices(rs.shape, rs.dst_mesh, rs.dst_mesh.coord(rank))]
            ok = ok and result is not None and result.dtype == want.dtype and np.array_equal(result, want)
            # the in-memory executor delivers the same slice
            sources = {r: np.ascontiguousarray(full[rs.src_spec.local_slices(rs.shape, rs.src_mesh, rs.src_mesh.coord(r))])
                       for r in rs.src_mesh.ranks}
            ok = ok and np.array_equal(reshard_in_memory(sources, rs, schedule)[rank], want)
        else:
            ok = ok and result is None
        bad = np.array([0 if ok else 1], dtype=np.int64)
        total = np.zeros_like(bad)
        comm.Allreduce(bad, total, op=MPI.SUM)
        failures += int(total[0] > 0)
        if rank == 0:
            steps = ", ".join(str(s) for s in rs.prepare)
            print(f"{'ok  ' if total[0] == 0 else 'FAIL'} {name} ({rs.src_spec} -> {rs.send_spec}: {steps}; "
                  f"{len(rs.tasks)} tasks)" + ("" if total[0] == 0 else f": {total[0]} ranks wrong"), flush=True)
    for _, _, _, resharder, _ in built:
        resharder.free()
    if rank == 0:
        print(f"{len(CASES) - failures}/{len(CASES)} cases passed", flush=True)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
