"""Training a small GPT on this machine's cores: meshplan against torch eager and torch DDP.

Usage (from the repository root, in meshplan's environment)::

    python benchmarks/train.py --torch-python /path/to/venv/bin/python [--repeat 3] [--steps 8] [--warmup 2]
        [--only eager|ddp|1x1|1x2-data|1x2-auto ...] [--workdir DIR] [--no-profile] [--json PATH]
    python benchmarks/train.py --smoke [--torch-python PY]      # tiny GPT, 3 steps
    python benchmarks/train.py --provider cuda --device h200 --torch-python python3 --mpiexec "mpiexec ..."
        [--layers 12 --hidden 1024 --heads 16 --vocab 32768 --seq 512]   # on one GPU

The model: a GPT written in torch (``GPT`` below: learned positions, pre-norm blocks of
LayerNorm, softmax attention with a causal mask, a GELU MLP, an untied head), by default 7
layers, hidden 512, 8 heads, vocabulary 8192, sequence 128 (30.5 M parameters), trained on
random tokens (targets: the next token) with AdamW (lr 3e-4, weight decay 0.01), batch 8.

torch is not one of meshplan's dependencies: everything that imports torch runs in a
subprocess of ``--torch-python`` (this file again, ``--worker``). There it exports the GPT
with the dynamo exporter (``torch.onnx.export(..., dynamo=True)``, the batch dim symbolic)
and saves its initial weights, so that every row starts from the same ones and step 1's
loss is the same number everywhere (printed as a check). Without a torch to run, the torch
rows are skipped and the same architecture is written with ``onnx.helper`` instead.

Rows (each run: ``--warmup`` steps, then ``--steps`` timed; samples/s from the median step;
``--repeat`` rounds run every row once in turns, and a row's figure is the median of its
rounds' medians, its ratio to torch the median of the rounds' ratios):

- torch eager: one process, ``torch.set_num_threads(2)``, torch's default AdamW;
- torch DDP: 2 processes (gloo), one thread each, each pinned to its own core, 4 samples each;
- meshplan 1x1: ``meshplan plan MODEL --train ... --mesh 1x1`` and ``mpiexec -n 1 meshplan
  train`` (one rank, the machine's cores as its threads); the step time from the log's
  ``step_seconds``, each rank's peak RSS and the plan's memory estimate from the command's
  report, the plan's step estimate from ``plan.json`` (``estimate.latency_seconds``);
- meshplan 1x2 data (``--policy data``) and 1x2 auto: ``mpiexec -n 2``, one thread a rank;
- with a profile (unless ``--no-profile``; timings cached in the work directory only, so
  every run measures afresh): ``mpiexec -n N meshplan profile MODEL --train --loss ...
  --optimizer adamw`` (the training step's operators, as ``plan --train`` builds it), then
  ``plan --train --profile``. A profiled plan with the same programs as its unprofiled twin
  is not run again (its measured steps are the twin's). ``--smoke`` profiles only with
  ``--profile``.

On one GPU (``--provider cuda``): torch eager runs on CUDA with TF32 off (as meshplan's CUDA
sessions), the DDP row is left out (NCCL wants a GPU a rank), the 1x2 rows put both ranks on
the one GPU (their gradients cross through host memory), each row's peak GPU memory per
process is read from ``nvidia-smi`` every 500 ms, and the table adds TFLOP/s (6 × parameters
× tokens a step, over the median step) and its share of ``--peak-tflops`` (the GPU's float32
peak without tensor cores: 67 for an H100 or H200 SXM).

Ratios: samples/s over the torch counterpart (1x1 over eager, 1x2 over DDP); peak RSS per
rank over the plan's memory estimate; the plan's step estimate over the measured step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MiB = 2 ** 20

FULL = {"layers": 7, "hidden": 512, "heads": 8, "vocab": 8192, "seq": 128, "batch": 8}
SMOKE = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 512, "seq": 16, "batch": 8}
HYPER = {"lr": 3e-4, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
LOSS = "cross_entropy:logits:targets"
ROWS = ("eager", "ddp", "1x1", "1x2-data", "1x2-auto")


def parameter_count(c: dict) -> int:
    d, v, t = c["hidden"], c["vocab"], c["seq"]
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return v * d + t * d + c["layers"] * block + 2 * d + d * v


# --- torch side (runs under --torch-python only) -------------------------------------------------

def _torch_model(c: dict):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = c["hidden"]
            self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.fc, self.act, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
            self.register_buffer("mask", torch.triu(torch.ones(c["seq"], c["seq"], dtype=torch.bool), 1),
                                 persistent=False)

        def forward(self, x):
            b, t, d = x.shape
            h = c["heads"]
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (y.reshape(b, t, h, d // h).transpose(1, 2) for y in (q, k, v))
            a = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
            a = a.masked_fill(self.mask, float("-inf")).softmax(-1)
            x = x + self.proj((a @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(self.act(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = c["hidden"]
            self.tok = nn.Embedding(c["vocab"], d)
            self.pos = nn.Parameter(torch.zeros(c["seq"], d))
            self.blocks = nn.ModuleList(Block() for _ in range(c["layers"]))
            self.lnf, self.head = nn.LayerNorm(d), nn.Linear(d, c["vocab"], bias=False)

        def forward(self, input_ids):
            x = self.tok(input_ids) + self.pos
            for block in self.blocks:
                x = block(x)
            return self.head(self.lnf(x))

    torch.manual_seed(0)
    model = GPT()
    with torch.no_grad():
        # every tensor distinct (the exporter's optimizer merges equal initializers: LayerNorms
        # all at 1 and 0 would become one shared weight)
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "lnf.weight")):
                p.normal_(1.0, 0.02)
            else:
                p.normal_(0.0, 0.02)
    return model


def _rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load_data(path):
    import torch
    data = np.load(path)
    return torch.from_numpy(data["input_ids"]), torch.from_numpy(data["targets"])


def _torch_loop(model, optimizer, ids, targets, first, count, step_batch, run_step):
    import torch
    n = ids.shape[0]
    device = ids.device
    losses, seconds = [], []
    for k in range(count):
        rows = (torch.arange(step_batch, device=device) + (first + k) * step_batch) % n
        x, y = ids[rows], targets[rows]
        started = time.perf_counter()
        loss = run_step(x, y)
        seconds.append(time.perf_counter() - started)
        losses.append(loss)
    return losses, seconds


def worker_export(c: dict, work: Path) -> dict:
    import torch
    import onnx
    model = _torch_model(c).eval()
    torch.save(model.state_dict(), work / "init.pt")
    example = torch.zeros(2, c["seq"], dtype=torch.int64)
    batch = torch.export.Dim("batch", min=1, max=1024)
    path = work / "gpt.onnx"
    started = time.perf_counter()
    torch.onnx.export(model, (example,), str(path), dynamo=True, input_names=["input_ids"], output_names=["logits"],
                      dynamic_shapes={"input_ids": {0: batch}}, external_data=True, verbose=False)
    exported = onnx.load(str(path), load_external_data=False)
    dims = [d.dim_param or d.dim_value for d in exported.graph.input[0].type.tensor_type.shape.dim]
    return {"path": str(path), "seconds": time.perf_counter() - started, "input_dims": dims,
            "opset": next(o.version for o in exported.opset_import if o.domain in ("", "ai.onnx")),
            "parameters": sum(p.numel() for p in model.parameters()), "torch": torch.__version__}


def _step_fn(model, optimizer):
    import torch
    import torch.nn.functional as F

    def run(x, y):
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        return float(loss.detach())
    return run


def _optimizer(model):
    import torch
    return torch.optim.AdamW(model.parameters(), lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                             betas=HYPER["betas"], eps=HYPER["eps"])


def worker_eager(c: dict, work: Path, warmup: int, steps: int, threads: int, device: str = "cpu") -> dict:
    import torch
    torch.set_num_threads(threads)
    if device == "cuda":    # float32 as float32: no TF32 (meshplan's CUDA sessions turn it off too)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = _torch_model(c)
    model.load_state_dict(torch.load(work / "init.pt"))
    model.to(device).train()
    optimizer = _optimizer(model)
    ids, targets = (t.to(device) for t in _load_data(work / "data.npz"))
    losses, seconds = _torch_loop(model, optimizer, ids, targets, 0, warmup + steps, c["batch"],
                                  _step_fn(model, optimizer))
    out = {"losses": losses, "step_seconds": seconds, "peak_rss_mib": [_rss_mib()], "threads": threads}
    if device == "cuda":
        out["torch_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / MiB
    return out


def _ddp_rank(rank: int, world: int, c: dict, work: str, warmup: int, steps: int, port: int, result: str):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world:
        os.sched_setaffinity(0, {cores[rank]})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = _torch_model(c)
    model.load_state_dict(torch.load(Path(work) / "init.pt"))
    model.train()
    ddp = DistributedDataParallel(model)
    optimizer = _optimizer(ddp)
    ids, targets = _load_data(Path(work) / "data.npz")
    share = c["batch"] // world
    # each rank: its share of the global batch of the same step as eager's
    run = _step_fn(ddp, optimizer)
    n = ids.shape[0]
    losses, seconds = [], []
    for k in range(warmup + steps):
        rows = (torch.arange(share) + k * c["batch"] + rank * share) % n
        dist.barrier()
        started = time.perf_counter()
        local = run(ids[rows], targets[rows])
        seconds.append(time.perf_counter() - started)
        total = torch.tensor([local])
        dist.all_reduce(total)
        losses.append(float(total) / world)
    rss = [None] * world
    dist.all_gather_object(rss, _rss_mib())
    if rank == 0:
        Path(result).write_text(json.dumps({"losses": losses, "step_seconds": seconds, "peak_rss_mib": rss,
                                            "threads": 1, "processes": world}))
    dist.destroy_process_group()


def worker_ddp(c: dict, work: Path, warmup: int, steps: int, world: int = 2) -> dict:
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = work / "ddp.json"
    mp.spawn(_ddp_rank, args=(world, c, str(work), warmup, steps, port, str(result)), nprocs=world, join=True)
    return json.loads(result.read_text())


def worker_main(args) -> None:
    c, work = json.loads(args.config), Path(args.workdir)
    if args.worker == "export":
        out = worker_export(c, work)
    elif args.worker == "eager":
        out = worker_eager(c, work, args.warmup, args.steps, args.threads, args.provider)
    else:
        out = worker_ddp(c, work, args.warmup, args.steps)
    print("RESULT " + json.dumps(out), flush=True)


# --- the same GPT in onnx.helper (when no torch is at hand) --------------------------------------

def build_onnx_gpt(c: dict, path: Path) -> dict:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    d, h, t, v = c["hidden"], c["heads"], c["seq"], c["vocab"]
    inits, nodes = [], []

    def weight(name, shape, mean=0.0):
        inits.append(numpy_helper.from_array((mean + 0.02 * rng.standard_normal(shape)).astype(np.float32), name))
        return name

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(kind, inputs, out, **attrs):
        nodes.append(helper.make_node(kind, inputs, [out], name=out, **attrs))
        return out

    const("shape4", np.array([-1, t, h, d // h], dtype=np.int64))
    const("shape3", np.array([-1, t, d], dtype=np.int64))
    const("scale", np.float32(1.0 / math.sqrt(d // h)))
    const("neg_inf", np.float32(-np.inf))
    const("mask", np.triu(np.ones((t, t), dtype=bool), 1))
    const("split3", np.array([d, d, d], dtype=np.int64))
    x = op("Add", [op("Gather", [weight("tok.weight", (v, d)), "input_ids"], "tok"), weight("pos", (t, d))], "x0")
    for i in range(c["layers"]):
        p = f"blocks.{i}."
        n1 = op("LayerNormalization", [x, weight(p + "ln1.weight", (d,), 1.0), weight(p + "ln1.bias", (d,))],
                p + "n1", axis=-1, epsilon=1e-5)
        qkv = op("Add", [op("MatMul", [n1, weight(p + "qkv.w", (d, 3 * d))], p + "qkv_mm"),
                         weight(p + "qkv.bias", (3 * d,))], p + "qkv")
        nodes.append(helper.make_node("Split", [qkv, "split3"], [p + "q", p + "k", p + "v"], name=p + "split", axis=-1))
        q = op("Transpose", [op("Reshape", [p + "q", "shape4"], p + "q4")], p + "qt", perm=[0, 2, 1, 3])
        k = op("Transpose", [op("Reshape", [p + "k", "shape4"], p + "k4")], p + "kt", perm=[0, 2, 3, 1])
        vv = op("Transpose", [op("Reshape", [p + "v", "shape4"], p + "v4")], p + "vt", perm=[0, 2, 1, 3])
        a = op("Mul", [op("MatMul", [q, k], p + "qk"), "scale"], p + "scores")
        a = op("Softmax", [op("Where", ["mask", "neg_inf", a], p + "masked")], p + "probs", axis=-1)
        y = op("Reshape", [op("Transpose", [op("MatMul", [a, vv], p + "av")], p + "avt", perm=[0, 2, 1, 3]),
                           "shape3"], p + "att")
        y = op("Add", [op("MatMul", [y, weight(p + "proj.w", (d, d))], p + "proj_mm"),
                       weight(p + "proj.bias", (d,))], p + "proj")
        x = op("Add", [x, y], p + "x1")
        n2 = op("LayerNormalization", [x, weight(p + "ln2.weight", (d,), 1.0), weight(p + "ln2.bias", (d,))],
                p + "n2", axis=-1, epsilon=1e-5)
        f = op("Add", [op("MatMul", [n2, weight(p + "fc.w", (d, 4 * d))], p + "fc_mm"),
                       weight(p + "fc.bias", (4 * d,))], p + "fc")
        f = op("Gelu", [f], p + "gelu")
        f = op("Add", [op("MatMul", [f, weight(p + "out.w", (4 * d, d))], p + "out_mm"),
                       weight(p + "out.bias", (d,))], p + "out")
        x = op("Add", [x, f], p + "x2")
    n = op("LayerNormalization", [x, weight("lnf.weight", (d,), 1.0), weight("lnf.bias", (d,))], "nf", axis=-1,
           epsilon=1e-5)
    op("MatMul", [n, weight("head.w", (d, v))], "logits")
    graph = helper.make_graph(nodes, "gpt",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", t])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", t, v])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    large = sum(i.ByteSize() for i in inits) > (1 << 30)
    onnx.save(model, str(path), save_as_external_data=large, location=path.name + ".data")
    return {"path": str(path), "parameters": sum(int(np.prod(i.dims)) for i in inits if i.data_type == 1
                                                 and int(np.prod(i.dims)) > 1), "opset": 20}


# --- the driver (meshplan's environment) ----------------------------------------------------------

def _run(command, what, env=None, timeout=None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run([str(a) for a in command], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": path, **(env or {})})
    if done.returncode:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-5:]
        raise RuntimeError(f"{what} failed (exit {done.returncode}): " + " | ".join(tail))
    return done


def _torch_worker(py, mode, c, work, warmup=0, steps=0, threads=2, provider="cpu") -> dict:
    with GpuMemory(provider == "cuda") as memory:
        done = _run([py, Path(__file__).resolve(), "--worker", mode, "--config", json.dumps(c), "--workdir", work,
                     "--warmup", warmup, "--steps", steps, "--threads", threads, "--provider", provider],
                    f"torch {mode}", env={"PYTHONPATH": ""})
    line = next(l for l in reversed(done.stdout.splitlines()) if l.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    if memory.enabled:
        out["peak_gpu_mib"] = memory.peaks()
    return out


class GpuMemory:
    """Each process's peak GPU memory while the ``with`` block runs, from ``nvidia-smi
    --query-compute-apps`` every 500 ms (only where ``enabled``; a poll stalls the driver's
    calls a moment, so not more often)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.samples: list[str] = []

    def __enter__(self):
        if self.enabled:
            self.file = tempfile.TemporaryFile(mode="w+")
            self.poller = subprocess.Popen(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                            "--format=csv,noheader,nounits", "-lms", "500"],
                                           stdout=self.file, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.poller.terminate()
            self.poller.wait()
            self.file.seek(0)
            self.samples = self.file.read().splitlines()
            self.file.close()
        return False

    def peaks(self) -> list[float]:
        """MiB, one per process seen, largest first."""
        best: dict[str, float] = {}
        for line in self.samples:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[1].replace(".", "", 1).isdigit():
                best[parts[0]] = max(best.get(parts[0], 0.0), float(parts[1]))
        return sorted(best.values(), reverse=True)


def torch_usable(py: str | None) -> str | None:
    """None where ``py`` runs torch with its dynamo exporter, else why not."""
    if not py:
        return "no --torch-python given"
    try:
        done = subprocess.run([py, "-c", "import torch, onnx, onnxscript; print(torch.__version__)"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    except OSError as exc:
        return f"{py}: {exc.strerror}"
    if done.returncode:
        return f"{py} cannot import torch, onnx and onnxscript ({(done.stderr.strip().splitlines() or ['?'])[-1]})"
    return None


MESHPLAN = [sys.executable, "-m", "cli.main"]


MPIEXEC: list[str] = []   # --mpiexec's words, where given


def _mpiexec() -> list[str]:
    return MPIEXEC or [shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
                       or "mpiexec"]


SOLVER: list[str] = []    # --solver NAME, where given


def plan(model: Path, out: Path, mesh: str, c: dict, policy: str = "auto", profile: Path | None = None,
         device: str = "cpu") -> dict:
    command = [*MESHPLAN, "plan", model, "--train", "--loss", LOSS, "--optimizer", "adamw", "--mesh", mesh,
               "--device", device, "--dim", f"batch={c['batch']}", "--policy", policy, *SOLVER, "-o", out]
    if profile is not None:
        command += ["--profile", profile]
    started = time.perf_counter()
    done = _run(command, f"meshplan plan {mesh} {policy}")
    document = json.loads((out / "plan.json").read_text())
    found = re.search(r"costs: (\d+) operator\(s\) measured, (\d+) from the analytic", done.stdout)
    return {"estimate_seconds": document["estimate"]["latency_seconds"],
            "memory_bytes": [s["memory_bytes"] for s in document["stages"]],
            "plan_seconds": time.perf_counter() - started,
            "report": [l for l in done.stdout.splitlines() if l.startswith(("plan:", "estimate:", "costs:"))]
                      + [l for l in done.stdout.splitlines() if re.match(r"\s+\d+\s", l)],
            "measured_ops": int(found.group(1)) if found else None,
            "analytic_ops": int(found.group(2)) if found else None}


def train(plan_dir: Path, ranks: int, data: Path, warmup: int, steps: int, work: Path, provider: str = "cpu") -> dict:
    log = work / f"{plan_dir.name}.log.json"
    with GpuMemory(provider == "cuda") as memory:
        done = _run([*_mpiexec(), "-n", ranks, *MESHPLAN, "train", plan_dir, "--data", data, "--steps",
                     warmup + steps, "--lr", HYPER["lr"], "--weight-decay", HYPER["weight_decay"],
                     "--betas", ",".join(map(str, HYPER["betas"])), "--eps", HYPER["eps"], "--provider", provider,
                     "--log", log, "-q"], f"meshplan train {plan_dir.name}")
    record = json.loads(log.read_text())
    rss, estimates = [], []
    for match in re.finditer(r"rank (\d+): peak RSS ([\d.]+) MiB(?: \(host memory\))?(?:, the plan's estimate ([\d.]+) MiB)?", done.stdout):
        rss.append(float(match.group(2)))
        estimates.append(float(match.group(3)) if match.group(3) else None)
    out = {"losses": record["losses"], "step_seconds": record["step_seconds"], "peak_rss_mib": rss,
           "memory_estimate_mib": estimates, "estimate_seconds": record["estimate_seconds"],
           "report": [l for l in done.stdout.splitlines() if l.startswith(("trained", "loss", "rank"))]}
    if memory.enabled:
        out["peak_gpu_mib"] = memory.peaks()
    return out


def _median_step(row: dict, warmup: int) -> float:
    return statistics.median(row["step_seconds"][warmup:] or row["step_seconds"])


def _same_programs(a: Path, b: Path) -> bool:
    files = sorted(p.name for p in a.glob("rank*.onnx"))
    return files == sorted(p.name for p in b.glob("rank*.onnx")) and \
        all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-python", help="a Python with torch (and onnx, onnxscript) for the torch rows and the "
                                               "export [default: none: torch rows skipped]")
    parser.add_argument("--smoke", action="store_true", help="tiny GPT (2 layers, hidden 64, sequence 16), 3 steps")
    parser.add_argument("--steps", type=int, help="timed steps a run [default: 8; 3 with --smoke]")
    parser.add_argument("--warmup", type=int, help="untimed steps first [default: 2; 1 with --smoke]")
    parser.add_argument("--repeat", type=int, default=1, help="rounds, every row once a round in turns [default: 1]")
    parser.add_argument("--only", action="append", choices=ROWS,
                        help="run only these rows (repeatable) [default: all]")
    for dim in ("layers", "hidden", "heads", "vocab", "seq", "batch"):
        parser.add_argument(f"--{dim}", type=int, help=f"override the GPT's {dim}")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu",
                        help="where torch eager and meshplan's programs run [default: cpu]")
    parser.add_argument("--device", help="the plans' device preset [default: cpu; h200 with --provider cuda]")
    parser.add_argument("--mpiexec", help="the launcher and its options, one string [default: mpiexec on PATH]")
    parser.add_argument("--solver", help="the plans' ILP solver (meshplan plan --solver) [default: meshplan's]")
    parser.add_argument("--peak-tflops", type=float, default=67.0,
                        help="the GPU's float32 peak without tensor cores, for the MFU column [default: 67]")
    parser.add_argument("--workdir", type=Path, help="where the model, data and plans go [default: a temporary "
                                                     "directory, removed at the end]")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled plans")
    parser.add_argument("--profile", action="store_true", help="with --smoke: profile too")
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    parser.add_argument("--worker", choices=["export", "eager", "ddp"], help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return 0

    c = dict(SMOKE if args.smoke else FULL)
    for dim in ("layers", "hidden", "heads", "vocab", "seq", "batch"):
        if getattr(args, dim):
            c[dim] = getattr(args, dim)
    if args.mpiexec:
        MPIEXEC[:] = args.mpiexec.split()
    if args.solver:
        SOLVER[:] = ["--solver", args.solver]
    cuda = args.provider == "cuda"
    device = args.device or ("h200" if cuda else "cpu")
    steps = args.steps or (3 if args.smoke else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    profiling = not args.no_profile and (args.profile or not args.smoke)
    only = set(args.only or ROWS)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="meshplan-train-bench-"))
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    why_not = torch_usable(args.torch_python)
    import onnxruntime
    results = {"config": c, "steps": steps, "warmup": warmup, "repeat": args.repeat, "hyper": HYPER,
               "cores": os.cpu_count(), "onnxruntime": onnxruntime.__version__, "rows": {}, "notes": [],
               "provider": args.provider, "device": device, "peak_tflops": args.peak_tflops if cuda else None}
    say(f"GPT: {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, vocabulary {c['vocab']}, sequence "
        f"{c['seq']}, batch {c['batch']}; AdamW lr {HYPER['lr']} weight decay {HYPER['weight_decay']}; "
        f"{args.repeat} round(s) of {warmup} warm-up + {steps} timed steps; {os.cpu_count()} cores; "
        f"onnxruntime {onnxruntime.__version__}; provider {args.provider}, plans for --device {device}")
    rows = results["rows"]
    counterpart = {}
    try:
        model = work / "gpt.onnx"
        if why_not is None:
            exported = _torch_worker(args.torch_python, "export", c, work)
            results["torch"] = exported["torch"]
            say(f"exported with torch {exported['torch']}'s dynamo exporter in {exported['seconds']:.1f} s: opset "
                f"{exported['opset']}, input dims {exported['input_dims']}, {exported['parameters'] / 1e6:.2f} M "
                "parameters")
        else:
            say(f"torch rows skipped: {why_not}; the GPT is written with onnx.helper instead")
            exported = build_onnx_gpt(c, model)
            results["notes"].append(f"torch rows skipped: {why_not}")
        results["parameters"] = exported["parameters"]
        rng = np.random.default_rng(1)
        tokens = rng.integers(0, c["vocab"], size=(8 * c["batch"], c["seq"] + 1), dtype=np.int64)
        data = work / "data.npz"
        np.savez(data, input_ids=tokens[:, :-1], targets=tokens[:, 1:])

        eager = "torch eager CUDA" if cuda else "torch eager 1x2 threads"
        ddp = "torch DDP 2x1 (gloo)"
        runs = {}          # row name: how to run it once
        if why_not is None and "eager" in only:
            rows[eager] = {}
            runs[eager] = lambda: _torch_worker(args.torch_python, "eager", c, work, warmup, steps, threads=2,
                                                provider=args.provider)
        if cuda and "ddp" in only:
            results["notes"].append("torch DDP left out on one GPU (NCCL wants a GPU a rank); the 1x2 rows are "
                                    "compared with nothing")
        if why_not is None and "ddp" in only and not cuda:
            rows[ddp] = {}
            runs[ddp] = lambda: _torch_worker(args.torch_python, "ddp", c, work, warmup, steps)
        meshplan_rows = [(name, mesh, ranks, policy, torch_row, None)
                         for key, name, mesh, ranks, policy, torch_row in (
                             ("1x1", "meshplan 1x1", "1x1", 1, "auto", eager),
                             ("1x2-data", "meshplan 1x2 data", "1x2", 2, "data", ddp),
                             ("1x2-auto", "meshplan 1x2 auto", "1x2", 2, "auto", ddp)) if key in only]
        if profiling:
            profiles = {}
            for mesh, ranks in sorted({(r[1], r[2]) for r in meshplan_rows}):
                out = work / f"profile{mesh}.json"
                started = time.perf_counter()
                _run([*_mpiexec(), "-n", ranks, *MESHPLAN, "profile", model, "--train", "--loss", LOSS, "--optimizer",
                      "adamw", "--mesh", mesh, "--device", device, "--dim", f"batch={c['batch']}", "--provider", args.provider,
                      "--cache", work / "profile-cache.sqlite", "-o", out], f"meshplan profile {mesh}")
                say(f"meshplan profile --train {mesh} (the training step): {time.perf_counter() - started:.0f} s")
                profiles[mesh] = out
            meshplan_rows += [(name + " profiled", mesh, ranks, policy, torch_row, profiles[mesh])
                              for name, mesh, ranks, policy, torch_row, _ in list(meshplan_rows)]
        plan_dirs = {}
        for name, mesh, ranks, policy, torch_row, profile in meshplan_rows:
            counterpart[name] = torch_row
            plan_dir = plan_dirs[name] = work / ("plan-" + name.split(" ", 1)[1].replace(" ", "-"))
            try:
                rows[name] = {"plan": plan(model, plan_dir, mesh, c, policy, profile, device)}
            except RuntimeError as exc:
                rows[name] = {"error": str(exc)}
                say(f"{name}: {exc}")
                continue
            say(f"{name}: planned in {rows[name]['plan']['plan_seconds']:.0f} s, estimate "
                f"{rows[name]['plan']['estimate_seconds'] * 1e3:.0f} ms a step")
            twin = next((other for other in plan_dirs if other != name and "error" not in rows[other]
                         and "same_programs_as" not in rows[other] and _same_programs(plan_dirs[other], plan_dir)),
                        None)
            if twin is not None:      # a profiled plan that chose the same programs: its runs are the twin's
                rows[name]["same_programs_as"] = twin
                say(f"{name}: the same programs as {twin}'s (its measured steps are those)")
            else:
                runs[name] = (lambda d=plan_dir, r=ranks: train(d, r, data, warmup, steps, work, args.provider))
        for round_ in range(args.repeat):
            for name, run in runs.items():
                load = os.getloadavg()[0]
                try:
                    done = run()
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    rows.setdefault(name, {})["error"] = str(exc)
                    say(f"{name}: {exc}")
                    continue
                row = rows.setdefault(name, {})
                done["load_before"] = load
                row.setdefault("rounds", []).append(done)
                say(f"round {round_ + 1} {name} (load {load:.1f}): {_median_step(done, warmup) * 1e3:.0f} ms a step, "
                    f"peak RSS {' / '.join(f'{r:.0f}' for r in done['peak_rss_mib'])} MiB, losses "
                    f"{done['losses'][0]:.5f} -> {done['losses'][-1]:.5f}")
        summarize(rows, counterpart, c["batch"], warmup, eager)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if all("error" not in r for r in results["rows"].values()) else 1


def say(text: str) -> None:
    print(text, flush=True)


def summarize(rows: dict, counterpart: dict, batch: int, warmup: int, eager: str = "") -> None:
    """Per row: the median over rounds of each round's median step; the ratio to the torch
    row as the median of the rounds' ratios (rounds in turns: a drifting machine slows both);
    the largest relative difference of a step's loss from torch eager's, step for step."""
    for name, row in rows.items():
        if "rounds" not in row or "error" in row:
            continue
        steps = [_median_step(r, warmup) for r in row["rounds"]]
        row["median_step_seconds"] = statistics.median(steps)
        row["samples_per_second"] = batch / row["median_step_seconds"]
        row["peak_rss_mib"] = [max(r["peak_rss_mib"][i] for r in row["rounds"])
                               for i in range(len(row["rounds"][0]["peak_rss_mib"]))]
        row["losses"] = row["rounds"][0]["losses"]
        if "peak_gpu_mib" in row["rounds"][0]:
            row["peak_gpu_mib"] = [max(r["peak_gpu_mib"][i] for r in row["rounds"] if len(r["peak_gpu_mib"]) > i)
                                   for i in range(max(len(r["peak_gpu_mib"]) for r in row["rounds"]))]
        if "memory_estimate_mib" in row["rounds"][0]:
            row["memory_estimate_mib"] = row["rounds"][0]["memory_estimate_mib"]
            row["estimate_seconds"] = row["plan"]["estimate_seconds"]
    for name, row in rows.items():
        twin = rows.get(row.get("same_programs_as", ""), {})
        if "median_step_seconds" in twin:
            for key in ("median_step_seconds", "samples_per_second", "peak_rss_mib", "losses", "rounds"):
                row[key] = twin[key]
            row["memory_estimate_mib"] = [m / MiB for m in row["plan"]["memory_bytes"]] * len(twin["peak_rss_mib"]) \
                if len(row["plan"]["memory_bytes"]) == 1 else [m / MiB for m in row["plan"]["memory_bytes"]]
            row["estimate_seconds"] = row["plan"]["estimate_seconds"]
    for name, row in rows.items():
        theirs = rows.get(counterpart.get(name) or "", {})
        if "rounds" in row and "rounds" in theirs and "error" not in row and "error" not in theirs:
            ratios = [(_median_step(t, warmup) / _median_step(m, warmup))
                      for m, t in zip(row["rounds"], theirs["rounds"])]
            row["vs_torch"] = statistics.median(ratios)
            row["vs_torch_rounds"] = ratios
    reference = rows.get(eager, {}).get("losses")
    for name, row in rows.items():
        if reference and name != eager and row.get("losses") and "error" not in row:
            pairs = list(zip(row["losses"], reference))
            row["loss_vs_eager"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def report(results: dict) -> None:
    rows = results["rows"]
    print()
    against = "GPU/plan" if results.get("peak_tflops") else "RSS/plan"
    print(f"{'row':<28} {'samples/s':>9} {'vs torch':>8} {'step':>9} {'peak RSS/rank MiB':>18} "
          f"{'plan mem MiB':>12} {against:>11} {'est':>8} {'est/meas':>8}  loss 1 -> last")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<28} failed: {row['error'][:300]}")
            continue
        if "median_step_seconds" not in row:
            continue
        ratio = f"{row['vs_torch']:.2f}x" if "vs_torch" in row else "-"
        rss = " / ".join(f"{r:.0f}" for r in row["peak_rss_mib"])
        estimates = row.get("memory_estimate_mib") or []
        plan_mem = " / ".join(f"{e:.0f}" for e in estimates if e) if any(estimates) else "-"
        # (on a GPU the plan's estimate is of the GPU's memory: the ratio is nvidia-smi's figure over it)
        mem = [r / e for r, e in zip(row.get("peak_gpu_mib") or row["peak_rss_mib"], estimates) if e]
        memory = " / ".join(f"{m:.2f}" for m in mem) if mem else "-"
        est = f"{row['estimate_seconds'] * 1e3:.0f}ms" if "estimate_seconds" in row else "-"
        over = f"{row['estimate_seconds'] / row['median_step_seconds']:.2f}" if "estimate_seconds" in row else "-"
        print(f"{name:<28} {row['samples_per_second']:>9.3f} {ratio:>8} {row['median_step_seconds'] * 1e3:>7.0f}ms "
              f"{rss:>18} {plan_mem:>12} {memory:>11} {est:>8} {over:>8}  {row['losses'][0]:.5f} -> "
              f"{row['losses'][-1]:.5f}")
    tokens = results["config"]["batch"] * results["config"]["seq"]
    for name, row in rows.items():
        if "median_step_seconds" not in row:
            continue
        extra = []
        if "loss_vs_eager" in row:
            extra.append(f"each step's loss within {row['loss_vs_eager']:.1e} (relative) of torch eager's")
        if row.get("peak_gpu_mib"):
            extra.append("peak GPU memory " + " / ".join(f"{m:.0f}" for m in row["peak_gpu_mib"]) + " MiB a process")
        if results.get("peak_tflops") and results.get("parameters"):
            flops = 6 * results["parameters"] * tokens / row["median_step_seconds"]
            extra.append(f"{flops / 1e12:.1f} TFLOP/s, MFU {flops / 1e12 / results['peak_tflops']:.1%} of "
                         f"{results['peak_tflops']:g}")
        if extra:
            print(f"{name}: " + "; ".join(extra))
    for name, row in rows.items():
        if "same_programs_as" in row:
            print(f"{name}: the same programs as {row['same_programs_as']} (its measured steps)")
        if "plan" in row and row["plan"].get("measured_ops") is not None:
            print(f"{name}: {row['plan']['measured_ops']} operator(s) measured, {row['plan']['analytic_ops']} "
                  "analytic (meshplan profile --train times the training step's operators)")
    for note in results["notes"]:
        print(note)


if __name__ == "__main__":
    sys.exit(main())
