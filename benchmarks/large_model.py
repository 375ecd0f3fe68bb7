"""Planning a model of a chosen size: peak memory and wall time against a plain copy.

    python benchmarks/large_model.py [--gb 2] [--mesh 1x4 [2x4 ...]] [--device h100-80g]
        [--memory-fraction F] [--batch 4] [--seq 512] [--run] [--whole-verify] [--work DIR] [--keep]
        [--json PATH] [--smoke]

Writes a Llama-style float16 decoder of about ``--gb`` GB straight to external data
(``sample_models/large_llama.py``: 0.4 GB layers, never holding the model whole), then
for each mesh plans it in a child process (``make_plan``: load, fold, plan, emit every
device's program and weights) and reports the child's peak RSS and wall time, next to
the time of a plain copy of the same weight bytes (``shutil.copyfile``, after the
weights were written, so both read from the same page cache) and the targets:
peak RSS ≤ 1.5 GiB + 2 × the largest initializer, wall time ≤ 3 × the copy. The exit
status is 1 when a target is missed or a plan fails. ``--work`` puts the model and the
plans on a disk with room (the model, plus what each plan writes: every device's
weights, so a data-parallel plan writes the model once per replica). ``--smoke`` writes
a small decoder instead (2 layers of hidden 256, 35 MB) and holds no target against the
exit status (a plain copy of it takes milliseconds): the script's path in seconds.

Columns: ``x copy``, the wall time over the plain copy of the model's weights;
``wrote GB``, what the plan directory holds; ``x copy w``, the wall time over a plain
copy of that many bytes (at the rate measured); ``x model``, peak RSS over the weight
bytes. ``--memory-fraction F`` gives each device memory for F of the weights, so that
plans must split them (as the tests' "devices holding 40% of the parameters").

``--run`` also runs each plan, ``mpiexec -n N meshplan run`` (CPU provider), and prints
every rank's peak RSS next to its program's bytes (from the run's trace), then
``meshplan verify --stages`` on the run's outputs and its peak RSS; ``--whole-verify``
adds ``meshplan verify --whole-model`` (the whole model in onnxruntime and every program
in one process: several times the model's bytes) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GIB = 1024**3
CHILD = """
import json, sys, time
from meshplan.process_memory import peak_rss_bytes
from meshplan.cost.cluster import make_cluster, parse_mesh
from meshplan.make_plan import make_plan
from dataclasses import replace
model, mesh, device, out, memory, batch, seq = sys.argv[1:8]
cluster = make_cluster(parse_mesh(mesh), device)
if float(memory) > 0:
    cluster = replace(cluster, device=replace(cluster.device, memory_bytes=float(memory)))
started = time.perf_counter()
plan = make_plan(model, cluster, {"batch": int(batch), "seq": int(seq)}, out)
print(json.dumps({"seconds": time.perf_counter() - started, "stages": [len(s.devices) for s in plan.stages],
                  "peak_rss_bytes": peak_rss_bytes()}))
"""


def _child_rss(command: list[str]) -> tuple[dict | None, str]:
    """Run ``meshplan`` COMMAND in a child process: (its peak RSS record, or None, and its output)."""
    from meshplan.testing.child_memory import peak_of, run_measured

    done = run_measured(command, REPO)
    peak = peak_of(done)
    if peak is None:
        return None, done.stdout + done.stderr
    return {"peak_rss_bytes": peak}, done.stdout


def run_and_verify(plan_dir: Path, work_dir: Path, model_bytes: int, whole: bool) -> dict:
    """``mpiexec -n N meshplan run`` on the plan (each rank's peak RSS and program bytes),
    then ``meshplan verify --stages`` (and ``--whole-model``) on its outputs (peak RSS)."""
    import numpy as np

    plan = json.loads((plan_dir / "plan.json").read_text())
    ranks = len(plan["programs"])
    shape = next(i["shape"] for i in plan["inputs"] if i["name"] == "input_ids")
    inputs = work_dir / "inputs.npz"
    np.savez(inputs, input_ids=np.random.default_rng(0).integers(0, 32000, size=shape, dtype=np.int64))
    trace, outputs = work_dir / "trace.json", work_dir / "outputs.npz"
    mpiexec = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    started = time.perf_counter()
    done = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "cli.main", "run", str(plan_dir),
                           "--inputs", str(inputs), "--output", str(outputs), "--trace", str(trace),
                           "--provider", "cpu"], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"      run failed: {last}")
        return {"error": f"run: {last}"}
    print(f"      meshplan run on {ranks} ranks: {time.perf_counter() - started:.1f} s")
    memory = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "M"]
    print(f"      {'rank':>4} {'program GB':>10} {'peak RSS GiB':>13} {'x program':>9}")
    for rank, row in enumerate(memory):
        print(f"      {rank:>4} {row['program_bytes'] / 1e9:>10.2f} {row['peak_rss_bytes'] / GIB:>13.2f} "
              f"{row['peak_rss_bytes'] / row['program_bytes']:>9.2f}")
    result = {"ranks": memory}
    for flag in ["--stages"] + (["--whole-model"] if whole else []):
        started = time.perf_counter()
        record, text = _child_rss(["verify", str(plan_dir), "--inputs", str(inputs), "--outputs", str(outputs), flag])
        if record is None:
            last = (text.strip().splitlines() or ["(no output)"])[-1]
            print(f"      meshplan verify {flag} failed: {last}")
            result["error"] = f"verify {flag}: {last}"
            continue
        rss = record["peak_rss_bytes"]
        print(f"      meshplan verify {flag}: peak RSS {rss / GIB:.2f} GiB ({rss / model_bytes:.2f} x model), "
              f"{time.perf_counter() - started:.1f} s")
        result[f"verify_{flag.lstrip('-').replace('-', '_')}_peak_rss_bytes"] = rss
    return result


def describe(path: Path) -> dict:
    """The facts ``write_large_llama`` returns, read back from a model it wrote."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    model = onnx.load(str(path), load_external_data=False)
    lengths = [int(ExternalDataInfo(t).length) for t in model.graph.initializer
               if t.data_location == onnx.TensorProto.EXTERNAL]
    layers = sum(1 for t in model.graph.initializer if t.name.endswith(".mlp.down_proj"))
    return {"path": str(path), "data": str(path.with_name(path.name + ".data")), "layers": layers,
            "weight_bytes": sum(lengths), "largest_initializer_bytes": max(lengths)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="weight bytes of the model, GB (default 2)")
    parser.add_argument("--mesh", nargs="+", default=["1x4"])
    parser.add_argument("--device", default="h100-80g")
    parser.add_argument("--memory-fraction", type=float, default=0.0,
                        help="give each device memory for this fraction of the weights (forces splits; default: "
                             "the device preset's memory)")
    parser.add_argument("--batch", type=int, default=4, help="the batch dimension to plan for (default 4)")
    parser.add_argument("--seq", type=int, default=512, help="the sequence length to plan for (default 512)")
    parser.add_argument("--run", action="store_true",
                        help="also run each plan under mpiexec and verify it stage by stage: peak RSS per rank")
    parser.add_argument("--whole-verify", action="store_true",
                        help="with --run: also verify with the whole model at once, for comparison")
    parser.add_argument("--work", type=Path, help="directory for the model and plans (default: a temporary one)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the model and plans in --work (a model kept there is planned again, not rewritten)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true",
                        help="a 35 MB decoder instead of --gb, the targets not held: the script's path in seconds")
    args = parser.parse_args(argv)
    from sample_models.large_llama import write_large_llama

    work_dir = args.work or Path(tempfile.mkdtemp(prefix="meshplan-large-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    rows, failed = [], False
    try:
        started = time.perf_counter()
        if (work_dir / "large.onnx").exists() and args.keep:
            facts = describe(work_dir / "large.onnx")    # written by an earlier --keep run
        else:
            shape = dict(layers=2, hidden=256, heads=4, ffn=688) if args.smoke else {}
            facts = write_large_llama(work_dir / "large.onnx", args.gb, **shape)
        written = time.perf_counter() - started
        size, largest = facts["weight_bytes"], facts["largest_initializer_bytes"]
        started = time.perf_counter()
        shutil.copyfile(facts["data"], work_dir / "copy.data")
        copy_seconds = time.perf_counter() - started
        (work_dir / "copy.data").unlink()
        bound = 1.5 * GIB + 2 * largest
        print(f"model: {facts['layers']} layers, {size / 1e9:.2f} GB of float16 weights (largest initializer "
              f"{largest / 1e6:.0f} MB), written in {written:.0f} s; plain copy of the weights {copy_seconds:.1f} s")
        print(f"targets: peak RSS <= 1.5 GiB + 2 x largest = {bound / GIB:.2f} GiB; wall <= 3 x copy = "
              f"{3 * copy_seconds:.1f} s")
        header = (f"{'mesh':>5} {'plan s':>8} {'x copy':>7} {'wrote GB':>8} {'x copy w':>8} {'peak RSS GiB':>13} "
                  f"{'x model':>8} {'stages':>14}  status")
        print(header)
        print("-" * len(header))
        for mesh in args.mesh:
            out = work_dir / f"plan-{mesh}"
            started = time.perf_counter()
            memory = args.memory_fraction * facts["weight_bytes"]
            done = subprocess.run([sys.executable, "-c", CHILD, facts["path"], mesh, args.device, str(out), str(memory),
                                   str(args.batch), str(args.seq)],
                                  capture_output=True, text=True, cwd=REPO)
            wall = time.perf_counter() - started
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                print(f"{mesh:>5} {wall:>8.1f}  plan failed: {last}")
                rows.append({"mesh": mesh, "error": last, "wall_seconds": wall})
                failed = True
                continue
            child = json.loads(done.stdout.strip().splitlines()[-1])
            rss = child["peak_rss_bytes"]
            written = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
            copy_written = copy_seconds * written / size       # a plain copy of what the plan wrote
            ok = rss <= bound and wall <= 3 * copy_seconds
            failed |= not ok and not args.smoke
            print(f"{mesh:>5} {wall:>8.1f} {wall / copy_seconds:>7.1f} {written / 1e9:>8.2f} "
                  f"{wall / copy_written:>8.1f} {rss / GIB:>13.2f} {rss / size:>8.2f} "
                  f"{'+'.join(map(str, child['stages'])):>14}  {'ok' if ok else 'over target'}")
            rows.append({"mesh": mesh, "wall_seconds": wall, "plan_seconds": child["seconds"], "peak_rss_bytes": rss,
                         "written_bytes": written, "stages": child["stages"], "within_targets": ok})
            if args.run:
                ran = run_and_verify(out, work_dir, size, args.whole_verify)
                rows[-1].update(ran)
                failed |= "error" in ran
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
    status = "FAILED" if failed else "PASSED"
    note = " (--smoke: targets not held)" if args.smoke else ""
    print(f"{status} | {len(rows)} mesh(es), model {size / 1e9:.2f} GB{note} | benchmarks/large_model.py")
    if args.json:
        args.json.write_text(json.dumps({"gb": args.gb, "weight_bytes": size, "largest_initializer_bytes": largest,
                                         "layers": facts["layers"], "copy_seconds": copy_seconds,
                                         "rss_bound_bytes": bound, "rows": rows}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
