"""Cross-mesh resharding measured across emulated hosts, next to the simulator's makespans.

Usage (from the repository root, as root on Linux)::

    python benchmarks/emulated_cluster.py [--rate 1gbit] [--delay-ms 0.2] [--rows 1024]
        [--cols 2048] [--repeats 5] [--json PATH] [--smoke]

Two hosts of two ranks each are emulated with network namespaces
(``meshplan.testing.emulated_cluster``): ranks of one host share memory, the hosts are
joined by links rate-limited with tc (and delayed with netem where the kernel has it).
One MPI job over the four ranks first measures both links as ``meshplan profile`` does
(one send/recv pair alone on each mesh axis), builds the cluster model from those
figures, then runs the paper's cross-mesh cases from mesh A (host 0) to mesh B
(host 1) with every scheduler on broadcast tasks and with naive send/recv, each
``--repeats`` times (the median kept; each time is the slowest rank's, from a common
barrier). Each row prints the measured makespan next to the simulator's for the same
link figures (``+ag`` rows: the tasks, then the all-gather inside B, in both).

Cases: ``equal`` (same mesh shape and spec), ``unequal`` (different mesh shapes or
sizes), ``unequal+ag``/``equal+ag`` (the tasks deliver a finer spec and B all-gathers
locally). Checks: every measured makespan within 1.5x of the simulated one, and where
the simulator puts the broadcast schedules ahead of naive send/recv (by more than 10%),
so does the measurement. The exit status is 1 when a check fails. ``--smoke`` moves a
64 x 64 tensor once per case and holds no check against the exit status (the times of
16 KiB say nothing of the links): the script's path in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SCHEDULERS = ("naive", "load_balance", "dfs", "randomized_greedy")
WITHIN = 1.5
# (case, mesh A shape, A ranks, spec A, mesh B shape, B ranks, spec B, local all-gather)
CASES = [
    ("equal", (1, 2), (0, 1), "RS1", (1, 2), (2, 3), "RS1", False),
    ("equal", (1, 2), (0, 1), "RR", (1, 2), (2, 3), "RR", False),
    ("equal+ag", (1, 2), (0, 1), "RR", (1, 2), (2, 3), "RR", True),
    ("unequal", (1, 2), (0, 1), "RS1", (2, 1), (2, 3), "S0R", False),
    ("unequal", (1, 1), (0,), "RR", (1, 2), (2, 3), "RR", False),
    ("unequal", (1, 2), (0, 1), "S0R", (1, 1), (2,), "RR", False),
    ("unequal+ag", (1, 2), (0, 1), "RS1", (2, 1), (2, 3), "RR", True),
    ("unequal+ag", (1, 1), (0,), "RR", (1, 2), (2, 3), "RR", True),
]


# --- inside the MPI job ------------------------------------------------------------------

def worker(args) -> int:
    import numpy as np
    from mpi4py import MPI

    from meshplan.cost.cluster import make_cluster
    from meshplan.profile.comm import CommMeasurer, message_sizes
    from meshplan.profile.document import Profile
    from meshplan.profile.measured import with_measured_links
    from meshplan.reshard.schedulers import schedule_tasks
    from meshplan.reshard.send_spec import allgather_seconds
    from meshplan.reshard.tasks import as_send_recv, plan_resharding
    from meshplan.runtime.cross_mesh_mpi import CrossMeshResharder
    from meshplan.sharding import LogicalMesh

    world = MPI.COMM_WORLD
    if world.size != 4:
        raise SystemExit("the benchmark job needs 4 ranks (2 hosts x 2)")
    # The links, measured as meshplan profile does; the cluster model takes them.
    measurer = CommMeasurer(MPI, world, (2, 2), budget_seconds=0.2)
    sizes = message_sizes(16 * 1024 * 1024)
    fits = [measurer.measure_link(axis, sizes) for axis in (0, 1)]
    profile = Profile(model={}, mesh=[2, 2], device="cpu", hardware="", provider="", onnxruntime="", threads=1,
                      ranks=4, operators={}, communication=fits, communication_source="measured",
                      cuda_aware_mpi={"value": None, "method": ""})
    cluster, _ = with_measured_links(make_cluster((2, 2), "cpu"), profile)
    shape = (args.rows, args.cols)
    full = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    rows = []
    for case, ma, ra, sa, mb, rb, sb, ag in CASES:
        mesh_a, mesh_b = LogicalMesh(ma, ra), LogicalMesh(mb, rb)
        transfer = plan_resharding(shape, sa, mesh_a, sb, mesh_b, 4, allow_local_allgather=ag)
        gather = allgather_seconds(transfer, cluster)
        runs = [(name, transfer, schedule_tasks(transfer.tasks, cluster, name, trials=32, node_budget=10_000))
                for name in SCHEDULERS]
        sendrecv = replace(transfer, tasks=tuple(as_send_recv(transfer.tasks)))
        runs.append(("sendrecv_naive", sendrecv, schedule_tasks(sendrecv.tasks, cluster, "naive")))
        row = {"case": case, "src_mesh": list(ma), "src_spec": sa, "dst_mesh": list(mb), "dst_spec": sb,
               "local_allgather": ag, "tasks": len(transfer.tasks), "nbytes": int(full.nbytes), "schedulers": {}}
        for name, moved, schedule in runs:
            resharder = CrossMeshResharder(moved, schedule, world, np.float32)
            local = None
            if world.rank in mesh_a.ranks:
                local = np.ascontiguousarray(full[moved.src_spec.local_slices(shape, mesh_a, mesh_a.coord(world.rank))])
            times = []
            for _ in range(args.repeats + 1):              # the first run warms the connections up
                world.Barrier()
                started = MPI.Wtime()
                out = resharder.run(local)
                mine = np.array([MPI.Wtime() - started])
                slowest = np.empty_like(mine)
                world.Allreduce(mine, slowest, op=MPI.MAX)
                times.append(float(slowest[0]))
            if world.rank in mesh_b.ranks:
                want = full[moved.dst_spec.local_slices(shape, mesh_b, mesh_b.coord(world.rank))]
                if not np.array_equal(out, want):
                    raise SystemExit(f"rank {world.rank}: wrong result in {case} {name}")
            resharder.free()
            row["schedulers"][name] = {"measured_ms": statistics.median(times[1:]) * 1e3,
                                       "simulated_ms": (schedule.makespan + gather) * 1e3}
        rows.append(row)
    if world.rank == 0:
        links = {"inter_host": {"bandwidth": cluster.inter_host.bandwidth, "latency": cluster.inter_host.latency},
                 "intra_host": {"bandwidth": cluster.intra_host.bandwidth, "latency": cluster.intra_host.latency}}
        Path(args.worker_out).write_text(json.dumps({"links": links, "rows": rows}))
    return 0


# --- the driver: set up the hosts, run the job, print ------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="inter-host link rate (default 1gbit)")
    parser.add_argument("--delay-ms", type=float, default=0.2, help="one-way delay on the links (needs netem)")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=2048, help="tensor [rows, cols] float32 (default 8 MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="a 64 x 64 tensor once per case, the checks not held: the script's path in seconds")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.smoke:
        args.rows, args.cols, args.repeats = 64, 64, 1

    from meshplan.testing.emulated_cluster import EmulatedCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"emulated_cluster: cannot run here: {reason}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(2, 2, args.rate, args.delay_ms) as cluster:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--worker-out", str(out),
                   "--rows", str(args.rows), "--cols", str(args.cols), "--repeats", str(args.repeats)]
        done = subprocess.run([*cluster.mpiexec_command(), *command], env=cluster.environment({"PYTHONPATH": str(REPO)}),
                              cwd=REPO, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not out.exists():
            print(done.stdout + done.stderr, file=sys.stderr)
            print("FAILED | the MPI job did not finish | benchmarks/emulated_cluster.py")
            return 1
        result = json.loads(out.read_text())
        delay = args.delay_ms if cluster.delay_applied else 0.0
    return report(result, args, delay)


def report(result: dict, args, delay_ms: float) -> int:
    links = result["links"]
    inter, intra = links["inter_host"], links["intra_host"]
    print(f"2 hosts x 2 ranks, link {args.rate}" + (f", {delay_ms} ms delay" if delay_ms else ", no added delay")
          + f"; tensor [{args.rows}, {args.cols}] float32 = {4 * args.rows * args.cols / 2**20:.0f} MiB")
    print(f"measured links: inter-host {inter['bandwidth'] / 1e6:.1f} MB/s, {inter['latency'] * 1e6:.0f} us; "
          f"intra-host {intra['bandwidth'] / 1e9:.2f} GB/s, {intra['latency'] * 1e6:.0f} us; times in ms "
          "(measured / simulated)")
    names = [*SCHEDULERS, "sendrecv_naive"]
    short = {"naive": "naive", "load_balance": "lbal", "dfs": "dfs", "randomized_greedy": "greedy",
             "sendrecv_naive": "s/r naive"}
    header = f"{'case':<11}{'A':>4} {'X_A':<5}{'B':>4} {'X_B':<5}{'tasks':>6}" + "".join(f"{short[n]:>16}" for n in names)
    print(header)
    print("-" * len(header))
    misses, order_misses = [], []
    for row in result["rows"]:
        cells = ""
        for name in names:
            cell = row["schedulers"][name]
            ratio = cell["measured_ms"] / cell["simulated_ms"]
            cell["ratio"] = ratio
            if not 1 / WITHIN <= ratio <= WITHIN:
                misses.append((row, name, ratio))
            cells += f"{cell['measured_ms']:>8.1f}/{cell['simulated_ms']:<7.1f}"
        a, b = "x".join(map(str, row["src_mesh"])), "x".join(map(str, row["dst_mesh"]))
        print(f"{row['case']:<11}{a:>4} {row['src_spec']:<5}{b:>4} {row['dst_spec']:<5}{row['tasks']:>6}{cells}")
        greedy, naive_sr = row["schedulers"]["randomized_greedy"], row["schedulers"]["sendrecv_naive"]
        row["broadcast_ahead_simulated"] = greedy["simulated_ms"] < naive_sr["simulated_ms"] / 1.1
        row["broadcast_ahead_measured"] = greedy["measured_ms"] < naive_sr["measured_ms"]
        if row["broadcast_ahead_simulated"] and not row["broadcast_ahead_measured"]:
            order_misses.append(row)
    print("-" * len(header))
    ratios = [c["ratio"] for r in result["rows"] for c in r["schedulers"].values()]
    ahead = [r for r in result["rows"] if r["broadcast_ahead_simulated"]]
    print(f"measured / simulated: {min(ratios):.2f} to {max(ratios):.2f}; broadcast schedules ahead of naive "
          f"send/recv in the simulator on {len(ahead)} row(s), measured ahead on "
          f"{sum(r['broadcast_ahead_measured'] for r in ahead)} of them")
    for row, name, ratio in misses:
        print(f"outside {WITHIN}x: {row['case']} {row['src_spec']} -> {row['dst_spec']} {name}: {ratio:.2f}")
    for row in order_misses:
        print(f"broadcast not ahead as simulated: {row['case']} {row['src_spec']} -> {row['dst_spec']}")
    status = "PASSED" if not misses and not order_misses else "FAILED"
    print(f"{status} | every makespan within {WITHIN}x of the simulator on "
          f"{len(ratios) - len(misses)}/{len(ratios)}{' (--smoke: checks not held)' if args.smoke else ''} | "
          "benchmarks/emulated_cluster.py")
    if args.json:
        flat = [{k: v for k, v in row.items() if k != "schedulers"} | {"scheduler": name, **cell}
                for row in result["rows"] for name, cell in row["schedulers"].items()]
        body = {"rate": args.rate, "delay_ms": delay_ms, "shape": [args.rows, args.cols], "links": result["links"],
                "rows": flat}
        Path(args.json).write_text(json.dumps(body, indent=1) + "\n")
    return 0 if status == "PASSED" or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
