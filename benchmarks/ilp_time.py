"""Sharding-ILP time for one whole stage: every layer of the GPT-style stack on one
logical mesh, solved from a cold cache (each distinct layer structure and boundary
layout once). Prints a table; ``--json PATH`` writes the numbers.

    python benchmarks/ilp_time.py [--layers 12] [--mesh 2x4] [--solver cbc|highs] [--json PATH]
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
from meshplan.cost.analytic import CostModel  # noqa: E402
from meshplan.model.graph import build_graph  # noqa: E402
from meshplan.intra.intra_op import IntraOpPass  # noqa: E402
from meshplan.model.load import canonicalize  # noqa: E402
from meshplan.make_plan import small_constants  # noqa: E402
from meshplan.inter.pipeline import choose_layering  # noqa: E402
from sample_models import make_gpt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--solvers", nargs="+", default=["cbc", "highs"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    mesh = parse_mesh(args.mesh)
    cluster = make_cluster(mesh, "h100-80g")
    rows = []
    print(f"{'layers':>6} {'mesh':>5} {'solver':>6} {'clusters':>8} {'ILPs':>5} {'reused':>7} {'variables':>9} "
          f"{'largest':>7} {'seconds':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            path = Path(tmp) / f"gpt{layers}.onnx"
            onnx.save(make_gpt(layers=layers, hidden=512, heads=8, vocab=4096, max_seq=256), str(path))
            work = Path(tmp) / f"work{layers}"
            work.mkdir()
            canonical = canonicalize(path, {"batch": 16, "seq": 256}, work)
            graph = build_graph(canonical.model)
            constants = small_constants(canonical.model)
            cost_model = CostModel(cluster)
            node_seconds = cost_model.graph_seconds(graph)
            layering = choose_layering(graph, node_seconds, cluster, constants)
            for solver in args.solvers:
                intra = IntraOpPass(graph, layering, cost_model, cluster, constants, solver)
                started = time.perf_counter()
                sharding = intra.stage(0, layering.num_layers, mesh, mesh)
                seconds = time.perf_counter() - started
                stats = intra.stats
                row = {"layers": layers, "mesh": args.mesh, "solver": solver, "clusters": layering.num_layers,
                       "ilps": stats.ilps, "reused": stats.cache_hits, "variables": stats.variables,
                       "largest_variables": stats.largest, "seconds": seconds,
                       "stage_seconds_estimate": sharding.seconds}
                rows.append(row)
                print(f"{layers:>6} {args.mesh:>5} {solver:>6} {row['clusters']:>8} {row['ilps']:>5} {row['reused']:>7} "
                      f"{row['variables']:>9} {row['largest_variables']:>7} {seconds:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "ilp_time", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
