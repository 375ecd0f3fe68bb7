"""Plan time and peak memory of a Llama-style decoder of about 1.35B parameters in float16
(hidden 2048, 24 layers, ffn 5504, vocab 32000: 2.7 GB of weights) on meshes 1x4 and 2x8.
Each plan runs in a child process, which reports its own peak RSS. Prints a table;
``--json PATH`` writes the numbers.

    python benchmarks/number_formats.py [--meshes 1x4 2x8] [--layers 24] [--dtype float16] [--json PATH]
    python benchmarks/number_formats.py --smoke --meshes 1x2 --layers 2    # a 5 MB model: the path in seconds

``--smoke`` shrinks the decoder (hidden 256, ffn 688, vocab 1000) to check the script, not
to measure it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHILD = """
import json, resource, sys, time
from meshplan.cost.cluster import make_cluster, parse_mesh
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
model, mesh, out = sys.argv[1:4]
started = time.perf_counter()
plan = make_plan(model, make_cluster(parse_mesh(mesh), "h100-80g"), {"batch": 8, "seq": 512}, out,
                 PlanOptions(microbatches=4))
print(json.dumps({"seconds": time.perf_counter() - started, "stages": [len(s.devices) for s in plan.stages],
                  "stage_layers": [s.layers for s in plan.stages], "latency_seconds": plan.estimate["latency_seconds"],
                  "throughput_per_second": plan.estimate["throughput_per_second"],
                  "dtypes": plan.model.get("compute_dtypes"),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["1x4", "2x8"])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true",
                        help="a small decoder (hidden 256): the script's path in seconds")
    args = parser.parse_args()
    from sample_models.llama import make_llama, save_llama

    rows = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        started = time.perf_counter()
        shape = dict(hidden=256, heads=4, ffn=688, vocab=1000) if args.smoke else \
            dict(hidden=2048, heads=16, ffn=5504, vocab=32000)
        model = save_llama(work / "llama.onnx", make_llama(layers=args.layers, **shape, max_seq=512, dtype=args.dtype))
        size = (work / "llama.onnx.data").stat().st_size
        print(f"wrote a {size / 1e9:.2f} GB {args.dtype} model in {time.perf_counter() - started:.0f} s")
        print(f"{'mesh':>5} {'plan s':>7} {'peak RSS GiB':>13} {'stages':>24} {'latency ms':>11}")
        for mesh in args.meshes:
            done = subprocess.run([sys.executable, "-c", CHILD, str(model), mesh, str(work / f"plan-{mesh}")],
                                  capture_output=True, text=True, cwd=REPO)
            if done.returncode:
                print(done.stderr[-2000:])
                return 1
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result.update(mesh=mesh, model_bytes=size)
            rows.append(result)
            print(f"{mesh:>5} {result['seconds']:>7.1f} {result['peak_rss_bytes'] / 2**30:>13.2f} "
                  f"{str(result['stages']):>24} {result['latency_seconds'] * 1e3:>11.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
