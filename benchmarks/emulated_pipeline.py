"""A pipelined training step across emulated hosts: the measured step next to the plan's estimate.

Usage (from the repository root, as root on Linux)::

    python benchmarks/emulated_pipeline.py [--rate 1gbit] [--microbatches 2 4 8] [--steps 6]
        [--warmup 2] [--layers 4] [--hidden 256] [--seq 128] [--vocab 2048] [--batch 8]
        [--json PATH] [--smoke]

Two hosts of one rank each (``meshplan.testing.emulated_cluster``: network namespaces
joined by veth links rate-limited with tc), so a 2-stage pipeline has one stage a host and
every activation and gradient between the stages crosses the link. The model: the GPT of
``benchmarks/train.py`` (written with ``onnx.helper``), trained with AdamW on random tokens.

1. ``meshplan profile --train`` under mpiexec across the two hosts, one thread a rank: the
   training step's operators at the microbatches' shapes, timed as the ranks run them.
2. A cluster file of the two hosts: the ``cpu`` device, the inter-host link at the rate tc
   gives it (``--rate``) and the latency of a small message measured over it.
3. For each microbatch count M: ``meshplan plan --train --stages 2 --microbatches M
   --profile ... --cluster ...`` (1F1B), then ``meshplan train`` across the hosts; the
   measured step is the median of the timed steps (after ``--warmup``), the estimate the
   plan's (its 1F1B schedule played with each part's and send's estimated time); each
   rank's busy share of its steps next to the pipeline's ideal idle share, (S − 1)/(M + S − 1).

Check: every measured step within 25 % of the plan's estimate (the exit status is 1
otherwise). ``--smoke``: a tiny GPT, one microbatch count, one timed step; the check is
not held (the script's path in seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from train import HYPER, LOSS, build_onnx_gpt  # noqa: E402  (the same GPT as the training benchmark)

MESHPLAN = [sys.executable, "-m", "cli.main"]
WITHIN = 0.25
STAGES = 2


def _run(cluster, command: list, what: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    done = cluster.run([str(c) for c in command], timeout=timeout, env={"PYTHONPATH": str(REPO)}, cwd=REPO)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
        raise SystemExit(f"{what} failed:\n" + "\n".join(tail))
    return done


def _plan(model: Path, out: Path, cluster_file: Path, profile: Path, c: dict, microbatches: int) -> dict:
    command = [*MESHPLAN, "plan", model, "--train", "--loss", LOSS, "--optimizer", "adamw", "--cluster", cluster_file,
               "--dim", f"batch={c['batch']}", "--stages", STAGES, "--microbatches", microbatches,
               "--profile", profile, "-o", out]
    done = subprocess.run([str(x) for x in command], capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"meshplan plan failed: {(done.stdout + done.stderr).strip()}")
    document = json.loads((out / "plan.json").read_text())
    return {"estimate_seconds": float(document["estimate"]["step_seconds"]),
            "report": [line for line in done.stdout.splitlines() if line.strip()][:12]}


_ECHO = """
import socket, sys, time
if sys.argv[1] == "serve":
    server = socket.create_server((sys.argv[2], 47011)); connection, _ = server.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (data := connection.recv(64)):
        connection sendall(data)
else:
    client = socket.create_connection((sys.argv[2], 47011)); client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(200):
        began = time.perf_counter(); client.sendall(b"x"); client.recv(64); times.append(time.perf_counter() - began)
    print(sorted(times)[len(times) // 2] / 2)
""".replace("connection sendall", "connection.sendall")


def _latency(cluster) -> float:
    """Seconds one way of a small message over the link: half the median round trip of a
    byte between the hosts over TCP."""
    server = subprocess.Popen(["ip", "netns", "exec", cluster.namespaces[1], sys.executable, "-c", _ECHO, "serve",
                               cluster.address(1)])
    try:
        for _ in range(50):
            done = subprocess.run(["ip", "netns", "exec", cluster.namespaces[0], sys.executable, "-c", _ECHO, "ask",
                                   cluster.address(1)], capture_output=True, text=True)
            if done.returncode == 0:
                return float(done.stdout.strip())
            time.sleep(0.1)   # the server not listening yet
        raise SystemExit(f"no round trip between the hosts: {done.stderr.strip()[-300:]}")
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="inter-host link rate [default: 1gbit]")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=6, help="timed steps a run [default: 6]")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first [default: 2]")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    parser.add_argument("--workdir", type=Path, help="keep the model, profiles, plans and logs here [default: a "
                        "temporary directory]")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT, 2 microbatches, 1 timed step; no check")
    args = parser.parse_args(argv)
    c = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab, "seq": args.seq,
         "batch": args.batch}
    if args.smoke:
        c = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 128, "seq": 16, "batch": 4}
        args.microbatches, args.steps, args.warmup = [2], 1, 1

    from meshplan.testing.emulated_cluster import EmulatedCluster, rate_bits, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"emulated_pipeline: cannot run here: {reason}", file=sys.stderr)
        return 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(2, 1, args.rate) as cluster:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = work / "gpt.onnx"
        info = build_onnx_gpt(c, model)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, c["vocab"], size=(4 * c["batch"], c["seq"] + 1))
        data = work / "data.npz"
        np.savez(data, input_ids=tokens[:, :-1].astype(np.int64), targets=tokens[:, 1:].astype(np.int64))
        latency = _latency(cluster)
        cluster_file = work / "cluster.toml"
        cluster_file.write_text(
            f'hosts = 2\ndevices_per_host = 1\ndevice = "cpu"\n[inter_host]\n'
            f"bandwidth_gbps = {rate_bits(args.rate) / 8 / 1e9:.6f}\nlatency_us = {latency * 1e6:.1f}\n")
        print(f"GPT {info['parameters'] / 1e6:.1f} M parameters ({c['layers']} layers, hidden {c['hidden']}, "
              f"sequence {c['seq']}, vocabulary {c['vocab']}), batch {c['batch']}; 2 hosts x 1 rank, link "
              f"{args.rate}, {latency * 1e6:.0f} us one way")
        for m in args.microbatches:
            profile = work / f"profile-m{m}.json"   # the step's operators at this microbatch's shapes
            _run(cluster, [*MESHPLAN, "profile", model, "--train", "--loss", LOSS, "--optimizer", "adamw",
                           "--cluster", cluster_file, "--dim", f"batch={c['batch']}", "--threads", 1,
                           "--cache", work / "cache.sqlite", "-o", profile]
                 + (["--microbatches", m] if m > 1 else []), "meshplan profile --train")
            plan_dir = work / f"plan-m{m}"
            planned = _plan(model, plan_dir, cluster_file, profile, c, m)
            log = work / f"m{m}.json"
            _run(cluster, [*MESHPLAN, "train", plan_dir, "--data", data, "--steps", args.warmup + args.steps,
                           "--lr", HYPER["lr"], "--weight-decay", HYPER["weight_decay"], "--provider", "cpu",
                           "--log", log, "--trace", work / f"m{m}-trace.json", "-q"], f"meshplan train (M = {m})")
            record = json.loads(log.read_text())
            measured = statistics.median(record["step_seconds"][args.warmup:])
            rows.append({"microbatches": m, "estimate_seconds": planned["estimate_seconds"],
                         "measured_seconds": measured, "ratio": measured / planned["estimate_seconds"],
                         "busy_fractions": record.get("busy_fractions", []),
                         "ideal_idle": (STAGES - 1) / (m + STAGES - 1), "losses": record["losses"],
                         "plan_report": planned["report"]})
    return report(rows, args)


def report(rows: list[dict], args) -> int:
    header = f"{'M':>3} {'estimate':>10} {'measured':>10} {'meas/est':>9}  {'busy share per rank':<22} {'idle (S-1)/(M+S-1)':>18}"
    print(header)
    print("-" * len(header))
    misses = []
    for row in rows:
        busy = " / ".join(f"{b:.2f}" for b in row["busy_fractions"])
        print(f"{row['microbatches']:>3} {row['estimate_seconds'] * 1e3:>8.1f}ms {row['measured_seconds'] * 1e3:>8.1f}ms "
              f"{row['ratio']:>9.2f}  {busy:<22} {row['ideal_idle']:>18.2f}")
        if abs(row["ratio"] - 1) > WITHIN:
            misses.append(row)
    print("-" * len(header))
    status = "PASSED" if not misses else "FAILED"
    if args.smoke:
        status = "SMOKE"
    print(f"{status} | measured step within {WITHIN:.0%} of the estimate on {len(rows) - len(misses)}/{len(rows)}"
          f"{' (--smoke: the check is not held)' if args.smoke else ''} | benchmarks/emulated_pipeline.py")
    if args.json:
        args.json.write_text(json.dumps({"rate": args.rate, "stages": STAGES, "rows": rows}, indent=1))
    return 0 if status != "FAILED" else 1


if __name__ == "__main__":
    sys.exit(main())
