"""Torch reference runs for meshplan's training: small models, their ONNX exports, torch's losses and weights.

``python -m sample_models.training.make_references -o sample_models/training [--only CASE ...]``
writes, for each case in :data:`CASES` (see README.md beside this file):

- ``<case>.onnx``: the forward model (outputs: logits or prediction, not the loss), exported
  by torch's TorchScript (``dynamo=False``) or dynamo exporter at the exporter's default
  opset (20 in torch 2.13 and 2.14), weights inline, a symbolic ``batch`` dimension on the
  inputs (other dimensions static). The dynamo exports lose their per-node metadata (stack traces
  with this machine's paths, module scopes): the graph and names are as exported;
- ``<case>.data.npz``: the training data, one array per ONNX input plus the target array
  ``target``, 32 samples on the leading axis; step ``k`` trains on the samples
  ``(k * batch + arange(batch)) % 32``;
- ``<case>.reference.npz``: ``losses`` (float64, the loss torch computed on each step's batch
  before that step's update), ``lrs`` (float64, the learning rate each step used),
  ``initial/NAME``, ``final/NAME`` (after the last step) and ``grads/NAME`` (the first step's
  gradient, before clipping) for every ONNX initializer NAME that holds a trainable torch
  parameter, in the initializer's own layout (``initial`` in the initializer's dtype;
  ``gpt_fp16_master``'s and ``gpt_fp16_dynamic``'s ``grads`` and ``final`` are their float32
  master weights'); ``gpt_fp16_dynamic`` adds ``scales`` (float64, the loss scale each step
  used) and ``skipped`` (bool, the steps that overflowed and took no update; its ``grads`` are
  those of the first step applied);
- ``<case>.json``: the settings (loss spec, optimizer, schedule, steps, batch, exporter,
  trainable, frozen and tied initializers, the parameter each initializer holds and in which
  layout, the graph's op types, versions).

The cases: ``mlp_sgd`` (Linear-GELU-Linear-ReLU-Linear, MSE, SGD with momentum and weight
decay; TorchScript exporter) and ``mlp_sgd_dynamo`` (the same run, dynamo exporter);
``gpt_adamw`` (a 2-layer GPT written with plain matmuls, softmax and a causal mask,
cross-entropy with ignored targets, AdamW, clipping, cosine schedule with warmup; dynamo);
``cnn_sgd`` (Conv-ReLU-MaxPool-Conv-ReLU-global average pool-Flatten-Linear, cross-entropy,
SGD with momentum; TorchScript); ``gpt2_tied`` (transformers' GPT2LMHeadModel with tied
embeddings, next-token cross-entropy, AdamW; dynamo); ``gpt_fp16_master`` (``gpt_adamw``'s
model, data and optimizer, the model converted to float16 before export, trained with float32
master weights and a static loss scale of 1024: :func:`train_master`; dynamo);
``gpt_fp16_dynamic`` (the same, with a dynamic loss scale, torch.amp.GradScaler's rule written
out: from 2**22, times 1/8 on a step whose float16 gradients overflow (the step skipped), times
8 after 3 applied steps in a row: :func:`train_dynamic`; dynamo).

The parameter an initializer holds is found by value at export time: every parameter gets
seeded noise added after its usual initialization, so that no two parameters (nor a
parameter and another's transpose) are equal, and each float initializer is compared (in
float32; a float16 model's against its float16 parameters) with every parameter, its
transpose and its leading rows (the dynamo exporter folds GPT-2's ``wpe[arange(16)]`` into
a constant of shape [1, 16, 64]). Each case is checked before its
data, reference and settings files are written: onnxruntime on the first batch with the
initial weights against torch's output (rtol 1e-4, atol 1e-5), on a batch of 3 (the symbolic
batch), with the final weights substituted against torch's final model, and ``losses[0]``
against a float64 numpy loss of onnxruntime's output (rtol 1e-4); the float16 cases with rtol
and atol 1e-2, and ``losses[0]`` within 2e-3 (the differences seen are printed).

It needs torch, onnxscript, onnxruntime and transformers (only for the cases with
``Case.transformers``: all but ``gpt_fp16_master`` and ``gpt_fp16_dynamic``, which never
import it), none of them dependencies of meshplan; install them in a virtual environment
outside the repository and run from the repository root::

    python3 -m venv torch-venv
    torch-venv/bin/pip install torch==2.13.0 numpy onnx onnxscript onnxruntime transformers
    torch-venv/bin/python -m sample_models.training.make_references -o sample_models/training

The committed files were written with torch 2.13.0+cpu, transformers 5.24.0, onnxscript
0.7.2, onnx 1.23.2, onnxruntime 1.32.0 and numpy 2.4.6 (Python 3.11), except
``gpt_fp16_master``'s and ``gpt_fp16_dynamic``'s, written later with torch 2.14.1 (the +cu130
build, on the CPU), onnxscript 0.7.2, onnx 1.23.2, onnxruntime 1.32.0 and numpy 2.4.6
(Python 3.11.7), without transformers; the run is deterministic on one machine, and other
versions may export different graphs or names.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from sample_models.training import CASES

SAMPLES = 32
SEED = 0
SCHEDULE_FORMULA = ("lr_k = lr * (k + 1) / warmup for k < warmup, else "
                    "lr * 0.5 * (1 + cos(pi * (k - warmup) / (steps - warmup))); k = 0 .. steps-1 is the step index")
CONSTANT_FORMULA = "lr_k = lr"
BATCH_FORMULA = "step k trains on samples (k * batch + arange(batch)) % samples"
NOISE = 0.02  # added to every parameter after its initialization (unique values for matching)


@dataclass
class Case:
    name: str
    build: Callable  # () -> torch.nn.Module, built after torch.manual_seed(SEED)
    data: Callable  # (numpy Generator) -> dict of arrays: the inputs and "target"
    inputs: list[str]
    output: str
    loss: str  # "mse" or "cross_entropy"
    exporter: str  # "torchscript" or "dynamo"
    optimizer: dict
    steps: int = 12
    batch: int = 8
    notes: list[str] = field(default_factory=list)
    # Mixed precision: dtype "float16" converts the model (.half()) before export and trains
    # float32 master copies of its parameters with a static loss scale (train_master), or with
    # a dynamic one where ``scaler`` is set (train_dynamic, torch.amp.GradScaler's rule: its
    # init_scale, growth_factor, backoff_factor, growth_interval; loss_scale is then "dynamic").
    dtype: str = "float32"
    loss_scale: float | str | None = None
    scaler: dict | None = None
    # onnxruntime against torch before writing: outputs (rtol, atol), losses[0] (loss_rtol)
    rtol: float = 1e-4
    atol: float = 1e-5
    loss_rtol: float = 1e-4
    # The run imports transformers and records its version (gpt2_tied builds with it; the
    # cases written before gpt_fp16_master record it too); False: never imported, null.
    transformers: bool = True


# ----------------------------------------------------------------------------- models


def build_mlp():
    from torch import nn

    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 4))


def mlp_data(rng: np.random.Generator) -> dict:
    x = rng.standard_normal((SAMPLES, 16)).astype(np.float32)
    mix = rng.standard_normal((16, 4)).astype(np.float32) / 4
    target = (np.tanh(x @ mix) + 0.1 * rng.standard_normal((SAMPLES, 4))).astype(np.float32)
    return {"x": x, "target": target}


GPT_VOCAB, GPT_HIDDEN, GPT_HEADS, GPT_LAYERS, GPT_SEQ, GPT_MLP = 128, 64, 4, 2, 16, 128


def build_gpt():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(GPT_HIDDEN)
            self.q = nn.Linear(GPT_HIDDEN, GPT_HIDDEN)
            self.k = nn.Linear(GPT_HIDDEN, GPT_HIDDEN)
            self.v = nn.Linear(GPT_HIDDEN, GPT_HIDDEN)
            self.proj = nn.Linear(GPT_HIDDEN, GPT_HIDDEN)
            self.ln2 = nn.LayerNorm(GPT_HIDDEN)
            self.fc1 = nn.Linear(GPT_HIDDEN, GPT_MLP)
            self.fc2 = nn.Linear(GPT_MLP, GPT_HIDDEN)
            self.act = nn.GELU()

        def forward(self, x, mask):
            batch, seq, hidden = x.shape
            head = hidden // GPT_HEADS
            h = self.ln1(x)

            def heads(t):
                return t.reshape(batch, seq, GPT_HEADS, head).transpose(1, 2)

            q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head)
            scores = scores.masked_fill(mask, float("-inf"))
            attn = torch.matmul(torch.softmax(scores, dim=-1), v)
            x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, hidden))
            return x + self.fc2(self.act(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(GPT_VOCAB, GPT_HIDDEN)
            self.pos = nn.Parameter(torch.randn(GPT_SEQ, GPT_HIDDEN) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(GPT_LAYERS))
            self.ln_f = nn.LayerNorm(GPT_HIDDEN)
            self.head = nn.Linear(GPT_HIDDEN, GPT_VOCAB, bias=False)
            # True above the diagonal: the positions a query may not attend to.
            self.register_buffer("mask", torch.triu(torch.ones(GPT_SEQ, GPT_SEQ, dtype=torch.bool), 1),
                                 persistent=False)

        def forward(self, input_ids):
            x = self.tok(input_ids) + self.pos
            for block in self.blocks:
                x = block(x, self.mask)
            return self.head(self.ln_f(x))

    return GPT()


def gpt_data(rng: np.random.Generator) -> dict:
    # Learnable sequences: each row counts up from a random start with a random stride
    # (mod vocab); targets are the next token, about 20% of positions (and always the
    # last, which has no next token) ignored with -100.
    start = rng.integers(0, GPT_VOCAB, (SAMPLES, 1))
    stride = rng.integers(1, 4, (SAMPLES, 1))
    seq = (start + stride * np.arange(GPT_SEQ + 1)) % GPT_VOCAB
    input_ids = seq[:, :-1].astype(np.int64)
    target = seq[:, 1:].astype(np.int64)
    target[rng.random(target.shape) < 0.2] = -100
    target[:, -1] = -100
    return {"input_ids": input_ids, "target": target}


def build_cnn():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, 5))


def cnn_data(rng: np.random.Generator) -> dict:
    # Five classes of 12x12 images on noise, told apart by shape, not place (the pooling is
    # global): a horizontal bar, a vertical bar, the diagonal, the anti-diagonal, a square.
    target = (np.arange(SAMPLES) % 5).astype(np.int64)
    rng.shuffle(target)
    image = 0.3 * rng.standard_normal((SAMPLES, 1, 12, 12))
    for i, label in enumerate(target):
        at = rng.integers(1, 9)
        if label == 0:
            image[i, 0, at:at + 2, :] += 1.5
        elif label == 1:
            image[i, 0, :, at:at + 2] += 1.5
        elif label == 2:
            image[i, 0, np.arange(12), np.arange(12)] += 1.5
        elif label == 3:
            image[i, 0, np.arange(12), 11 - np.arange(12)] += 1.5
        else:
            image[i, 0, at:at + 4, at:at + 4] += 1.5
    return {"image": image.astype(np.float32), "target": target}


GPT2_VOCAB, GPT2_HIDDEN, GPT2_HEADS, GPT2_LAYERS, GPT2_POSITIONS, GPT2_SEQ, GPT2_MLP = 128, 64, 4, 2, 32, 16, 128


def build_gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=GPT2_LAYERS, n_embd=GPT2_HIDDEN, n_head=GPT2_HEADS, vocab_size=GPT2_VOCAB,
                        n_positions=GPT2_POSITIONS, n_inner=GPT2_MLP, attn_pdrop=0.0, resid_pdrop=0.0,
                        embd_pdrop=0.0, summary_first_dropout=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight, "GPT2LMHeadModel did not tie its embeddings"

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    return Logits()


def gpt2_data(rng: np.random.Generator) -> dict:
    start = rng.integers(0, GPT2_VOCAB, (SAMPLES, 1))
    stride = rng.integers(1, 4, (SAMPLES, 1))
    input_ids = ((start + stride * np.arange(GPT2_SEQ)) % GPT2_VOCAB).astype(np.int64)
    target = np.full_like(input_ids, -100)
    target[:, :-1] = input_ids[:, 1:]  # next token; the last position has none
    return {"input_ids": input_ids, "target": target}


SGD_MLP = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4, "clip_norm": None,
           "schedule": "constant", "warmup": 0}
ADAMW_GPT = {"optimizer": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
             "clip_norm": 1.0, "schedule": "cosine", "warmup": 3}
# factors of 8 keep every step's scale an octave or more from where its float16 backward overflows, in
# torch (from about 2**20) and in onnxruntime (about 2**21.5: another order of float16 roundings): the same
# steps overflow in both
DYNAMIC_SCALER = {"init_scale": 2.0 ** 22, "growth_factor": 8.0, "backoff_factor": 0.125, "growth_interval": 3}
CASE_LIST = [
    Case("mlp_sgd", build_mlp, mlp_data, ["x"], "prediction", "mse", "torchscript", SGD_MLP),
    Case("mlp_sgd_dynamo", build_mlp, mlp_data, ["x"], "prediction", "mse", "dynamo", SGD_MLP,
         notes=["the same model, data and run as mlp_sgd (identical losses and weights), exported by dynamo"]),
    Case("gpt_adamw", build_gpt, gpt_data, ["input_ids"], "logits", "cross_entropy", "dynamo", ADAMW_GPT),
    Case("cnn_sgd", build_cnn, cnn_data, ["image"], "logits", "cross_entropy", "torchscript",
         {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "clip_norm": None,
          "schedule": "constant", "warmup": 0}),
    Case("gpt2_tied", build_gpt2, gpt2_data, ["input_ids"], "logits", "cross_entropy", "dynamo",
         {"optimizer": "adamw", "lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
          "clip_norm": None, "schedule": "constant", "warmup": 0}),
    Case("gpt_fp16_master", build_gpt, gpt_data, ["input_ids"], "logits", "cross_entropy", "dynamo",
         ADAMW_GPT, dtype="float16", loss_scale=1024.0, rtol=1e-2, atol=1e-2, loss_rtol=2e-3,
         transformers=False,
         notes=["mixed precision: gpt_adamw's model (same seed, noise and data), converted to float16 (.half()) "
                "before export: initializers, activations and logits are float16; initial/* are the float16 "
                "initializers as exported",
                "master weights: before step 0 each trainable parameter p gets a float32 copy m = float32(p); "
                "AdamW, clipping and the schedule act on the masters only",
                "each step: logits = model(inputs) in float16; loss = cross_entropy(float32(logits), target) "
                "in float32; (loss * loss_scale).backward() in float16; m.grad = float32(p.grad) / loss_scale; "
                "losses[k] is the unscaled loss; clip_grad_norm_ over the masters' gradients; AdamW step on "
                "the masters; then p = float16(m) (round to nearest even) for the next step's forward",
                "loss_scale is static (a power of two, so the unscaling is exact); no step is skipped, every "
                "gradient was finite",
                "grads/* are the masters' first-step gradients (float32, unscaled, before clipping) and final/* "
                "the masters after the last step (float32); the model's float16 weights after training are "
                "float16(final/*)",
                "blocks.*.k.bias: the exact gradient is zero (softmax is invariant to adding the same value to a "
                "query's scores); the float16 backward leaves rounding noise (about 4e-7 after unscaling, 1e-10 "
                "in gpt_adamw), which AdamW's normalization turns into steps of about lr: their final values "
                "(about 0.016 from gpt_adamw's) follow torch's float16 rounding, not the loss"]),
    Case("gpt_fp16_dynamic", build_gpt, gpt_data, ["input_ids"], "logits", "cross_entropy", "dynamo",
         ADAMW_GPT, dtype="float16", loss_scale="dynamic", scaler=DYNAMIC_SCALER, rtol=1e-2, atol=1e-2,
         loss_rtol=2e-3, transformers=False,
         notes=["mixed precision as gpt_fp16_master (the same float16 model, export, data, float32 master "
                "weights, AdamW, clipping and schedule), with a dynamic loss scale instead of a static one: "
                "torch.amp.GradScaler's rule, written out",
                "scaler state: scale = init_scale, tracker = 0. Each step k: logits = model(inputs) in "
                "float16; loss = cross_entropy(float32(logits), target) in float32; losses[k] is the unscaled "
                "loss, lrs[k] the schedule's lr, scales[k] = scale; (loss * scale).backward() in float16; "
                "found_inf = any float16 gradient element is inf or nan",
                "found_inf (skipped[k] true): no unscaling, no clipping, no AdamW step (masters, AdamW's "
                "moments and its step count unchanged; the float16 model unchanged); scale *= backoff_factor; "
                "tracker = 0",
                "otherwise: m.grad = float32(p.grad) / scale (exact: a power of two); clip_grad_norm_ over the "
                "masters; AdamW step on the masters; p = float16(m); tracker += 1; if tracker == "
                "growth_interval: scale *= growth_factor, tracker = 0",
                "the schedule steps every step, skipped or not (LambdaLR.step() after each step, as a torch "
                "loop with GradScaler does): an applied step k uses lrs[k]; AdamW's bias correction counts "
                "the applied steps only (its step count is the number of applied steps so far, not k + 1)",
                "init_scale 2**22 overflows float16 on purpose; growth and backoff factors of 8 (GradScaler's "
                "growth_factor and backoff_factor) keep each step's scale an octave or more away from where "
                "its float16 backward overflows (about 2**20 in torch, 2**21.5 in onnxruntime, whose kernels "
                "round otherwise), so that an implementation of the rule skips the same steps",
                "final/* are the masters after the last step (float32); the model's float16 weights after "
                "training are float16(final/*)",
                "blocks.*.k.bias: the exact gradient is zero; the float16 backward leaves rounding noise that "
                "AdamW's normalization turns into steps of about lr (see gpt_fp16_master)"]),
]
CASE_BY_NAME = {case.name: case for case in CASE_LIST}
assert tuple(CASE_BY_NAME) == CASES


# ----------------------------------------------------------------------------- training


def lr_factor(settings: dict, step: int) -> float:
    """The learning-rate multiplier of step ``step`` (what LambdaLR applies to ``lr``)."""
    if settings["schedule"] == "constant":
        return 1.0
    warmup, steps = settings["warmup"], settings["steps"]
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))


def torch_loss(kind: str, output, target):
    import torch.nn.functional as F

    if kind == "mse":
        return F.mse_loss(output, target)
    classes = output.shape[-1]
    return F.cross_entropy(output.reshape(-1, classes), target.reshape(-1), ignore_index=-100)


def numpy_loss(kind: str, output: np.ndarray, target: np.ndarray) -> float:
    """The loss spec's meaning in float64 numpy (what the test side computes)."""
    output = output.astype(np.float64)
    if kind == "mse":
        return float(np.mean((output - target) ** 2))
    logits = output.reshape(-1, output.shape[-1])
    labels = target.reshape(-1)
    keep = labels != -100
    logits, labels = logits[keep], labels[keep]
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(labels)), labels].mean())


def batch_indices(step: int, batch: int) -> np.ndarray:
    return (step * batch + np.arange(batch)) % SAMPLES


def optimizer(tensors, settings: dict):
    """The case's torch optimizer over ``tensors`` and its LambdaLR schedule."""
    import torch

    if settings["optimizer"] == "sgd":
        opt = torch.optim.SGD(tensors, lr=settings["lr"], momentum=settings["momentum"],
                              weight_decay=settings["weight_decay"])
    else:
        opt = torch.optim.AdamW(tensors, lr=settings["lr"], betas=tuple(settings["betas"]),
                                eps=settings["eps"], weight_decay=settings["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(settings, step))
    return opt, sched


def train(case: Case, model, data: dict, settings: dict) -> dict:
    """Run the torch training; returns losses, lrs, first-step grads and final parameters by torch name."""
    import torch

    params = dict(model.named_parameters())  # tied parameters appear once
    opt, sched = optimizer(params.values(), settings)
    model.train()
    losses, lrs, grads = [], [], {}
    for step in range(case.steps):
        idx = batch_indices(step, case.batch)
        args = [torch.from_numpy(data[name][idx]) for name in case.inputs]
        target = torch.from_numpy(data["target"][idx])
        opt.zero_grad(set_to_none=True)
        loss = torch_loss(case.loss, model(*args), target)
        loss.backward()
        if step == 0:
            grads = {name: p.grad.detach().clone().numpy() for name, p in params.items()}
        if settings["clip_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(params.values(), settings["clip_norm"])
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    final = {name: p.detach().clone().numpy() for name, p in params.items()}
    return {"losses": np.array(losses, np.float64), "lrs": np.array(lrs, np.float64), "grads": grads,
            "final": final}


def train_master(case: Case, model, data: dict, settings: dict) -> dict:
    """Mixed-precision training of a float16 model with float32 master weights and a static
    loss scale (:func:`train_dynamic`'s loop with a scale that never changes, every step's
    scaled gradients finite); returns what :func:`train` does, grads and final being the
    masters' (float32)."""
    static = {"init_scale": case.loss_scale, "growth_factor": 1.0, "backoff_factor": 1.0,
              "growth_interval": case.steps + 1}
    run = train_dynamic(case, model, data, settings, static)
    if run["skipped"].any():
        raise AssertionError(f"{case.name}: a scaled float16 gradient overflowed at step "
                             f"{int(np.argmax(run['skipped']))}")
    return {key: run[key] for key in ("losses", "lrs", "grads", "final")}


def train_dynamic(case: Case, model, data: dict, settings: dict, scaler: dict | None = None) -> dict:
    """Mixed-precision training of a float16 model with float32 master weights and a dynamic
    loss scale (``scaler``, by default ``case.scaler``), torch.amp.GradScaler's rule written out:
    a step whose scaled float16 gradients hold an inf or a nan is skipped (no unscaling, no
    clipping, no optimizer step: masters, AdamW's moments and step count and the float16 model
    unchanged) and halves the scale (``backoff_factor``); ``growth_interval`` applied steps in a
    row double it (``growth_factor``). The schedule advances every step, skipped or not. Returns
    what :func:`train_master` does (``grads``: the first applied step's) plus ``scales`` (the
    scale each step used), ``skipped`` and ``notes`` (the run's sequence, for the settings)."""
    import torch

    scaler = scaler or case.scaler
    scale, tracker = float(scaler["init_scale"]), 0
    params = dict(model.named_parameters())  # float16
    masters = {name: p.detach().float().requires_grad_(True) for name, p in params.items()}
    opt, sched = optimizer(masters.values(), settings)
    model.train()
    losses, lrs, scales, skipped, grads = [], [], [], [], {}
    for step in range(case.steps):
        idx = batch_indices(step, case.batch)
        args = [torch.from_numpy(data[name][idx]) for name in case.inputs]
        target = torch.from_numpy(data["target"][idx])
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        logits = model(*args)
        assert logits.dtype == torch.float16, logits.dtype
        loss = torch_loss(case.loss, logits.float(), target)  # float32
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
        scales.append(scale)
        (loss * scale).backward()  # float16 gradients of the scaled loss
        found_inf = any(not bool(torch.isfinite(p.grad).all()) for p in params.values())
        skipped.append(found_inf)
        if found_inf:
            scale *= scaler["backoff_factor"]
            tracker = 0
        else:
            for name, p in params.items():
                masters[name].grad = p.grad.float() / scale  # exact: the scale is a power of two
            if not grads:
                grads = {name: m.grad.detach().clone().numpy() for name, m in masters.items()}
            if settings["clip_norm"] is not None:
                torch.nn.utils.clip_grad_norm_(masters.values(), settings["clip_norm"])
            opt.step()
            with torch.no_grad():
                for name, p in params.items():
                    p.data.copy_(masters[name].data.half())
            tracker += 1
            if tracker == scaler["growth_interval"]:
                scale *= scaler["growth_factor"]
                tracker = 0
        with warnings.catch_warnings():  # a skipped first step: the schedule steps before the optimizer
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            sched.step()
    if not grads:
        raise AssertionError(f"{case.name}: every step overflowed; no gradient to record")
    final = {name: m.detach().clone().numpy() for name, m in masters.items()}
    applied = [k for k, skip in enumerate(skipped) if not skip]
    sequence = ", ".join(f"{k}: 2**{math.log2(scales[k]):g}{' skipped' if skipped[k] else ''}"
                         for k in range(case.steps))
    print(f"  {case.name} steps (scale, skipped): {sequence}")
    first = applied[0]
    same = np.array_equal(batch_indices(first, case.batch), batch_indices(0, case.batch))
    notes = [f"this run, step: scale (skipped): {sequence}; AdamW took {len(applied)} steps",
             f"grads/* are step {first}'s (the first applied): at the initial weights (no step before it "
             f"was applied), on step {first}'s batch"
             + (" (the same samples as step 0's: the first batch's gradient at the initial weights, as in "
                "the other cases)" if same else "")]
    return {"losses": np.array(losses, np.float64), "lrs": np.array(lrs, np.float64), "grads": grads,
            "final": final, "scales": np.array(scales, np.float64), "skipped": np.array(skipped, bool),
            "notes": notes}


# ----------------------------------------------------------------------------- export


def export(case: Case, module, example: list, path: Path) -> None:
    import torch

    module = copy.deepcopy(module).eval()  # no dropout or batch statistics: eval() changes nothing
    if case.exporter == "torchscript":
        axes = {name: {0: "batch"} for name in [*case.inputs, case.output]}
        torch.onnx.export(module, tuple(example), str(path), dynamo=False, input_names=case.inputs,
                          output_names=[case.output], dynamic_axes=axes)
    else:
        batch = torch.export.Dim("batch", min=1, max=1024)
        program = torch.onnx.export(module, tuple(example), dynamo=True, input_names=case.inputs,
                                    output_names=[case.output], dynamic_shapes=tuple({0: batch} for _ in example),
                                    external_data=False)
        program.save(str(path), external_data=False)
        strip_node_metadata(path)


def strip_node_metadata(path: Path) -> None:
    """Drop the dynamo exporter's per-node metadata (stack traces naming this machine's paths,
    module scopes, fx nodes): about 40% of a small export's bytes. The graph, the names and the
    inputs' and initializers' own metadata stay as exported."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        del node.metadata_props[:]
    onnx.save(model, str(path))


FLOAT_TYPES = (1, 10, 11)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE


def match_initializers(model_proto, params: dict) -> dict:
    """ONNX float initializer name -> where it comes from, for those holding a trainable parameter.

    An entry is ``{"param": torch name, "transposed": bool, "rows": None or k, "shape": [...]}``:
    the initializer equals the parameter, its transpose, or (``rows`` k) its first k rows
    reshaped to ``shape`` (the dynamo exporter folds ``wpe[arange(seq)]`` into a constant when
    seq is static).
    """
    from onnx import numpy_helper

    # Compared in float32: a float16 model's initializers against its (float16) parameters.
    params = {name: p.astype(np.float32) for name, p in params.items()}
    mapping = {}
    for init in model_proto.graph.initializer:
        if init.data_type not in FLOAT_TYPES:
            continue
        value = numpy_helper.to_array(init).astype(np.float32)
        hits = []
        for name, p in params.items():
            if p.shape == value.shape and np.array_equal(p, value):
                hits.append((name, False, None))
            if p.ndim == 2 and p.T.shape == value.shape and np.array_equal(p.T, value):
                hits.append((name, True, None))
            row = int(np.prod(p.shape[1:]))
            if p.ndim >= 1 and 0 < value.size < p.size and value.size % row == 0:
                rows = value.size // row
                if np.array_equal(value.reshape(rows, *p.shape[1:]), p[:rows]):
                    hits.append((name, False, rows))
        if len(hits) > 1:
            raise RuntimeError(f"initializer {init.name} matches several parameters: {hits}")
        if hits:
            name, transposed, rows = hits[0]
            mapping[init.name] = {"param": name, "transposed": transposed, "rows": rows, "shape": list(value.shape)}
    missing = set(params) - {entry["param"] for entry in mapping.values()}
    if missing:
        raise RuntimeError(f"parameters with no ONNX initializer holding them: {sorted(missing)}")
    return mapping


def in_layout(value: np.ndarray, entry: dict) -> np.ndarray:
    """A torch parameter's value (or gradient) in the layout of the initializer ``entry`` describes."""
    if entry["transposed"]:
        value = value.T
    if entry["rows"] is not None:
        value = value[:entry["rows"]].reshape(entry["shape"])
    return np.ascontiguousarray(value)


def check_partial(mapping: dict, grads: dict) -> None:
    """A parameter held only in part (first rows) must get no gradient in the other rows, so
    that training the initializer alone is training the parameter."""
    for name, grad in grads.items():
        entries = [e for e in mapping.values() if e["param"] == name]
        if entries and all(e["rows"] is not None for e in entries):
            rows = max(e["rows"] for e in entries)
            if np.any(grad[rows:] != 0):
                raise AssertionError(f"{name}: rows past {rows} have a gradient but no initializer holds them")


def run_onnx(model_proto, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def with_weights(model_proto, values: dict):
    from onnx import numpy_helper

    model_proto = copy.deepcopy(model_proto)
    for init in model_proto.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    return model_proto


def op_types(model_proto) -> list[str]:
    ops = set()

    def walk(graph):
        for node in graph.node:
            ops.add(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}")
            for attr in node.attribute:
                if attr.g is not None and attr.g.node:
                    walk(attr.g)

    walk(model_proto.graph)
    for function in model_proto.functions:
        for node in function.node:
            ops.add(node.op_type)
    return sorted(ops)


def weight_path_op_types(model_proto, trainable) -> list[str]:
    """The op types of the nodes that read a trainable initializer, directly or through other
    nodes: those whose gradient rules training needs."""
    live, ops = set(trainable), set()
    for node in model_proto.graph.node:  # topologically sorted
        if live.intersection(node.input):
            ops.add(node.op_type)
            live.update(node.output)
    return sorted(ops)


def check_close(what: str, got: np.ndarray, want: np.ndarray, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: onnxruntime gave {got.dtype}{list(got.shape)}, "
                             f"torch {want.dtype}{list(want.shape)}")
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    rel = diff / np.maximum(np.abs(want.astype(np.float64)), 1e-30)
    print(f"  {what}: max abs diff {diff.max():.3g}, max rel diff {rel.max():.3g} (rtol {rtol}, atol {atol})")
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        raise AssertionError(f"{what}: onnxruntime and torch differ (max abs diff {diff.max()})")


# ----------------------------------------------------------------------------- one case


def versions(with_transformers: bool = True) -> dict:
    import onnx
    import onnxruntime
    import onnxscript
    import torch

    if with_transformers:
        import transformers
    return {"torch": torch.__version__,
            "transformers": transformers.__version__ if with_transformers else None, "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__, "numpy": np.__version__}


def make_case(case: Case, out: Path) -> dict:
    import onnx
    import torch
    from onnx import numpy_helper

    torch.manual_seed(SEED)
    module = case.build()
    with torch.no_grad():  # distinct values everywhere: value matching is unambiguous
        for p in module.parameters():
            p.add_(torch.randn_like(p) * NOISE)
    if case.dtype == "float16":
        module.half()
    data = case.data(np.random.default_rng(SEED))
    params = {name: p.detach().clone().numpy() for name, p in module.named_parameters()}

    first = batch_indices(0, case.batch)
    onnx_path = out / f"{case.name}.onnx"
    export(case, module, [torch.from_numpy(data[name][first]) for name in case.inputs], onnx_path)
    proto = onnx.load(str(onnx_path))
    onnx.checker.check_model(proto)
    graph_inputs = [i.name for i in proto.graph.input]
    graph_outputs = [o.name for o in proto.graph.output]
    assert graph_inputs == case.inputs and graph_outputs == [case.output], (graph_inputs, graph_outputs)
    mapping = match_initializers(proto, params)

    # torch's outputs with the initial weights, before training changes the module
    module.eval()
    with torch.no_grad():
        want_first = module(*[torch.from_numpy(data[n][first]) for n in case.inputs]).numpy()
        odd = np.arange(3)
        want_odd = module(*[torch.from_numpy(data[n][odd]) for n in case.inputs]).numpy()

    settings = {"loss": f"{case.loss}:{case.output}:target"}
    for key in ("optimizer", "lr", "momentum", "weight_decay", "betas", "eps", "clip_norm", "schedule", "warmup"):
        settings[key] = case.optimizer.get(key)
    settings.update({"steps": case.steps, "batch": case.batch, "exporter": case.exporter})
    if case.dtype != "float32":
        settings.update({"dtype": case.dtype, "master_weights": "float32", "loss_scale": case.loss_scale})
        if case.scaler is not None:
            settings.update(case.scaler)
            run = train_dynamic(case, module, data, settings)
        else:
            run = train_master(case, module, data, settings)
    else:
        run = train(case, module, data, settings)

    # checks: initial weights on the first batch, an odd batch size, final weights
    tol = {"rtol": case.rtol, "atol": case.atol}
    check_close(f"{case.name} first batch", run_onnx(proto, {n: data[n][first] for n in case.inputs}), want_first,
                **tol)
    check_close(f"{case.name} batch of 3", run_onnx(proto, {n: data[n][odd] for n in case.inputs}), want_odd, **tol)
    got_first = run_onnx(proto, {n: data[n][first] for n in case.inputs})
    loss0 = numpy_loss(case.loss, got_first, data["target"][first])
    print(f"  {case.name} losses[0] {float(run['losses'][0])!r}, numpy float64 on onnxruntime's output {loss0!r}: "
          f"rel diff {abs(loss0 - run['losses'][0]) / abs(run['losses'][0]):.3g} (rtol {case.loss_rtol})")
    if not math.isclose(loss0, run["losses"][0], rel_tol=case.loss_rtol):
        raise AssertionError(f"{case.name}: loss[0] {run['losses'][0]} but numpy on onnxruntime's output {loss0}")
    check_partial(mapping, run["grads"])
    final_values = {onnx_name: in_layout(run["final"][e["param"]], e) for onnx_name, e in mapping.items()}
    # the model's own weights after training (float16(masters) for a float16 model)
    model_dtype = np.dtype(case.dtype)
    final_weights = {onnx_name: value.astype(model_dtype) for onnx_name, value in final_values.items()}
    with torch.no_grad():
        want_final = module(*[torch.from_numpy(data[n][first]) for n in case.inputs]).numpy()
    check_close(f"{case.name} final weights", run_onnx(with_weights(proto, final_weights),
                                                        {n: data[n][first] for n in case.inputs}), want_final, **tol)

    reference = {"losses": run["losses"], "lrs": run["lrs"]}
    if case.scaler is not None:  # the scale each step used, and which steps were skipped
        reference.update({"scales": run["scales"], "skipped": run["skipped"]})
    exported = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer if i.name in mapping}
    for onnx_name, entry in mapping.items():
        reference[f"initial/{onnx_name}"] = in_layout(params[entry["param"]], entry)
        if reference[f"initial/{onnx_name}"].dtype != exported[onnx_name].dtype:
            raise AssertionError(f"{onnx_name}: a {exported[onnx_name].dtype} initializer holds "
                                 f"{reference[f'initial/{onnx_name}'].dtype} parameter {entry['param']}")
        reference[f"final/{onnx_name}"] = final_values[onnx_name]
        reference[f"grads/{onnx_name}"] = in_layout(run["grads"][entry["param"]], entry)

    floats = [i.name for i in proto.graph.initializer if i.data_type in FLOAT_TYPES]
    holders: dict[str, list[str]] = {}
    for onnx_name, entry in mapping.items():
        holders.setdefault(entry["param"], []).append(onnx_name)
    shared = tied_parameters(module)
    tied = [names for name, names in holders.items() if len(names) > 1 or name in shared]
    ver = versions(case.transformers)
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    settings.update({
        "frozen": [name for name in floats if name not in mapping],
        "tied": tied,
        "torch": ver["torch"],
        "transformers": ver["transformers"],
        # beyond the brief's keys: what a test needs to interpret the files
        "trainable": list(mapping),
        "initializers": mapping,
        "schedule_formula": SCHEDULE_FORMULA if settings["schedule"] == "cosine" else CONSTANT_FORMULA,
        "samples": SAMPLES,
        "batch_indices": BATCH_FORMULA,
        "inputs": case.inputs,
        "output": case.output,
        "target": "target",
        "opset": opset,
        "op_types": op_types(proto),
        "op_types_on_weight_path": weight_path_op_types(proto, mapping),
        "seed": SEED,
        "versions": ver,
        "notes": [
            "losses[k] is the loss on step k's batch before step k's update; final/* are after the last step",
            "grads/* are the first step's gradients before clipping, in the initializer's layout"
            if case.scaler is None else
            "grads/* are the gradients of the first step applied (the first not skipped), before clipping, "
            "in the initializer's layout",
            "frozen: the float initializers that hold no trainable parameter (constants of the graph)",
            "initializers: the torch parameter each trainable initializer holds; transposed: it holds the "
            "transpose; rows k: it holds the first k rows reshaped to shape",
            "weight decay applies to every trainable parameter (one parameter group)",
            *(["sgd: torch.optim.SGD, dampening 0, nesterov False: buf = momentum*buf + (g + wd*p) "
               "(buf = g + wd*p on the first step), p -= lr*buf"] if settings["optimizer"] == "sgd" else
              ["adamw: torch.optim.AdamW (amsgrad False): p *= 1 - lr*wd, then the bias-corrected Adam step "
               "with m, v starting at zero"]),
            *(["clip_norm: torch.nn.utils.clip_grad_norm_ over all trainable parameters' gradients together "
               "(global L2 norm; gradients scaled by min(1, clip_norm / (norm + 1e-6)))"]
              if settings["clip_norm"] else []),
            *case.notes,
            *run.get("notes", []),
        ],
    })
    if tied:
        settings["notes"].append(tied_note(proto, tied, mapping))

    save_npz(out / f"{case.name}.data.npz", data)
    save_npz(out / f"{case.name}.reference.npz", reference)
    (out / f"{case.name}.json").write_text(json.dumps(settings, indent=1) + "\n")
    return settings


def save_npz(path: Path, arrays: dict) -> None:
    """``np.savez_compressed`` with fixed member dates, so that a rerun writes the same bytes."""
    import io
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for key, value in arrays.items():
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.asanyarray(value), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, buffer.getvalue())


def tied_parameters(module) -> set[str]:
    """Names (as named_parameters gives them) of parameters reachable under two or more module paths."""
    paths: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(name)
    return {names[0] for names in paths.values() if len(names) > 1}


def tied_note(proto, tied: list, mapping: dict) -> str:
    readers: dict[str, list[str]] = {}
    for node in proto.graph.node:
        for name in node.input:
            if any(name in group for group in tied):
                readers.setdefault(name, []).append(node.op_type)
    groups = []
    for group in tied:
        parts = [f"{name} ({'transposed, ' if mapping[name]['transposed'] else ''}read by "
                 f"{', '.join(readers.get(name, [])) or 'nothing'})" for name in group]
        groups.append(f"{mapping[group[0]]['param']} is held by " + " and ".join(parts))
    return ("tied: each list holds one torch parameter (one update, its gradient the sum over every use). "
            "grads/NAME of every initializer of a list is that whole gradient (in NAME's layout), not the "
            "part through NAME's own readers, and final/NAME is the one torch value in NAME's layout: "
            + "; ".join(groups))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, required=True, help="folder to write the files into")
    parser.add_argument("--only", nargs="+", choices=CASES)
    args = parser.parse_args()
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
        import torch  # noqa: F401
    except ImportError as error:
        raise SystemExit(f"make_references needs torch, onnxscript, onnxruntime and transformers ({error}); in a "
                         "virtual environment outside the repository: pip install torch==2.13.0 numpy onnx "
                         "onnxscript onnxruntime transformers") from error
    warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export")
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only or CASES
    if any(CASE_BY_NAME[name].transformers for name in names):
        try:
            import transformers  # noqa: F401
        except ImportError as error:
            users = ", ".join(n for n in names if CASE_BY_NAME[n].transformers)
            raise SystemExit(f"make_references needs transformers for {users} ({error}): pip install "
                             "transformers") from error
    for name in names:
        settings = make_case(CASE_BY_NAME[name], args.out)
        print(f"{name}: {settings['exporter']} opset {settings['opset']}, {len(settings['trainable'])} trainable "
              f"initializers, frozen {settings['frozen']}, tied {settings['tied']}")
        print(f"  ops: {' '.join(settings['op_types'])}")


if __name__ == "__main__":
    main()
