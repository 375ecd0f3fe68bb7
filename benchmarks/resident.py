"""The resident job's per-call time against its programs' own time and against one launch per call.

An LLM export with a key/value cache (default: the committed optimum sample; any model
with ``input_ids``, ``attention_mask``, ``position_ids`` and ``past_key_values.N.*``
inputs) is planned once with ranges (batch 1:4, sequence 1:64, past 0:PAST), then:

- **resident, decode**: one ``meshplan.Job`` under mpiexec; rank 0 prefills 16 tokens and
  makes ``--calls`` decode calls (batch 1, one token, only the last logits to rank 0, the
  cache kept on the ranks), timing each ``job.run``;
- **resident, full batch**: the same job, calls of batch 4 × 64 tokens from an empty cache;
- **programs**: for each of those calls, the time the ranks spent inside onnxruntime
  (``job.stats()``: per rank; a call's is the sum over stages of the slowest rank of each);
  the job's overhead is the call's time less that;
- **one launch per call**: ``mpiexec -n N meshplan run PLAN --inputs …`` on the same call
  (the cache in the inputs file), wall time of the whole command;
- **onnxruntime, one device**: the original model in one session, for scale.

Prints a table and, with ``--json PATH``, writes the numbers. ``--serve`` is the job's own
entry under mpiexec (the script starts it itself).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "sample_models" / "llama_optimum.onnx"
PROMPT = 16


def llm_dims(model_path: Path) -> tuple[str, str, str, list[str], int, int, int]:
    """(batch, sequence, past dim names, state input names, kv heads, head size, vocab)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    inputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    pasts = sorted(n for n in inputs if n.startswith("past_key_values."))
    logits = next(v for v in model.graph.output if v.name == "logits")
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    ids, past = inputs["input_ids"], inputs[pasts[0]]
    return ids[0], ids[1], past[2], pasts, past[1], past[3], vocab


def feeds_for(model_path: Path, batch: int, seq: int, past: int, with_past: bool = True) -> dict[str, np.ndarray]:
    _, _, _, pasts, heads, head_size, vocab = llm_dims(model_path)
    rng = np.random.default_rng(seq)
    feeds = {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, past + seq), np.int64),
             "position_ids": np.broadcast_to(np.arange(past, past + seq), (batch, seq)).astype(np.int64).copy()}
    if with_past:
        feeds.update({name: np.zeros((batch, heads, past, head_size), np.float32) for name in pasts})
    return feeds


def critical_path(plan, seconds: list[float]) -> float:
    """The programs' part of a call: each stage's slowest rank, summed over the stages."""
    return sum(max(seconds[r] for r in stage.devices) for stage in plan.stages)


def serve(plan_dir: str, model_path: Path, calls: int, out: Path) -> None:
    """Under mpiexec: the job; rank 0 times decode and full-batch calls."""
    from meshplan.runtime.job import Job

    with Job(plan_dir, provider="cpu") as job:
        if job is None:
            return
        results = {}
        for label, batch, seq in (("decode", 1, 1), ("full batch", 4, 64)):
            times, programs = [], []
            job.reset_state()
            past = 0
            if label == "decode":
                job.run(feeds_for(model_path, 1, PROMPT, 0, with_past=False), outputs={"logits": np.s_[:, -1:]})
                past = PROMPT
            for call in range(calls + 2):   # two warm-up calls
                if label == "full batch":
                    job.reset_state()
                feeds = feeds_for(model_path, batch, seq, past, with_past=False)
                started = time.perf_counter()
                job.run(feeds, outputs={"logits": np.s_[:, -1:]})
                elapsed = time.perf_counter() - started
                stats = job.stats()
                if call >= 2:
                    times.append(elapsed)
                    programs.append(critical_path(job.plan, stats.program_seconds))
                if label == "decode":
                    past += 1
            results[label] = {"call_seconds": statistics.median(times), "program_seconds": statistics.median(programs),
                              "overhead_seconds": statistics.median(t - p for t, p in zip(times, programs)),
                              "calls": calls, "batch": batch, "tokens": seq}
        out.write_text(json.dumps(results))


def one_launch(plan_dir: Path, ranks: int, inputs: Path, repeats: int) -> float:
    """Median wall time of ``mpiexec -n RANKS meshplan run PLAN --inputs INPUTS``."""
    meshplan = shutil.which("meshplan", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    command = [mpiexec(), "-n", str(ranks), meshplan, "run", str(plan_dir), "--inputs", str(inputs), "--provider", "cpu"]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def single_device(model_path: Path, feeds: dict, repeats: int) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def mpiexec() -> str:
    return shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--mesh", default="1x2")
    parser.add_argument("--max-stages", type=int)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--past", type=int, default=255, help="top of the past's range")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", nargs=3, metavar=("PLAN", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], Path(args.serve[1]), args.calls, Path(args.serve[2]))
        return

    from meshplan.cost.cluster import make_cluster, parse_mesh
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_plan import make_plan
    from meshplan.model.sizes import DimRange

    batch, seq, past, *_ = llm_dims(args.model)
    mesh = parse_mesh(args.mesh)
    ranks = mesh[0] * mesh[1]
    work = Path(tempfile.mkdtemp(prefix="resident-"))
    try:
        plan_dir = work / "plan"
        started = time.perf_counter()
        plan = make_plan(args.model, make_cluster(mesh, args.device),
                         {batch: DimRange(1, 4), seq: DimRange(1, 64), past: DimRange(0, args.past)}, plan_dir,
                         PlanOptions(max_stages=args.max_stages))
        plan_seconds = time.perf_counter() - started
        shape = " + ".join(f"{'x'.join(map(str, s.logical_mesh))}" for s in plan.stages)
        out = work / "resident.json"
        command = [mpiexec(), "-n", str(ranks), sys.executable, __file__, "--calls", str(args.calls),
                   "--serve", str(plan_dir), str(args.model), str(out)]
        subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        resident = json.loads(out.read_text())
        rows = []
        for label, call in resident.items():
            decode = label == "decode"
            feeds = feeds_for(args.model, call["batch"], call["tokens"], PROMPT if decode else 0)
            inputs = work / f"{label}.npz"
            np.savez(inputs, **feeds)
            launch = one_launch(plan_dir, ranks, inputs, args.launches)
            local = single_device(args.model, feeds, max(args.calls, 5))
            rows.append({"call": label, **call, "one_launch_seconds": launch, "onnxruntime_one_device_seconds": local,
                         "overhead_fraction": call["overhead_seconds"] / call["call_seconds"]})
        size_mb = args.model.stat().st_size / 1e6
        print(f"model {args.model.name} ({size_mb:.1f} MB), plan on {args.mesh} ({shape}), planned in {plan_seconds:.1f} s, "
              f"{args.calls} calls each")
        print(f"{'call':<11} {'resident':>10} {'programs':>10} {'overhead':>16} {'one launch':>11} {'ORT 1 dev':>10}")
        for row in rows:
            print(f"{row['call']:<11} {row['call_seconds'] * 1e3:>8.2f}ms {row['program_seconds'] * 1e3:>8.2f}ms "
                  f"{row['overhead_seconds'] * 1e3:>8.3f}ms ({row['overhead_fraction']:>4.0%}) "
                  f"{row['one_launch_seconds']:>10.2f}s {row['onnxruntime_one_device_seconds'] * 1e3:>8.2f}ms")
        if args.json:
            args.json.write_text(json.dumps({"model": str(args.model), "mesh": args.mesh, "stages": shape,
                                             "plan_seconds": plan_seconds, "rows": rows}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
