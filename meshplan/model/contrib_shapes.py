"""Shapes that onnx's shape inference leaves unknown: the outputs of onnxruntime's
``com.microsoft`` operators (it has no schema for them), and inputs of same-shape
operators whose output shape is known (onnx infers forward only: a ReduceSum over axes
read from an input has no shape, but the Sqrt of it that is a graph output has the shape
the model declares, and so has the sum).

``infer_with_contrib`` alternates onnx's inference with these rules until nothing new is
learnt, so the operators downstream get their shapes too.
"""

from __future__ import annotations

from typing import Callable

import onnx
from onnx import helper

MICROSOFT = "com.microsoft"


def _matmul_nbits(node: onnx.NodeProto, types: dict) -> list[tuple[int, list[int]]] | None:
    """A's element type and shape, with the last dim N."""
    a = types.get(node.input[0])
    if a is None:
        return None
    n = next(att.i for att in node.attribute if att.name == "N")
    elem, shape = a
    return [(elem, shape[:-1] + [n])]


# op type → f(node, known (elem type, shape) by tensor name) → (elem type, shape) per output, or None
RULES: dict[str, Callable] = {"MatMulNBits": _matmul_nbits}


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


def add_contrib_shapes(model: onnx.ModelProto) -> bool:
    """Add value_info for the outputs of contrib ops whose inputs are known; whether any was added."""
    known = _known(model)
    outputs = {v.name: v for v in model.graph.output}
    added = False
    for node in model.graph.node:
        rule = RULES.get(node.op_type) if node.domain == MICROSOFT else None
        if rule is None or all(not name or name in known for name in node.output):
            continue
        found = rule(node, known)
        for name, typed in zip(node.output, found or []):
            if not name or name in known:
                continue
            value = helper.make_tensor_value_info(name, *typed)
            if name in outputs:
                outputs[name].CopyFrom(value)
            else:
                model.graph.value_info.append(value)
            known[name] = typed
            added = True
    return added


def infer_with_contrib(model: onnx.ModelProto, infer: Callable[[onnx.ModelProto], onnx.ModelProto]) -> onnx.ModelProto:
    """``infer`` (onnx's shape inference), then contrib shapes, until neither learns more."""
    model = infer(model)
    while add_contrib_shapes(model) or add_shapes_from_consumers(model):
        model = infer(model)
    return model
