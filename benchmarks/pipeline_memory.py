"""Activations in flight under 1F1B and GPipe: a pipelined training step run stage by stage
in one process (``runtime.pipeline_inprocess``), each stage's most bytes kept between runs.

Usage (from the repository root)::

    python benchmarks/pipeline_memory.py [--case gpt_adamw] [--stages 4] [--microbatches 8]
        [--batch 32] [--json PATH]

The case is one of sample_models/training's (a GPT with AdamW by default), its forward graph
cut into ``--stages`` runs of nodes of equal length; one step of ``--batch`` samples in
``--microbatches`` microbatches. For each schedule and stage: the microbatches whose
tensors the stage held at once (1F1B: S − i; GPipe: all), the most bytes it held, and the
estimate: that many microbatches times what one microbatch leaves between its forward and
its backward (measured on a step of one microbatch). The loss of the step is printed for
both schedules (the same step, so the same loss).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshplan.emit.train_schedule import GPIPE, ONE_F_ONE_B  # noqa: E402
from meshplan.runtime.pipeline_inprocess import PipelineRunner  # noqa: E402
from meshplan.testing.train_reference import even_stages  # noqa: E402
from meshplan.training.optimizers import DEFAULTS  # noqa: E402
from meshplan.training.pipeline_step import split_step  # noqa: E402
from meshplan.training.step_model import TrainSpec, build_step_model  # noqa: E402
from sample_models.training import CASES, load_case  # noqa: E402


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="gpt_adamw", choices=CASES)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} is not a multiple of --microbatches {args.microbatches}")
    case = load_case(args.case)
    per_mb = args.batch // args.microbatches
    _, single = one_step(case, args.stages, 1, per_mb, ONE_F_ONE_B)
    one = single.peak_kept
    rows = {}
    print(f"{args.case}: {args.stages} stages, {args.microbatches} microbatches of {per_mb} samples")
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
    if args.json:
        args.json.write_text(json.dumps({"case": args.case, "stages": args.stages, "microbatches": args.microbatches,
                                         "batch": args.batch, "one_microbatch_bytes": one, "schedules": rows,
                                         "ratio_1f1b_over_gpipe": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
