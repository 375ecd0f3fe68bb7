"""Cross-mesh resharding under mpiexec (4 ranks): every rank checks its result.

Run as ``mpiexec -n 4 python tests/mpi_scripts/reshard_case.py``. Each case moves a
deterministic tensor between two meshes of the 4 ranks; every destination rank compares
what it got with the slice its spec names, and with the in-memory executor. Cases with
a send spec first rearrange the tensor inside the source mesh (the transfer's
``prepare`` steps: all-to-all, all-gather or slice). Rank 0 prints one line per case;
the exit status is 0 only if every case matched on every rank.

``run_cases(comm, buffers)`` is also used by device_path_case.py with device buffers.
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from meshplan.cost.cluster import make_cluster  # noqa: E402
from meshplan.reshard.schedulers import schedule_tasks  # noqa: E402
from meshplan.reshard.tasks import plan_resharding  # noqa: E402
from meshplan.runtime.buffers import HOST  # noqa: E402
from meshplan.runtime.cross_mesh_mpi import CrossMeshResharder, reshard_in_memory  # noqa: E402
from meshplan.sharding import LogicalMesh  # noqa: E402

# name, shape, (A shape, A ranks, spec), send spec, (B shape, B ranks, spec), local all-gather, algorithm, dtype
CASES = [
    ("1x2->1x2 same spec", (6, 8), ((1, 2), (0, 1), "RS1"), None, ((1, 2), (2, 3), "RS1"), False, "randomized_greedy", np.float32),
    ("1x2->1x2 bcast", (6, 8), ((1, 2), (0, 1), "RS1"), None, ((1, 2), (2, 3), "RR"), False, "randomized_greedy", np.float32),
    ("1x2->1x2 scatter+allgather", (6, 8), ((1, 2), (0, 1), "RR"), None, ((1, 2), (2, 3), "RR"), True, "dfs", np.float32),
    ("1x2->2x1 send/recv", (4, 6), ((1, 2), (0, 1), "RS1"), None, ((2, 1), (2, 3), "S0R"), False, "naive", np.float32),
    ("2x1->1x2 bcast", (4, 6, 2), ((2, 1), (1, 0), "S0RR"), None, ((1, 2), (3, 2), "RRR"), False, "load_balance", np.float64),
    ("1x1->1x3 bcast", (6, 4), ((1, 1), (0,), "RR"), None, ((1, 3), (1, 2, 3), "RR"), False, "randomized_greedy", np.float32),
    ("1x1->1x3 local allgather", (6, 4), ((1, 1), (0,), "RR"), None, ((1, 3), (1, 2, 3), "RR"), True, "randomized_greedy", np.int32),
    ("1x1->1x3 split", (5, 6), ((1, 1), (3,), "RR"), None, ((1, 3), (0, 1, 2), "RS1"), False, "dfs", np.float32),
    ("1x3->1x1 gather", (6, 3), ((1, 3), (1, 2, 3), "S1R"), None, ((1, 1), (0,), "RR"), False, "randomized_greedy", np.float32),
    ("prepare 1x2->1x2 all_to_all", (4, 6), ((1, 2), (0, 1), "RS1"), "S1R", ((1, 2), (2, 3), "RS1"), False, "randomized_greedy", np.float32),
    ("prepare 1x2->2x1 all_gather", (4, 6), ((1, 2), (0, 1), "S1R"), "RR", ((2, 1), (3, 2), "S0R"), False, "randomized_greedy", np.float32),
    ("prepare 2x1->1x2 all_to_all axis 0", (4, 6, 2), ((2, 1), (1, 0), "S0RR"), "RS0R", ((1, 2), (2, 3), "RRR"), True, "randomized_greedy", np.float64),
    ("prepare 1x2->2x1 slice", (4, 6), ((1, 2), (2, 3), "RR"), "S1R", ((2, 1), (0, 1), "RS0"), False, "randomized_greedy", np.int32),
    ("prepare 1x3->1x1 all_to_all", (6, 3), ((1, 3), (1, 2, 3), "S1R"), "RS1", ((1, 1), (0,), "RR"), False, "randomized_greedy", np.float32),
]


def report(comm, line: str, ok: bool) -> bool:
    bad = np.array([0 if ok else 1], dtype=np.int64)
    total = np.zeros_like(bad)
    comm.Allreduce(bad, total, op=MPI.SUM)
    if comm.rank == 0:
        print(f"{'ok  ' if total[0] == 0 else 'FAIL'} {line}" + ("" if total[0] == 0 else f": {total[0]} ranks wrong"),
              flush=True)
    return total[0] == 0


def run_cases(comm, buffers=HOST) -> tuple[int, int]:
    """Every case with tensors of ``buffers``' kind; (cases passed, cases)."""
    rank = comm.Get_rank()
    cluster = make_cluster((2, 2))
    built = []
    for name, shape, (sa, ra, xa), send, (sb, rb, xb), allgather, algorithm, dtype in CASES:
        rs = plan_resharding(shape, xa, LogicalMesh(sa, ra), xb, LogicalMesh(sb, rb), np.dtype(dtype).itemsize,
                             allow_local_allgather=allgather, send_spec=send)
        schedule = schedule_tasks(rs.tasks, cluster, algorithm, trials=8, polish=16)
        resharder = CrossMeshResharder(rs, schedule, comm, dtype, buffers=buffers)   # collective, same order
        built.append((name, rs, schedule, resharder, dtype, send))
    passed = 0
    for name, rs, schedule, resharder, dtype, send in built:
        full = np.arange(math.prod(rs.shape), dtype=dtype).reshape(rs.shape) * 3 + 1

        def shard(r):
            return np.ascontiguousarray(full[rs.src_spec.local_slices(rs.shape, rs.src_mesh, rs.src_mesh.coord(r))])

        local = buffers.from_host(shard(rank)) if rank in rs.src_mesh.ranks else None
        result = resharder.run(local)
        ok = bool(rs.prepare) == (send is not None)
        if rank in rs.dst_mesh.ranks:
            want = full[rs.dst_spec.local_slices(rs.shape, rs.dst_mesh, rs.dst_mesh.coord(rank))]
            got = None if result is None else buffers.to_host(result)
            in_memory = reshard_in_memory({r: shard(r) for r in rs.src_mesh.ranks}, rs, schedule)[rank]
            ok = ok and got is not None and got.dtype == want.dtype and np.array_equal(got, want)
            ok = ok and np.array_equal(in_memory, want)
        else:
            ok = ok and result is None
        steps = ", ".join(str(s) for s in rs.prepare)
        passed += report(comm, f"{name} ({len(rs.tasks)} tasks, {len(rs.allgathers)} all-gathers"
                          + (f"; {rs.src_spec} -> {rs.send_spec}: {steps}" if steps else "") + ")", ok)
    for *_, resharder, _, _ in built:
        resharder.free()
    return passed, len(built)


def main() -> int:
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 4:
        if comm.Get_rank() == 0:
            print(f"needs 4 ranks, got {comm.Get_size()}", file=sys.stderr)
        return 1
    passed, total = run_cases(comm)
    if comm.rank == 0:
        print(f"{passed}/{total} cases passed", flush=True)
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
