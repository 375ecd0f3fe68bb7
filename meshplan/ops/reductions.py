"""Normalisations, pools and reductions: split the dims they do not reduce over."""

from __future__ import annotations

from math import prod

import numpy as np

from meshplan.ops.grad_words import GradientError, GradNode
from meshplan.ops.registry import define, gradient, per_element, rule
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


# --- gradients -----------------------------------------------------------------------------

def _axes(g: GradNode) -> list[int]:
    """The reduced axes (input 1 from opset 18, 13 for ReduceSum; else the attribute), as
    non-negative ints; every axis where none are given (unless noop_with_empty_axes)."""
    rank = g.rank(g.x(0))
    if g.has_input(1):
        given = g.value(1)
        if given is None:
            raise GradientError(f"{g.op_type} node '{g.name}': the axes are not a constant")
        axes = [int(a) for a in np.asarray(given).reshape(-1)]
    else:
        axes = list(g.attr("axes", []))
    if not axes:
        return [] if g.attr("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in axes)


def _kept(g: GradNode, name: str, axes: list[int]) -> str:
    """An output (or its gradient) with the reduced axes back as 1s."""
    if g.attr("keepdims", 1) or not axes:
        return name
    return g.op("Unsqueeze", name, g.ints(axes))


def _spread(g: GradNode, axes: list[int]) -> str:
    return g.op("Expand", _kept(g, g.dy(0), axes), g.shape_tensor(g.x(0)))


def _count(g: GradNode) -> str:
    """Elements per output element: size(x) / size(y), in x's dtype."""
    to = _float_type(g)
    return g.op("Div", g.op("Cast", g.op("Size", g.x(0)), to=to), g.op("Cast", g.op("Size", g.y(0)), to=to))


def _float_type(g: GradNode) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(g.dtype(g.x(0)))


def _none_after(first: list, g: GradNode) -> list:
    return first + [None] * (len(g.inputs) - len(first))


@gradient("ReduceSum")
def _reduce_sum_grad(g: GradNode) -> list:
    axes = _axes(g)
    return _none_after([_spread(g, axes) if axes else g.dy(0)], g)


@gradient("ReduceMean")
def _reduce_mean_grad(g: GradNode) -> list:
    axes = _axes(g)
    if not axes:
        return _none_after([g.dy(0)], g)
    return _none_after([g.op("Div", _spread(g, axes), _count(g))], g)


@gradient("ReduceSumSquare")
def _reduce_sum_square_grad(g: GradNode) -> list:
    axes = _axes(g)
    two_x = g.op("Mul", g.x(0), g.const(2.0, like=g.x(0)))
    return _none_after([g.op("Mul", _spread(g, axes) if axes else g.dy(0), two_x)], g)


@gradient("ReduceL2")
def _reduce_l2_grad(g: GradNode) -> list:
    """d‖x‖ = dy·x/‖x‖."""
    axes = _axes(g)
    norm = g.op("Expand", _kept(g, g.y(0), axes), g.shape_tensor(g.x(0)))
    return _none_after([g.op("Mul", _spread(g, axes), g.op("Div", g.x(0), norm))], g)


@gradient("ReduceLogSumExp")
def _reduce_lse_grad(g: GradNode) -> list:
    """dy·softmax(x) over the reduced axes."""
    axes = _axes(g)
    lse = g.op("Expand", _kept(g, g.y(0), axes), g.shape_tensor(g.x(0)))
    return _none_after([g.op("Mul", _spread(g, axes), g.op("Exp", g.op("Sub", g.x(0), lse)))], g)


@gradient("ReduceMax", "ReduceMin")
def _reduce_max_grad(g: GradNode) -> list:
    """dy shared evenly among the elements equal to the result (as torch's amax/amin)."""
    axes = _axes(g)
    best = g.op("Expand", _kept(g, g.y(0), axes), g.shape_tensor(g.x(0)))
    hit = g.op("Cast", g.op("Equal", g.x(0), best), to=_float_type(g))
    ties = g.op("ReduceSum", hit, g.ints(axes), keepdims=1)
    return _none_after([g.op("Mul", _spread(g, axes), g.op("Div", hit, ties))], g)


def _softmax_axis(g: GradNode) -> int:
    return int(g.attr("axis", -1)) % g.rank(g.x(0))


@gradient("Softmax")
def _softmax_grad(g: GradNode) -> list:
    """dx = y·(dy − Σ dy·y) along the axis (opset 13+: one axis)."""
    y, dy, axis = g.y(0), g.dy(0), g.ints([_softmax_axis(g)])
    inner = g.op("ReduceSum", g.op("Mul", dy, y), axis, keepdims=1)
    return [g.op("Mul", y, g.op("Sub", dy, inner))]


@gradient("LogSoftmax")
def _log_softmax_grad(g: GradNode) -> list:
    """dx = dy − exp(y)·Σ dy along the axis."""
    y, dy, axis = g.y(0), g.dy(0), g.ints([_softmax_axis(g)])
    total = g.op("ReduceSum", dy, axis, keepdims=1)
    return [g.op("Sub", dy, g.op("Mul", g.op("Exp", y), total))]


def normalization_grad(g: GradNode, axes: list[int], centered: bool, epsilon: float, scale: str | None) -> tuple:
    """The gradient of x̂·scale where x̂ = (x − mean)·rstd (centered) or x·rstd (RMS) over
    ``axes``; returns (dx, x̂), the statistics recomputed here in x's dtype."""
    x, dy = g.x(0), g.dy(0)
    c = lambda v: g.const(v, like=x)
    ax = g.ints(axes)
    xc = g.op("Sub", x, g.op("ReduceMean", x, ax, keepdims=1)) if centered else x
    rstd = g.op("Reciprocal", g.op("Sqrt", g.op("Add", g.op("ReduceMean", g.op("Mul", xc, xc), ax, keepdims=1),
                                                   c(epsilon))))
    xhat = g.op("Mul", xc, rstd)
    dxhat = g.op("Mul", dy, scale) if scale is not None else dy
    inner = g.op("Mul", xhat, g.op("ReduceMean", g.op("Mul", dxhat, xhat), ax, keepdims=1))
    if centered:
        inner = g.op("Add", inner, g.op("ReduceMean", dxhat, ax, keepdims=1))
    return g.op("Mul", rstd, g.op("Sub", dxhat, inner)), xhat


@gradient("LayerNormalization")
def _layer_norm_grad(g: GradNode) -> list:
    rank = g.rank(g.x(0))
    axes = list(range(int(g.attr("axis", -1)) % rank, rank))
    dx, xhat = normalization_grad(g, axes, True, float(g.attr("epsilon", 1e-5)), g.x(1))
    dscale = g.unbroadcast(g.op("Mul", g.dy(0), xhat), g.x(1)) if g.need(1) else None
    dbias = g.unbroadcast(g.dy(0), g.x(2)) if g.has_input(2) and g.need(2) else None
    return [dx if g.need(0) else None, dscale, dbias]
