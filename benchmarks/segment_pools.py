"""One rank's decode step cut at its collectives, on onnxruntime thread pools of three kinds:
what a pool per session costs a rank whose cores are its own.

A tensor-parallel rank runs its program as several onnxruntime sessions, one per segment
between two collectives. Each session has a pool of its own unless the process shares one
(``providers.share_one_pool``), and a pool's threads spin for a while after its run. Here
rank 0's program of the 1x2 plan of ``small_batch_split.py``'s 117 MB decode step runs in
one process with ``--threads`` threads (default: every core this process may use), each
collective replaced by this rank's own part (an all-gather by its part twice) after a pause
of ``--wait`` microseconds yielding the core, as a rank waiting in MPI does. Three runners,
each a process of its own that stays up, take turns in blocks of ``--steps`` steps
(``--blocks`` turns, each in a new random order, a pause of quiet before each):

- ``spinning``: a pool per session, spinning (the rule for ranks with cores of their own
  until 2026-11; 5.0-5.4 ms a step on 1x2 on 16 cores);
- ``not spinning``: a pool per session, not spinning (the rule after that);
- ``one pool``: the process's one pool shared by the sessions, spinning (``threads.one_pool``:
  the rule now, in the commands' processes).

Printed: each runner's median step and, against ``one pool``, the median of the blocks'
ratios (its step / one pool's: above 1 is slower).

    python benchmarks/segment_pools.py [--threads N] [--wait 30] [--blocks 12] [--steps 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

RUNNERS = {"one pool": "shared", "not spinning": "off", "spinning": "on"}


def worker(program: str, kind: str, threads: int, wait_us: float) -> None:
    """Load the program's segments with pools of ``kind`` (shared, on, off); answer each line
    "N" with the mean seconds of N steps."""
    import numpy as np

    from meshplan.providers import share_one_pool
    from meshplan.runtime.program import ProgramRunner

    if kind == "shared" and not share_one_pool(threads):
        raise SystemExit("onnxruntime refused a process-wide pool")
    runner = ProgramRunner(Path(program), ["CPUExecutionProvider"], threads=threads, spinning=kind != "off")
    wait = wait_us * 1e-6

    def exchange(step, tensor):
        until = time.perf_counter() + wait
        while time.perf_counter() < until:
            os.sched_yield()
        if step.kind.name == "all_gather":
            return np.concatenate([tensor, tensor], axis=step.dim)
        return tensor

    feeds = {"input_ids": np.array([[5]], dtype=np.int64)}
    runner.run(feeds, exchange)
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        steps = int(line)
        started = time.perf_counter()
        for _ in range(steps):
            runner.run(feeds, exchange)
        print(json.dumps((time.perf_counter() - started) / steps), flush=True)


def rank_program(workdir: Path) -> tuple[Path, int]:
    """Rank 0's program of the 1x2 plan of the 117 MB step, and how many sessions it runs as."""
    import onnx

    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_plan import make_plan
    from meshplan.runtime.program import ProgramRunner
    from benchmarks.small_batch_split import MODEL
    from sample_models.gpt import make_gpt

    path = workdir / "step.onnx"
    onnx.save_model(make_gpt(**MODEL), str(path), save_as_external_data=True, location="step.data")
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {"batch": 1, "seq": 1}, workdir / "plan",
                     PlanOptions(solver="highs", policy="megatron", max_stages=1))
    program = workdir / "plan" / plan.program_of_rank(0).file
    return program, ProgramRunner(program, ["CPUExecutionProvider"], lazy=True).sessions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--wait", type=float, default=30.0, help="microseconds each collective waits, yielding")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pause", type=float, default=0.3, help="seconds of quiet before each block")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", nargs=4, metavar=("PROGRAM", "KIND", "THREADS", "WAIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    from decode_blocks import Runner, take_turns   # (processes that stay up and run blocks of steps)

    if args.worker:
        program, kind, threads, wait = args.worker
        worker(program, kind, int(threads), float(wait))
        return 0
    if args.threads < 2:
        print("needs two threads or more: with one, onnxruntime makes no pool")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        program, sessions = rank_program(Path(tmp))
        print(f"rank 0 of the 1x2 plan of the 117 MB decode step: {sessions} sessions, {args.threads} threads, "
              f"collectives waiting {args.wait:g} us; blocks of {args.steps} steps, {args.blocks} turns")
        runners = [Runner(name, [sys.executable, __file__, "--worker", str(program), kind, str(args.threads),
                                 str(args.wait)], huge_pages=False) for name, kind in RUNNERS.items()]
        try:
            take_turns(runners, args.blocks, args.steps, args.pause)
        finally:
            for runner in runners:
                runner.close()
    base = runners[0]
    rows = []
    for runner in runners:
        ratios = [mine / theirs for mine, theirs in zip(runner.steps, base.steps)]
        rows.append({"runner": runner.name, "median_ms": statistics.median(runner.steps) * 1e3,
                     "vs_one_pool": statistics.median(ratios), "blocks_ms": [b * 1e3 for b in runner.steps]})
        print(f"{runner.name:13} {rows[-1]['median_ms']:8.3f} ms a step   x{rows[-1]['vs_one_pool']:.2f} one pool's "
              "(median of the blocks' ratios)")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "segment_pools", "sessions": sessions, "threads": args.threads,
                                         "wait_us": args.wait, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
