"""Optimizers as ONNX nodes: one update per trained weight, with torch.optim's semantics.

The hyperparameters are float32 scalar inputs of every step (``HYPER``), so a schedule of
the learning rate costs nothing and one plan serves any setting:

- ``sgd`` (``torch.optim.SGD``, dampening 0, not Nesterov): g ← g + wd·w; b ← μ·b + g
  (b starts at 0, so its first value is g, as torch's); w ← w − lr·b.
- ``adamw`` (``torch.optim.AdamW``): w ← w·(1 − lr·wd); m ← β1·m + (1 − β1)·g;
  v ← β2·v + (1 − β2)·g²; w ← w − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε), t the step
  (counted from 1). Written as w − (lr·c2/(1 − β1ᵗ)) · m / (√v + ε·c2), c2 = √(1 − β2ᵗ),
  with the clipping's factor folded into (1 − β1) and (1 − β2): the scalars are worked out
  once a step, and each weight's update makes 13 passes over its tensors instead of 15
  (torch's own order differs from it by rounding only). Its g² term is (g·(1 − β2)c²)·g, whose
  first product waits for the norm: a g² made from the gradient alone would be computed as
  soon as the gradient is (onnxruntime runs a node once its inputs are ready) and held
  through the rest of the backward pass, every weight's at once (116 MiB on a 30 M GPT).

Before the update, gradients may be clipped by their global norm (torch's
``clip_grad_norm_``): n = √Σ‖g‖², g ← g·min(1, c/(n + 1e-6)) where c = ``train.clip_norm``
is positive; n is an output of every step either way. Each ‖g‖² is the ReduceSum of g·g,
whose squares die at once (the update makes its own g² term, later: above).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from meshplan.errors import TrainError

OPTIMIZERS = ("sgd", "adamw")
HYPER = {"sgd": ("train.lr", "train.momentum", "train.weight_decay", "train.clip_norm"),
         "adamw": ("train.lr", "train.step", "train.beta1", "train.beta2", "train.eps", "train.weight_decay",
                   "train.clip_norm")}
# torch's defaults, used where the command line gives none
DEFAULTS = {"train.lr": 1e-3, "train.momentum": 0.0, "train.weight_decay": 0.0, "train.clip_norm": 0.0,
            "train.beta1": 0.9, "train.beta2": 0.999, "train.eps": 1e-8,
            "train.loss_scale": 1.0}   # (a plan with --master-weights: ``master_weights``)
SLOTS = {"sgd": ("momentum_buffer",), "adamw": ("exp_avg", "exp_avg_sq")}   # torch's state names
GRAD_NORM = "train.grad_norm"
UPDATED = ".updated"
# gradient accumulation over microbatches: each call adds its microbatch's gradient of the
# loss's sum into ``W.grad_acc`` and the sum and count into these; the call whose
# ``APPLY`` is 1 updates from their quotient and starts them again at 0
APPLY, ACC_TOTAL, ACC_COUNT, GRAD_ACC = "train.apply", "train.acc.total", "train.acc.count", "grad_acc"


def updated(name: str) -> str:
    """The output that becomes state input ``name`` at the next step."""
    return name + UPDATED


def slot(weight: str, kind: str) -> str:
    return f"{weight}.{kind}"


@dataclass
class _Emit:
    nodes: list = field(default_factory=list)
    constants: list = field(default_factory=list)
    count: int = 0

    def __call__(self, op: str, *inputs: str, name: str | None = None, **attrs) -> str:
        self.count += 1
        out = name or f"train.update/{op}_{self.count}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=f"train.update/n{self.count}", **attrs))
        return out

    def const(self, value, dtype) -> str:
        self.count += 1
        name = f"train.update/c{self.count}"
        self.constants.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name


def build_update(optimizer: str, weights: dict[str, tuple[str, np.dtype]], accumulate: tuple[str, str, str] | None
                 = None, guard: bool = False) -> _Emit:
    """The nodes of one step's update: ``weights`` maps each trained weight to (its gradient's
    name, its dtype); the new values are the outputs ``updated(name)`` (weights and slots).

    ``accumulate`` = (the microbatch's loss, its sum, its count): the gradient is of the
    microbatch's mean; it is accumulated as a sum (× count) with the loss's sum and count
    (``GRAD_ACC``, ``ACC_TOTAL``, ``ACC_COUNT``), and every state keeps its value unless
    ``APPLY``; the loss output ``train.loss`` is then the accumulated mean.

    ``guard``: a step whose gradients' global norm is not finite (a loss scale that made a
    float16 gradient overflow: ``master_weights``) leaves the weights and slots as they were,
    as torch's ``GradScaler`` skips ``optimizer.step()``; the accumulated gradients start
    again at 0 all the same."""
    if optimizer not in OPTIMIZERS:
        raise TrainError(f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZERS)})")
    e = _Emit()
    f32 = np.float32
    finals: dict[str, str] = {}     # output → its new value before the APPLY mask
    masked = accumulate is not None or guard
    apply = None
    if accumulate is not None:
        _, total, count = accumulate
        apply = e("Greater", APPLY, e.const(0.5, f32))
        count_sum = e("Add", ACC_COUNT, count)
        total_sum = e("Add", ACC_TOTAL, total)
        e("Div", total_sum, count_sum, name="train.loss")
        zero = e.const(0.0, f32)
        e("Where", apply, zero, count_sum, name=updated(ACC_COUNT))
        e("Where", apply, zero, total_sum, name=updated(ACC_TOTAL))
        summed = {}
        for name, (grad, dtype) in weights.items():
            scale = count_sum if dtype == np.float32 else e("Cast", count_sum, to=helper.np_dtype_to_tensor_dtype(dtype))
            counted = count if dtype == np.float32 else e("Cast", count, to=helper.np_dtype_to_tensor_dtype(dtype))
            acc = e("Add", slot(name, GRAD_ACC), e("Mul", grad, counted))
            e("Where", apply, e.const(0.0, dtype), acc, name=updated(slot(name, GRAD_ACC)))
            summed[name] = (e("Div", acc, scale), dtype)
        weights = summed
    squares = []
    for name, (grad, dtype) in weights.items():
        g32 = grad if dtype == np.float32 else e("Cast", grad, to=TensorProto.FLOAT)
        squares.append(e("ReduceSum", e("Mul", g32, g32), keepdims=0))
    norm = e("Sqrt", squares[0] if len(squares) == 1 else e("Sum", *squares), name=GRAD_NORM)
    clip = "train.clip_norm"
    coef = e("Min", e("Div", clip, e("Add", norm, e.const(1e-6, f32))), e.const(1.0, f32))
    scale = e("Where", e("Greater", clip, e.const(0.0, f32)), coef, e.const(1.0, f32))
    cast_of = {}

    def hyper(input_name: str, dtype) -> str:
        if np.dtype(dtype) == np.float32:
            return input_name
        key = (input_name, np.dtype(dtype).str)
        if key not in cast_of:
            cast_of[key] = e("Cast", input_name, to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        return cast_of[key]

    if optimizer == "adamw":   # scalars once a step, so that each weight's update reads its tensors fewest times
        t = "train.step"
        one = e.const(1.0, f32)
        correction1 = e("Sub", one, e("Pow", "train.beta1", t))
        correction2 = e("Sqrt", e("Sub", one, e("Pow", "train.beta2", t)))
        keep = e("Sub", one, e("Mul", "train.lr", "train.weight_decay"))
        rest1 = e("Mul", e("Sub", one, "train.beta1"), scale)                  # (1 − β1)·clip
        rest2 = e("Mul", e("Sub", one, "train.beta2"), e("Mul", scale, scale))  # (1 − β2)·clip²
        eps = e("Mul", "train.eps", correction2)
        step_size = e("Mul", e("Div", "train.lr", correction1), correction2)
    for name, (grad, dtype) in weights.items():
        h = lambda n: hyper(n, dtype)
        out = (lambda n: finals.setdefault(updated(n), f"{n}.new")) if masked else (lambda n: updated(n))
        if optimizer == "sgd":
            g = e("Add", e("Mul", grad, h(scale)), e("Mul", h("train.weight_decay"), name))
            buf = e("Add", e("Mul", h("train.momentum"), slot(name, "momentum_buffer")), g,
                    name=out(slot(name, "momentum_buffer")))
            e("Sub", name, e("Mul", h("train.lr"), buf), name=out(name))
            continue
        decayed = e("Mul", name, h(keep))
        m = e("Add", e("Mul", h("train.beta1"), slot(name, "exp_avg")), e("Mul", h(rest1), grad),
              name=out(slot(name, "exp_avg")))
        v = e("Add", e("Mul", h("train.beta2"), slot(name, "exp_avg_sq")), e("Mul", e("Mul", grad, h(rest2)), grad),
              name=out(slot(name, "exp_avg_sq")))
        denom = e("Add", e("Sqrt", v), h(eps))
        e("Sub", decayed, e("Mul", h(step_size), e("Div", m, denom)), name=out(name))
    if guard:   # a finite norm less itself is 0; an infinite or NaN one gives NaN
        finite = e("Equal", e("Sub", norm, norm), e.const(0.0, f32))
        apply = finite if apply is None else e("And", apply, finite)
    for output, new in finals.items():   # unchanged until the step's last microbatch (and where skipped)
        e("Where", apply, new, output[:-len(UPDATED)], name=output)
    return e


def unmasked(model: onnx.ModelProto, pairs: Mapping[str, str] | None = None) -> None:
    """``model`` as it computes with ``APPLY`` 1 (a step's last microbatch, a pipelined stage's
    update, which runs once a step): each weight's or slot's mask ``Where(Greater(APPLY, c),
    new, old)`` (``build_update``) is its new value itself, made by ``new``'s own node, which
    then need not read the old value (so a job may write it into the old value's buffer:
    ``model.in_place``). ``pairs``: each masked output → the state input it replaces (default:
    ``NAME.updated`` → ``NAME``). A mask that also skips a step whose gradients are not finite
    (``guard``) is another condition and stays. A new value that a node outside ONNX's domains
    makes (a collective of the plan, which a job runs between its sessions) is copied by an
    ``Identity`` in the mask's place instead, so that the state is made where the job keeps it
    (on a device, say). Changes ``model``."""
    graph = model.graph
    producer = {o: node for node in graph.node for o in node.output if o}
    outputs = {v.name for v in graph.output}
    dropped, renamed = set(), {}
    for node in graph.node:
        if node.op_type != "Where" or len(node.output) != 1:
            continue
        output = node.output[0]
        old_of = pairs.get(output) if pairs is not None else \
            (output[:-len(UPDATED)] if output.endswith(UPDATED) else None)
        condition, new, old = node.input
        test = producer.get(condition)
        if old_of is None or old != old_of or test is None or test.op_type != "Greater" or test.input[0] != APPLY:
            continue
        threshold = scalar_constant(graph, test.input[1])
        maker = producer.get(new)
        if threshold is None or not 0.0 <= threshold < 1.0 or maker is None or new in outputs:
            continue
        if maker.domain not in ("", "ai.onnx"):   # made by a node of the plan's own (a collective that
            node.op_type = "Identity"             # moves it to the state's layout): a copy where it is kept
            del node.input[:]
            node.input.append(new)
            continue
        maker.output[list(maker.output).index(new)] = output
        renamed[new] = output   # (what else reads the new value, the weight's step its slots', reads it so)
        dropped.add(id(node))
    if dropped:
        for node in graph.node:
            for index, name in enumerate(node.input):
                if name in renamed:
                    node.input[index] = renamed[name]
        kept = [n for n in graph.node if id(n) not in dropped]
        while True:   # and what only the masks read (the test of APPLY)
            read = {name for n in kept for name in n.input} | outputs
            alive = [n for n in kept if any(o in read for o in n.output)]
            if len(alive) == len(kept):
                break
            kept = alive
        del graph.node[:]
        graph.node.extend(kept)
        made = {o for n in graph.node for o in n.output}
        stale = [v for v in graph.value_info if v.name not in made]   # the masks' inputs renamed away
        for value in stale:
            graph.value_info.remove(value)


def idle_outputs(graph: onnx.GraphProto, updates: Mapping[str, str]) -> dict[str, str]:
    """The pairs of ``updates`` (a state output → the state input it replaces) whose output
    is ``Where(c, new, old)`` of that input in ``graph``, with ``c`` false whenever ``APPLY``
    is 0: ``Greater(APPLY, t)`` with a constant ``t`` ≥ 0, or an ``And`` of it with anything."""
    producer = {o: node for node in graph.node for o in node.output if o}

    def off_when_idle(name: str) -> bool:
        node = producer.get(name)
        if node is None:
            return False
        if node.op_type == "Greater":
            threshold = scalar_constant(graph, node.input[1])
            return node.input[0] == APPLY and threshold is not None and threshold >= 0.0
        if node.op_type == "And":
            return any(off_when_idle(i) for i in node.input)
        return False

    found = {}
    for output, source in updates.items():
        node = producer.get(output)
        if node is not None and node.op_type == "Where" and len(node.input) == 3 and node.input[2] == source \
                and off_when_idle(node.input[0]):
            found[output] = source
    return found


def scalar_constant(graph: onnx.GraphProto, name: str) -> float | None:
    """The value of ``name`` where it is a one-value initializer (in the file itself) or
    Constant node of ``graph`` (None otherwise)."""
    for tensor in graph.initializer:
        if tensor.name == name and not tensor.external_data and np.prod(tensor.dims, dtype=np.int64) == 1:
            return float(numpy_helper.to_array(tensor).reshape(-1)[0])
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attr in node.attribute:
                if attr.name == "value":
                    value = numpy_helper.to_array(attr.t)
                    return float(value.reshape(-1)[0]) if value.size == 1 else None
    return None
