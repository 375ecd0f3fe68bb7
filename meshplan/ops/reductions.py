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
    if not axes:   # noop_with_empty_axes: y = x
        return _none_after([g.dy(0)], g)
    best = g.op("Expand", _kept(g, g.y(0), axes), g.shape_tensor(g.x(0)))
    hit = g.op("Cast", g.op("Equal", g.x(0), best), to=_float_type(g))
    ties = g.op("ReduceSum", hit, g.ints(axes), keepdims=1)
    return _none_after([g.op("Mul", _spread(g, axes), g.op("Div", hit, ties))], g)


def _softmax_axes(g: GradNode) -> str:
    """The normalised axes: ``axis`` (default -1) from opset 13; before, every axis from
    ``axis`` (default 1) on, the input read as a matrix."""
    rank = g.rank(g.x(0))
    if g.opset >= 13:
        return g.ints([int(g.attr("axis", -1)) % rank])
    return g.ints(range(int(g.attr("axis", 1)) % rank, rank))


@gradient("Softmax")
def _softmax_grad(g: GradNode) -> list:
    """dx = y·(dy − Σ dy·y) along the axis."""
    y, dy, axis = g.y(0), g.dy(0), _softmax_axes(g)
    inner = g.op("ReduceSum", g.op("Mul", dy, y), axis, keepdims=1)
    return [g.op("Mul", y, g.op("Sub", dy, inner))]


@gradient("LogSoftmax")
def _log_softmax_grad(g: GradNode) -> list:
    """dx = dy − exp(y)·Σ dy along the axis."""
    y, dy, axis = g.y(0), g.dy(0), _softmax_axes(g)
    total = g.op("ReduceSum", dy, axis, keepdims=1)
    return [g.op("Sub", dy, g.op("Mul", g.op("Exp", y), total))]


def normalization_grad(g: GradNode, axes: list[int], centered: bool, epsilon: float, scale: str | None,
                       source: str | None = None, dy: str | None = None, dmean: str | None = None,
                       drstd: str | None = None) -> tuple:
    """The gradient of x̂·scale where x̂ = (x − mean)·rstd (centered) or x·rstd (RMS) over
    ``axes`` (x: ``source``, default input 0; dy default output 0's gradient); returns (dx, x̂),
    the statistics recomputed here in x's dtype. ``dmean``, ``drstd``: the gradients of the
    statistics as outputs (keepdims shape), added: dmean/H and −drstd·rstd³·(x − mean)/H."""
    x = source or g.x(0)
    dy = dy or g.dy(0)
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
    dx = g.op("Mul", rstd, g.op("Sub", dxhat, inner))
    if dmean is not None or drstd is not None:
        to = _onnx_type(g.dtype(x))
        count = g.op("Div", g.op("Cast", g.op("Size", x), to=to), g.op("Cast", g.op("Size", rstd), to=to))
        if dmean is not None:
            dx = g.op("Add", dx, g.op("Div", _cast_to(g, dmean, x), count))
        if drstd is not None:
            cube = g.op("Mul", rstd, g.op("Mul", rstd, rstd))
            dx = g.op("Sub", dx, g.op("Div", g.op("Mul", g.op("Mul", _cast_to(g, drstd, x), cube), xc), count))
    return dx, xhat


def _cast_to(g: GradNode, name: str, like: str) -> str:
    return name if g.dtype(name) == g.dtype(like) else g.op("Cast", name, to=_onnx_type(g.dtype(like)))


def _onnx_type(dtype) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _stat(g: GradNode, index: int) -> str | None:
    """Output ``index``'s gradient where the loss depends on it (a statistics output)."""
    return g.dy(index) if g.has_dy(index) else None


@gradient("LayerNormalization")
def _layer_norm_grad(g: GradNode) -> list:
    """y = x̂·scale + B over the axes from ``axis``; Mean and InvStdDev, where the loss reads
    them, add theirs to dx."""
    rank = g.rank(g.x(0))
    axes = list(range(int(g.attr("axis", -1)) % rank, rank))
    dx, xhat = normalization_grad(g, axes, True, float(g.attr("epsilon", 1e-5)), g.x(1),
                                  dmean=_stat(g, 1), drstd=_stat(g, 2))
    dscale = g.unbroadcast(g.op("Mul", g.dy(0), xhat), g.x(1)) if g.need(1) else None
    dbias = g.unbroadcast(g.dy(0), g.x(2)) if g.has_input(2) and g.need(2) else None
    return [dx if g.need(0) else None, dscale, dbias]


def _channels(g: GradNode, name: str) -> str:
    """A per-channel vector [C] shaped to broadcast against x [N, C, …]."""
    rank = g.rank(g.x(0))
    return g.op("Unsqueeze", name, g.ints(range(1, rank - 1))) if rank > 2 else name


@gradient("BatchNormalization")
def _batch_norm_grad(g: GradNode) -> list:
    """Inference: y = (x − mean)·rstd·scale + B, rstd = 1/√(var + ε) of the running statistics:
    dx = dy·scale·rstd, dscale = Σ dy·x̂, dB = Σ dy, dmean = −Σ dy·scale·rstd,
    dvar = −½·rstd²·Σ dy·scale·x̂. training_mode=1: the batch's statistics over every dim but
    the channels, dx as a layer norm's over those dims; the running outputs take none."""
    x, dy = g.x(0), g.dy(0)
    rank = g.rank(x)
    axes = [0] + list(range(2, rank))
    eps = float(g.attr("epsilon", 1e-5))
    scale = _channels(g, g.x(1))
    sum_c = lambda v: g.op("ReduceSum", v, g.ints(axes), keepdims=0)
    if int(g.attr("training_mode", 0)):
        dx, xhat = normalization_grad(g, axes, True, eps, scale)
        return [dx if g.need(0) else None, sum_c(g.op("Mul", dy, xhat)) if g.need(1) else None,
                sum_c(dy) if g.need(2) else None, None, None]
    rstd = g.op("Reciprocal", g.op("Sqrt", g.op("Add", g.x(4), g.const(eps, like=x))))
    rstd_c = _channels(g, rstd)
    xhat = g.op("Mul", g.op("Sub", x, _channels(g, g.x(3))), rstd_c)
    dxhat = g.op("Mul", dy, scale)
    dmean = g.op("Neg", g.op("Mul", sum_c(dxhat), rstd)) if g.need(3) else None
    dvar = g.op("Mul", sum_c(g.op("Mul", dxhat, xhat)), g.op("Mul", g.op("Mul", rstd, rstd), g.const(-0.5, like=x))) \
        if g.need(4) else None
    return [g.op("Mul", dxhat, rstd_c) if g.need(0) else None, sum_c(g.op("Mul", dy, xhat)) if g.need(1) else None,
            sum_c(dy) if g.need(2) else None, dmean, dvar]


@gradient("InstanceNormalization")
def _instance_norm_grad(g: GradNode) -> list:
    """y = x̂·scale + B, x̂ normalised over the spatial dims of each sample and channel: dx
    as a layer norm's over those dims, dscale = Σ dy·x̂, dB = Σ dy (over batch and space)."""
    x, dy = g.x(0), g.dy(0)
    rank = g.rank(x)
    dx, xhat = normalization_grad(g, list(range(2, rank)), True, float(g.attr("epsilon", 1e-5)),
                                  _channels(g, g.x(1)))
    sum_c = lambda v: g.op("ReduceSum", v, g.ints([0] + list(range(2, rank))), keepdims=0)
    return [dx if g.need(0) else None, sum_c(g.op("Mul", dy, xhat)) if g.need(1) else None,
            sum_c(dy) if g.need(2) else None]


@gradient("ReduceL1")
def _reduce_l1_grad(g: GradNode) -> list:
    """dx = dy·sign(x)."""
    axes = _axes(g)
    return _none_after([g.op("Mul", _spread(g, axes) if axes else g.dy(0), g.op("Sign", g.x(0)))], g)


@gradient("ReduceLogSum")
def _reduce_log_sum_grad(g: GradNode) -> list:
    """dx = dy / Σx = dy·exp(−y)."""
    axes = _axes(g)
    total = g.op("Exp", g.op("Expand", _kept(g, g.y(0), axes), g.shape_tensor(g.x(0))))
    return _none_after([g.op("Div", _spread(g, axes) if axes else g.dy(0), total)], g)


@gradient("CumSum")
def _cumsum_grad(g: GradNode) -> list:
    """dx = the cumulative sum of dy the other way (``reverse`` flipped, ``exclusive`` kept)."""
    return [g.op("CumSum", g.dy(0), g.x(1), exclusive=int(g.attr("exclusive", 0)),
                 reverse=1 - int(g.attr("reverse", 0))), None]


@gradient("TopK")
def _top_k_grad(g: GradNode) -> list:
    """dy added back at the positions the values came from (the Indices output)."""
    from meshplan.ops.shapes import _positions, _scatter_back

    x = g.x(0)
    picked = g.op("GatherElements", _positions(g, x), g.y(1), axis=int(g.attr("axis", -1)))
    return [_scatter_back(g, picked, g.dy(0), x, add=True), None]


# --- pools ---------------------------------------------------------------------------------

@gradient("GlobalAveragePool")
def _global_average_pool_grad(g: GradNode) -> list:
    """dx = dy spread over the spatial dims / their size."""
    return [g.op("Div", g.op("Expand", g.dy(0), g.shape_tensor(g.x(0))), _count(g))]


@gradient("GlobalMaxPool")
def _global_max_pool_grad(g: GradNode) -> list:
    """dy shared evenly among the elements equal to the maximum (as ReduceMax)."""
    x = g.x(0)
    spatial = g.ints(range(2, g.rank(x)))
    hit = g.op("Cast", g.op("Equal", x, g.op("Expand", g.y(0), g.shape_tensor(x))), to=_float_type(g))
    ties = g.op("ReduceSum", hit, spatial, keepdims=1)
    return [g.op("Mul", g.op("Expand", g.dy(0), g.shape_tensor(x)), g.op("Div", hit, ties))]


@gradient("MaxPool")
def _max_pool_grad(g: GradNode) -> list:
    """dy added at each window's argmax: the node's Indices output (row-major), or those of a
    MaxPool of x with the same windows the rule writes."""
    from meshplan.ops.shapes import _scatter_back

    x = g.x(0)
    if len(g.outputs) > 1 and g.outputs[1] and int(g.attr("storage_order", 0)) == 0:
        indices = g.y(1)
    else:
        attrs = {k: v for k, v in g.attrs.items() if k != "storage_order"}
        indices = g.op("MaxPool", x, outputs=2, **attrs)[1]
    return [_scatter_back(g, indices, g.dy(0), x, add=True)]


@gradient("AveragePool")
def _average_pool_grad(g: GradNode) -> list:
    """dx = Σ over the windows reading each position of dy/c, c the window's divisor as the
    pool counts it (count_include_pad either way, ceil_mode): 1/c = AveragePool(1)/Σ-pool(1);
    the sum over windows a ConvTranspose with a kernel of ones, per channel."""
    from meshplan.ops.contractions import transposed_window, window_geometry

    x, dy = g.x(0), g.dy(0)
    kernel = list(g.attr("kernel_shape"))
    sizes, outs, strides, dilations, begin = window_geometry(g, kernel)
    dtype = g.dtype(x)
    ones = g.op("ConstantOfShape", g.ints([1, 1] + sizes), value=np.ones(1, dtype=dtype))
    averaged = g.op("AveragePool", ones, **g.attrs)
    window = g.const(np.ones([1, 1] + kernel, dtype=dtype))
    ends = [max(0, s * (o - 1) + (k - 1) * d + 1 - b - i)
            for i, o, s, d, k, b in zip(sizes, outs, strides, dilations, kernel, begin)]
    counted = g.op("Conv", ones, window, strides=strides, dilations=dilations, pads=begin + ends)
    reach = [(i + b + e - (k - 1) * d - 1) // s + 1
             for i, s, d, k, b, e in zip(sizes, strides, dilations, kernel, begin, ends)]
    if reach != outs:
        spatial = list(range(2, 2 + len(kernel)))
        counted = g.op("Slice", counted, g.ints([0] * len(kernel)), g.ints(outs), g.ints(spatial))
    scaled = g.op("Mul", dy, g.op("Div", averaged, counted))
    flat = g.op("Reshape", scaled, g.ints([-1, 1] + outs))   # every (sample, channel) alone
    back = transposed_window(g, flat, window, kernel, 1)
    return [g.op("Reshape", back, g.shape_tensor(x))]


@gradient("GroupNormalization")
def _group_norm_grad(g: GradNode) -> list:
    """x̂ normalised over each group of channels (with their spatial dims) per sample; y =
    x̂·scale + bias, scale and bias per channel (opset 21) or per group (opset 18, read from
    their size): dx as a layer norm's over the group, dscale = Σ dy·x̂, dbias = Σ dy (over the
    batch, the space, and the group's channels where they are per group)."""
    x, dy = g.x(0), g.dy(0)
    shape, groups = g.shape(x), int(g.attr("num_groups"))
    channels, per = shape[1], g.shape(g.x(1))[0]
    if not isinstance(channels, int) or not isinstance(per, int):
        raise GradientError(f"GroupNormalization node '{g.name}': channels of unknown count")
    by_group = per != channels
    scale = g.x(1)
    if by_group:   # [G] → [C]: each group's scale for each of its channels
        scale = g.op("Reshape", g.op("Expand", g.op("Unsqueeze", scale, g.ints([1])),
                                     g.ints([groups, channels // groups])), g.ints([channels]))
    grouped = lambda name: g.op("Reshape", name, g.ints([0, groups, -1]))
    dx, xhat = normalization_grad(g, [2], True, float(g.attr("epsilon", 1e-5)), None, source=grouped(x),
                                  dy=grouped(g.op("Mul", dy, _channels(g, scale))))
    xhat = g.op("Reshape", xhat, g.shape_tensor(x))
    axes = g.ints([0] + list(range(2, len(shape))))

    def per_parameter(name: str) -> str:
        summed = g.op("ReduceSum", name, axes, keepdims=0)
        return g.op("ReduceSum", g.op("Reshape", summed, g.ints([groups, -1])), g.ints([1]), keepdims=0) \
            if by_group else summed
    return [g.op("Reshape", dx, g.shape_tensor(x)) if g.need(0) else None,
            per_parameter(g.op("Mul", dy, xhat)) if g.need(1) else None,
            per_parameter(dy) if g.need(2) else None]


# --- losses exported with the model ------------------------------------------------------------

def _class_loss_grad(g: GradNode, softmax: bool) -> list:
    """l[n, …] = −w[t]·x[n, t, …] (x the log-probabilities: the input, or LogSoftmax(scores));
    a target equal to ignore_index counts 0. dx = −onehot(t)·w[t]·dl, dl = dy (none), dy
    broadcast (sum), dy/Σ w[t] (mean); scores: dx = (softmax − onehot(t))·w[t]·dl, and
    log_prob's gradient, where read, through LogSoftmax."""
    from meshplan.ops.shapes import _text

    x, target = g.x(0), g.x(1)
    rank = g.rank(x)
    to = _onnx_type(g.dtype(x))
    valid = None
    if g.attr("ignore_index") is not None:
        valid = g.op("Not", g.op("Equal", target, g.const(np.asarray(int(g.attr("ignore_index")),
                                                                      dtype=g.dtype(target)))))
        target = g.op("Where", valid, target, g.const(np.zeros((), dtype=g.dtype(target))))
    weight = g.op("Gather", g.x(2), target) if g.has_input(2) else None
    if valid is not None:
        mask = g.op("Cast", valid, to=to)
        weight = mask if weight is None else g.op("Mul", weight, mask)
    reduction = _text(g.attr("reduction"), "mean")
    dl = g.dy(0)
    if reduction == "mean":
        total = g.op("ReduceSum", weight, keepdims=0) if weight is not None else \
            g.op("Cast", g.op("Size", target), to=to)
        dl = g.op("Div", dl, total)
    coef = g.op("Mul", dl, weight) if weight is not None else dl
    if reduction != "none":
        coef = g.op("Expand", coef, g.op("Shape", target))
    coef = g.op("Unsqueeze", coef, g.ints([1]))
    classes = g.op("Range", g.const(np.int64(0)), g.op("Gather", g.shape_tensor(x), g.const(np.int64(1))),
                   g.const(np.int64(1)))
    classes = g.op("Reshape", classes, g.ints([1, -1] + [1] * (rank - 2)))
    labels = g.op("Unsqueeze", g.op("Cast", target, to=_onnx_type(np.int64)), g.ints([1]))
    onehot = g.op("Cast", g.op("Equal", labels, classes), to=to)
    if not softmax:
        return [g.op("Neg", g.op("Mul", onehot, coef)), None, None][:len(g.inputs)]
    log_prob = g.y(1) if len(g.outputs) > 1 and g.outputs[1] else g.op("LogSoftmax", x, axis=1)
    prob = g.op("Exp", log_prob)
    dx = g.op("Mul", g.op("Sub", prob, onehot), coef)
    if g.has_dy(1):
        dlp = g.dy(1)
        dx = g.op("Add", dx, g.op("Sub", dlp, g.op("Mul", prob, g.op("ReduceSum", dlp, g.ints([1]), keepdims=1))))
    return [dx, None, None][:len(g.inputs)]


gradient("SoftmaxCrossEntropyLoss")(lambda g: _class_loss_grad(g, True))
gradient("NegativeLogLikelihoodLoss")(lambda g: _class_loss_grad(g, False))
