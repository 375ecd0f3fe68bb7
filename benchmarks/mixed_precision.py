"""A float16 GPT trained with and without float32 master weights, against the same GPT in float32.

Usage (from the repository root)::

    python benchmarks/mixed_precision.py [--layers 4] [--hidden 256] [--heads 4] [--vocab 2048]
        [--seq 64] [--batch 8] [--steps 40] [--lr 1e-3] [--loss-scale 1024] [--mesh 1x1]
        [--provider cpu|cuda] [--device PRESET] [--mpiexec CMD] [--workdir DIR] [--json PATH] [--smoke]

The GPT is ``benchmarks/train.py``'s (written with onnx.helper), its float initializers and
output written once in float32 and once in float16 (the same values, rounded). The data are
learnable sequences (each row counts up from a random start with a random stride). Three rows,
each planned with ``meshplan plan --train --optimizer adamw`` on ``--mesh`` and trained
``--steps`` steps by ``mpiexec -n N meshplan train`` at a constant learning rate from the same
weights on the same batches:

- ``float32``: the model in float32 (the reference);
- ``float16``: the float16 model trained in its own dtype (weights, gradients and AdamW's
  slots in float16);
- ``float16 + masters``: ``--master-weights`` and ``train --loss-scale``: float32 masters,
  the forward and backward in float16;
- with ``--provider cuda`` also ``bfloat16 + masters`` (onnxruntime's CPU provider has no
  bfloat16 kernels), without a loss scale.

``--provider cuda`` plans for ``--device`` (h200 by default) and trains on the GPU.

For each: the first and last loss, the largest relative distance of a step's loss from the
float32 row's, whether every loss was finite, the median step, each rank's peak RSS next to
the plan's estimate, and the bytes the plan counts on a device at the step's peak (weights,
gradients, the optimizer's slots, old and new, and the step's other tensors; the process
apart), per parameter of the model.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

LOSS = "cross_entropy:logits:targets"
ROWS = ("float32", "float16", "float16+masters")
GPU_ROWS = ROWS + ("bfloat16+masters",)


def narrowed(source: Path, target: Path, dtype: str = "float16") -> None:
    """``source`` with every float32 initializer and the output in ``dtype``."""
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    kind = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    model = onnx.load(str(source))
    for index, tensor in enumerate(model.graph.initializer):
        if tensor.data_type == TensorProto.FLOAT:
            model.graph.initializer[index].CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(tensor).astype(kind), tensor.name))
    for value in model.graph.output:
        value.type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(kind))
    del model.graph.value_info[:]
    onnx.save(model, str(target))


def counting_data(path: Path, samples: int, seq: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    start = rng.integers(0, vocab, (samples, 1))
    stride = rng.integers(1, 4, (samples, 1))
    rows = (start + stride * np.arange(seq + 1)) % vocab
    np.savez(path, input_ids=rows[:, :-1].astype(np.int64), targets=rows[:, 1:].astype(np.int64))


def _run(command: list, what: str) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode != 0:
        raise SystemExit(f"error: {what} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done


def _mpiexec(given: str | None) -> list[str]:
    if given:
        return given.split()
    beside = Path(sys.executable).parent / "mpiexec"     # the mpich wheel's, else the PATH's
    return [str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")]


def run_row(row: str, model: Path, data: Path, args, work: Path) -> dict:
    meshplan = [sys.executable, "-m", "cli.main"]
    plan_dir = work / f"plan-{row.replace('+', '-')}"
    masters = ["--master-weights"] if row.endswith("+masters") else []
    device = args.device or ("h200" if args.provider == "cuda" else "cpu")
    _run([*meshplan, "plan", model, "--train", "--loss", LOSS, "--optimizer", "adamw", *masters, "--mesh", args.mesh,
          "--device", device, "--dim", f"batch={args.batch}", "-o", plan_dir], f"meshplan plan ({row})")
    document = json.loads((plan_dir / "plan.json").read_text())
    ranks = int(np.prod([int(n) for n in args.mesh.split("x")]))
    log = work / f"{plan_dir.name}.log.json"
    scale = ["--loss-scale", args.loss_scale] if row == "float16+masters" else []
    done = _run([*_mpiexec(args.mpiexec), "-n", ranks, *meshplan, "train", plan_dir, "--data", data, "--steps",
                 args.steps, "--lr", args.lr, "--betas", "0.9,0.95", "--weight-decay", 0.01, *scale,
                 "--provider", args.provider, "--log", log, "-q"], f"meshplan train ({row})")
    record = json.loads(log.read_text())
    rss = [(float(m.group(1)), float(m.group(2))) for m in
           re.finditer(r"rank \d+: peak RSS ([\d.]+) MiB(?: \(host memory\))?, the plan's estimate ([\d.]+) MiB",
                       done.stdout)]
    training = document["training"]
    parameters = sum(int(np.prod(w["shape"])) for w in training["weights"].values())
    memory = training.get("memory", {})        # a device's bytes by kind (a list of them: a stage's each)
    held = memory if isinstance(memory, dict) else (memory[0] if memory else {})
    step = sum(float(v) for k, v in held.items() if k != "process")   # the step's tensors at its peak
    steps = record["step_seconds"][1:] or record["step_seconds"]
    return {"losses": record["losses"], "step_seconds": float(np.median(steps)), "peak_rss_mib": [r for r, _ in rss],
            "estimate_mib": [e for _, e in rss], "parameters": parameters,
            "plan_bytes_per_parameter": step / parameters if parameters and step else None,
            "finite": bool(all(math.isfinite(x) for x in record["losses"]))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 4), ("hidden", 256), ("heads", 4), ("vocab", 2048), ("seq", 64), ("batch", 8),
                          ("steps", 40)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--loss-scale", type=float, default=1024.0)
    parser.add_argument("--mesh", default="1x1")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--device", help="the plans' device preset [default: cpu; h200 with --provider cuda]")
    parser.add_argument("--mpiexec", help="the launcher and its options, one string [default: mpiexec]")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT (1 layer, hidden 64, vocabulary 256, "
                                                             "sequence 16), 4 steps")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.heads, args.vocab, args.seq, args.steps = 1, 64, 4, 256, 16, 4
    from train import build_onnx_gpt   # the benchmark GPT, written with onnx.helper

    work = args.workdir or Path(tempfile.mkdtemp(prefix="mixed-precision."))
    work.mkdir(parents=True, exist_ok=True)
    try:
        sizes = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
                 "seq": args.seq, "batch": args.batch}
        full, half, brain = work / "gpt32.onnx", work / "gpt16.onnx", work / "gptbf16.onnx"
        built = build_onnx_gpt(sizes, full)
        narrowed(full, half)
        rows_wanted = GPU_ROWS if args.provider == "cuda" else ROWS
        if "bfloat16+masters" in rows_wanted:
            narrowed(full, brain, "bfloat16")
        data = work / "data.npz"
        counting_data(data, args.batch * 8, args.seq, args.vocab)
        print(f"GPT of {built['parameters'] / 1e6:.2f} M parameters ({args.layers} layers, hidden {args.hidden}, "
              f"vocabulary {args.vocab}, sequence {args.seq}), batch {args.batch}, AdamW lr {args.lr:g}, "
              f"{args.steps} steps on {args.mesh} ({args.provider}); loss scale {args.loss_scale:g} with float16 "
              "masters")
        models = {"float32": full, "float16": half, "float16+masters": half, "bfloat16+masters": brain}
        rows = {row: run_row(row, models[row], data, args, work) for row in rows_wanted}
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    reference = np.asarray(rows["float32"]["losses"])
    print(f"{'row':17} {'loss first -> last':>22} {'max |Δ|/fp32':>12} {'step':>9} {'peak RSS MiB':>14} "
          f"{'estimate MiB':>13} {'plan B/param':>13}")
    for row, found in rows.items():
        losses = np.asarray(found["losses"])
        found["max_relative_to_float32"] = float(np.max(np.abs(losses - reference) / np.abs(reference))) \
            if found["finite"] else None
        gap = f"{found['max_relative_to_float32']:.2e}" if found["finite"] else "not finite"
        per = found["plan_bytes_per_parameter"]
        print(f"{row:17} {losses[0]:>10.5g} -> {losses[-1]:<9.5g} {gap:>12} {found['step_seconds'] * 1e3:>7.1f}ms "
              f"{'/'.join(f'{r:.0f}' for r in found['peak_rss_mib']):>14} "
              f"{'/'.join(f'{e:.0f}' for e in found['estimate_mib']):>13} "
              f"{(f'{per:.1f}' if per else '-'):>13}")
    body = {"sizes": sizes, "lr": args.lr, "loss_scale": args.loss_scale, "mesh": args.mesh, "steps": args.steps,
            "provider": args.provider,
            "parameters": built["parameters"], "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(body, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
