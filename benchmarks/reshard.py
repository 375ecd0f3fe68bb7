"""Compare the cross-mesh resharding schedulers on the cluster model.

Usage (from the repository root)::

    python benchmarks/reshard.py [--json PATH] [--trials N] [--dfs-nodes N] [--quick] [--check]

Each row moves one fp32 activation (``[batch*seq, hidden]``, 64 MB by default) from
mesh A to mesh B on a cluster of 8-device hosts, 300 GB/s inside a host and 25 GB/s
between hosts (5 µs / 20 µs latency). A mesh ``n x m`` takes ``m`` devices on each of
``n`` hosts of its own; B's hosts follow A's. Cases (the MLSys paper's three):

* ``equal``: equal mesh shapes and specs (pipeline stages of Megatron-style layers);
  with ``+ag`` the tasks deliver a finer spec and B all-gathers (scatter + all-gather).
* ``unequal``: different mesh shapes, send/recv or broadcast of the refined pieces.
* ``unequal+ag``: different shapes with the local all-gather in B.

``+ag`` rows gather only along B's axis 1 (inside hosts).

Each row first chooses the *send spec* with ``send_spec.best_resharding`` (randomized
greedy): the layout A rearranges the tensor into with its intra-mesh collectives
before the unit tasks (``send`` column; the same as ``X_A`` when no rearrangement
pays). Every other column then works on that transfer's tasks.

Columns, in ms: ``prep``, the rearrangement inside A (alpha-beta model of A's links);
the simulated makespans of the cross-mesh step with the four schedulers on broadcast
tasks; the send/recv baseline (one task per receiver) with the naive and the
randomized greedy scheduler; the lower bound of the tasks; the all-gather time
(``+ag`` rows); ``direct``, randomized greedy without rearrangement (the tasks from
``X_A``); then ``gr/lb`` = (prep + greedy) / bound, and the broadcast gain (send/recv
over broadcast, both with randomized greedy). ``prep`` and ``+ag`` come on top of
every scheduler column; ``gr/lb`` counts ``prep`` but, as the bound, not ``+ag`` (the
same all-gather follows with and without rearrangement). The target is ``gr/lb``
within 1.15 on every row; ``--check`` exits 1 when a row misses it.

Without rearrangement ``2x8 S01R -> 4x8 RS1`` would miss it (1.33): every B device
needs 16 slices of 512 KB held by 16 different A devices, the 128 broadcasts into the
same four hosts run in waves that each pay their 60 us latency with the NICs idle
(3.644 ms, against a bound of 2.744 ms). An all-to-all inside A's hosts (S01R ->
S0S1, about 0.05 ms over the 300 GB/s links) leaves two 4 MB slices per B device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshplan.cost.cluster import GB, Cluster, DeviceSpec, LinkSpec  # noqa: E402
from meshplan.reshard.schedulers import schedule_tasks  # noqa: E402
from meshplan.reshard.send_spec import allgather_seconds, best_resharding  # noqa: E402
from meshplan.reshard.simulator import lower_bound  # noqa: E402
from meshplan.reshard.tasks import as_send_recv, plan_resharding  # noqa: E402
from meshplan.sharding import LogicalMesh  # noqa: E402

PER_HOST = 8
TARGET = 1.15

# (case, mesh A, spec A, mesh B, spec B, local all-gather)
ROWS = [
    ("equal", (1, 2), "RR", (1, 2), "RR", False),
    ("equal", (1, 2), "RR", (1, 2), "RR", True),
    ("equal", (2, 4), "S0R", (2, 4), "S0R", False),
    ("equal", (2, 4), "S0R", (2, 4), "S0R", True),
    ("equal", (4, 8), "S0R", (4, 8), "S0R", False),
    ("equal", (4, 8), "S0R", (4, 8), "S0R", True),
    ("equal", (4, 8), "S0S1", (4, 8), "S0S1", False),
    ("equal", (4, 8), "RS1", (4, 8), "RS1", False),
    ("unequal", (2, 4), "S0S1", (4, 2), "S1S0", False),
    ("unequal", (1, 4), "RS1", (2, 4), "S0R", False),
    ("unequal", (4, 8), "S0S1", (2, 8), "S0R", False),
    ("unequal", (2, 8), "S01R", (4, 8), "RS1", False),
    ("unequal", (4, 8), "S0R", (8, 4), "S0S1", False),
    ("unequal", (4, 8), "RS1", (4, 4), "S0R", False),
    ("unequal+ag", (2, 4), "S0R", (4, 2), "RR", True),
    ("unequal+ag", (1, 4), "RS1", (2, 4), "S0R", True),
    ("unequal+ag", (4, 8), "S0S1", (2, 8), "S0R", True),
    ("unequal+ag", (4, 8), "S0R", (8, 4), "S0R", True),
    ("unequal+ag", (4, 8), "RS1", (4, 4), "S0R", True),
]
ALGOS = ("naive", "load_balance", "dfs", "randomized_greedy")


def cluster_for(mesh_a, mesh_b) -> tuple[Cluster, LogicalMesh, LogicalMesh]:
    hosts = mesh_a[0] + mesh_b[0]
    device = DeviceSpec("bench", 80 * 1024**3, 1e15, 3e12, 5e-6)
    cluster = Cluster(hosts, PER_HOST, device, LinkSpec(300 * GB, 5e-6), LinkSpec(25 * GB, 20e-6))

    def place(shape, first_host):
        n, m = shape
        if m > PER_HOST:
            raise SystemExit(f"mesh {shape} does not fit {PER_HOST}-device hosts")
        return LogicalMesh(shape, tuple((first_host + i) * PER_HOST + j for i in range(n) for j in range(m)))

    return cluster, place(mesh_a, 0), place(mesh_b, mesh_a[0])


def run_row(row, shape, trials: int, dfs_nodes: int) -> dict:
    case, ma, sa, mb, sb, ag = row
    cluster, mesh_a, mesh_b = cluster_for(ma, mb)
    axes = (1,) if ag else None
    t0 = time.perf_counter()
    choice = best_resharding(shape, sa, mesh_a, sb, mesh_b, 4, cluster, "randomized_greedy", local_allgather=ag,
                             allgather_axes=axes, trials=trials)
    choose_seconds = time.perf_counter() - t0
    rs = choice.transfer
    result = {"case": case, "src_mesh": list(ma), "src_spec": sa, "dst_mesh": list(mb), "dst_spec": sb,
              "local_allgather": ag, "send_spec": str(rs.send_spec), "prepare": [str(s) for s in rs.prepare],
              "prepare_seconds": choice.prepare_seconds, "sent_spec": str(rs.sent_spec), "tasks": len(rs.tasks),
              "nbytes": rs.itemsize * math.prod(shape), "choose_seconds": choose_seconds, "choice": choice.stats}
    times = {}
    for algo in ALGOS:
        t0 = time.perf_counter()
        if algo == "randomized_greedy":
            sched = choice.schedule     # what best_resharding scheduled; its time: the whole choice
            t0 -= choose_seconds
        else:
            sched = schedule_tasks(rs.tasks, cluster, algo, trials=trials, node_budget=dfs_nodes)
        times[algo] = time.perf_counter() - t0
        result[algo] = sched.makespan
        if algo == "dfs":
            result["dfs_complete"] = bool(sched.stats.get("complete"))
    sendrecv = as_send_recv(rs.tasks)
    result["sendrecv_naive"] = schedule_tasks(sendrecv, cluster, "naive").makespan
    result["sendrecv_greedy"] = schedule_tasks(sendrecv, cluster, "randomized_greedy", trials=trials).makespan
    result["lower_bound"] = lower_bound(rs.tasks, cluster)
    result["allgather"] = allgather_seconds(rs, cluster)
    direct = plan_resharding(shape, sa, mesh_a, sb, mesh_b, 4, allow_local_allgather=ag, allgather_axes=axes)
    result["direct_tasks"] = len(direct.tasks)
    result["direct_greedy"] = schedule_tasks(direct.tasks, cluster, "randomized_greedy", trials=trials).makespan
    result["direct_lower_bound"] = lower_bound(direct.tasks, cluster)
    result["direct_greedy_over_bound"] = result["direct_greedy"] / result["direct_lower_bound"]
    result["greedy_over_bound"] = (result["prepare_seconds"] + result["randomized_greedy"]) / result["lower_bound"]
    result["broadcast_gain"] = result["sendrecv_greedy"] / result["randomized_greedy"]
    result["broadcast_gain_vs_naive_sendrecv"] = result["sendrecv_naive"] / result["randomized_greedy"]
    result["scheduler_seconds"] = times
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the numbers to this file")
    parser.add_argument("--rows", type=int, default=8192, help="batch*seq of the activation (default 8192)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048: 64 MB in fp32)")
    parser.add_argument("--trials", type=int, default=32, help="randomized greedy rounds (default 32)")
    parser.add_argument("--dfs-nodes", type=int, default=10_000, help="node budget of dfs per row (default 10000)")
    parser.add_argument("--quick", action="store_true", help="only the first row of each case")
    parser.add_argument("--check", action="store_true", help="exit 1 if greedy misses the target on a row")
    args = parser.parse_args(argv)
    shape = (args.rows, args.hidden)
    rows = ROWS
    if args.quick:
        seen, rows = set(), []
        for row in ROWS:
            if row[0] not in seen:
                seen.add(row[0])
                rows.append(row)
    start = time.perf_counter()
    results = []
    ms = 1e3
    header = (f"{'case':<11}{'A':>5} {'X_A':<5}{'B':>5} {'X_B':<5}{'send':<6}{'sent':<6}{'tasks':>6}{'prep':>7}"
              f"{'naive':>8}{'lbal':>8}{'dfs':>8}{'greedy':>8}{'s/r':>8}{'s/r-gr':>8}{'bound':>8}{'+ag':>7}"
              f"{'direct':>8}{'gr/lb':>7}{'bcast':>7}")
    print(f"tensor {list(shape)} fp32 = {4 * shape[0] * shape[1] / 2**20:.0f} MiB; hosts of {PER_HOST} devices, "
          "300 GB/s intra-host, 25 GB/s inter-host; times in ms")
    print(header)
    print("-" * len(header))
    for row in rows:
        r = run_row(row, shape, args.trials, args.dfs_nodes)
        results.append(r)
        a, b = "x".join(map(str, r["src_mesh"])), "x".join(map(str, r["dst_mesh"]))
        dfs_mark = "" if r["dfs_complete"] else "*"
        print(f"{r['case']:<11}{a:>5} {r['src_spec']:<5}{b:>5} {r['dst_spec']:<5}{r['send_spec']:<6}{r['sent_spec']:<6}"
              f"{r['tasks']:>6}{r['prepare_seconds'] * ms:>7.3f}"
              f"{r['naive'] * ms:>8.3f}{r['load_balance'] * ms:>8.3f}{r['dfs'] * ms:>7.3f}{dfs_mark or ' '}"
              f"{r['randomized_greedy'] * ms:>8.3f}{r['sendrecv_naive'] * ms:>8.3f}{r['sendrecv_greedy'] * ms:>8.3f}"
              f"{r['lower_bound'] * ms:>8.3f}{r['allgather'] * ms:>7.3f}{r['direct_greedy'] * ms:>8.3f}"
              f"{r['greedy_over_bound']:>7.3f}{r['broadcast_gain']:>6.1f}x")
    worst = max(r["greedy_over_bound"] for r in results)
    over = [r for r in results if r["greedy_over_bound"] > TARGET]
    elapsed = time.perf_counter() - start
    print("-" * len(header))
    print("* dfs stopped at its budget (best found); send = spec A rearranges into first (prep ms); "
          "s/r = send/recv, no broadcast;")
    print("prep and +ag come on top of every scheduler column; direct = greedy without rearrangement; "
          "gr/lb = (prep + greedy) / bound; bcast = s/r-gr / greedy")
    for r in over:
        print(f"over target: {'x'.join(map(str, r['src_mesh']))} {r['src_spec']} -> {'x'.join(map(str, r['dst_mesh']))} "
              f"{r['dst_spec']} ({r['greedy_over_bound']:.3f})")
    status = "PASSED" if not over else "FAILED"
    choose = max(r["choose_seconds"] for r in results)
    print(f"{status} | prep + greedy within {TARGET}x of the bound on {len(results) - len(over)}/{len(results)} rows, "
          f"worst {worst:.3f} | choosing the send spec: at most {choose:.2f} s a row | {elapsed:.1f} s | "
          "benchmarks/reshard.py")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": list(shape), "target": TARGET, "worst_greedy_over_bound": worst,
                       "rows_over_target": len(over), "seconds": elapsed, "rows": results}, f, indent=2)
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
