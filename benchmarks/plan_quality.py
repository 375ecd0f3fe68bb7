"""Plan quality: meshplan's automatic plan against hand-written baselines, all estimated
with the same cost model, for the GPT-style stack at 12 and 24 layers on 1x4, 1x8, 2x4
and 2x8 meshes of h100-80g devices.

Baselines: (a) pure data parallel — one stage over the whole mesh, activations split
along the batch, weights replicated; (b) Megatron-style — tensor parallel inside each
host (column- then row-parallel matrix products) and pipeline stages across hosts;
(c) pipeline only — one device per stage. meshplan's plan must never be worse than the
best of them. Prints a table; ``--json PATH`` writes the numbers.

    python benchmarks/plan_quality.py [--layers 12 24] [--meshes 1x4 1x8 2x4 2x8] [--json PATH]
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
from meshplan.errors import PlanError  # noqa: E402
from meshplan.make_plan import plan_model  # noqa: E402
from meshplan.inter.pipeline import PlanOptions  # noqa: E402
from sample_models import make_gpt  # noqa: E402

MODEL = dict(hidden=512, heads=8, vocab=4096, max_seq=256)
DIMS = {"batch": 64, "seq": 256}
MICROBATCHES = 4


def baselines(mesh: tuple[int, int]) -> dict[str, PlanOptions]:
    hosts, per_host = mesh
    common = dict(microbatches=MICROBATCHES)
    return {
        "meshplan": PlanOptions(**common),
        "data parallel": PlanOptions(policy="data", submeshes=((hosts, per_host) if hosts > 1 else (1, per_host),),
                                     max_stages=1, **common),
        "megatron TP+PP": PlanOptions(policy="megatron", submeshes=((1, per_host),), **common),
        "pipeline only": PlanOptions(submeshes=((1, 1),), **common),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--meshes", nargs="+", default=["1x4", "1x8", "2x4", "2x8"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows, ok = [], True
    names = list(baselines((1, 1)))
    header = f"{'layers':>6} {'mesh':>5} " + " ".join(f"{n:>15}" for n in names) + f" {'plan s':>7} {'stages':>6}  verdict"
    print("estimated latency per batch (ms), h100-80g, batch 64 x seq 256, hidden 512, 4 microbatches")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            path = Path(tmp) / f"gpt{layers}.onnx"
            onnx.save_model(make_gpt(layers=layers, **MODEL), str(path), save_as_external_data=True,
                            location=f"gpt{layers}.data")
            for mesh_text in args.meshes:
                mesh = parse_mesh(mesh_text)
                cluster = make_cluster(mesh, "h100-80g")
                row = {"layers": layers, "mesh": mesh_text, "latency_seconds": {}}
                for name, options in baselines(mesh).items():
                    work = Path(tempfile.mkdtemp(dir=tmp))
                    started = time.perf_counter()
                    try:
                        plan = plan_model(path, cluster, DIMS, work, options)[0]
                        row["latency_seconds"][name] = plan.estimate["latency_seconds"]
                        if name == "meshplan":
                            row["plan_seconds"] = time.perf_counter() - started
                            row["stages"] = [[len(s.devices), s.logical_mesh] for s in plan.stages]
                            row["ilp"] = plan.solver["ilp"]
                    except PlanError as exc:
                        row["latency_seconds"][name] = None
                        row.setdefault("infeasible", {})[name] = str(exc)
                best_baseline = min(v for k, v in row["latency_seconds"].items() if k != "meshplan" and v is not None)
                mine = row["latency_seconds"]["meshplan"]
                row["never_worse"] = mine <= best_baseline * (1 + 1e-9)
                ok &= row["never_worse"]
                rows.append(row)
                cells = " ".join(
                    f"{row['latency_seconds'][n] * 1e3:>15.3f}" if row["latency_seconds"][n] is not None else f"{'infeasible':>15}"
                    for n in names)
                print(f"{layers:>6} {mesh_text:>5} {cells} {row['plan_seconds']:>7.2f} {len(row['stages']):>6}  "
                      f"{'ok' if row['never_worse'] else 'WORSE'}")
    print("PASSED | meshplan never worse than the best baseline" if ok else "FAILED | meshplan worse on some row")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "plan_quality", "model": MODEL, "dims": DIMS,
                                         "microbatches": MICROBATCHES, "rows": rows}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
