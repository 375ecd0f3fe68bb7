"""Time to first token and decode tokens/s of ``meshplan generate`` against
onnxruntime-genai's own generator, on the same model files.

Models (written into ``--workdir``, never committed): a Llama in the builder's format of
``--gigabytes`` in float32 (``sample_models.genai_large``), the same quantized to int4 by
onnxruntime's MatMulNBits quantizer, and, with ``--export PATH``, an optimum or torch
export (for which onnxruntime-genai has no configuration, so only meshplan runs it).

Each model is planned for generation (``meshplan plan --generate``) on 1x1 and on 1x2
(tensor parallel: ``--policy megatron --max-stages 1``), and ``mpiexec -n N meshplan
generate`` runs one prompt for ``--new-tokens`` tokens (each rank gets cores / ranks
threads: one per rank on 1x2 on a 2-core machine). onnxruntime-genai runs the builder's
models in one process with ``--genai-threads`` threads, its key/value buffer at the same
``--max-length`` as the plans'. The numbers are each run's own report (meshplan's
``--output`` metrics; genai timed around ``append_tokens`` and ``generate_next_token``,
its TTFT the second generation's of its process). The runners take turns,
``--repeat`` rounds of one run each, so that a machine whose memory bandwidth drifts
(a shared virtual machine's does, by tens of percent over hours) slows them alike; the
table gives the best and the median of the rounds, and per model each meshplan run's
decode tokens/s and warm TTFT over onnxruntime-genai's (the medians of the rounds'
ratios) and what 1x2's
step adds to 1x1's per collective of its step (the target with both ranks on one GPU: at
most 60 µs).

    python benchmarks/generate.py --gigabytes 0.4 [--export llama_large.onnx] [--json PATH]

On a GPU, on builder folders made for CUDA (onnxruntime-genai-cuda beside onnxruntime-gpu),
with the machine's own MPI launcher:

    python benchmarks/generate.py --provider cuda --device h200 --folders fp16=/m/fp16 int4=/m/int4 \
        --mpiexec "mpiexec --oversubscribe" --max-length 512 --new-tokens 128 --repeat 2

adds runs of meshplan 1x1 without CUDA graphs (``--no-cuda-graph``) and with the token chosen
from logits copied to the host (``MESHPLAN_DEVICE_CHOICE=0``; by default a job of one rank on
CUDA chooses it next to the logits), and reports each
meshplan run's load, warm TTFT, ms per token, CUDA graphs and each rank's peak GPU memory
(``nvidia-smi``, read in one more run of each after the timed rounds: polling it stalls the
GPU's driver calls) next to the plan's estimate; onnxruntime-genai's load, first and warm TTFT
(two generations in one process) and ms per token.

A run that fails is printed as FAILED after the tables, the others going on; the exit
status is then 1. The committed samples take seconds:

    python benchmarks/generate.py --folders fp32=sample_models/genai/llama_fp32 --max-length 32 --prompt-length 4 \
        --new-tokens 2 --repeat 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, **kwargs)
    if done.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stdout}\n{done.stderr}")
    return done


def write_models(workdir: Path, gigabytes: float, context: int) -> dict[str, Path]:
    sys.path.insert(0, str(REPO))
    from sample_models.genai_large import write_builder_llama

    fp32 = workdir / "builder_fp32"
    if not (fp32 / "model.onnx").exists():
        write_builder_llama(fp32, gigabytes, context=context)
    int4 = workdir / "builder_int4"
    if not (int4 / "model.onnx").exists():
        int4.mkdir(parents=True, exist_ok=True)
        _quantize(fp32 / "model.onnx", int4 / "model.onnx")
        shutil.copy(fp32 / "genai_config.json", int4 / "genai_config.json")
    return {"builder fp32": fp32 / "model.onnx", "builder int4": int4 / "model.onnx"}


def _quantize(source: Path, target: Path) -> None:
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)

    model = onnx.load(str(source))
    quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    onnx.save_model(quantizer.model.model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=target.name + ".data", size_threshold=1024)


class Setup:
    """How meshplan runs here: its command, the MPI launcher, the provider and the device the
    plans are costed for."""

    def __init__(self, args):
        found = BIN / "meshplan"
        self.meshplan = [str(found)] if found.exists() else [shutil.which("meshplan") or "meshplan"]
        self.mpiexec = shlex.split(args.mpiexec) if args.mpiexec else [str(BIN / "mpiexec")]
        self.provider, self.device, self.solver = args.provider, args.device, args.solver
        # Open MPI hands a rank only the variables ``-x`` names; MPICH's hydra hands it all
        try:
            version = subprocess.run([self.mpiexec[0], "--version"], capture_output=True, text=True, check=False)
            said = version.stdout + version.stderr
        except OSError:
            said = ""
        openmpi = "Open MPI" in said or "OpenRTE" in said
        self.forward = [f for name in ("MESHPLAN_HUGE_PAGES", "MESHPLAN_DEVICE_CHOICE") for f in ("-x", name)] \
            if openmpi else []


def meshplan_run(setup: Setup, model: Path, mesh: str, plans: Path, prompt: list[int], new_tokens: int,
                 max_length: int, graphs: bool = True, huge_pages: bool = True, memory: bool = False,
                 device_choice: bool = True) -> dict:
    """One ``meshplan generate`` under the launcher; ``memory``: poll each process's GPU memory while
    it runs (``nvidia-smi`` every 100 ms stalls the GPU's driver calls, so timed runs go without).
    ``device_choice``: False chooses the token from logits copied to the host (``MESHPLAN_DEVICE_CHOICE=0``)."""
    plan_dir = plans / f"{model.parent.name}_{model.stem}_{mesh}_{max_length}"
    policy = ["--policy", "megatron", "--max-stages", "1"] if mesh != "1x1" else []
    if not (plan_dir / "plan.json").exists():
        _run([*setup.meshplan, "plan", str(model), "--mesh", mesh, "--device", setup.device, "--generate",
              "--max-length", str(max_length), "--solver", setup.solver, *policy, "-o", str(plan_dir)])
    ranks = int(mesh.split("x")[0]) * int(mesh.split("x")[1])
    ids = plans / "prompt.json"
    ids.write_text(json.dumps([prompt]))
    out = plans / f"out_{mesh}.json"
    memory = GpuMemory() if memory and setup.provider == "cuda" else None
    try:
        _run([*setup.mpiexec, *setup.forward, "-n", str(ranks), *setup.meshplan, "generate", str(plan_dir),
              "--prompt-ids", str(ids), "--max-new-tokens", str(new_tokens), "--eos", "-1", "--output", str(out), "--provider", setup.provider,
              *([] if graphs else ["--no-cuda-graph"])],
             env={**os.environ, "MESHPLAN_HUGE_PAGES": "1" if huge_pages else "0",
                  "MESHPLAN_DEVICE_CHOICE": "1" if device_choice else "0"})
    finally:
        peaks = memory.stop() if memory is not None else []
    body = json.loads(out.read_text())
    metrics = body["metrics"]
    plan = json.loads((plan_dir / "plan.json").read_text())
    return {"ttft_s": metrics["ttft_seconds"], "decode_tokens_per_s": metrics["decode_tokens_per_second"],
            "ms_per_token": metrics["time_per_output_token_seconds"] * 1e3, "load_s": metrics["load_seconds"],
            "estimate_ms": metrics["estimate_step_seconds"] * 1e3, "graphs": metrics.get("cuda_graphs"),
            "gpu_mib_per_rank": peaks,
            "estimate_mib_per_rank": [round(s["memory_bytes"] / 2**20) for s in plan["stages"]
                                      for _ in s["devices"]] if plan.get("stages") else [],
            "ids": body["sequences"][0]["ids"], "token_choice": metrics.get("token_choice"),
            "threads_per_rank": max(1, (os.cpu_count() or 1) // ranks),
            "collectives": sum(len(s.get("collectives") or []) for s in plan.get("stages", []))}


class GpuMemory:
    """Each process's peak GPU memory while a run lasts (``nvidia-smi`` every 100 ms), in MiB,
    highest first."""

    def __init__(self):
        self.peaks: dict[str, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.done.wait(0.1):
            try:
                text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                       "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                      timeout=5).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in text.splitlines():
                pid, _, used = line.partition(",")
                if used.strip().isdigit():
                    self.peaks[pid.strip()] = max(self.peaks.get(pid.strip(), 0), int(used))

    def stop(self) -> list[int]:
        self.done.set()
        self.thread.join()
        return sorted(self.peaks.values(), reverse=True)


GENAI = textwrap.dedent("""
    import json, sys, time
    import onnxruntime_genai as og
    folder, prompt, new, capacity = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    threads = int(sys.argv[5])
    loading = time.perf_counter()
    config = og.Config(folder)
    if threads:   # over the folder's settings, leaving its file as it is
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    load = time.perf_counter() - loading
    found = []
    for _ in range(2):   # the first generation in the process, then a warm one (the one reported)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=capacity, do_sample=False)   # the key/value buffer's capacity
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens([prompt])
        generator.generate_next_token()
        first = time.perf_counter()
        ids = [int(generator.get_next_tokens()[0])]
        while len(ids) < new and not generator.is_done():
            generator.generate_next_token()
            ids.append(int(generator.get_next_tokens()[0]))
        end = time.perf_counter()
        found.append((first - start, (len(ids) - 1) / (end - first), (end - first) * 1e3 / max(1, len(ids) - 1), ids))
        del generator
    print(json.dumps({"load_s": load, "first_ttft_s": found[0][0], "ttft_s": found[1][0],
                      "decode_tokens_per_s": found[1][1], "ms_per_token": found[1][2], "ids": found[1][3]}))
""")


def genai_run(model: Path, prompt: list[int], new_tokens: int, threads: int, max_length: int) -> dict | None:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return None
    # threads 0: a CUDA folder keeps its own settings
    done = _run([sys.executable, "-c", GENAI, str(model.parent), json.dumps(prompt), str(new_tokens), str(max_length),
                 str(threads)])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["threads_per_rank"] = threads
    return result


def summary(runs: list[dict]) -> dict:
    """The best TTFT and decode tokens/s of the runs, and the median decode tokens/s."""
    chosen = dict(min(runs, key=lambda r: r["ttft_s"]))
    rates = [r["decode_tokens_per_s"] for r in runs]
    chosen["decode_tokens_per_s"] = max(rates)
    chosen["median_decode_tokens_per_s"] = statistics.median(rates)
    chosen["ms_per_token"] = 1e3 / statistics.median(rates)
    chosen["rounds"] = rates
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=0.4, help="size of the float32 builder model")
    parser.add_argument("--export", type=Path, help="an optimum or torch export with a key/value cache")
    parser.add_argument("--workdir", type=Path, help="where models and plans go [default: a temporary folder]")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--genai-threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON here")
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu",
                        help="meshplan's provider (onnxruntime-genai runs as its folders say)")
    parser.add_argument("--device", default="cpu", help="the device the plans are costed for (meshplan plan --device)")
    parser.add_argument("--folders", nargs="+", metavar="NAME=DIR",
                        help="builder folders to run instead of writing models (on a GPU: made for CUDA)")
    parser.add_argument("--mpiexec", help="the MPI launcher and its options [default: the environment's mpiexec]")
    parser.add_argument("--solver", default="cbc", choices=("cbc", "highs"), help="meshplan plan --solver")
    parser.add_argument("--huge-pages", default="on", choices=("on", "off", "both"),
                        help="meshplan's ranks with malloc's memory in transparent huge pages (the `meshplan` "
                             "command's default), with 4 KiB pages (MESHPLAN_HUGE_PAGES=0), or both in turns")
    args = parser.parse_args()
    if args.provider == "cuda":
        sys.path.insert(0, str(REPO))
        from meshplan.providers import cuda_usable

        if not cuda_usable():
            raise SystemExit("--provider cuda: the CUDA execution provider is not usable here "
                             "(no GPU or CUDA libraries)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="meshplan-generate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.folders:
        bad = [f for f in args.folders if "=" not in f or not (Path(f.partition("=")[2]) / "model.onnx").is_file()]
        if bad:
            raise SystemExit(f"--folders takes NAME=DIR, DIR holding a model.onnx: {bad[0]!r}")
        models = {f"builder {n}": Path(d).resolve() / "model.onnx" for n, _, d in (f.partition("=") for f in args.folders)}
    else:
        models = write_models(workdir, args.gigabytes, args.max_length)
    if args.export:
        models["export"] = args.export.resolve()
    setup = Setup(args)
    prompt = [(7 * i + 5) % 250 + 2 for i in range(args.prompt_length)]
    genai = f"onnxruntime-genai, {args.genai_threads} threads" if args.provider == "cpu" else "onnxruntime-genai"
    rows, ratios, ttft_ratios, failures, per_collective = [], {}, {}, [], {}
    if importlib.util.find_spec("onnxruntime_genai") is None:
        print("onnxruntime-genai is not installed: its runs are left out")
    for label, model in models.items():
        size = sum(f.stat().st_size for f in model.parent.iterdir() if f.name.startswith(model.stem))
        runners = {}
        for pages in (("on", "off") if args.huge_pages == "both" else (args.huge_pages,)):
            for mesh in ("1x1", "1x2"):
                name = f"meshplan generate {mesh}" + (", 4 KiB pages" if pages == "off" and args.huge_pages == "both" else "")
                runners[name] = (lambda mesh=mesh, pages=pages, memory=False: meshplan_run(
                    setup, model, mesh, workdir, prompt, args.new_tokens, args.max_length, huge_pages=pages == "on",
                    memory=memory))
        if args.provider == "cuda":
            runners["meshplan generate 1x1, no CUDA graph"] = lambda memory=False: meshplan_run(
                setup, model, "1x1", workdir, prompt, args.new_tokens, args.max_length, graphs=False, memory=memory)
            runners["meshplan generate 1x1, token chosen on the host"] = lambda memory=False: meshplan_run(
                setup, model, "1x1", workdir, prompt, args.new_tokens, args.max_length, memory=memory,
                device_choice=False)
        if label != "export" and importlib.util.find_spec("onnxruntime_genai") is not None:
            threads = args.genai_threads if args.provider == "cpu" else 0
            runners[genai] = lambda: genai_run(model, prompt, args.new_tokens, threads, args.max_length)
        runs: dict[str, list[dict]] = {name: [] for name in runners}
        for round_ in range(args.repeat):   # taking turns, each round in another order
            names = list(runners)
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                try:
                    runs[name].append(runners[name]())
                except SystemExit as exc:   # one runner's failure is a result too: the others go on
                    failures.append(f"{label}, {name}: {str(exc)[-1500:]}")
        peaks = {}
        if args.provider == "cuda":   # each process's GPU memory, read in one more run, untimed
            for name in runs:
                if name.startswith("meshplan") and runs[name]:
                    try:
                        peaks[name] = runners[name](memory=True)["gpu_mib_per_rank"]
                    except SystemExit as exc:
                        failures.append(f"{label}, {name} (GPU memory): {str(exc)[-1500:]}")
        for name, found in runs.items():
            if found:
                rows.append({"model": label, "bytes": size, "runner": name, **summary(found),
                             **({"gpu_mib_per_rank": peaks[name]} if name in peaks else {})})
        one, two = runs["meshplan generate 1x1"], runs["meshplan generate 1x2"]
        if one and two and len(one) == len(two) and two[0]["collectives"]:
            # what 1x2 adds to the 1x1 step, per collective of its step (the rounds' median)
            per_collective[label] = (statistics.median(b["ms_per_token"] - a["ms_per_token"] for a, b in zip(one, two))
                                     * 1e3 / two[0]["collectives"], two[0]["collectives"])
        for name in runs:
            if name.startswith("meshplan") and runs.get(genai) and len(runs[name]) == len(runs[genai]):
                ratios[(label, name)] = statistics.median(a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                                                          for a, b in zip(runs[name], runs[genai]))
                ttft_ratios[(label, name)] = statistics.median(a["ttft_s"] / b["ttft_s"]
                                                               for a, b in zip(runs[name], runs[genai]))
    for row in rows:
        same = [r for r in rows if r["model"] == row["model"]]
        row["same_ids_as_first"] = row["ids"] == same[0]["ids"]
    if args.json:
        body = {"rows": [{k: v for k, v in r.items() if k != "ids"} for r in rows],
                "ratio_1x2_to_genai": {label: r for (label, name), r in ratios.items() if name == "meshplan generate 1x2"},
                "ratio_to_genai": {f"{label}, {name}": r for (label, name), r in ratios.items()},
                "warm_ttft_ratio_to_genai": {f"{label}, {name}": r for (label, name), r in ttft_ratios.items()},
                "max_length": args.max_length, "new_tokens": args.new_tokens,
                "us_per_collective_1x2_over_1x1": {k: v[0] for k, v in per_collective.items()}}
        args.json.write_text(json.dumps(body, indent=1) + "\n")
    print(f"key/value capacity {args.max_length}, prompt {args.prompt_length}, {args.new_tokens} new tokens, "
          f"{args.repeat} rounds")
    print(f"{'model':14} {'size':>9} {'runner':34} {'threads/rank':>12} {'TTFT':>9} {'decode tok/s':>13} "
          f"{'median':>7}  same ids")
    for r in rows:
        print(f"{r['model']:14} {r['bytes'] / 1e6:7.0f}MB {r['runner']:34} {r['threads_per_rank']:>12} "
              f"{r['ttft_s'] * 1e3:7.3f}ms {r['decode_tokens_per_s']:13.1f} {r['median_decode_tokens_per_s']:7.1f}  "
              f"{r['same_ids_as_first']}")
    for (label, name), ratio in ratios.items():
        print(f"{label}: decode tokens/s of {name} / onnxruntime-genai's = {ratio:.2f} (median of the rounds)")
    for (label, name), ratio in ttft_ratios.items():
        print(f"{label}: warm TTFT of {name} / onnxruntime-genai's = {ratio:.2f} (median of the rounds)")
    for label, (micros, count) in per_collective.items():
        print(f"{label}: 1x2's step over 1x1's = {micros:.0f} us per collective ({count} a step; median of the rounds)")
    print(f"\n{'model':14} {'runner':38} {'load':>7} {'first TTFT':>10} {'ms/token':>9} {'estimate':>9}  GPU MiB per rank "
          "(estimate) / CUDA graphs")
    for line in failures:
        print(f"FAILED {line}")
    for r in rows:
        first = r.get("first_ttft_s", r["ttft_s"])
        print(f"{r['model']:14} {r['runner']:38} {r.get('load_s', 0):6.2f}s {first * 1e3:8.1f}ms "
              f"{r.get('ms_per_token', 1e3 / r['decode_tokens_per_s']):9.3f} "
              f"{r['estimate_ms'] if 'estimate_ms' in r else float('nan'):9.3f}  "
              f"{r.get('gpu_mib_per_rank', '')} ({r.get('estimate_mib_per_rank', '')}) / {r.get('graphs')}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
