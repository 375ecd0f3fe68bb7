"""A decode step at batch 1 on this machine: meshplan's plan for 1x4 against its plan for
1x2 (device preset ``cpu``), both measured under mpiexec. At batch 1 the work is reading
the weights, so the planner splits them over every device where that is estimated
faster; the measured run on 1x4 must not be slower than the 1x2 plan's.

    python benchmarks/small_batch_split.py [--repeat 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from meshplan.cost.cluster import make_cluster  # noqa: E402
from meshplan.inter.pipeline import PlanOptions  # noqa: E402
from meshplan.make_plan import make_plan  # noqa: E402
from sample_models.gpt import make_gpt  # noqa: E402

MODEL = dict(layers=2, hidden=1024, heads=16, vocab=2048, max_seq=64)   # 117 MB of float32 weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    meshplan = shutil.which("meshplan")
    mpiexec = shutil.which("mpiexec")
    if not meshplan or not mpiexec:
        print("needs the meshplan command and mpiexec on PATH")
        return 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.onnx"
        onnx.save_model(make_gpt(**MODEL), str(path), save_as_external_data=True, location="step.data")
        inputs = Path(tmp) / "in.npz"
        np.savez(inputs, input_ids=np.array([[5]], dtype=np.int64))
        print(f"decode step, batch 1, {MODEL}, device preset cpu, median of {args.repeat} runs")
        for mesh in [(1, 2), (1, 4)]:
            plan_dir = Path(tmp) / f"plan-{mesh[1]}"
            plan = make_plan(path, make_cluster(mesh, "cpu"), {"batch": 1, "seq": 1}, plan_dir, PlanOptions())
            done = subprocess.run([mpiexec, "-n", str(plan.num_ranks), meshplan, "run", str(plan_dir), "--inputs",
                                   str(inputs), "--repeat", str(args.repeat)], capture_output=True, text=True)
            found = re.search(r"measured: latency ([\d.]+) ms", done.stdout)
            if done.returncode or not found:
                print(done.stdout + done.stderr)
                return 1
            row = {"mesh": f"{mesh[0]}x{mesh[1]}", "stages": [len(s.devices) for s in plan.stages],
                   "idle": plan.idle_ranks, "estimate_ms": plan.estimate["latency_seconds"] * 1e3,
                   "measured_ms": float(found.group(1))}
            rows.append(row)
            print(f"{row['mesh']}: stages {row['stages']} (idle {row['idle']}), estimate {row['estimate_ms']:.3f} ms, "
                  f"measured {row['measured_ms']:.3f} ms")
    ok = rows[1]["measured_ms"] <= rows[0]["measured_ms"]
    print("PASSED | 1x4 not slower than 1x2" if ok else "FAILED | 1x4 slower than 1x2")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "small_batch_split", "model": MODEL, "rows": rows}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
