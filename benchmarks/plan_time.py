"""Planning time (no profiling) of the GPT-style sample stack at 12, 24 and 48 layers on
meshes 1x4 and 2x8: load + canonicalise + layer clustering + stage DP + emitting every
device's program. Prints a table; ``--json PATH`` writes the numbers.

    python benchmarks/plan_time.py [--layers 12 24 48] [--meshes 1x4 2x8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnx  # noqa: E402

from meshplan.cost.cluster import make_cluster, parse_mesh  # noqa: E402
from meshplan.make_plan import make_plan  # noqa: E402
from meshplan.inter.pipeline import PlanOptions  # noqa: E402
from sample_models import make_gpt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48])
    parser.add_argument("--meshes", nargs="+", default=["1x4", "2x8"])
    parser.add_argument("--device", default="h100-80g")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    rows = []
    header = f"{'layers':>6} {'mesh':>5} {'nodes':>6} {'clusters':>8} {'stages':>6} {'plan s':>7} {'DP s':>7} {'est. latency':>13}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            path = Path(tmp) / f"gpt{layers}.onnx"
            onnx.save_model(make_gpt(layers=layers), str(path))
            for mesh_text in args.meshes:
                mesh = parse_mesh(mesh_text)
                started = time.perf_counter()
                plan = make_plan(path, make_cluster(mesh, args.device), {"batch": 16, "seq": 64},
                                 Path(tmp) / f"plan{layers}-{mesh_text}", PlanOptions(microbatches=args.microbatches))
                seconds = time.perf_counter() - started
                row = {
                    "layers": layers, "mesh": mesh_text, "nodes": plan.solver["nodes"],
                    "clusters": plan.solver["layers"], "stages": len(plan.stages), "plan_seconds": seconds,
                    "stage_dp_seconds": plan.timings["stage_dp_seconds"],
                    "estimated_latency_seconds": plan.estimate["latency_seconds"],
                }
                rows.append(row)
                print(f"{layers:>6} {mesh_text:>5} {row['nodes']:>6} {row['clusters']:>8} {row['stages']:>6} "
                      f"{seconds:>7.2f} {row['stage_dp_seconds']:>7.3f} {row['estimated_latency_seconds'] * 1e3:>10.3f} ms")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "plan_time", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
