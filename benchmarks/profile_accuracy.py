"""How well the planner's estimates match measured runs, with the CPU profile and without.

For each sample model and mesh 1x2 / 1x4: ``mpiexec -n N meshplan profile`` (operators
shared among the ranks, collectives timed), a plan made with ``ProfiledCostModel`` and
one with the analytic model, then ``mpiexec -n N meshplan run PLAN --repeat R --trace``
for each. Compared: each stage's estimated compute time against its program timed alone
with onnxruntime (median of 50 runs on one microbatch, the thread count meshplan run
gives a rank; sharded stages: the median of their "stage k" trace events); the
plan's estimated pipeline latency against the median measured latency per batch; and
("work err") the fill-drain latency of the estimated stage times against that of the
measured stage times — the part of the latency the cost model is responsible for, without
the runtime's waits, barriers and output collection. Errors are (estimate − measured) /
measured. Mind the host: a 1x4 mesh on fewer than 4 cores is oversubscribed, and other
jobs on the machine show up in every measured number.

    python benchmarks/profile_accuracy.py [--models mlp gpt resnet] [--meshes 1x2 1x4]
        [--microbatches 2] [--repeat 20] [--no-analytic] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from meshplan.cost.cluster import make_cluster, parse_mesh  # noqa: E402
from meshplan.cost.analytic import CostModel  # noqa: E402
from meshplan.model.graph import build_graph  # noqa: E402
from meshplan.files import file_sha256  # noqa: E402
from meshplan.model.load import canonicalize  # noqa: E402
from meshplan.make_plan import make_plan  # noqa: E402
from meshplan.inter.pipeline import PlanOptions  # noqa: E402
from meshplan.profile import ProfiledCostModel, load_profile  # noqa: E402
from sample_models import SAMPLES, make_inputs  # noqa: E402

BIN = Path(sys.executable).parent
_UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6}


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def _mpiexec() -> str:
    return str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else "mpiexec"


def _meshplan() -> list[str]:
    script = BIN / "meshplan"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cli.main"]


def _check(result: subprocess.CompletedProcess, what: str) -> str:
    if result.returncode != 0:
        raise SystemExit(f"{what} failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return result.stdout


def profile(model: Path, dims: dict, ranks: int, mesh: str, microbatches: int, cache: Path, out: Path) -> float:
    command = [_mpiexec(), "-n", str(ranks), sys.executable, "-c", "from cli.profile_cmd import profile; profile()",
               str(model), "--mesh", mesh, "--provider", "cpu", "--cache", str(cache), "-o", str(out)]
    for name, value in dims.items():
        command += ["--dim", f"{name}={value}"]
    if microbatches > 1:
        command += ["--microbatches", str(microbatches)]
    started = time.perf_counter()
    _check(subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600), "meshplan profile")
    return time.perf_counter() - started


def run_plan(plan_dir: Path, inputs: Path, ranks: int, repeat: int) -> tuple[float, dict[int, float]]:
    """(median latency per batch, {stage: median compute seconds per microbatch})."""
    trace = plan_dir.parent / f"{plan_dir.name}.trace.json"
    command = [_mpiexec(), "-n", str(ranks), *_meshplan(), "run", str(plan_dir), "--inputs", str(inputs),
               "--repeat", str(repeat), "--trace", str(trace), "--provider", "cpu"]
    out = _check(subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600), "meshplan run")
    match = re.search(r"measured: latency ([\d.]+) (s|ms|µs|us) per batch", out)
    if not match:
        raise SystemExit(f"cannot read the measured latency from:\n{out}")
    latency = float(match.group(1)) * _UNITS[match.group(2)]
    per_stage: dict[int, dict[int, float]] = {}
    for event in json.loads(trace.read_text())["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") == "X" and name.startswith("stage "):
            stage, mb = int(name.split()[1]), event["args"]["microbatch"]
            slot = per_stage.setdefault(stage, {})
            slot[mb] = max(slot.get(mb, 0.0), event["dur"] * 1e-6)    # the stage's slowest rank
    return latency, {s: statistics.median(v.values()) for s, v in per_stage.items()}


def boundary_values(canonical_path: Path, graph, names: list[str], feeds: dict) -> dict:
    """The tensors crossing stage boundaries, from onnxruntime on the unpartitioned canonical model."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    model = onnx.load(str(canonical_path))
    present = {o.name for o in model.graph.output}
    for name in names:
        if name not in present and name not in feeds:
            info = graph.tensors[name]
            model.graph.output.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(info.dtype), list(info.shape)))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    inputs = {i.name: feeds[i.name] for i in session.get_inputs()}
    return {**feeds, **dict(zip(outputs, session.run(outputs, inputs)))}


def stage_times_in_process(plan, plan_dir: Path, canonical_path: Path, graph, inputs: dict, threads: int,
                           runs: int = 50) -> dict[int, float]:
    """Median seconds of each one-device stage's program on one microbatch, run alone with
    onnxruntime as a rank runs it (no MPI, no other stage competing for the cores)."""
    import onnxruntime as ort

    from meshplan.runtime.tensors import split_microbatches

    needed = sorted({n for stage in plan.stages for n in stage.inputs})
    values = boundary_values(canonical_path, graph, needed, dict(split_microbatches(inputs, plan)[0]))
    programs = {p.rank: plan_dir / p.file for p in plan.programs}
    found = {}
    for stage in plan.stages:
        if len(stage.devices) > 1:
            continue
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        session = ort.InferenceSession(str(programs[stage.devices[0]]), options, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        feeds = {i.name: values[i.name] for i in session.get_inputs() if i.name in values}
        for _ in range(5):
            session.run(names, feeds)
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            session.run(names, feeds)
            times.append(time.perf_counter() - started)
        found[stage.index] = statistics.median(times)
    return found


def stage_compute_estimates(plan, cost_model, graph) -> dict[int, float]:
    """Estimated compute of each stage: Σ node seconds for one-device stages (what the trace
    times: no send), the planner's stage seconds for sharded ones."""
    by_name = {node.name: node for node in graph.nodes}
    found = {}
    for stage in plan.stages:
        if len(stage.devices) == 1:
            found[stage.index] = sum(cost_model.node_seconds(by_name[op], graph) for op in stage.operators)
        else:
            found[stage.index] = stage.seconds
    return found


def _error(estimate: float, measured: float) -> float:
    return (estimate - measured) / measured if measured > 0 else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SAMPLES))
    parser.add_argument("--meshes", nargs="+", default=["1x2", "1x4"])
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--no-analytic", action="store_true", help="skip the plans made with the analytic model")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    rows = []
    header = (f"{'model':>7} {'mesh':>4} {'cost model':>10} {'stages':>6} {'est. latency':>12} {'measured':>10} "
              f"{'error':>7} {'work err':>8} {'worst stage err':>15} {'measured nodes':>14}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(prefix="profile-accuracy-") as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache.sqlite"
        for name in args.models:
            sample = SAMPLES[name]
            dims = dict(sample.dims)
            inputs = tmp / f"{name}.inputs.npz"
            np.savez(inputs, **make_inputs(name, dims, seed=0))
            for mesh_text in args.meshes:
                mesh = parse_mesh(mesh_text)
                ranks = mesh[0] * mesh[1]
                cluster = make_cluster(mesh, "cpu")
                profile_path = tmp / f"{name}-{mesh_text}.profile.json"
                profile_seconds = profile(sample.path, dims, ranks, mesh_text, args.microbatches, cache, profile_path)
                loaded = load_profile(profile_path, file_sha256(sample.path), cluster)
                kinds = [("profiled", ProfiledCostModel(cluster, loaded))]
                if not args.no_analytic:
                    kinds.append(("analytic", None))
                for kind, cost_model in kinds:
                    plan_dir = tmp / f"{name}-{mesh_text}-{kind}"
                    plan = make_plan(sample.path, cluster, dims, plan_dir, PlanOptions(microbatches=args.microbatches),
                                     cost_model=cost_model)
                    counted = (getattr(cost_model, "measured_nodes", 0), getattr(cost_model, "analytic_nodes", None))
                    # The graph the planner costed: the per-microbatch program dims.
                    work = tmp / f"{name}-{mesh_text}-{kind}.work"
                    work.mkdir()
                    batch_dim = plan.batch["dim"]
                    program_dims = dict(dims)
                    if batch_dim:
                        program_dims[batch_dim] = plan.batch["microbatch_size"]
                    canonical = canonicalize(sample.path, program_dims, work)
                    graph = build_graph(canonical.model)
                    costing = cost_model or CostModel(cluster)
                    estimates = stage_compute_estimates(plan, costing, graph)
                    latency, traced = run_plan(plan_dir, inputs, ranks, args.repeat)
                    with np.load(inputs) as archive:
                        arrays = {k: archive[k] for k in archive.files}
                    alone = stage_times_in_process(plan, plan_dir, canonical.path, graph, arrays,
                                                   max(1, (os.cpu_count() or 1) // ranks))
                    measured_stages = {i: alone.get(i, traced.get(i, float("nan"))) for i in traced}
                    stage_rows = []
                    for stage in plan.stages:
                        measured = measured_stages.get(stage.index, float("nan"))
                        stage_rows.append({
                            "stage": stage.index, "devices": stage.devices, "operators": len(stage.operators),
                            "estimate_seconds": estimates[stage.index], "measured_seconds": measured,
                            "error": _error(estimates[stage.index], measured),
                        })
                    estimate = plan.estimate["latency_seconds"]
                    # The latency the measured stage work alone implies (fill-drain), without the
                    # runtime's waits, barriers and output collection: what the estimate models.
                    work = [measured_stages.get(s.index, 0.0) for s in plan.stages]
                    work_latency = sum(work) + (args.microbatches - 1) * max(work)
                    est_work = [estimates[s.index] for s in plan.stages]
                    est_work_latency = sum(est_work) + (args.microbatches - 1) * max(est_work)
                    row = {
                        "model": name, "mesh": mesh_text, "ranks": ranks, "cost_model": kind,
                        "microbatches": args.microbatches, "stages": stage_rows,
                        "estimate_latency_seconds": estimate, "measured_latency_seconds": latency,
                        "latency_error": _error(estimate, latency),
                        "stage_work_latency_seconds": work_latency,
                        "estimated_stage_work_latency_seconds": est_work_latency,
                        "stage_work_error": _error(est_work_latency, work_latency),
                        "profile_seconds": profile_seconds,
                        "measured_nodes": counted[0],
                        "analytic_nodes": len(graph.nodes) if counted[1] is None else counted[1],
                    }
                    rows.append(row)
                    worst = max((abs(s["error"]) for s in stage_rows), default=float("nan"))
                    nodes = f"{row['measured_nodes']}/{row['measured_nodes'] + row['analytic_nodes']}"
                    print(f"{name:>7} {mesh_text:>4} {kind:>10} {len(plan.stages):>6} {estimate * 1e3:>9.3f} ms "
                          f"{latency * 1e3:>7.3f} ms {row['latency_error']:>+7.1%} {row['stage_work_error']:>+8.1%} {worst:>15.1%} "
                          f"{nodes:>14}")
    profiled = [r for r in rows if r["cost_model"] == "profiled"]
    if profiled:
        within = sum(abs(r["latency_error"]) <= 0.25 for r in profiled)
        work_within = sum(abs(r["stage_work_error"]) <= 0.25 for r in profiled)
        print(f"profiled latency estimates within 25%: {within} of {len(profiled)}; "
              f"median |error| {statistics.median(abs(r['latency_error']) for r in profiled):.1%}; "
              f"stage-work latency within 25%: {work_within} of {len(profiled)}")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "profile_accuracy", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
