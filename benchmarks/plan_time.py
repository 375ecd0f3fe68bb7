"""Planning time (no profiling) of whole `meshplan plan` runs, each in a child process
with its peak RSS.

Rows (pick with ``--rows``):

* ``gpt``: the onnx-helper GPT-style stack at 12, 24 and 48 layers on 1x4 and 2x8 (load,
  canonicalise, layers, ILPs, stage DP, every device's program).
* ``gpt2``: a 24-layer GPT-2 from transformers (``GPT2Config(n_layer=24, n_embd=256,
  n_head=8, vocab_size=1000)``) exported by torch's dynamo exporter
  (``sample_models/gpt2_dynamo.py``), batch 16 × seq 128 in 4 microbatches, on 2x8 and
  16x8, programs included. The export needs torch and transformers: ``--gpt2-model PATH``
  names an export made beforehand (``python -m sample_models.gpt2_dynamo -o PATH`` where
  they are installed); without either the rows are skipped with a message.
* ``llama70b``: a 70B-shaped Llama decoder (80 layers, hidden 8192, 64 query / 8 key-value
  heads, ffn 28672, vocab 128256, float16: 141 GB of weights in a sparse external data
  file, written in a second) planned with ``--no-programs`` on 16x8 and 128x8, batch 16 ×
  seq 1024 in 8 microbatches.

Each row is planned once per ``--workers`` count (``MESHPLAN_PLAN_WORKERS``: the processes
that solve the layer ILPs side by side; default: the planner's own choice, the cores it may
run on). Peak RSS is the planner's process alone (each worker is a fork sharing its pages).

    python benchmarks/plan_time.py [--rows gpt gpt2 llama70b] [--gpt2-model PATH] [--workers N ...] [--solver S]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402

from meshplan.testing.child_memory import peak_of, run_measured  # noqa: E402
from sample_models import make_gpt  # noqa: E402

LLAMA_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)


def plan_row(name: str, model: Path, mesh: str, dims: dict[str, int], microbatches: int, out: Path,
             extra: tuple[str, ...] = (), timeout: float = 3600, workers: int | None = None) -> dict:
    """One ``meshplan plan`` timed (``workers``: its ``MESHPLAN_PLAN_WORKERS``; None: its default)."""
    from meshplan.intra.parallel_solves import WORKERS_VARIABLE

    args = ["plan", model, "--mesh", mesh, "--microbatches", str(microbatches), *extra, "-o", out]
    for dim, size in dims.items():
        args += ["--dim", f"{dim}={size}"]
    before = os.environ.pop(WORKERS_VARIABLE, None)
    if workers is not None:
        os.environ[WORKERS_VARIABLE] = str(workers)
    started = time.perf_counter()
    try:
        done = run_measured(args, cwd=ROOT, timeout=timeout)
    finally:
        os.environ.pop(WORKERS_VARIABLE, None)
        if before is not None:
            os.environ[WORKERS_VARIABLE] = before
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{name} on {mesh} failed: {done.stderr.strip().splitlines()[-1:]}")
    plan = json.loads((out / "plan.json").read_text())
    return {
        "model": name, "mesh": mesh, "workers": workers, "programs": len(plan["programs"]),
        "nodes": plan["solver"]["nodes"],
        "layers": plan["solver"]["layers"], "stages": len(plan["stages"]), "ilps": plan["solver"]["ilp"]["solved"],
        "dp_solves": plan["solver"]["tmax_candidates"], "plan_seconds": seconds,
        "peak_rss_bytes": peak_of(done), "estimated_latency_seconds": plan["estimate"]["latency_seconds"],
    }


def gpt2_model(given: Path | None, tmp: Path) -> Path | None:
    if given is not None:
        return given
    from sample_models.gpt2_dynamo import MissingExporter, export

    try:
        return export(tmp / "gpt2.onnx")
    except MissingExporter as exc:
        print(f"skipping the gpt2 rows: {exc}; or pass --gpt2-model PATH", file=sys.stderr)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["gpt", "gpt2", "llama70b"], choices=["gpt", "gpt2", "llama70b"])
    parser.add_argument("--gpt2-model", type=Path, help="a GPT-2 export made by sample_models/gpt2_dynamo.py")
    parser.add_argument("--gpt-layers", type=int, nargs="+", default=[12, 24, 48])
    parser.add_argument("--meshes", nargs="+", help="meshes for every row kind (default: per kind)")
    parser.add_argument("--solver", help="the ILP solver (meshplan plan's --solver; default its own)")
    parser.add_argument("--workers", type=int, nargs="+", default=[None],
                        help="plan each row with each of these counts of ILP-solving processes")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    rows = []
    header = (f"{'model':>16} {'mesh':>6} {'workers':>7} {'nodes':>6} {'layers':>6} {'stages':>6} {'ILPs':>5} "
              f"{'programs':>8} {'plan s':>8} {'peak RSS':>9} {'est. latency':>13}")
    print(header)
    print("-" * len(header))

    def show(*plan_args, **plan_options):
        if args.solver:
            plan_options["extra"] = tuple(plan_options.get("extra", ())) + ("--solver", args.solver)
        for count in args.workers:
            _show(plan_row(*plan_args, **plan_options, workers=count))

    def _show(row):
        rows.append(row)
        rss = f"{row['peak_rss_bytes'] / 2**30:.2f} GiB" if row["peak_rss_bytes"] else "?"
        workers = "default" if row["workers"] is None else row["workers"]
        print(f"{row['model']:>16} {row['mesh']:>6} {workers:>7} {row['nodes']:>6} {row['layers']:>6} {row['stages']:>6} "
              f"{row['ilps']:>5} {row['programs']:>8} {row['plan_seconds']:>8.1f} {rss:>9} "
              f"{row['estimated_latency_seconds'] * 1e3:>10.3f} ms", flush=True)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if "gpt" in args.rows:
            for layers in args.gpt_layers:
                path = tmp / f"gpt{layers}.onnx"
                onnx.save_model(make_gpt(layers=layers), str(path))
                for mesh in args.meshes or ["1x4", "2x8"]:
                    show(f"gpt-{layers}", path, mesh, {"batch": 16, "seq": 64}, 8, tmp / f"g{layers}-{mesh}")
        if "gpt2" in args.rows:
            model = gpt2_model(args.gpt2_model, tmp)
            if model is not None:
                for mesh in args.meshes or ["2x8", "16x8"]:
                    show("gpt2-24 dynamo", model, mesh, {"batch": 16, "seq": 128}, 4, tmp / f"gpt2-{mesh}")
        if "llama70b" in args.rows:
            from sample_models.large_llama import write_large_llama

            (tmp / "l70").mkdir()
            facts = write_large_llama(tmp / "l70" / "model.onnx", **LLAMA_70B, sparse=True)
            print(f"(70B-shaped decoder: {facts['weight_bytes'] / 1e9:.0f} GB of float16 weights in a sparse file)")
            for mesh in args.meshes or ["16x8", "128x8"]:
                show("llama-70b shape", Path(facts["path"]), mesh, {"batch": 16, "seq": 1024}, 8, tmp / f"l70-{mesh}",
                     extra=("--no-programs",))
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "plan_time", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
