"""Shapes that onnx's shape inference leaves unknown: the outputs of onnxruntime's
``com.microsoft`` operators (it has no schema for them), and inputs of same-shape
operators whose output shape is known (onnx infers forward only: a ReduceSum over axes
read from an input has no shape, but the Sqrt of it that is a graph output has the shape
the model declares, and so has the sum).

``infer_with_contrib`` alternates onnx's inference with these rules until nothing new is
learnt, so the operators downstream get their shapes too.
"""

from __future__ import annotations

from math import prod
from typing import Callable

import onnx
from onnx import helper, numpy_helper

MICROSOFT = "com.microsoft"


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _matmul_nbits(node: onnx.NodeProto, types: dict, values: dict) -> list | None:
    """A's element type and shape, with the last dim N."""
    a = types.get(node.input[0])
    if a is None:
        return None
    elem, shape = a
    return [(elem, shape[:-1] + [_attrs(node)["N"]])]


def _with_ones_from(shape: list, axis: int) -> list:
    axis = axis + len(shape) if axis < 0 else axis
    return shape[:axis] + [1] * (len(shape) - axis)


def _layer_norm(node: onnx.NodeProto, types: dict, values: dict) -> list | None:
    """(Simplified)LayerNormalization as onnxruntime defines it: Y of the scale's type and
    X's shape; the statistics (Mean, InvStdDev) in ``stash_type`` with 1 from ``axis`` on."""
    x, scale = types.get(node.input[0]), types.get(node.input[1])
    if x is None or scale is None:
        return None
    attrs = _attrs(node)
    stats = (attrs.get("stash_type", onnx.TensorProto.FLOAT), _with_ones_from(x[1], attrs.get("axis", -1)))
    return [(scale[0], x[1])] + [stats] * (len(node.output) - 1)


def _skip_layer_norm(node: onnx.NodeProto, types: dict, values: dict) -> list | None:
    """Skip(Simplified)LayerNormalization: the output and the input+skip(+bias) sum of the
    input's type and shape; mean and inverse standard deviation in float with last dim 1."""
    x = types.get(node.input[0])
    if x is None:
        return None
    stats = (onnx.TensorProto.FLOAT, _with_ones_from(x[1], -1))
    return [x, stats, stats, x][:len(node.output)]


def _same_as_input(node: onnx.NodeProto, types: dict, values: dict) -> list | None:
    x = types.get(node.input[0])
    return None if x is None else [x]


def _gather_block_quantized(node: onnx.NodeProto, types: dict, values: dict) -> list | None:
    """The scales' type; data's shape (uint8 data packs 8 / bits values per byte along
    ``quantize_axis``) with ``gather_axis`` replaced by the indices' shape."""
    data, indices, scales = (types.get(name) for name in node.input[:3])
    if data is None or indices is None or scales is None:
        return None
    attrs = _attrs(node)
    shape = list(data[1])
    rank = len(shape)
    quantize_axis = attrs.get("quantize_axis", 1) % rank
    gather_axis = attrs.get("gather_axis", 0) % rank
    if data[0] == onnx.TensorProto.UINT8 and isinstance(shape[quantize_axis], int):
        shape[quantize_axis] *= 8 // attrs.get("bits", 4)
    return [(scales[0], shape[:gather_axis] + list(indices[1]) + shape[gather_axis + 1:])]


def _scalar(values: dict, name: str) -> int | None:
    value = values.get(name) if name else None
    return None if value is None or value.size != 1 else int(value.reshape(-1)[0])


def _group_query_attention(node: onnx.NodeProto, types: dict, values: dict) -> list | None:
    """output [batch, seq, num_heads * head_size] of the query's type; present key and
    value [batch, kv_num_heads, max(past length, total_sequence_length), head_size] (the
    past's length where past and present share a buffer of fixed capacity). Where
    total_sequence_length is computed at run time (a ranged plan's canonical model: the
    attention mask's length) the cache's length is left unknown: the buffer's capacity for
    a shared buffer, past + new positions for a growing cache, as the model folded at each
    size says; the output's shape never depends on it."""
    inputs = list(node.input) + [""] * (16 - len(node.input))
    query = types.get(inputs[0])
    if query is None or len(query[1]) != 3:
        return None
    attrs = _attrs(node)
    heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
    batch, seq, width = query[1]
    if not isinstance(width, int):
        return None
    head_size = width // (heads + 2 * kv_heads) if not inputs[1] else width // heads
    found = [(query[0], [batch, seq, heads * head_size])]
    if len(node.output) > 1:
        total = _scalar(values, inputs[6])
        past = types.get(inputs[3]) if inputs[3] else None
        capacity = past[1][2] if past is not None and isinstance(past[1][2], int) else None
        if total is None:
            length = None    # computed at run time (a ranged plan): the folded views give its sizes
        else:
            length = total if capacity is None else max(total, capacity)
        cache = (past[0] if past is not None else query[0], [batch, kv_heads, length, head_size])
        found += [cache, cache]
    return found[:len(node.output)]


def _multi_head_attention(node: onnx.NodeProto, types: dict, values: dict) -> list | None:
    """Separate query [batch, seq, hidden], key and value [batch, kv_seq, hidden(v)]: output
    [batch, seq, v hidden]; present key and value [batch, num_heads, past + kv_seq, head size]."""
    inputs = list(node.input) + [""] * (10 - len(node.input))
    query, key, value = (types.get(name) if name else None for name in inputs[:3])
    if query is None or key is None or value is None or len(query[1]) != 3 or len(key[1]) != 3:
        return None
    heads = _attrs(node)["num_heads"]
    batch, seq, _ = query[1]
    found = [(query[0], [batch, seq, value[1][2]])]
    past = types.get(inputs[6]) if inputs[6] else None
    length = key[1][1] + (past[1][2] if past is not None else 0)
    found += [(query[0], [batch, heads, length, key[1][2] // heads]),
              (query[0], [batch, heads, length, value[1][2] // heads])]
    return found[:len(node.output)]


# (domain, op type) → f(node, known (elem type, shape) by tensor name, small constant values
# by name) → (elem type, shape) per output, or None
RULES: dict[tuple[str, str], Callable] = {
    (MICROSOFT, "MatMulNBits"): _matmul_nbits,
    (MICROSOFT, "SkipSimplifiedLayerNormalization"): _skip_layer_norm,
    (MICROSOFT, "SkipLayerNormalization"): _skip_layer_norm,
    (MICROSOFT, "RotaryEmbedding"): _same_as_input,
    (MICROSOFT, "GatherBlockQuantized"): _gather_block_quantized,
    (MICROSOFT, "GroupQueryAttention"): _group_query_attention,
    (MICROSOFT, "MultiHeadAttention"): _multi_head_attention,
    ("", "SimplifiedLayerNormalization"): _layer_norm,   # onnxruntime's, in the default domain
    ("", "LayerNormalization"): _layer_norm,             # onnxruntime's before opset 17
}


def _known(model: onnx.ModelProto) -> dict[str, tuple[int, list]]:
    """Tensors with a typed shape: graph inputs, value_info, outputs, initializers."""
    found = {}
    g = model.graph
    for value in list(g.input) + list(g.value_info) + list(g.output):
        t = value.type.tensor_type
        if value.type.HasField("tensor_type") and t.HasField("shape") and t.elem_type:
            found[value.name] = (t.elem_type, [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                                              for d in t.shape.dim])
    for init in g.initializer:
        found[init.name] = (init.data_type, list(init.dims))
    return found


# Operators (default domain) whose output has the shape of their first input.
SAME_SHAPE = {
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "BitwiseNot", "Cast", "CastLike", "Ceil", "Celu",
    "Cos", "Cosh", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN",
    "LeakyRelu", "Log", "Mish", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign",
    "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu",
}


def add_shapes_from_consumers(model: onnx.ModelProto) -> bool:
    """Give the first input of a same-shape operator its output's static shape where onnx
    left the input's shape unknown but typed its elements; whether any was added."""
    known = _known(model)
    untyped = {v.name: v for v in model.graph.value_info
               if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type and v.name not in known}
    added = False
    for node in reversed(model.graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in SAME_SHAPE or not node.input:
            continue
        source, result = node.input[0], known.get(node.output[0])
        if source not in untyped or result is None or not all(isinstance(d, int) for d in result[1]):
            continue
        value = untyped.pop(source)
        value.CopyFrom(helper.make_tensor_value_info(source, value.type.tensor_type.elem_type, result[1]))
        known[source] = (value.type.tensor_type.elem_type, result[1])
        added = True
    return added


def _small_values(model: onnx.ModelProto) -> dict:
    """Values of the small loaded initializers (GroupQueryAttention's total_sequence_length)."""
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
            if t.data_location != onnx.TensorProto.EXTERNAL and prod(t.dims) <= 16}


def add_contrib_shapes(model: onnx.ModelProto) -> bool:
    """Add value_info for the outputs of contrib ops whose inputs are known; whether any was
    added. A graph output whose declared static shape the operator contradicts takes the
    operator's (GroupQueryAttention's present key and value are declared with the total
    sequence length, but are the past's buffer where past and present share one)."""
    known = _known(model)
    outputs = {v.name: v for v in model.graph.output}
    values = None
    added = False
    for node in model.graph.node:
        rule = RULES.get(("" if node.domain in ("", "ai.onnx") else node.domain, node.op_type))
        if rule is None or all(not name or (name in known and name not in outputs) for name in node.output):
            continue
        values = _small_values(model) if values is None else values
        found = rule(node, known, values)
        for name, typed in zip(node.output, found or []):
            if not name:
                continue
            if name in known:
                static = all(isinstance(d, int) for d in typed[1])
                if name not in outputs or not static or list(known[name][1]) == list(typed[1]):
                    continue
            value = helper.make_tensor_value_info(name, *typed)
            if name in outputs:
                outputs[name].CopyFrom(value)
            else:
                model.graph.value_info.append(value)
            known[name] = typed
            added = True
    return added


def has_rules(model: onnx.ModelProto) -> bool:
    """Whether the model has an operator whose shapes only these rules give."""
    return any(("" if n.domain in ("", "ai.onnx") else n.domain, n.op_type) in RULES for n in model.graph.node)


def infer_with_contrib(model: onnx.ModelProto, infer: Callable[[onnx.ModelProto], onnx.ModelProto],
                       lenient: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None) -> onnx.ModelProto:
    """``infer`` (onnx's shape inference), then contrib shapes, until neither learns more.
    With ``lenient`` (inference that leaves what it cannot type untyped) and an operator of
    ``RULES``, the two alternate leniently first: a strict pass would stop at the first
    reader of an output onnx cannot type (a schema without an inference function)."""
    if lenient is not None and has_rules(model):
        model = lenient(model)
        while add_contrib_shapes(model) or add_shapes_from_consumers(model):
            model = lenient(model)
    model = infer(model)
    while add_contrib_shapes(model) or add_shapes_from_consumers(model):
        model = infer(model)
    return model
