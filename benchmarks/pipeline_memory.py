"""Activations in flight under 1F1B and GPipe, measured two ways.

Usage (from the repository root)::

    python benchmarks/pipeline_memory.py [--case gpt_adamw] [--stages 4] [--microbatches 8]
        [--batch 32] [--json PATH]
    python benchmarks/pipeline_memory.py --mpi [--stages 4] [--microbatches 8] [--batch 32]
        [--layers 8] [--hidden 256] [--heads 4] [--vocab 2048] [--seq 128] [--steps 2] [--replicas 1]
        [--tensor-parallel T|T0,T1,...] [--policy auto|data|megatron] [--devices N | --stage-devices D0,D1,...]
        [--workdir DIR] [--json PATH]

In process (the default): the case is one of sample_models/training's (a GPT with AdamW by
default), its forward graph cut into ``--stages`` runs of nodes of equal length, one step of
``--batch`` samples in ``--microbatches`` microbatches run stage by stage
(``runtime.pipeline_inprocess``). For each schedule and stage: the microbatches whose
tensors the stage held at once (1F1B: S − i; GPipe: all), the most bytes it held between
runs, and the estimate: that many microbatches times what a step of one microbatch left
held. Both schedules' loss is printed (the same step, so the same loss).

``--mpi``: a GPT written with onnx.helper (``benchmarks/train.py``'s, at the sizes given) is
planned with ``meshplan plan --train --stages S --schedule 1f1b|gpipe`` (and 1F1B with
``--recompute``) on a 1xS mesh of CPU devices (1x(S·R) with ``--replicas R``: each stage R
data-parallel replicas, which hold the optimizer's state in row blocks; with
``--tensor-parallel T``, replicas of T devices that shard the stage's operators, on a
1x(S·R·T) mesh, and no recomputing row; ``--tensor-parallel T0,T1,...``, each stage its
own T, on a 1x(R·ΣT) mesh) and trained for ``--steps`` steps by ``mpiexec -n S·R·T meshplan
train``; each rank's peak RSS as the command reports it, next to the plan's
estimate of its stage, and the step's median time. ``--policy``: the plans' sharding policy
(what the devices that shard a stage may choose). ``--devices N``: a 1xN mesh whatever the
stages (where S does not divide N the cut gives each stage its replicas); ``--stage-devices``:
each stage's devices, given (``plan --stage-devices``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from meshplan.emit.train_schedule import GPIPE, ONE_F_ONE_B  # noqa: E402
from meshplan.runtime.pipeline_inprocess import PipelineRunner  # noqa: E402
from meshplan.testing.train_reference import even_stages  # noqa: E402
from meshplan.training.optimizers import DEFAULTS  # noqa: E402
from meshplan.training.pipeline_step import split_step  # noqa: E402
from meshplan.training.step_model import TrainSpec, build_step_model  # noqa: E402
from sample_models.training import CASES, load_case  # noqa: E402

MiB = 2 ** 20
RECOMPUTED = "1f1b+recompute"   # (--mpi) 1F1B with --recompute


def one_step(case: dict, stages: int, microbatches: int, batch: int, kind: str):
    settings = case["settings"]
    step = build_step_model(case["model_path"], TrainSpec(settings["loss"], settings["optimizer"],
                                                          microbatches=microbatches, stages=stages))
    pipeline = split_step(step, even_stages(step, case["model_path"], stages), stages)
    runner = PipelineRunner(pipeline, microbatches, case["initial"], kind)
    count = len(next(iter(case["data"].values())))
    index = np.arange(batch) % count
    data = {n: a[index] for n, a in case["data"].items()}
    found = runner.step(data, {**DEFAULTS, "train.step": 1})
    return found["train.loss"], runner


def in_process(args) -> dict:
    case = load_case(args.case)
    per_mb = args.batch // args.microbatches
    _, single = one_step(case, args.stages, 1, per_mb, ONE_F_ONE_B)
    one = single.peak_kept
    rows = {}
    print(f"{args.case}: {args.stages} stages, {args.microbatches} microbatches of {per_mb} samples, in process")
    print(f"{'schedule':8} {'stage':>5} {'in flight':>9} {'kept KiB':>9} {'estimate KiB':>12}")
    for kind in (ONE_F_ONE_B, GPIPE):
        loss, runner = one_step(case, args.stages, args.microbatches, args.batch, kind)
        stages = []
        for s in range(args.stages):
            flight = runner.peak_in_flight[s]
            estimate = flight * one[s]
            stages.append({"stage": s, "in_flight": flight, "kept_bytes": runner.peak_kept[s],
                           "estimate_bytes": estimate})
            print(f"{kind:8} {s:>5} {flight:>9} {runner.peak_kept[s] / 1024:>9.1f} {estimate / 1024:>12.1f}")
        rows[kind] = {"loss": loss, "stages": stages}
        print(f"{kind:8} loss {loss:.6f}")
    ratio = [a["kept_bytes"] / b["kept_bytes"] for a, b in zip(rows[ONE_F_ONE_B]["stages"], rows[GPIPE]["stages"])]
    print("1F1B over GPipe, bytes kept per stage: " + ", ".join(f"{r:.2f}" for r in ratio))
    return {"case": args.case, "one_microbatch_bytes": one, "schedules": rows, "ratio_1f1b_over_gpipe": ratio}


def under_mpi(args) -> dict:
    sys.path.insert(0, str(HERE))
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="pipeline-memory."))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _mpi_rows(args, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def _mpi_rows(args, work: Path) -> dict:
    from train import build_onnx_gpt   # the benchmark GPT, written with onnx.helper

    sizes = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
             "seq": args.seq, "batch": args.batch}
    model = work / "gpt.onnx"
    built = build_onnx_gpt(sizes, model)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, (args.batch * 2, args.seq + 1))
    data = work / "data.npz"
    np.savez(data, input_ids=ids[:, :-1], targets=ids[:, 1:])
    script = Path(sys.executable).parent / "meshplan"
    meshplan = [str(script)] if script.exists() else [sys.executable, "-m", "cli.main"]
    beside = Path(sys.executable).parent / "mpiexec"     # the mpich wheel's, else the PATH's
    mpiexec = str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")
    each = [int(t) for t in str(args.tensor_parallel).split(",")]     # one T, or one a stage
    T = args.tensor_parallel
    ranks_count = args.replicas * (sum(each) if len(each) > 1 else args.stages * each[0])
    given = ["--stage-devices", args.stage_devices] if args.stage_devices else []
    if args.stage_devices:
        ranks_count = sum(int(d) for d in args.stage_devices.split(","))
    elif args.devices:
        ranks_count = args.devices
    print(f"GPT of {built['parameters'] / 1e6:.1f} M parameters ({args.layers} layers, hidden {args.hidden}, "
          f"sequence {args.seq}); {args.stages} stages, {args.microbatches} microbatches of "
          f"{args.batch // args.microbatches} samples, "
          + (f"{args.replicas} replica(s) of {T} device(s) that shard its operators a stage"
             if not given and not args.devices else f"{ranks_count} devices")
          + ", under mpiexec")
    print(f"{'schedule':8} {'rank':>4} {'peak RSS MiB':>12} {'estimate MiB':>12}")
    rows = {}
    for kind in (ONE_F_ONE_B, GPIPE) + ((RECOMPUTED,) if each == [1] else ()):
        plan_dir = work / f"plan-{kind}"
        _run([*meshplan, "plan", model, "--train", "--loss", "cross_entropy:logits:targets", "--optimizer", "adamw",
              "--mesh", f"1x{ranks_count}", "--stages", args.stages, "--schedule",
              kind.split("+")[0], "--tensor-parallel", T, "--policy", args.policy,
              *(["--recompute"] if kind == RECOMPUTED else []), *given, "--microbatches",
              args.microbatches, "--dim", f"batch={args.batch}", "--device", "cpu", "-o", plan_dir])
        log = work / f"log-{kind}.json"
        done = _run([mpiexec, "-n", ranks_count, *meshplan, "train", plan_dir, "--data", data,
                     "--steps", args.steps,
                     "--lr", 3e-4, "--log", log, "-q"])
        ranks = []
        for match in re.finditer(r"rank (\d+): peak RSS ([\d.]+) MiB, the plan's estimate ([\d.]+) MiB", done.stdout):
            ranks.append({"rank": int(match.group(1)), "peak_rss_mib": float(match.group(2)),
                          "estimate_mib": float(match.group(3))})
            print(f"{kind:14} {ranks[-1]['rank']:>4} {ranks[-1]['peak_rss_mib']:>12.1f} "
                  f"{ranks[-1]['estimate_mib']:>12.1f}")
        record = json.loads(log.read_text())
        planned = json.loads((plan_dir / "plan.json").read_text())
        rows[kind] = {"ranks": ranks, "losses": record["losses"], "step_seconds": record["step_seconds"],
                      "stage_devices": [len(stage["devices"]) for stage in planned["stages"]],
                      "estimate_seconds": planned["estimate"]["step_seconds"]}
        print(f"{kind:14} stages' devices {', '.join(map(str, rows[kind]['stage_devices']))}; estimated step "
              f"{rows[kind]['estimate_seconds'] * 1e3:.0f} ms")
        print(f"{kind:14} losses {', '.join(f'{v:.5f}' for v in record['losses'])}; step "
              f"{sorted(record['step_seconds'])[len(record['step_seconds']) // 2] * 1e3:.0f} ms")
    ratio = [a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in zip(rows[ONE_F_ONE_B]["ranks"], rows[GPIPE]["ranks"])]
    print("1F1B over GPipe, peak RSS per rank: " + ", ".join(f"{r:.2f}" for r in ratio))
    again = [a["peak_rss_mib"] / b["peak_rss_mib"]
             for a, b in zip(rows[RECOMPUTED]["ranks"], rows[ONE_F_ONE_B]["ranks"])] if RECOMPUTED in rows else []
    if again:
        print("1F1B recomputing over 1F1B, peak RSS per rank: " + ", ".join(f"{r:.2f}" for r in again))
    return {"sizes": sizes, "parameters": built["parameters"], "replicas": args.replicas, "tensor_parallel": T,
            "policy": args.policy,
            "schedules": rows,
            "ratio_1f1b_over_gpipe": ratio,
            "ratio_recomputed_over_1f1b": again}


def _run(command) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, command))}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="gpt_adamw", choices=CASES)
    parser.add_argument("--mpi", action="store_true", help="plan and train a GPT under mpiexec; measure RSS")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1, help="with --mpi: data-parallel replicas a stage")
    parser.add_argument("--tensor-parallel", default="1",
                        help="with --mpi: devices of each replica that shard the stage's operators (T, or T0,T1,... "
                             "one a stage)")
    parser.add_argument("--policy", default="auto", choices=("auto", "data", "megatron"),
                        help="with --mpi: the plans' sharding policy")
    parser.add_argument("--devices", type=int, help="with --mpi: a 1xN mesh (the cut gives each stage its devices)")
    parser.add_argument("--stage-devices", help="with --mpi: each stage's devices, D0,D1,...")
    parser.add_argument("--workdir", help="where the model, data and plans go [default: a temporary folder, removed]")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} is not a multiple of --microbatches {args.microbatches}")
    body = under_mpi(args) if args.mpi else in_process(args)
    body.update({"stages": args.stages, "microbatches": args.microbatches, "batch": args.batch,
                 "mode": "mpi" if args.mpi else "in process"})
    if args.json:
        args.json.write_text(json.dumps(body, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
