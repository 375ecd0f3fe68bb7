"""The training step as one ONNX model: forward, loss, backward, clipping and update.

``build_step_model`` turns a forward model into a model that the planner plans and the job
runs like any other:

- each trained weight (a float initializer of two or more elements, finite where stored
  inline, that the loss depends on, not matched by ``--frozen``) becomes a state input of
  the same name, and its new value the output ``NAME.updated`` (``optimizers.updated``);
  the optimizer's slots (``NAME.exp_avg``, ``NAME.exp_avg_sq`` or ``NAME.momentum_buffer``)
  are state too, starting at zero. State stays on the ranks that hold it between steps, so
  the weights are resident and updated in place of the old ones;
- the loss's target and the hyperparameters (``optimizers.HYPER``: learning rate, step,
  betas, ...) are inputs of every step; ``train.loss`` and ``train.grad_norm`` its outputs;
- frozen weights stay initializers (sliced by the emitter as any weight);
- a weight the exporter stored twice (a tied embedding and its transposed copy) is trained
  once, the copy a node of it (``ties.py``);
- with ``master_weights``, a float16/bfloat16 weight is float32 state read through a cast,
  and the loss's gradient is scaled (``master_weights.py``).

The forward graph is brought to opset 18 first (the gradient rules are written in its
operator forms). The trained weights' values are not in the step model: a job starts from
the source model's (``manifest["weights"]``) or from a checkpoint.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from meshplan.errors import TrainError
from meshplan.model.load import name_nodes
from meshplan.ops.grad_words import GradientError
from meshplan.training.autodiff import gradients, is_float
from meshplan.training.losses import COUNT, LOSS, TOTAL, LossSpec, build_loss
from meshplan.training.master_weights import LOSS_SCALE, hold_in_float32, scaled_loss, unscaled
from meshplan.training.ties import retie
from meshplan.training.optimizers import (ACC_COUNT, ACC_TOTAL, APPLY, GRAD_ACC, GRAD_NORM, HYPER, SLOTS,
                                          build_update, slot, updated)

OPSET = 18


@dataclass(frozen=True)
class TrainSpec:
    """What ``meshplan plan --train`` asks for."""

    loss: str
    optimizer: str = "adamw"
    frozen: tuple[str, ...] = ()
    microbatches: int = 1        # calls a step's batch is split into (gradients accumulated)
    stages: int = 1              # pipeline stages (> 1: accumulated even over one microbatch)
    master_weights: bool = False  # float16/bfloat16 weights held and updated in float32 (``master_weights``)

    @property
    def accumulate(self) -> bool:
        return self.microbatches > 1 or self.stages > 1


@dataclass
class StepModel:
    model: onnx.ModelProto
    state: dict[str, str]                 # output → the state input it becomes
    manifest: dict = field(default_factory=dict)
    # each node's part of the step (by node name): FORWARD (the model, its loss, tied
    # copies), BACKWARD (the gradients) or UPDATE (accumulation, clipping, the optimizer);
    # and each backward node's forward node (``autodiff.Gradients.origin``)
    roles: dict[str, str] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    gradients: dict[str, str] = field(default_factory=dict)   # trained weight → its gradient's tensor


FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _trained(model: onnx.ModelProto, frozen: tuple[str, ...]) -> list[onnx.TensorProto]:
    chosen = []
    for tensor in model.graph.initializer:
        if not is_float(helper.tensor_dtype_to_np_dtype(tensor.data_type)) or int(np.prod(tensor.dims)) < 2:
            continue
        if any(fnmatch.fnmatchcase(tensor.name, p) for p in frozen):
            continue
        if tensor.data_location != TensorProto.EXTERNAL and tensor.ByteSize() < (1 << 20):
            if is_additive_mask(numpy_helper.to_array(tensor)):
                continue
        chosen.append(tensor)
    return chosen


MASK_FLOOR = -1e3   # an additive mask's blocked value is at most this (exporters write -1e4, -1e9, finfo.min, -inf)


def is_additive_mask(values: np.ndarray) -> bool:
    """A constant added to attention scores to block positions (a causal mask), not a weight:
    it holds -inf, or only 0 and one value of ``MASK_FLOOR`` or below (torch keeps such a
    tensor as a buffer, which its optimizer does not train)."""
    if not np.all(np.isfinite(values)):
        return True
    distinct = np.unique(values)
    return len(distinct) == 2 and distinct[1] == 0 and distinct[0] <= MASK_FLOOR


def _attr(node: onnx.NodeProto, name: str, default=None):
    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


def _training_modes(model: onnx.ModelProto) -> dict[str, str]:
    """Operators exported in training mode, as training runs them: a BatchNormalization with
    ``training_mode=1`` normalises by the batch's statistics and its running statistics
    (initializers) are state, updated each step — returned as {updated output: input}; a
    Dropout in training mode gets its mask output (its gradient reads it)."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    constants = {t.name: t for t in graph.initializer}
    stats = {}
    for node in graph.node:
        if node.op_type == "BatchNormalization" and _attr(node, "training_mode", 0):
            while len(node.output) < 3:
                node.output.append("")
            for index, out in ((3, 1), (4, 2)):
                name = node.input[index]
                if name in initializers and name not in stats.values():
                    node.output[out] = updated(name)
                    stats[updated(name)] = name
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2] in constants:
            training = bool(numpy_helper.to_array(constants[node.input[2]]))
            if training and (len(node.output) < 2 or not node.output[1]):
                while len(node.output) < 2:
                    node.output.append("")
                node.output[1] = f"{node.output[0]}.mask"
    return stats


def build_step_model(source: str | Path, spec: TrainSpec) -> StepModel:
    """The training step of the model at ``source`` (read without its external weights)."""
    source = Path(source)
    model = onnx.load(str(source), load_external_data=False)
    if _opset(model) < OPSET:
        try:
            model = onnx.version_converter.convert_version(model, OPSET)
        except Exception as exc:
            raise TrainError(f"{source}: opset {_opset(model)} could not be brought to {OPSET} for training "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    loss_spec = LossSpec.parse(spec.loss)
    accumulate = spec.accumulate
    seed = LOSS + "/microbatch" if accumulate else LOSS
    loss = build_loss(model, loss_spec, seed)
    graph = model.graph
    tied = retie(model, source.parent, {t.name for t in _trained(model, spec.frozen)})
    stats = _training_modes(model)
    candidates = [t for t in _trained(model, spec.frozen) if t.name not in stats.values()]
    by_name = {t.name: t for t in candidates}
    statistics = {t.name: t for t in model.graph.initializer if t.name in stats.values()}
    graph.node.extend(loss.nodes)
    graph.initializer.extend(loss.constants)
    masters = _masters(model, candidates) if spec.master_weights else {}
    start = seed
    if masters:
        node, start = scaled_loss(seed)
        graph.node.append(node)
    name_nodes(model)
    if loss.target is not None:
        graph.input.append(loss.target)
    controls = list(HYPER[spec.optimizer]) + ([APPLY] if accumulate else []) + ([LOSS_SCALE] if masters else [])
    held = {t.name: TensorProto.FLOAT if t.name in masters else t.data_type for t in candidates}
    graph.input.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in controls)
    # trained weights become inputs (before shape inference, so it sees them as such)
    kept = [t for t in graph.initializer if t.name not in by_name]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    for tensor in candidates + list(statistics.values()):
        graph.input.append(helper.make_tensor_value_info(tensor.name, held.get(tensor.name, tensor.data_type),
                                                         list(tensor.dims)))
    kept = [t for t in graph.initializer if t.name not in statistics]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:
        raise TrainError(f"shape inference of the training graph failed: {str(exc).splitlines()[0]}") from None
    try:
        found = gradients(inferred, start, list(by_name))
    except GradientError:
        raise
    reached = {n: g for n, g in found.of.items() if g is not None}
    rescale, reached, origin = unscaled(reached, masters)
    if not reached:
        hint = "every float weight is frozen or does not reach the loss" if candidates else \
            "the model has no float weight of two or more elements outside --frozen"
        raise TrainError("nothing to train: no weight takes a gradient from the loss", hint=hint)
    # weights the loss does not reach stay initializers, as frozen ones
    for name in [n for n in by_name if n not in reached]:
        graph.input.remove(next(v for v in graph.input if v.name == name))
        graph.initializer.append(by_name.pop(name))
    dtypes = {n: np.dtype(helper.tensor_dtype_to_np_dtype(held[n])) for n in reached}
    update = build_update(spec.optimizer, {n: (reached[n], dtypes[n]) for n in reached},
                          (seed, TOTAL, COUNT) if accumulate else None, guard=bool(masters))
    roles = {node.name: FORWARD for node in graph.node}
    roles.update({node.name: BACKWARD for node in found.nodes + rescale})
    roles.update({node.name: UPDATE for node in update.nodes})
    graph.node.extend(found.nodes + rescale)
    graph.initializer.extend(found.constants)
    graph.node.extend(update.nodes)
    graph.initializer.extend(update.constants)
    state = {}
    slots = SLOTS[spec.optimizer] + ((GRAD_ACC,) if accumulate else ())
    for name in reached:
        tensor = by_name[name]
        for kind in slots:
            graph.input.append(helper.make_tensor_value_info(slot(name, kind), held[name], list(tensor.dims)))
            state[updated(slot(name, kind))] = slot(name, kind)
        state[updated(name)] = name
    state.update(stats)
    accumulators = [ACC_TOTAL, ACC_COUNT] if accumulate else []
    for name in accumulators:
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))
        state[updated(name)] = name
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(LOSS, TensorProto.FLOAT, []))
    graph.output.append(helper.make_tensor_value_info(GRAD_NORM, TensorProto.FLOAT, []))
    for out, name in state.items():
        if name in accumulators:
            graph.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, []))
            continue
        tensor = statistics.get(name) or by_name.get(name) or by_name[name.rsplit(".", 1)[0]]
        graph.output.append(helper.make_tensor_value_info(out, held.get(tensor.name, tensor.data_type),
                                                          list(tensor.dims)))
    del graph.value_info[:]
    manifest = {
        "loss": str(loss_spec), "optimizer": spec.optimizer, "frozen": list(spec.frozen),
        "target": loss_spec.target, "hyperparameters": controls,
        "weights": {name: {"shape": list(by_name[name].dims), "dtype": dtypes[name].name,
                           **({"model_dtype": _dtype_name(masters[name])} if name in masters else {})}
                    for name in reached},
        "slots": list(slots), "microbatches": spec.microbatches, "accumulators": accumulators,
        "not_reached": sorted(set(t.name for t in candidates) - set(reached)),
        "guarded": bool(masters),     # a step whose gradients are not finite is skipped (``build_update``)
        "tied": tied,
        "statistics": {name: {"shape": list(t.dims),
                              "dtype": np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).name}
                       for name, t in statistics.items()},
    }
    return StepModel(model, state, manifest, roles, {**found.origin, **origin}, dict(reached))


def _masters(model: onnx.ModelProto, candidates: list) -> dict[str, int]:
    """``--master-weights``: the float16/bfloat16 ones of ``candidates`` read through casts of
    float32 masters (``master_weights``); one error line where there are none."""
    try:
        masters = hold_in_float32(model, candidates)
    except ValueError as exc:
        raise TrainError(f"--master-weights: {exc}") from None
    if not masters:
        raise TrainError("--master-weights: no trained weight is float16 or bfloat16",
                         hint="the weights already train in their own dtype; leave --master-weights out")
    return masters


def _dtype_name(data_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).name


def save_step_model(step: StepModel, source: str | Path, path: str | Path) -> Path:
    """Write the step model to ``path``: the frozen weights it keeps that lie in the source
    model's external data files (beside ``source``) are copied range by range, never held in
    memory, into the step model's own data file (``path`` + ``.data``); those inline in the
    source stay inline. Written to temporary names, then renamed."""
    from meshplan.model.weights import copy_range, point_to

    path, base = Path(path), Path(source).parent
    model = step.model
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    staging = data.with_name(data.name + ".tmp")
    offset = 0
    with open(staging, "wb") as out:
        for tensor in model.graph.initializer:
            if tensor.data_location != TensorProto.EXTERNAL:
                continue
            length = copy_range(tensor, base, out)
            point_to(tensor, data.name, offset, length)
            offset += length
    if offset:
        staging.replace(data)
    else:
        staging.unlink()
    written = path.with_name(path.name + ".tmp")
    onnx.save(model, str(written))
    written.replace(path)
    return path
