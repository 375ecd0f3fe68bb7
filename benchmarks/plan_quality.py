"""Plan quality: meshplan's automatic plan against hand-written baselines, all estimated
with the same cost model, for the GPT-style stack at 12 and 24 layers on 1x4, 1x8, 2x4
and 2x8 meshes of h100-80g devices.

Baselines: (a) pure data parallel — one stage over the whole mesh, activations split
along the batch, weights replicated; (b) Megatron-style — tensor parallel inside each
host (column- then row-parallel matrix products) and pipeline stages across hosts;
(c) pipeline only — one device per stage. meshplan's plan must never be worse than the
best of them. Prints a table; ``--json PATH`` writes the numbers.

A second table takes one decode step (seq 1) at batch 1 and 2, where reading the weights
is the work, on 1x1, 1x2, 1x4, 2x2 and 2x4: meshplan's plan against the same baselines,
and against its own plans on fewer devices (1x2 ≤ 1x1, 1x4 ≤ 1x2, 2x2 ≤ 1x2, 2x4 ≤ 1x4):
more devices are never worse, and devices the plan leaves idle are counted.

    python benchmarks/plan_quality.py [--layers 12 24] [--meshes 1x4 1x8 2x4 2x8] [--small-layers 12]
        [--small-meshes 1x1 1x2 1x4 2x2 2x4] [--json PATH]
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


SMALL_BATCHES = (1, 2)
SMALL_MESHES = ("1x1", "1x2", "1x4", "2x2", "2x4")
FEWER = {"1x2": "1x1", "1x4": "1x2", "2x2": "1x2", "2x4": "1x4"}


def small_batch_rows(layers: int, tmp: str, meshes=SMALL_MESHES) -> tuple[list[dict], bool]:
    """One decode step at batch 1 and 2 on the small meshes: meshplan against the
    baselines, and against itself on fewer devices."""
    path = Path(tmp) / f"gpt{layers}-step.onnx"
    onnx.save_model(make_gpt(layers=layers, **MODEL), str(path), save_as_external_data=True,
                    location=f"gpt{layers}-step.data")
    rows, ok = [], True
    for batch in SMALL_BATCHES:
        mine: dict[str, float] = {}
        for mesh_text in meshes:
            mesh = parse_mesh(mesh_text)
            cluster = make_cluster(mesh, "h100-80g")
            row = {"layers": layers, "batch": batch, "seq": 1, "mesh": mesh_text, "latency_seconds": {}}
            for name, options in baselines(mesh).items():
                options = PlanOptions(**{**options.__dict__, "microbatches": 1})
                if name == "data parallel" and batch % (mesh[0] * mesh[1]):
                    row["latency_seconds"][name] = None
                    continue
                try:
                    plan = plan_model(path, cluster, {"batch": batch, "seq": 1}, Path(tempfile.mkdtemp(dir=tmp)),
                                      options)[0]
                    row["latency_seconds"][name] = plan.estimate["latency_seconds"]
                    if name == "meshplan":
                        row["stages"] = [[len(s.devices), s.logical_mesh] for s in plan.stages]
                        row["idle"] = plan.idle_ranks
                except PlanError as exc:
                    row["latency_seconds"][name] = None
                    row.setdefault("infeasible", {})[name] = str(exc)
            mine[mesh_text] = row["latency_seconds"]["meshplan"]
            others = [v for k, v in row["latency_seconds"].items() if k != "meshplan" and v is not None]
            row["never_worse"] = not others or mine[mesh_text] <= min(others) * (1 + 1e-9)
            if FEWER.get(mesh_text) in mine:
                row["fewer_devices"] = {"mesh": FEWER[mesh_text], "latency_seconds": mine[FEWER[mesh_text]]}
                row["never_worse_than_fewer"] = mine[mesh_text] <= mine[FEWER[mesh_text]] * (1 + 1e-9)
                ok &= row["never_worse_than_fewer"]
            ok &= row["never_worse"]
            rows.append(row)
    return rows, ok


def print_small(rows: list[dict], names: list[str]) -> None:
    print()
    print("one decode step (seq 1), estimated latency (µs), h100-80g, hidden 512, 1 microbatch")
    header = (f"{'layers':>6} {'batch':>5} {'mesh':>5} " + " ".join(f"{n:>15}" for n in names)
              + f" {'fewer devices':>14} {'idle':>5}  verdict")
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = " ".join(f"{row['latency_seconds'][n] * 1e6:>15.1f}" if row["latency_seconds"][n] is not None
                         else f"{'-':>15}" for n in names)
        fewer = row.get("fewer_devices")
        fewer_text = f"{fewer['mesh']} {fewer['latency_seconds'] * 1e6:.1f}" if fewer else "-"
        good = row["never_worse"] and row.get("never_worse_than_fewer", True)
        print(f"{row['layers']:>6} {row['batch']:>5} {row['mesh']:>5} {cells} {fewer_text:>14} {len(row['idle']):>5}  "
              f"{'ok' if good else 'WORSE'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--meshes", nargs="+", default=["1x4", "1x8", "2x4", "2x8"])
    parser.add_argument("--small-layers", type=int, nargs="*", default=[12],
                        help="layer counts of the decode-step rows at batch 1 and 2 (none: skip them)")
    parser.add_argument("--small-meshes", nargs="+", default=list(SMALL_MESHES),
                        help="the meshes of the decode-step rows (each against its smaller mesh where that ran too)")
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
        small = []
        for layers in args.small_layers:
            found, fine = small_batch_rows(layers, tmp, args.small_meshes)
            small += found
            ok &= fine
        if small:
            print_small(small, names)
    print("PASSED | meshplan never worse than the best baseline, nor than itself on fewer devices" if ok
          else "FAILED | meshplan worse on some row")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "plan_quality", "model": MODEL, "dims": DIMS,
                                         "microbatches": MICROBATCHES, "rows": rows, "small_batch_rows": small},
                                        indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
