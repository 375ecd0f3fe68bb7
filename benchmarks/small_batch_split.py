"""A decode step at batch 1 on this machine: meshplan's plans for 1x2, 1x4 and 1x8 (device
preset ``cpu``), each measured under mpiexec, against onnxruntime running the whole model in
one process with every core this process may use. At batch 1 the work is reading the
weights, so the planner splits them over every device where that is estimated faster (and
may leave devices idle where it is not): time(1x8) <= time(1x4) <= time(1x2) is the aim,
and 1x2 and 1x4 within 1.15x of onnxruntime with all threads.

The ranks of these meshes share this one machine, and the plans say so (``--host shared``,
``meshplan plan --shared-host``): a device that works while others beside it idle gets
their cores, so splitting the step over ranks divides no memory bandwidth, and the planner
leaves devices idle where the collectives would not pay. ``--host own`` plans as if each
rank had a machine of its own (the ``cpu`` preset's devices, every rank splitting the step),
``--host both`` runs both plans; the checks are of the shared plans.

``--cores`` also reports what each rank got: the cores this process may use and, per
mesh, each rank's onnxruntime threads and whether they spin (from ``meshplan run``).
``--bind both`` runs each mesh a second time with ``--no-bind-cores`` (ranks the launcher
left unbound sharing the machine's cores, spinning off, as before ranks bound themselves);
the checks are of meshplan's default.

Each run of a mesh follows a run of onnxruntime alone, in rounds (``--rounds``): a row's
ratio is the median of its rounds' ratios, so that a machine whose speed drifts compares
runs made side by side.

    python benchmarks/small_batch_split.py [--repeat 20] [--rounds 3] [--meshes 1x2,1x4,1x8] [--host shared|own|both]
        [--cores] [--bind on|off|both] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
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
    parser.add_argument("--rounds", type=int, default=3, help="runs of every mesh, each after onnxruntime alone")
    parser.add_argument("--meshes", default="1x2,1x4,1x8", help="comma-separated HxD meshes")
    parser.add_argument("--cores", action="store_true", help="report the cores and each rank's threads")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--mpiexec", help="the MPI launcher and its options [default: mpiexec on PATH]")
    parser.add_argument("--solver", default="cbc", choices=("cbc", "highs"), help="the ILP solver of the plans")
    parser.add_argument("--bind", default="on", choices=("on", "off", "both"),
                        help="meshplan run with its own core binding (on), --no-bind-cores (off), or each mesh both ways")
    parser.add_argument("--host", default="shared", choices=("shared", "own", "both"),
                        help="plan the ranks as shares of this machine (shared), as machines of their own (own), or both")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeat < 1:
        print("error: --rounds and --repeat must be at least 1")
        return 1
    meshplan = shutil.which("meshplan")
    mpiexec = shutil.which("mpiexec")
    if not meshplan or not (mpiexec or args.mpiexec):
        print("needs the meshplan command and mpiexec on PATH")
        return 1
    import shlex

    launcher = shlex.split(args.mpiexec) if args.mpiexec else [mpiexec]
    from meshplan.rank_layout import own_cores

    from meshplan.cost.cluster import parse_mesh

    try:
        meshes = [parse_mesh(m) for m in args.meshes.split(",")]
    except ValueError as exc:
        print(f"error: {exc}")
        return 1
    cores = len(own_cores())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.onnx"
        onnx.save_model(make_gpt(**MODEL), str(path), save_as_external_data=True, location="step.data")
        feeds = {"input_ids": np.array([[5]], dtype=np.int64)}
        inputs = Path(tmp) / "in.npz"
        np.savez(inputs, **feeds)
        print(f"decode step, batch 1, {MODEL}, device preset cpu, median of {args.repeat} runs, {cores} core(s), "
              f"{args.rounds} round(s), each run after onnxruntime alone with {cores} thread(s)")
        hosts = {"shared": [True], "own": [False], "both": [True, False]}[args.host]
        runs = []
        for mesh, shared in [(m, h) for m in meshes for h in hosts]:
            plan_dir = Path(tmp) / f"plan-{mesh[0]}x{mesh[1]}-{'shared' if shared else 'own'}"
            plan = make_plan(path, make_cluster(mesh, "cpu", shared_host=shared), {"batch": 1, "seq": 1}, plan_dir,
                             PlanOptions(solver=args.solver))
            for bound in {"on": [True], "off": [False], "both": [True, False]}[args.bind]:
                runs.append({"mesh": f"{mesh[0]}x{mesh[1]}", "shared_host": shared, "bind_cores": bound,
                             "stages": [len(s.devices) for s in plan.stages], "idle": plan.idle_ranks,
                             "estimate_ms": plan.estimate["latency_seconds"] * 1e3, "ranks": plan.num_ranks,
                             "plan_dir": str(plan_dir), "measured": [], "alone": [], "threads": {},
                             # what the working ranks run: plans of equal programs are one plan
                             "programs": sorted(f"{p.stage}:{p.sha256}" for p in plan.programs)})
        for _ in range(args.rounds):
            for row in runs:
                row["alone"].append(onnxruntime_alone(path, feeds, args.repeat, cores))
                done = subprocess.run([*launcher, "-n", str(row["ranks"]), meshplan, "run", row["plan_dir"], "--inputs",
                                       str(inputs), "--repeat", str(args.repeat), "--provider", "cpu",
                                       *([] if row["bind_cores"] else ["--no-bind-cores"])],
                                      capture_output=True, text=True)
                found = re.search(r"measured: latency ([\d.]+) (ms|us|µs|s)", done.stdout)
                if done.returncode or not found:
                    print(done.stdout + done.stderr)
                    return 1
                scale = {"ms": 1.0, "us": 1e-3, "µs": 1e-3, "s": 1e3}[found.group(2)]
                row["measured"].append(float(found.group(1)) * scale)
                row["threads"] = {int(r): t for r, t in re.findall(r"^rank (\d+): .*; (.*)$", done.stdout, flags=re.M)}
    rows = []
    for row in runs:
        row.pop("plan_dir")
        row["measured_ms"] = statistics.median(row["measured"])
        row["alone_ms"] = statistics.median(row["alone"])
        row["ratio"] = statistics.median(m / a for m, a in zip(row["measured"], row["alone"]))
        rows.append(row)
        print(f"{row['mesh']}{'' if row['shared_host'] else ' (own hosts)'}{'' if row['bind_cores'] else ' --no-bind-cores'}: "
              f"stages {row['stages']} (idle {row['idle']}), estimate {row['estimate_ms']:.3f} ms, "
              f"measured {row['measured_ms']:.3f} ms, onnxruntime alone {row['alone_ms']:.3f} ms: "
              f"{row['ratio']:.2f}x (median of the rounds' ratios)")
        if args.cores:
            for rank, text in sorted(row["threads"].items()):
                print(f"    rank {rank}: {text}")
    checked = [r for r in rows if r["bind_cores"] == (args.bind != "off") and r["shared_host"] == (args.host != "own")]
    ratios = [r["ratio"] for r in checked]
    ordered = all(later <= earlier for earlier, later in zip(ratios, ratios[1:]))
    print(("yes" if ordered else "no") + f": each larger mesh at least as fast as the one before ({args.meshes}; "
          "ratios to onnxruntime alone)")
    if not ordered:   # plans of the same stages (one device working) differ by the machine's noise alone
        near = all(later <= 1.05 * earlier for earlier, later in zip(ratios, ratios[1:]))
        print(("yes" if near else "no") + ": each larger mesh within 5% of the one before or faster")
    for earlier, later in zip(checked, checked[1:]):   # a larger mesh the planner gave the same programs
        if later["programs"] == earlier["programs"]:
            print(f"{later['mesh']} runs the plan of {earlier['mesh']} (the same programs on the working ranks, "
                  f"the others idle): their ratios differ by the machine's noise, "
                  f"{later['ratio']:.2f}x against {earlier['ratio']:.2f}x")
    for row in checked:
        if row["mesh"] in ("1x2", "1x4"):
            within = row["ratio"] <= 1.15
            print(f"{'yes' if within else 'no'}: {row['mesh']} within 1.15x of onnxruntime with {cores} threads")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "small_batch_split", "model": MODEL, "cores": cores,
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
