"""Which tensors of a pipelined step the replicas of a stage share in row blocks (ZeRO-1).

A stage with R data-parallel replicas runs its ``norm`` and ``update`` parts on each
replica's row blocks of every weight's tensors (``meshplan.replica_shards``): the
accumulated gradient, the optimizer's slots, the weight's own values. That is only the same
step where those parts compute each element from the same element of their inputs, and
reduce nothing but whole tensors into the partial sums the clipping reads (which the
replicas then add up). ``update_shards`` checks it and names the tensors; ``relaxed``
writes a part that takes them in any number of rows.
"""

from __future__ import annotations

import onnx

from meshplan.training.pipeline_step import CLIP, NORM, UPDATE_PHASE, PipelineStep

# What an optimizer's parts may compute on row blocks: one element from the same element.
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Sqrt", "Pow", "Neg", "Abs", "Sign", "Reciprocal", "Exp", "Log",
               "Where", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal", "Not", "And", "Or", "Max",
               "Min", "Clip", "Cast", "Identity", "Constant"}
WHOLE_REDUCTIONS = {"ReduceSum", "ReduceSumSquare"}


def update_shards(pipeline: PipelineStep, replicas: int) -> set[str]:
    """The tensors each stage's ``norm`` and ``update`` parts read or make per weight (of
    one or more dims), which its ``replicas`` hold in row blocks; none (every replica
    updating every weight whole) with one replica a stage, or where a part computes
    anything else (``_row_wise``) or a trained weight has no dims to cut."""
    if replicas < 2:
        return set()
    weights = pipeline.step.manifest.get("weights", {})
    if any(not info["shape"] for info in weights.values()):
        return set()
    beside = {n for (_, phase), part in pipeline.parts.items() if phase == CLIP
              for n in list(part.inputs) + list(part.outputs)}
    found: set[str] = set()
    for (_, phase), part in pipeline.parts.items():
        if phase not in (NORM, UPDATE_PHASE):
            continue
        if not isinstance(part.model, onnx.ModelProto) or not _row_wise(part.model, beside):
            return set()
        graph = part.model.graph
        for value in list(graph.input) + list(graph.output):
            if value.name not in beside and len(value.type.tensor_type.shape.dim) > 0:
                found.add(value.name)
    return found


def _row_wise(model: onnx.ModelProto, partials: set[str]) -> bool:
    """Whether ``model`` computes its outputs element by element, but for whole-tensor sums
    that reach only ``partials`` (what the clipping reads)."""
    reduced: set[str] = set()
    for node in model.graph.node:
        if node.op_type in WHOLE_REDUCTIONS:
            if len(node.input) > 1 and node.input[1] or any(a.name == "axes" for a in node.attribute):
                return False
            reduced.update(node.output)
        elif node.op_type == "Sum" or node.op_type in ELEMENTWISE:
            if any(name in reduced for name in node.input):
                if node.op_type not in ("Sum", "Add", "Identity", "Cast"):
                    return False
                reduced.update(node.output)
        else:
            return False
    return all(value.name in partials for value in model.graph.output if value.name in reduced)


def relaxed(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """``model`` with the inputs and outputs in ``names`` of any shape of their rank, and the
    shapes of its inner tensors left to onnxruntime."""
    found = onnx.ModelProto()
    found.CopyFrom(model)
    for value in list(found.graph.input) + list(found.graph.output):
        if value.name in names:
            for index, dim in enumerate(value.type.tensor_type.shape.dim):
                dim.Clear()
                dim.dim_param = f"{value.name}.d{index}"
    del found.graph.value_info[:]
    return found
