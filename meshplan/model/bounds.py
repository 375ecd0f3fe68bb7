"""Data-dependent dimensions: a tensor whose size depends on tensor values (NonZero's
count, Compress, Unique, TopK with a computed k, NonMaxSuppression) gets a symbolic dim
and an upper bound.

onnx's shape inference names such a dim with a symbol (``unk__N``) at the node that makes
it and carries the symbol to every tensor it flows into (a Gather of the selected rows,
the MatMuls after it). Walking the nodes in topological order, the node where a symbol
first appears gives it the bound its operator's rule computes from its inputs' sizes (a
dim with no symbol gets a fresh one, ``dd<i>``). The bounds are kept in the model's metadata (``BOUNDS_KEY``): the
planner sizes such a tensor at its bound (cost, memory), never splits its bounded dims,
and keeps it inside one stage; the programs declare the symbol, so onnxruntime runs them
with the actual size.

A dim no rule below bounds (a Range over a computed length, a Loop's iterations) takes the
size one onnxruntime run on sample inputs gives it (``sample``; the loader's): an
estimate, listed under ``SAMPLED_KEY``. Nothing correct depends on a bound (such a dim is
never split and the programs declare it without a size): costs and memory do. Where the
sample run fails too, the loader's error ("dynamic dimension after folding") stands.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from math import prod

import onnx
from onnx import helper

BOUNDS_KEY = "meshplan.dim_bounds"
SAMPLED_KEY = "meshplan.dim_sampled"
SYMBOL_PREFIX = "dd"

# ops whose output dim i (aligned from the right) is at most the largest input dim i
_BROADCASTING = {
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Mean", "Sum", "Where", "Equal", "Less", "LessOrEqual",
    "Greater", "GreaterOrEqual", "And", "Or", "Xor", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "PRelu",
}
# ops that never make a dim longer than the same dim of their first input
_SHRINKING = {"Slice", "Compress", "TopK", "Unique", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin",
              "ReduceProd", "Identity", "Cast", "CastLike", "Softmax", "LogSoftmax", "Relu", "Sigmoid", "Tanh",
              "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Not", "Gelu", "Silu", "Clip"}


def read_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """Symbol → upper bound, as recorded in the model (empty for static models)."""
    for prop in model.metadata_props:
        if prop.key == BOUNDS_KEY:
            return {str(k): int(v) for k, v in json.loads(prop.value).items()}
    return {}


def _write_bounds(model: onnx.ModelProto, bounds: dict[str, int]) -> None:
    kept = [p for p in model.metadata_props if p.key != BOUNDS_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if bounds:
        model.metadata_props.append(onnx.StringStringEntryProto(key=BOUNDS_KEY, value=json.dumps(bounds, sort_keys=True)))


def _typed(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    typed = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input)}
    for init in model.graph.initializer:
        typed.setdefault(init.name, helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return typed


def _dims(value: onnx.ValueInfoProto | None, bounds: dict[str, int]) -> list[int | None] | None:
    """Each dim's value or bound (None where neither is known); None without a shape."""
    if value is None or not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return None
    found: list[int | None] = []
    for dim in value.type.tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            found.append(dim.dim_value)
        elif dim.HasField("dim_param") and dim.dim_param in bounds:
            found.append(bounds[dim.dim_param])
        else:
            found.append(None)
    return found


def _unknown(value: onnx.ValueInfoProto | None, bounds: dict[str, int]) -> list[int]:
    dims = _dims(value, bounds)
    return [] if dims is None else [i for i, d in enumerate(dims) if d is None]


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _bound(node: onnx.NodeProto, ins: list[list[int] | None], out_dims: list[int | None], axis: int) -> int | None:
    """An upper bound of dim ``axis`` of an output of ``node`` whose static dims are
    ``out_dims`` (None where not a number); None where no rule applies."""
    out_rank = len(out_dims)
    first = ins[0] if ins else None
    if first is not None and any(d is None for d in first):
        return None
    size = prod(first) if first is not None else None
    op = node.op_type
    if size is None and op in ("NonZero", "Compress", "Unique", "TopK", "Reshape", "Flatten"):
        return None
    if op == "NonZero":
        return size
    if op in ("Compress", "Unique", "TopK"):
        along = _attr(node, "axis", -1 if op == "TopK" else None)
        if along is None:
            return size
        along %= len(first)
        return first[axis] if axis != along and out_rank == len(first) else first[along]
    if op == "NonMaxSuppression":
        scores = ins[1]
        if scores is None or any(d is None for d in scores):
            return None
        return prod(scores)                    # batches × classes × boxes
    if op in ("Reshape", "Flatten"):   # as many elements as its input: the other dims divide them
        others = prod(d for k, d in enumerate(out_dims) if k != axis and d is not None and d > 0)
        return size // others
    if op == "Concat":
        along = _attr(node, "axis") % out_rank
        if any(i is None or any(d is None for d in i) for i in ins):
            return None
        return sum(i[along] for i in ins)
    if op in _BROADCASTING:
        candidates = [i[len(i) - out_rank + axis] for i in ins
                      if i is not None and len(i) - out_rank + axis >= 0]
        if not candidates or any(c is None for c in candidates):
            return None
        return max(candidates)
    if op in _SHRINKING and first is not None and len(first) == out_rank:
        return first[axis]
    if op == "Gather" and first is not None:
        along = _attr(node, "axis", 0) % len(first)
        index = ins[1]
        if index is None or any(d is None for d in index):
            return None
        shape = first[:along] + index + first[along + 1:]
        return shape[axis] if len(shape) == out_rank else None
    return None


def bound_dynamic_dims(model: onnx.ModelProto, on_unbounded: Callable[[onnx.NodeProto, str], None],
                       sample: Callable[[], dict[str, tuple[int, ...]]] | None = None) -> None:
    """Give every data-dependent dim of an inferred ``model`` a bound, in place (see the
    module's doc). A dim no rule bounds takes its size in ``sample()`` (every node output's
    shape in one run on sample inputs; called once, when first needed): an estimate,
    recorded under ``SAMPLED_KEY``. ``on_unbounded(node, tensor)`` is called (and must
    raise) for a dim neither gives."""
    bounds = read_bounds(model)
    typed = _typed(model)
    fresh = 0
    sampled: list[str] = []
    observed: dict[str, tuple[int, ...]] | None = None
    for node in model.graph.node:
        ins = None
        for index, name in enumerate(node.output):
            value = typed.get(name) if name else None
            missing = _unknown(value, bounds)
            if not missing:
                continue
            if ins is None:
                ins = [_dims(typed.get(i), bounds) if i else None for i in node.input]
            dims = value.type.tensor_type.shape.dim
            for axis in missing:
                static = [d.dim_value if d.HasField("dim_value") else None for d in dims]
                bound = _bound(node, ins, static, axis)
                if bound is None and sample is not None:
                    observed = sample() if observed is None else observed
                    if name in observed and len(observed[name]) == len(dims):
                        bound = observed[name][axis]
                if bound is None:
                    on_unbounded(node, name)
                    raise AssertionError("on_unbounded must raise")
                if not dims[axis].dim_param:
                    while f"{SYMBOL_PREFIX}{fresh}" in bounds:
                        fresh += 1
                    dims[axis].dim_param = f"{SYMBOL_PREFIX}{fresh}"
                if _bound(node, ins, static, axis) is None:
                    sampled.append(dims[axis].dim_param)
                bounds[dims[axis].dim_param] = max(int(bound), 0)
    _write_bounds(model, bounds)
    _write_list(model, SAMPLED_KEY, sampled)


def read_sampled(model: onnx.ModelProto) -> list[str]:
    """The symbols whose bound is a sample run's size, not a bound."""
    for prop in model.metadata_props:
        if prop.key == SAMPLED_KEY:
            return list(json.loads(prop.value))
    return []


def _write_list(model: onnx.ModelProto, key: str, values: list[str]) -> None:
    kept = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if values:
        model.metadata_props.append(onnx.StringStringEntryProto(key=key, value=json.dumps(sorted(set(values)))))
