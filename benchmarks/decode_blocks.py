"""Decode steps of meshplan and onnxruntime-genai in interleaved blocks: a measure that a
machine whose memory bandwidth drifts within minutes cannot tilt.

``generate.py`` alternates whole runs (a load, a prompt, the tokens); on a shared machine
the bandwidth a decode step is bound by moves by tens of percent between two runs, so a
few percent between two runners takes many rounds to see. Here every runner is a process
that stays up, its model loaded and warm, and the runners take turns in blocks of
``--steps`` decode steps (``--blocks`` turns, each in a new random order): each block of a
runner has a block of every other runner seconds away. Each block starts after ``--pause``
seconds of quiet: onnxruntime's pool threads spin on for tens of milliseconds after a run
(30-40 ms of CPU in the half second after a block, in every runner), and a block begun at
once shares the cores with the runner before it (onnxruntime alone measured 0.80-0.85x
onnxruntime-genai's speed on the int4 model without the pause, 1.01x with it). Printed per
runner: the median step,
and against the first runner the median of the blocks' ratios (first's step / this one's,
so above 1 is faster) with its quartiles.

Runners (``--runners``, comma-separated; a ``:4k`` suffix runs one with 4 KiB pages, the
others start as ``meshplan generate`` does, with malloc in huge pages where the kernel
gives them on request; ``:nobind`` runs meshplan as ``--no-bind-cores``: no rank binds
itself, no thread is pinned):

- ``genai``: onnxruntime-genai's generator on the builder folder, ``--threads`` threads
  (``generate_next_token`` and ``get_next_tokens`` per step);
- ``onnxruntime``: the 1x1 plan's program in onnxruntime alone
  (``step_overhead.onnxruntime_runner``: every buffer bound once, the cache as input and
  output, the token and a static mask updated in place, the logits read and the argmax
  taken in numpy);
- ``1x1``, ``1x2``: ``meshplan generate``'s loop (greedy) through the resident job, under
  ``mpiexec -n 1`` / ``-n 2`` (one thread a rank on 1x2 on 2 cores, as ``generate.py``).

    python benchmarks/decode_blocks.py --folder DIR [--runners genai,onnxruntime,1x1,1x2] [--blocks 30] [--steps 40]

``--folder`` is a builder folder (``generate.py --workdir W`` writes ``W/builder_fp32``);
without it the 0.4 GB float32 builder Llama is written into ``--workdir``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))
PROMPT = 32


# --- the workers: each answers "N" (run N decode steps) with the seconds a step took ----------

def _serve(block) -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        print(json.dumps(block(int(line))), flush=True)


def genai_worker(folder: str, capacity: int, threads: int) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_overhead import genai_runner

    work = Path(tempfile.mkdtemp(prefix="meshplan-blocks-genai-"))
    _serve(genai_runner(work, capacity, threads, Path(folder), PROMPT))


def onnxruntime_worker(plan_dir: str, capacity: int, threads: int) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_overhead import onnxruntime_runner

    from meshplan.plan_format import read_plan

    program = Path(plan_dir) / read_plan(plan_dir).programs[0].file
    _serve(onnxruntime_runner(program, capacity, threads, PROMPT))


def meshplan_worker(plan_dir: str, bind: str = "bind") -> None:
    """Every rank: the resident job; rank 0 runs ``generate``'s loop a block at a time
    (``bind``: "nobind" as ``--no-bind-cores``)."""
    import statistics as stats

    sys.path.insert(0, str(REPO))
    from meshplan.generation.driver import JobStepper
    from meshplan.generation.loop import Generation, GenerationShape
    from meshplan.generation.sampling import Sampler
    from meshplan.runtime.job import Job
    from meshplan.runtime.threads import set_binding

    set_binding(bind != "nobind", pin=True)     # (as the commands: this process is the rank's own)

    job = Job(plan_dir, "cpu", cache_in_place=True)
    if not job.is_driver:
        job.serve()
        return
    generation = Generation(GenerationShape.of_plan(job.plan), JobStepper(job))

    def block(steps: int) -> float:
        _, metrics = generation.run([list(range(1, PROMPT + 1))], steps + 1, Sampler())
        return stats.mean(metrics.decode_seconds)
    try:
        _serve(block)
    finally:
        job.close()


# --- the coordinator ---------------------------------------------------------------------------

class Runner:
    def __init__(self, name: str, command: list[str], huge_pages: bool):
        from meshplan.process_memory import huge_page_environment

        env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MESHPLAN_HUGE_PAGES")}
        if huge_pages:
            env = huge_page_environment(env) or env
        else:
            env["MESHPLAN_HUGE_PAGES"] = "0"
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                        cwd=REPO)
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"runner {name} did not start (said {line!r})")
        self.steps: list[float] = []

    def block(self, steps: int) -> float:
        self.process.stdin.write(f"{steps}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"runner {self.name} stopped")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.process.stdin.write("\n")
            self.process.stdin.close()
        except OSError:
            pass
        self.process.wait(timeout=60)


def take_turns(runners: list[Runner], blocks: int, steps: int, pause: float) -> None:
    """A warm block of ``steps`` each, then ``blocks`` turns, each in a new random order and
    each block after ``pause`` seconds of quiet; a runner's blocks land in its ``steps``."""
    for runner in runners:
        runner.block(steps)
    for _ in range(blocks):
        for runner in random.sample(runners, len(runners)):
            time.sleep(pause)
            runner.steps.append(runner.block(steps))


def plan(folder: Path, mesh: str, capacity: int, workdir: Path) -> Path:
    plan_dir = workdir / f"plan_{mesh}_{capacity}"
    if not (plan_dir / "plan.json").exists():
        policy = ["--policy", "megatron", "--max-stages", "1"] if mesh != "1x1" else []
        done = subprocess.run([sys.executable, "-m", "cli.main", "plan", str(folder / "model.onnx"), "--mesh", mesh,
                               "--device", "cpu", "--generate", "--max-length", str(capacity), *policy,
                               "-o", str(plan_dir)], capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            raise SystemExit(f"meshplan plan failed: {done.stderr.strip()}")
    return plan_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, help="a builder folder (model.onnx, genai_config.json)")
    parser.add_argument("--workdir", type=Path, help="where plans (and a written model) go [default: a temporary folder]")
    parser.add_argument("--gigabytes", type=float, default=0.4, help="size of the model written without --folder")
    parser.add_argument("--runners", default="genai,onnxruntime,1x1,1x2")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--steps", type=int, default=40, help="decode steps a block")
    parser.add_argument("--pause", type=float, default=0.3,
                        help="seconds of quiet before each block (0: none)")
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime-genai's and onnxruntime alone's threads")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers as JSON here")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pause < 0:
        parser.error(f"--pause must be 0 or more seconds, got {args.pause}")
    if args.worker:
        kind, *rest = args.worker
        {"genai": lambda: genai_worker(rest[0], int(rest[1]), int(rest[2])),
         "onnxruntime": lambda: onnxruntime_worker(rest[0], int(rest[1]), int(rest[2])),
         "meshplan": lambda: meshplan_worker(*rest)}[kind]()
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="meshplan-blocks-"))
    workdir.mkdir(parents=True, exist_ok=True)
    folder = args.folder
    if folder is None:
        sys.path.insert(0, str(REPO))
        from sample_models.genai_large import write_builder_llama

        folder = workdir / "builder_fp32"
        if not (folder / "model.onnx").exists():
            write_builder_llama(folder, args.gigabytes, context=args.capacity)
    folder = folder.resolve()
    mpiexec = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else shutil.which("mpiexec") or "mpiexec"
    me = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    runners: list[Runner] = []
    try:
        for spec in args.runners.split(","):
            kind, *options = spec.split(":")
            huge = "4k" not in options
            if kind == "genai" and importlib.util.find_spec("onnxruntime_genai") is None:
                print(f"runner {spec}: onnxruntime-genai is not installed, left out", flush=True)
                continue
            if kind == "genai":
                command = [*me, "genai", str(folder), str(args.capacity), str(args.threads)]
            elif kind == "onnxruntime":
                command = [*me, "onnxruntime", str(plan(folder, "1x1", args.capacity, workdir)), str(args.capacity),
                           str(args.threads)]
            elif kind in ("1x1", "1x2", "1x4"):
                ranks = int(kind.split("x")[1])
                command = [mpiexec, "-n", str(ranks), *me, "meshplan", str(plan(folder, kind, args.capacity, workdir)),
                           "nobind" if "nobind" in options else "bind"]
            else:
                raise SystemExit(f"unknown runner {spec!r} (genai, onnxruntime, 1x1, 1x2, 1x4; :4k for 4 KiB pages, "
                                 ":nobind for meshplan as --no-bind-cores)")
            runners.append(Runner(spec, command, huge))
        take_turns(runners, args.blocks, args.steps, args.pause)
    finally:
        for runner in runners:
            runner.close()
    if not runners:
        raise SystemExit("no runner left to run")
    first = runners[0]
    print(f"{folder.name}, capacity {args.capacity}, {args.blocks} blocks of {args.steps} decode steps in turns, "
          f"{args.pause:g} s of quiet before each")
    body = {"blocks": args.blocks, "steps": args.steps, "pause_s": args.pause, "runners": {}}
    for runner in runners:
        ratios = sorted(a / b for a, b in zip(first.steps, runner.steps))
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{runner.name:16} median step {statistics.median(runner.steps) * 1e3:7.3f} ms   speed against "
              f"{first.name}: {statistics.median(ratios):.3f} (quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f})")
        body["runners"][runner.name] = {"median_step_s": statistics.median(runner.steps),
                                        "speed_against_first": statistics.median(ratios), "steps_s": runner.steps}
    if args.json:
        args.json.write_text(json.dumps(body, indent=1) + "\n")


if __name__ == "__main__":
    main()
