"""Shapes of onnxruntime's ``com.microsoft`` operators that onnx's shape inference leaves
unknown (it has no schema for them).

``infer_with_contrib`` alternates onnx's inference with these rules until nothing new is
learnt, so the operators downstream of a contrib op get their shapes too.
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
    while add_contrib_shapes(model):
        model = infer(model)
    return model
