"""Alpa's GPT weak-scaling table, planned for training by meshplan without programs.

Each GPT-3 model of Alpa's table (OSDI 2022, §8.1: 350M on 1 GPU up to 39B on 64,
sequence 1024, vocabulary 51,200, global batch 1,024) is written in float16 with a sparse
weight file (``sample_models/large_gpt.py``: no weight byte is written or read) and
planned by ``meshplan plan --train --no-programs --max-stages N`` (AdamW, 1F1B) on a
cluster file of Alpa's testbed: hosts of 8 V100 16 GB, NVLink inside a host, 25 Gbit/s
between hosts. Each plan runs in a child process, timed, with its peak RSS.

Printed per model: the plan (stages, their submeshes and logical meshes, microbatches),
planning seconds and memory, the estimated step and memory per GPU, and throughput in
PFLOPS by Alpa's formula (96·B·S·H²·L·(1 + S/6H) + 6·B·S·H·V per iteration, which counts
the recomputation Alpa does, whether or not meshplan's plan does: the same numerator in
every column, so the columns' ratio is their step times') next to Alpa's and Megatron-LM's
measured figures
(``ALPA_MEASURED``). meshplan's figure is the planner's analytic estimate (dense peaks of
the V100), not a measured run.

    python benchmarks/alpa_gpt.py [--models 350M 1.3B ...] [--microbatches M ...] [--recompute]
        [--json PATH]

``--microbatches`` lists the counts tried per model (the fastest plan is kept; default:
the count of Alpa's own plan for that size). ``--recompute`` plans with activation
recomputation, as Alpa's and Megatron-LM's runs of this table did.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshplan.testing.child_memory import peak_of, run_measured  # noqa: E402
from sample_models.large_gpt import ALPA_GPT, write_large_gpt  # noqa: E402

SEQ, VOCAB, BATCH = 1024, 51200, 1024
# Alpa's Figure 7a (PFLOPS): (Megatron-LM, Alpa), and the microbatches of Alpa's plans
ALPA_MEASURED = {"350M": (0.048, 0.045), "1.3B": (0.224, 0.233), "2.6B": (0.404, 0.493), "6.7B": (0.905, 0.960),
                 "15B": (1.864, 1.917), "39B": (3.702, 3.648)}
ALPA_MICROBATCHES = {"350M": 64, "1.3B": 128, "2.6B": 128, "6.7B": 64, "15B": 128, "39B": 1024}

TESTBED = """hosts = {hosts}
devices_per_host = {per_host}
[device]
preset = "v100-32g"
name = "v100-16g"
memory_gb = 16
[intra_host]
bandwidth_gbps = 50
latency_us = 5
[inter_host]
bandwidth_gbps = 3.125
latency_us = 20
"""


def alpa_flops(layers: int, hidden: int, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> float:
    """FLOPs of one iteration as Alpa counts them (with activation recomputation)."""
    return 96 * batch * seq * hidden ** 2 * layers * (1 + seq / (6 * hidden)) + 6 * batch * seq * hidden * vocab


def plan_row(name: str, model: Path, cluster: Path, gpus: int, microbatches: int, out: Path, batch: int,
             seq: int, timeout: float, recompute: bool = False) -> dict:
    args = ["plan", model, "--train", "--loss", "cross_entropy:logits:labels", "--optimizer", "adamw",
            "--cluster", cluster, "--dim", f"batch={batch}", "--dim", f"seq={seq}", "--microbatches", str(microbatches),
            "--max-stages", str(gpus), "--no-programs", *(["--recompute"] if recompute else []), "-o", out]
    started = time.perf_counter()
    done = run_measured(args, cwd=ROOT, timeout=timeout)
    seconds = time.perf_counter() - started
    if done.returncode:
        return {"model": name, "microbatches": microbatches, "error": done.stderr.strip().splitlines()[-1:]}
    plan = json.loads((out / "plan.json").read_text())
    step = plan["estimate"]["latency_seconds"]
    return {
        "model": name, "gpus": gpus, "microbatches": microbatches, "stages": len(plan["stages"]),
        "submeshes": ["x".join(map(str, s["submesh"])) for s in plan["stages"]],
        "logical_meshes": ["x".join(map(str, s["logical_mesh"])) for s in plan["stages"]],
        "devices_used": sum(len(s["devices"]) for s in plan["stages"]),
        "plan_seconds": seconds, "peak_rss_bytes": peak_of(done), "step_seconds": step,
        "memory_bytes_per_gpu": max(plan["estimate"]["memory_bytes_per_device"]),
        "ilps": plan["solver"]["ilp"]["solved"],
    }


def _runs(names: list[str]) -> str:
    """``1x8, 1x8, 1x4`` as ``2×1x8, 1x4`` (runs of equal neighbours)."""
    out: list[list] = []
    for name in names:
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return ", ".join(f"{n}×{name}" if n > 1 else name for name, n in out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ALPA_GPT), choices=list(ALPA_GPT))
    parser.add_argument("--microbatches", type=int, nargs="+", help="counts tried per model (default: Alpa's)")
    parser.add_argument("--layers", type=int, help="override every model's layer count (a quick check)")
    parser.add_argument("--batch", type=int, default=BATCH, help="global batch (Alpa's: 1024)")
    parser.add_argument("--seq", type=int, default=SEQ, help="sequence length (Alpa's: 1024)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--recompute", action="store_true", help="plan with activation recomputation")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    header = (f"{'model':>5} {'GPUs':>4} {'mb':>5} {'stages':>6}  {'submeshes (logical meshes)':<44} {'plan s':>7} "
              f"{'RSS':>8} {'step s':>8} {'GiB/GPU':>7} {'PFLOPS':>7} {'Alpa':>6} {'Megatron':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in args.models:
            shape = dict(ALPA_GPT[name])
            gpus = shape.pop("gpus")
            if args.layers:
                shape["layers"] = args.layers
            model = tmp / name / "model.onnx"
            model.parent.mkdir()
            write_large_gpt(model, **shape, vocab=VOCAB, positions=args.seq, sparse=True)
            cluster = tmp / name / "cluster.toml"
            cluster.write_text(TESTBED.format(hosts=max(1, gpus // 8), per_host=min(gpus, 8)))
            tried = [plan_row(name, model, cluster, gpus, m, tmp / name / f"plan{m}", args.batch, args.seq,
                              args.timeout, args.recompute) for m in (args.microbatches or [ALPA_MICROBATCHES[name]])]
            found = [r for r in tried if "error" not in r]
            if not found:
                print(f"{name:>5} {gpus:>4} no plan: {tried[-1]['error']}", flush=True)
                rows.append({"model": name, "gpus": gpus, "tried": tried})
                continue
            best = min(found, key=lambda r: r["step_seconds"])
            flops = alpa_flops(shape["layers"], shape["hidden"], args.batch, args.seq)
            megatron, alpa = ALPA_MEASURED[name]
            best.update(pflops=flops / best["step_seconds"] / 1e15, alpa_pflops=alpa, megatron_pflops=megatron,
                        tried=[{k: r.get(k) for k in ("microbatches", "step_seconds", "plan_seconds", "error")}
                               for r in tried])
            rows.append(best)
            layout = ", ".join(f"{s} ({l})" if s != l else s for s, l in zip(best["submeshes"], best["logical_meshes"]))
            if len(layout) > 44:
                layout = _runs([f"{s} ({l})" if s != l else s for s, l in zip(best["submeshes"],
                                                                                best["logical_meshes"])])
            rss = f"{best['peak_rss_bytes'] / 2**30:.2f} G" if best["peak_rss_bytes"] else "?"
            print(f"{name:>5} {gpus:>4} {best['microbatches']:>5} {best['stages']:>6}  {layout:<44} "
                  f"{best['plan_seconds']:>7.1f} {rss:>8} {best['step_seconds']:>8.2f} "
                  f"{best['memory_bytes_per_gpu'] / 2**30:>7.2f} {best['pflops']:>7.3f} {alpa:>6.3f} {megatron:>8.3f}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "alpa_gpt", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
