"""Normalisations, pools and reductions: split the dims they do not reduce over."""

from __future__ import annotations

from math import prod

from meshplan.ops.registry import define, per_element, rule
from meshplan.ops.view import P, R, OpView, Rule, need


@rule("Softmax", "LogSoftmax", flops=per_element(5))
def _softmax(op: OpView) -> list[Rule]:
    """Split the dims the normalisation does not cover.

    From opset 13 it covers dim ``axis`` (default -1); before, dims ``axis``… (default 1).
    With the opset unknown, only dims before both readings of ``axis`` are split.
    """
    rank = op.rank
    if op.opset is not None and op.opset >= 13:
        axis = op.axis(op.attr("axis", -1))
        dims = [d for d in range(rank) if d != axis]
    else:
        axis = op.axis(op.attr("axis", 1)) if op.opset is not None or "axis" in op.node.attrs \
            else min(1, op.axis(-1))
        dims = list(range(axis))
    return [((d,), (d,)) for d in dims]


define("Hardmax", rule=_softmax)


@rule("LayerNormalization", flops=per_element(8))
def _layer_norm(op: OpView) -> list[Rule]:
    """Dims before ``axis``; scale and bias (over axis…) stay replicated; Mean/InvStdDev follow X."""
    axis = op.axis(op.attr("axis", -1))
    return [((d, R, R), (d, d, d)) for d in range(axis)]


@rule("BatchNormalization", flops=per_element(4))
def _batch_norm(op: OpView) -> list[Rule]:
    """Inference form only: batch, or channels with scale, B, mean and var sliced."""
    need(not op.attr("training_mode", 0) and sum(o is not None for o in op.outs) == 1)
    return [((0, R, R, R, R), (0,)), ((1, 0, 0, 0, 0), (1,))]


define("InstanceNormalization", rule=lambda op: [((0, R, R), (0,)), ((1, 0, 0), (1,))], flops=per_element(8))
define("GroupNormalization", flops=per_element(8))
# Normalises across channels: every other dim splits.
define("LRN", rule=lambda op: [((d,), (d,)) for d in range(op.rank) if d != 1], flops=per_element(6))


def _window_flops(op: OpView) -> float:
    return float(op.outs[0].size * prod(op.attr("kernel_shape", [1])))


def _input_size(op: OpView) -> float:
    return float(op.ins[0].size)


def _pool(op: OpView) -> list[Rule]:
    """Batch and channels. MaxPool's Indices output counts over the whole tensor: not split."""
    need(len(op.outs) < 2 or op.outs[1] is None)
    return [((0,), (0,)), ((1,), (1,))]


def _average_pool(op: OpView) -> list[Rule]:
    return _pool(op) + [((P,), (P,))]


define("MaxPool", "LpPool", rule=_pool, flops=_window_flops)
define("AveragePool", rule=_average_pool, flops=_window_flops)
define("GlobalMaxPool", rule=_pool, flops=_input_size)
define("GlobalLpPool", rule=_pool)
define("GlobalAveragePool", rule=_average_pool, flops=_input_size)

REDUCE = (
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
)


@rule(*REDUCE, flops=_input_size)
def _reduce(op: OpView) -> list[Rule]:
    """Split kept dims; ReduceSum over a split dim gives a partial sum; Sum/Mean are linear."""
    rank = op.rank
    if "axes" in op.node.attrs:
        axes = [op.axis(a) for a in op.attr("axes")]
    elif op.has_input(1):
        given = op.const(1)
        need(given is not None)
        axes = [op.axis(int(a)) for a in given.reshape(-1)]
    else:
        axes = []
    linear = op.node.op_type in ("ReduceSum", "ReduceMean")
    if not axes:
        if op.attr("noop_with_empty_axes", 0):
            return [((d, R), (d,)) for d in range(rank)] + ([((P, R), (P,))] if linear else [])
        axes = list(range(rank))
    keep = op.attr("keepdims", 1)
    rules: list[Rule] = [((d, R), (d if keep else d - sum(a < d for a in axes),)) for d in range(rank) if d not in axes]
    if op.node.op_type == "ReduceSum":
        rules += [((d, R), (P,)) for d in axes]
    return rules + ([((P, R), (P,))] if linear else [])


@rule("ArgMax", "ArgMin", flops=_input_size)
def _arg_reduce(op: OpView) -> list[Rule]:
    axis = op.axis(op.attr("axis", 0))
    keep = op.attr("keepdims", 1)
    return [((d,), (d if keep or d < axis else d - 1,)) for d in range(op.rank) if d != axis]
