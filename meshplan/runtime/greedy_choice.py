"""The greedy choice of the next token made where the logits are computed.

``with_greedy_choice`` appends to a program the nodes that pick, for every position, the
index of the highest logit (the first on a tie, as numpy's ``argmax`` and the greedy
``Sampler`` do) as one more output, ``greedy_output(logits)``: a job of one rank on a GPU
then brings rank 0 token ids instead of logits (``ProgramRunner(choose=...)``), and the
choice runs inside the decode step's CUDA graph.

How the index is found (``METHOD``, or the ``method`` argument):

* ``"argmax"``: one ``ArgMax`` over the vocabulary;
* ``"topk"``: ``TopK`` with k = 1 (the lower index first among equal values, as the
  ONNX operator specifies), its indices;
* ``"chunked"``: the vocabulary cut into rows of a divisor near its square root: each row's
  maximum and the index in it, the first row holding the highest maximum, and its index
  there: reductions over many short rows instead of one long one (a GPU's reduction
  kernels use many blocks then). A vocabulary without such a divisor takes ``"argmax"``.

Logits holding a NaN may give another id than numpy's (which answers the first NaN): the
operators' handling of NaN is the provider's.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

GREEDY_SUFFIX = ".greedy"
# logits onnxruntime's ArgMax, TopK and ReduceMax take on the CPU and CUDA alike (bfloat16:
# no ArgMax on either, so such a model's token is chosen on the host)
CHOOSABLE = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)
METHODS = ("argmax", "topk", "chunked")
METHOD = "argmax"


def greedy_output(logits: str) -> str:
    """The name of the token ids chosen greedily from output ``logits``."""
    return logits + GREEDY_SUFFIX


def with_greedy_choice(model: onnx.ModelProto, logits: str, method: str | None = None) -> onnx.ModelProto | None:
    """``model`` (its weights left where they are) with one more output: the greedy ids of
    ``logits`` (int64, the logits' shape less the vocabulary). None where ``logits`` is not
    an output of known rank, or of a type the choice's operators do not take (``CHOOSABLE``)."""
    method = method or METHOD
    if method not in METHODS:
        raise ValueError(f"unknown greedy choice method {method!r} (one of {', '.join(METHODS)})")
    graph = model.graph
    found = next((o for o in graph.output if o.name == logits), None)
    if found is None or not found.type.tensor_type.HasField("shape") \
            or found.type.tensor_type.elem_type not in CHOOSABLE:
        return None
    dims = list(found.type.tensor_type.shape.dim)
    if len(dims) < 2:
        return None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    vocab = dims[-1].dim_value if dims[-1].HasField("dim_value") else 0
    chosen = onnx.ModelProto()
    chosen.CopyFrom(model)
    name = greedy_output(logits)
    nodes, constants = _nodes(method, logits, name, len(dims), vocab, opset)
    chosen.graph.node.extend(nodes)
    chosen.graph.initializer.extend(constants)
    shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims[:-1]]
    chosen.graph.output.append(helper.make_tensor_value_info(name, TensorProto.INT64, shape))
    return chosen


def _nodes(method: str, logits: str, out: str, rank: int, vocab: int, opset: int) -> tuple[list, list]:
    """The nodes (and constants) that write the greedy ids of ``logits`` to ``out``."""
    tag = f"{out}/"
    last = np.array([-1], dtype=np.int64)
    if method == "topk":
        k = numpy_helper.from_array(np.array([1], dtype=np.int64), tag + "k")
        nodes = [helper.make_node("TopK", [logits, k.name], [tag + "values", tag + "indices"], tag + "TopK", axis=-1,
                                  largest=1, sorted=1)]
        squeeze, constants = _squeeze(tag + "indices", out, tag, opset)
        return nodes + squeeze, [k, *constants]
    width = _row_width(vocab) if method == "chunked" else 0
    if not width:
        return [helper.make_node("ArgMax", [logits], [out], tag + "ArgMax", axis=-1, keepdims=0)], []
    rows = vocab // width
    shape = numpy_helper.from_array(np.array([0] * (rank - 1) + [rows, width], dtype=np.int64), tag + "shape")
    step = numpy_helper.from_array(np.array(width, dtype=np.int64), tag + "width")
    nodes = [helper.make_node("Reshape", [logits, shape.name], [tag + "rows"], tag + "Reshape")]
    constants = [shape, step]
    if opset >= 18:
        axes = numpy_helper.from_array(last, tag + "axes")
        constants.append(axes)
        nodes.append(helper.make_node("ReduceMax", [tag + "rows", axes.name], [tag + "maxima"], tag + "ReduceMax",
                                      keepdims=0))
    else:
        nodes.append(helper.make_node("ReduceMax", [tag + "rows"], [tag + "maxima"], tag + "ReduceMax", axes=[-1],
                                      keepdims=0))
    nodes += [
        helper.make_node("ArgMax", [tag + "maxima"], [tag + "row"], tag + "ArgMaxRow", axis=-1, keepdims=1),
        helper.make_node("ArgMax", [tag + "rows"], [tag + "within"], tag + "ArgMaxWithin", axis=-1, keepdims=0),
        helper.make_node("GatherElements", [tag + "within", tag + "row"], [tag + "at"], tag + "GatherElements",
                         axis=-1),
        helper.make_node("Mul", [tag + "row", step.name], [tag + "start"], tag + "Mul"),
        helper.make_node("Add", [tag + "start", tag + "at"], [tag + "index"], tag + "Add"),
    ]
    squeeze, more = _squeeze(tag + "index", out, tag, opset)
    return nodes + squeeze, constants + more


def _squeeze(source: str, out: str, tag: str, opset: int) -> tuple[list, list]:
    """``source`` less its last axis (of 1)."""
    if opset >= 13:
        axes = numpy_helper.from_array(np.array([-1], dtype=np.int64), tag + "squeeze_axes")
        return [helper.make_node("Squeeze", [source, axes.name], [out], tag + "Squeeze")], [axes]
    return [helper.make_node("Squeeze", [source], [out], tag + "Squeeze", axes=[-1])], []


def _row_width(vocab: int) -> int:
    """A divisor of ``vocab`` between half its square root and twice it (0: none): the rows
    of the chunked choice."""
    if vocab < 64:
        return 0
    root = math.isqrt(vocab)
    for delta in range(root):
        for width in (root + delta, root - delta):
            if root // 2 <= width <= 2 * root and width > 1 and vocab % width == 0:
                return width
    return 0
