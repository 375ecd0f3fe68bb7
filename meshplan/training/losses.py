"""Losses as ONNX nodes appended to the forward graph.

``cross_entropy:LOGITS:TARGET``: classes on LOGITS' last axis, the mean over the positions
whose TARGET is not -100 (torch's ``F.cross_entropy`` on the flattened logits, computed in
float32 whatever the logits' type); ``mse:OUTPUT:TARGET``: the mean of the squared
differences; ``OUTPUT``: a scalar the model computes. TARGET becomes an input of the
training program, its dims named as the output's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from meshplan.errors import TrainError

IGNORE_INDEX = -100
LOSS = "train.loss"
# the loss as a sum over the batch and the count it is the mean over (the positions that
# count for cross-entropy, the elements for MSE, 1 for a model's scalar): what microbatches
# accumulate, so that a step's loss is the mean over its whole batch
TOTAL, COUNT = "train.loss/total", "train.loss/count"


@dataclass(frozen=True)
class LossSpec:
    kind: str                  # "cross_entropy", "mse" or "output"
    output: str
    target: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LossSpec":
        parts = text.split(":")
        if len(parts) == 1 and parts[0]:
            return cls("output", parts[0])
        if len(parts) == 3 and parts[0] in ("cross_entropy", "mse") and parts[1] and parts[2]:
            return cls(parts[0], parts[1], parts[2])
        raise TrainError(f"--loss {text!r}: expected cross_entropy:LOGITS:TARGET, mse:OUTPUT:TARGET or OUTPUT")

    def __str__(self) -> str:
        return self.output if self.kind == "output" else f"{self.kind}:{self.output}:{self.target}"


@dataclass
class LossNodes:
    nodes: list
    constants: list
    target: onnx.ValueInfoProto | None    # the new input, or None


def _output_type(model: onnx.ModelProto, name: str) -> onnx.TypeProto:
    for value in model.graph.output:
        if value.name == name:
            return value.type
    outputs = ", ".join(v.name for v in model.graph.output)
    raise TrainError(f"the loss names no output of the model: {name!r} (outputs: {outputs})")


def build_loss(model: onnx.ModelProto, spec: LossSpec, name: str = LOSS) -> LossNodes:
    """The nodes computing the loss ``name`` (a float32 scalar) from the model's outputs, as
    ``TOTAL`` / ``COUNT``."""
    kind = _output_type(model, spec.output).tensor_type
    names = {v.name for v in list(model.graph.input) + list(model.graph.output)}
    if spec.target is not None and spec.target in names:
        raise TrainError(f"the loss target {spec.target!r} is already a tensor of the model; name it otherwise")
    dims = list(kind.shape.dim)
    c = lambda name, value: numpy_helper.from_array(np.asarray(value), f"train.loss/{name}")
    nodes, consts = [], []

    def node(op, inputs, name, **attrs):
        out = f"train.loss/{name}"
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    logits = spec.output
    if kind.elem_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE):
        raise TrainError(f"loss output {spec.output!r} is not a floating tensor")
    if kind.elem_type != TensorProto.FLOAT:
        logits = node("Cast", [logits], "as_float", to=TensorProto.FLOAT)
    if spec.kind == "output":
        if len(dims) and any(not d.HasField("dim_value") or d.dim_value != 1 for d in dims):
            raise TrainError(f"loss output {spec.output!r} is not a scalar (shape "
                             f"{[d.dim_value or d.dim_param for d in dims]})", hint="name a scalar, or use mse:/cross_entropy:")
        consts += [c("shape", np.zeros(0, dtype=np.int64)), c("one", np.float32(1.0))]
        nodes.append(helper.make_node("Reshape", [logits, "train.loss/shape"], [TOTAL], name=TOTAL))
        nodes.append(helper.make_node("Identity", ["train.loss/one"], [COUNT], name=COUNT))
        nodes.append(helper.make_node("Div", [TOTAL, COUNT], [name], name=name))
        return LossNodes(nodes, consts, None)
    if spec.kind == "mse":
        target = helper.make_tensor_value_info(spec.target, TensorProto.FLOAT, _dims(dims))
        diff = node("Sub", [logits, spec.target], "diff")
        square = node("Mul", [diff, diff], "square")
        consts.append(c("axes", np.arange(len(dims), dtype=np.int64)))
        nodes.append(helper.make_node("ReduceSum", [square, "train.loss/axes"], [TOTAL], name=TOTAL, keepdims=0))
        size = node("Size", [square], "size")
        nodes.append(helper.make_node("Cast", [size], [COUNT], name=COUNT, to=TensorProto.FLOAT))
        nodes.append(helper.make_node("Div", [TOTAL, COUNT], [name], name=name))
        return LossNodes(nodes, consts, target)
    if not dims:
        raise TrainError(f"cross_entropy: {spec.output!r} has no class axis")
    target = helper.make_tensor_value_info(spec.target, TensorProto.INT64, _dims(dims[:-1]))
    consts += [c("ignore", np.int64(IGNORE_INDEX)), c("zero_id", np.int64(0)), c("last", np.array([-1])),
               c("zero", np.float32(0.0)), c("axes", np.arange(len(dims) - 1, dtype=np.int64))]
    logp = node("LogSoftmax", [logits], "log_probs", axis=-1)
    ignored = node("Equal", [spec.target, "train.loss/ignore"], "ignored")
    valid = node("Not", [ignored], "valid")
    ids = node("Where", [valid, spec.target, "train.loss/zero_id"], "ids")
    picked = node("GatherElements", [logp, node("Unsqueeze", [ids, "train.loss/last"], "ids1")], "picked", axis=-1)
    nll = node("Neg", [node("Squeeze", [picked, "train.loss/last"], "picked0")], "nll")
    kept = node("Where", [valid, nll, "train.loss/zero"], "kept")
    total = node("ReduceSum", [kept, "train.loss/axes"], "total", keepdims=0)
    count = node("ReduceSum", [node("Cast", [valid], "valid_f", to=TensorProto.FLOAT), "train.loss/axes"], "count",
                 keepdims=0)
    nodes.append(helper.make_node("Div", [total, count], [name], name=name))
    return LossNodes(nodes, consts, target)


def _dims(dims) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]
