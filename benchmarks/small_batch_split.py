"""A decode step at batch 1 on this machine: meshplan's plans for 1x2, 1x4 and 1x8 (device
preset ``cpu``), each measured under mpiexec, against onnxruntime running the whole model in
one process with every core this process may use. At batch 1 the work is reading the
weights, so the planner splits them over every device where that is estimated faster (and
may leave devices idle where it is not): time(1x8) <= time(1x4) <= time(1x2) is the aim,
and 1x2 and 1x4 within 1.15x of onnxruntime with all threads.

``--cores`` also reports what each rank got: the cores this process may use and, per
mesh, each rank's onnxruntime threads and whether they spin (from ``meshplan run``).
``--bind both`` runs each mesh a second time with ``--no-bind-cores`` (ranks the launcher
left unbound sharing the machine's cores, spinning off, as before ranks bound themselves);
the checks are of meshplan's default.

    python benchmarks/small_batch_split.py [--repeat 20] [--meshes 1x2,1x4,1x8] [--cores] [--bind on|off|both]
        [--json PATH]
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


def onnxruntime_alone(path: Path, inputs: dict, repeat: int, threads: int) -> float:
    """Median ms of the whole model in one session with ``threads`` threads."""
    import statistics
    import time

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, inputs)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        session.run(None, inputs)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--meshes", default="1x2,1x4,1x8", help="comma-separated HxD meshes")
    parser.add_argument("--cores", action="store_true", help="report the cores and each rank's threads")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--mpiexec", help="the MPI launcher and its options [default: mpiexec on PATH]")
    parser.add_argument("--solver", default="cbc", choices=("cbc", "highs"), help="the ILP solver of the plans")
    parser.add_argument("--bind", default="on", choices=("on", "off", "both"),
                        help="meshplan run with its own core binding (on), --no-bind-cores (off), or each mesh both ways")
    args = parser.parse_args()
    meshplan = shutil.which("meshplan")
    mpiexec = shutil.which("mpiexec")
    if not meshplan or not (mpiexec or args.mpiexec):
        print("needs the meshplan command and mpiexec on PATH")
        return 1
    import shlex

    launcher = shlex.split(args.mpiexec) if args.mpiexec else [mpiexec]
    from meshplan.rank_layout import own_cores

    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
    cores = len(own_cores())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.onnx"
        onnx.save_model(make_gpt(**MODEL), str(path), save_as_external_data=True, location="step.data")
        feeds = {"input_ids": np.array([[5]], dtype=np.int64)}
        inputs = Path(tmp) / "in.npz"
        np.savez(inputs, **feeds)
        print(f"decode step, batch 1, {MODEL}, device preset cpu, median of {args.repeat} runs, {cores} core(s)")
        alone = onnxruntime_alone(path, feeds, args.repeat, cores)
        print(f"onnxruntime alone, {cores} thread(s): {alone:.3f} ms")
        for mesh in meshes:
            plan_dir = Path(tmp) / f"plan-{mesh[0]}x{mesh[1]}"
            plan = make_plan(path, make_cluster(mesh, "cpu"), {"batch": 1, "seq": 1}, plan_dir, PlanOptions(solver=args.solver))
            for bound in {"on": [True], "off": [False], "both": [True, False]}[args.bind]:
                done = subprocess.run([*launcher, "-n", str(plan.num_ranks), meshplan, "run", str(plan_dir), "--inputs",
                                       str(inputs), "--repeat", str(args.repeat), "--provider", "cpu",
                                       *([] if bound else ["--no-bind-cores"])],
                                      capture_output=True, text=True)
                found = re.search(r"measured: latency ([\d.]+) (ms|us|µs|s)", done.stdout)
                if done.returncode or not found:
                    print(done.stdout + done.stderr)
                    return 1
                scale = {"ms": 1.0, "us": 1e-3, "µs": 1e-3, "s": 1e3}[found.group(2)]
                threads = re.findall(r"^rank (\d+): .*; (.*)$", done.stdout, flags=re.M)
                row = {"mesh": f"{mesh[0]}x{mesh[1]}", "bind_cores": bound, "stages": [len(s.devices) for s in plan.stages],
                       "idle": plan.idle_ranks, "estimate_ms": plan.estimate["latency_seconds"] * 1e3,
                       "measured_ms": float(found.group(1)) * scale, "threads": {int(r): t for r, t in threads}}
                rows.append(row)
                print(f"{row['mesh']}{'' if bound else ' --no-bind-cores'}: stages {row['stages']} (idle {row['idle']}), "
                      f"estimate {row['estimate_ms']:.3f} ms, measured {row['measured_ms']:.3f} ms "
                      f"({row['measured_ms'] / alone:.2f}x onnxruntime alone)")
                if args.cores:
                    for rank, text in sorted(row["threads"].items()):
                        print(f"    rank {rank}: {text}")
    checked = [r for r in rows if r["bind_cores"] == (args.bind != "off")]
    times = [r["measured_ms"] for r in checked]
    ordered = all(later <= earlier for earlier, later in zip(times, times[1:]))
    print(("yes" if ordered else "no") + f": each larger mesh at least as fast as the one before ({args.meshes})")
    for row in checked:
        if row["mesh"] in ("1x2", "1x4"):
            within = row["measured_ms"] <= 1.15 * alone
            print(f"{'yes' if within else 'no'}: {row['mesh']} within 1.15x of onnxruntime with {cores} threads")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "small_batch_split", "model": MODEL, "cores": cores,
                                         "onnxruntime_alone_ms": alone, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
