"""Shape operators: reshapes, transposes, slices, concatenations, gathers. They move data
(no FLOPs); a split changing a shape input (Reshape's target, Expand's shape) carries a
rewrite, the input's new value on every device."""

from __future__ import annotations

from math import prod

import numpy as np
from onnx import TensorProto, helper

from meshplan.ops.pointwise import broadcast
from meshplan.ops.grad_words import GradNode
from meshplan.ops.registry import define, gradient, no_flops, rule
from meshplan.ops.grad_words import GradientError
from meshplan.ops.view import P, R, LocalShape, NoRule, OpView, Rule, need


def _reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Runs of input and output dims (ignoring size-1 dims) with equal products, in order."""
    a = [d for d, s in enumerate(src) if s != 1]
    b = [d for d, s in enumerate(dst) if s != 1]
    groups = []
    i = j = 0
    while i < len(a) and j < len(b):
        gi, go = [a[i]], [b[j]]
        pi, po = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po and i < len(a):
                gi.append(a[i])
                pi *= src[a[i]]
                i += 1
            elif po < pi and j < len(b):
                go.append(b[j])
                po *= dst[b[j]]
                j += 1
            else:
                raise NoRule
        groups.append((gi, go))
    return groups


def _reshape(op: OpView) -> list[Rule]:
    """Split the leading dim of a run of dims and the leading dim of the run it becomes.

    Row-major order is kept, so the k-th chunk of a run's leading dim is the same
    elements as the k-th chunk of its image's leading dim (e.g. hidden → heads × head_dim:
    hidden split ↔ heads split). Shape inputs stay replicated; Reshape's target becomes
    the local shape.
    """
    src, dst = op.shape(0), op.out_shape
    need(0 not in src and 0 not in dst and prod(src) == prod(dst))
    return [((gi[0],), (go[0],)) for gi, go in _reshape_groups(src, dst)] + [((P,), (P,))]


def _rewrite_to_local_shape(index: int):
    """The shape input ``index`` becomes the local output shape (needs an initializer). In a
    ranged plan, where the output's size follows the call's, the input is divided by the
    split instead (``LocalShape``: the same entries for every size, computed at run time
    where the input is)."""
    def rewrite(op: OpView, inputs, outputs, mesh):
        local = outputs[0].local_shape(op.out_shape, mesh)
        if local == tuple(op.out_shape):
            return ()
        if op.outs[0].ranged or (op.graph.ranged and op.has_input(index) and not op.is_constant(index)):
            divisors = tuple(outputs[0].shards(d, mesh) for d in range(len(op.out_shape)))
            length = op.shape(index)[0] if op.shape(index) else len(divisors)
            return ((index, LocalShape(divisors[len(divisors) - length:])),)
        return ((index, local),) if op.is_constant(index) else None
    return rewrite


def _squeeze_keeps_split_dims(op: OpView, inputs, outputs, mesh):
    """Squeeze without axes drops every size-1 dim: a split must not leave a local size of 1."""
    if op.has_input(1) or "axes" in op.node.attrs:
        return ()
    local = inputs[0].local_shape(op.shape(0), mesh)
    return None if any(size == 1 != full for size, full in zip(local, op.shape(0))) else ()




define("Reshape", rule=_reshape, flops=no_flops, rewrite=_rewrite_to_local_shape(1))
define("Squeeze", rule=_reshape, flops=no_flops, rewrite=_squeeze_keeps_split_dims)
define("Flatten", "Unsqueeze", rule=_reshape, flops=no_flops)
define("ConstantOfShape", "Range", flops=no_flops)


@rule("GatherElements", flops=no_flops, lookups=(0,))
def _gather_elements(op: OpView) -> list[Rule]:
    """Data and indices split together on a dim other than the gathered axis, where their
    sizes agree (each output element reads its own row of that dim)."""
    axis = op.axis(op.attr("axis", 0))
    data, indices = op.shape(0), op.shape(1)
    return [((d, d), (d,)) for d in range(op.rank) if d != axis and data[d] == indices[d]]


@rule("ScatterElements", flops=no_flops, partial_bias=0)
def _scatter_elements(op: OpView) -> list[Rule]:
    """Data, indices and updates split together on a dim other than the scattered axis
    (their sizes agreeing); with ``reduction="add"``, indices and updates split on the
    scattered axis (their values are positions in the whole data, the other dims place by
    position) and the data and the result as addends."""
    axis = op.axis(op.attr("axis", 0))
    data, indices, updates = op.shape(0), op.shape(1), op.shape(2)
    rules = [((d, d, d), (d,)) for d in range(op.rank) if d != axis and data[d] == indices[d] == updates[d]]
    if op.attr("reduction", b"none") in (b"add", "add"):
        rules.append(((P, axis, axis), (P,)))
    return rules


@rule("ScatterND", flops=no_flops, partial_bias=0)
def _scatter_nd(op: OpView) -> list[Rule]:
    """A slice dim of the data (past the indexed ones) split with the updates' matching
    dim; with ``reduction="add"``, the indices' and updates' leading (update) dims split
    together and the data and the result as addends (an embedding's gradient scattered
    from a split batch)."""
    data, indices = op.shape(0), op.shape(1)
    depth, leading = indices[-1], len(indices) - 1
    rules = [((j, R, leading + j - depth), (j,)) for j in range(depth, len(data))]
    if op.attr("reduction", b"none") in (b"add", "add"):
        rules += [((P, d, d), (P,)) for d in range(leading)]
    return rules


@rule("Shape", flops=no_flops)
def _shape(op: OpView) -> list[Rule]:
    """The shape of a tensor split anywhere (or partial) is one replicated vector: the
    emitter scales the local shape back to the whole tensor's by the split. (Ranged plans,
    where shapes are computed at run time; elsewhere shapes are folded.)"""
    need(op.graph.ranged)
    return [((d,), (R,)) for d in range(op.rank)] + [((P,), (R,))]


@rule("Transpose", flops=no_flops)
def _transpose(op: OpView) -> list[Rule]:
    perm = op.attr("perm") or list(reversed(range(op.rank)))
    return [((p,), (d,)) for d, p in enumerate(perm)] + [((P,), (P,))]


@rule("Expand", flops=no_flops, rewrite=_rewrite_to_local_shape(1))
def _expand(op: OpView) -> list[Rule]:
    """X broadcasts to the output; the shape input becomes the local output shape."""
    return broadcast(op, operands=1) + [((P, R), (P,))]


@rule("Tile", flops=no_flops)
def _tile(op: OpView) -> list[Rule]:
    """Dims repeated once split."""
    repeats = op.ints(None, 1)
    need(repeats is not None)
    return [((d, R), (d,)) for d, r in enumerate(repeats) if r == 1] + [((P, R), (P,))]


@rule("Concat", flops=no_flops)
def _concat(op: OpView) -> list[Rule]:
    axis = op.axis(op.attr("axis"))
    n = len(op.ins)
    return [((d,) * n, (d,)) for d in range(op.rank) if d != axis] + [((P,) * n, (P,))]


@rule("Split", flops=no_flops)
def _split(op: OpView) -> list[Rule]:
    axis = op.axis(op.attr("axis", 0))
    n = len(op.outs)
    return [((d, R), (d,) * n) for d in range(op.rank) if d != axis] + [((P, R), (P,) * n)]


def _untouched(size: int, start: int, end: int, step: int) -> bool:
    """Whether slicing [start:end:step] of a dim of ``size`` keeps all of it in order."""
    if step != 1:
        return False
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    return min(max(start, 0), size) == 0 and min(max(end, 0), size) == size


@rule("Slice", flops=no_flops)
def _slice(op: OpView) -> list[Rule]:
    """Dims the slice keeps whole (step 1 over the full range) split; slicing is linear."""
    shape = op.shape(0)
    linear: list[Rule] = [((P,), (P,))]
    if "starts" in op.node.attrs:   # opset 1-9
        starts, ends, axes, steps = op.ints("starts", None), op.ints("ends", None), op.ints("axes", None), None
    else:
        starts, ends, axes, steps = (op.ints(None, i) for i in (1, 2, 3, 4))
        if (op.has_input(3) and axes is None) or (op.has_input(4) and steps is None):
            return linear
    if (starts is None or ends is None) and axes is not None and op.graph.ranged:
        # bounds computed at run time: the dims they cut are cut, the others are whole
        cut = {op.axis(a) for a in axes}
        return [((d,), (d,)) for d in range(len(shape)) if d not in cut] + linear
    if starts is None or ends is None:
        return linear
    axes = [op.axis(a) for a in (axes if axes is not None else range(len(starts)))]
    steps = steps if steps is not None else [1] * len(starts)
    cut = {a for a, s, e, st in zip(axes, starts, ends, steps) if not _untouched(shape[a], s, e, st)}
    return [((d,), (d,)) for d in range(len(shape)) if d not in cut] + linear


@rule("Pad", flops=no_flops)
def _pad(op: OpView) -> list[Rule]:
    """Dims with no padding split; zero padding (or reflect/edge) is linear."""
    pads = op.ints("pads", 1)
    need(pads is not None)
    rank = op.rank
    axes = list(range(rank))
    if op.has_input(3):
        given = op.const(3)
        need(given is not None)
        axes = [op.axis(int(a)) for a in given.reshape(-1)]
    half = len(pads) // 2
    padded = {a for k, a in enumerate(axes) if pads[k] or pads[k + half]}
    rules: list[Rule] = [((d,), (d,)) for d in range(rank) if d not in padded]
    mode = op.attr("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        rules.append(((P,), (P,)))
    else:
        value = op.const(2) if op.has_input(2) else np.array(op.attr("value", 0.0))
        if value is not None and not np.any(value):
            rules.append(((P,), (P,)))
    return rules


def _gather(op: OpView) -> list[Rule]:
    """Indices split with the data replicated; data split on a dim other than ``axis``
    (an embedding table on its last dim) with the indices replicated; linear in the data.
    Constant indices along ``axis`` 0 that pick sample b at position b (``x[arange(B)]``
    as an exporter writes it): the data's first dim split with the output's, each device
    given its piece of the indices (``_local_lookup``)."""
    axis = op.axis(op.attr("axis", 0))
    q = len(op.shape(1))
    rules: list[Rule] = [((R, e), (axis + e,)) for e in range(q)]
    rules += [((d, R), (d if d < axis else d + q - 1,)) for d in range(op.rank) if d != axis]
    if axis == 0 and q >= 1 and _batch_lookup(op, 0) is not None:
        rules.append(((0, R), (0,)))
    return rules + [((P, R), (P,))]


def _gather_nd(op: OpView) -> list[Rule]:
    """Without batch dims: the lookups (the indices' leading dims) split with the data
    replicated; the data split on a dim the indices do not address (stacked expert weights
    [experts, out, in] gathered per token: ``out`` or ``in``) with the indices replicated;
    linear in the data. Constant indices whose first column is the batch position
    (``[[b, i], …]`` at position b, as exporters write ``x[arange(B), i]``): the data's
    first dim split with the output's, each device given its piece of the indices
    (``_local_lookup``). With one batch dim: the batch split in all three."""
    q = len(op.shape(1))
    if op.attr("batch_dims", 0) == 1:
        return [((0, 0), (0,))]
    if op.attr("batch_dims", 0) != 0:
        raise NoRule
    k = op.shape(1)[-1]
    rules: list[Rule] = [((R, e), (e,)) for e in range(q - 1)]
    rules += [((d, R), (q - 1 + d - k,)) for d in range(k, op.rank)]
    if q >= 2 and _batch_lookup(op, 1) is not None:
        rules.append(((0, R), (0,)))
    return rules + [((P, R), (P,))]


# --- lookups whose indices are the batch position -----------------------------------------


def _batch_lookup(op: OpView, depth: int) -> np.ndarray | None:
    """The constant int64 indices (input 1) of a Gather (``depth`` 0) or GatherND (``depth``
    1: the first column of the last dim) whose entry at position b of their first dim is b
    itself, for every b of the data's first dim: the lookup keeps each sample apart. None
    otherwise."""
    indices, data = op.const(1), op.shape(0)
    if indices is None or indices.dtype != np.int64 or indices.ndim < 1 + depth or not data:
        return None
    if indices.shape[0] != data[0] or (depth and indices.shape[-1] < 1):
        return None
    column = indices[..., 0] if depth else indices
    column = np.where(column < 0, column + data[0], column)
    position = np.arange(data[0]).reshape((-1,) + (1,) * (column.ndim - 1))
    return indices if np.array_equal(column, np.broadcast_to(position, column.shape)) else None


def _local_lookup(depth: int):
    """The rewrite of a batch-position lookup split on its first dim: the first piece of
    the indices, which is every piece's (its batch column counted from the piece's start),
    when the other columns are the same in every piece; else the split is not offered."""
    def rewrite(op: OpView, inputs, outputs, mesh):
        data = inputs[0]
        if data is None or data.dims[0] == R or (depth == 0 and op.axis(op.attr("axis", 0)) != 0):
            return ()
        if inputs[1] is not None and not inputs[1].is_replicated:
            return ()
        indices = _batch_lookup(op, depth)
        if indices is None:
            return None
        pieces = data.shards(0, mesh)
        size = indices.shape[0] // pieces
        local = indices.copy()
        if depth:
            local[..., 0] = np.where(local[..., 0] < 0, local[..., 0] + indices.shape[0], local[..., 0])
            local[..., 0] -= (np.arange(indices.shape[0]) // size * size).reshape((-1,) + (1,) * (indices.ndim - 2))
        else:
            local = np.where(local < 0, local + indices.shape[0], local)
            local = local - (np.arange(indices.shape[0]) // size * size).reshape((-1,) + (1,) * (indices.ndim - 1))
        parts = np.split(local, pieces, axis=0)
        if not all(np.array_equal(p, parts[0]) for p in parts[1:]):
            return None
        return ((1, _nested(parts[0])),)
    return rewrite


def _nested(array: np.ndarray):
    """An int array as nested tuples (a rewrite's value: hashable, any shape)."""
    return int(array) if array.ndim == 0 else tuple(_nested(a) for a in array)


define("Gather", rule=_gather, flops=no_flops, heavy=True, rewrite=_local_lookup(0), lookups=(0,))
define("GatherND", rule=_gather_nd, flops=no_flops, heavy=True, rewrite=_local_lookup(1), lookups=(0,))


# --- Resize ----------------------------------------------------------------------------------

# (coordinate transformation, nearest rounding) under which nearest upsampling by an integer
# factor s reads input position floor(x / s) for output position x: every output piece
# comes from the matching input piece
_NEAREST_LOCAL = {("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"), ("half_pixel", "round_prefer_ceil"),
                  ("pytorch_half_pixel", "round_prefer_floor"), ("pytorch_half_pixel", "round_prefer_ceil")}


def _text(value, default: str) -> str:
    value = default if value is None else value
    return value.decode() if isinstance(value, bytes) else value


def _resize(op: OpView) -> list[Rule]:
    """Dims that keep their size (scale 1: the batch, the channels) split in input and
    output, in every mode; a spatial dim upsampled by an integer factor in nearest mode
    (where each output position reads input position ``floor(x / s)``: ``_NEAREST_LOCAL``)
    splits too, each device upsampling its own rows. Linear in the input."""
    coordinates = _text(op.attr("coordinate_transformation_mode"), "half_pixel")
    need(coordinates != "tf_crop_and_resize")
    # sizes read as bounds keep the aspect ratio of the whole, which a piece does not have
    need(_text(op.attr("keep_aspect_ratio_policy"), "stretch") == "stretch")
    src, dst = op.shape(0), op.out_shape
    need(src is not None and dst is not None and len(src) == len(dst))
    mode = _text(op.attr("mode"), "nearest")
    rounding = _text(op.attr("nearest_mode"), "round_prefer_floor")
    rules: list[Rule] = []
    for d, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            rules.append(((d,), (d,)))
        elif (mode == "nearest" and a > 0 and b % a == 0 and (coordinates, rounding) in _NEAREST_LOCAL
              and not op.attr("antialias", 0)):
            rules.append(((d,), (d,)))
    return rules + [((P,), (P,))]


def _resize_sizes(op: OpView, inputs, outputs, mesh):
    """A constant ``sizes`` input becomes the local output sizes (of ``axes`` where given)."""
    if not op.has_input(3) or outputs[0] is None:
        return ()
    local = outputs[0].local_shape(op.out_shape, mesh)
    if local == tuple(op.out_shape):
        return ()
    if op.const(3) is None:
        return None
    axes = op.attr("axes")
    picked = [op.axis(int(a), len(local)) for a in axes] if axes else range(len(local))
    return ((3, tuple(local[a] for a in picked)),)


define("Resize", rule=_resize, rewrite=_resize_sizes)


# --- gradients: layout operators move dy back; lookups scatter-add it ----------------------

@gradient("Reshape", "Squeeze", "Unsqueeze", "Flatten")
def _reshape_grad(g: GradNode) -> list:
    return [g.op("Reshape", g.dy(0), g.shape_tensor(g.x(0)))] + [None] * (len(g.inputs) - 1)


@gradient("Transpose")
def _transpose_grad(g: GradNode) -> list:
    rank = g.rank(g.x(0))
    perm = list(g.attr("perm", list(range(rank))[::-1]))
    return [g.op("Transpose", g.dy(0), perm=[perm.index(i) for i in range(rank)])]


@gradient("Expand")
def _expand_grad(g: GradNode) -> list:
    return [g.unbroadcast(g.dy(0), g.x(0)), None]


@gradient("Tile")
def _tile_grad(g: GradNode) -> list:
    """Each of the tiles' addends: dy viewed as [r0, d0, r1, d1, …] summed over the r's."""
    repeats = g.value(1)
    if repeats is None:
        raise GradientError(f"Tile node '{g.name}': the repeats are not a constant")
    shape = g.shape(g.x(0))
    split = [v for r, d in zip(repeats.tolist(), shape) for v in (int(r), d if isinstance(d, int) else -1)]
    if sum(1 for v in split if v == -1) > 1:
        raise GradientError(f"Tile node '{g.name}': more than one dim of unknown size")
    viewed = g.op("Reshape", g.dy(0), g.ints(split))
    summed = g.op("ReduceSum", viewed, g.ints(range(0, 2 * len(shape), 2)), keepdims=0)
    return [g.op("Reshape", summed, g.shape_tensor(g.x(0))), None]


def _positions(g: GradNode, name: str) -> str:
    """An int64 tensor of ``name``'s shape holding each element's flat index."""
    count = g.op("Size", name)
    return g.op("Reshape", g.op("Range", g.const(np.int64(0)), count, g.const(np.int64(1))),
                g.shape_tensor(name))


def _scatter_back(g: GradNode, picked: str, dy: str, x: str, add: bool) -> str:
    """dx: zeros of x's shape with dy's elements added (or written) at the flat positions
    ``picked`` (int64, dy's shape) of x."""
    flat = g.op("Reshape", picked, g.ints([-1]))
    if add:
        scattered = _scatter_add(g, "ScatterElements", _scalar_size(g, x), flat, g.op("Reshape", dy, g.ints([-1])),
                                 g.dtype(x), axis=0)
    else:
        zeros = g.op("ConstantOfShape", _scalar_size(g, x), value=np.zeros(1, dtype=g.dtype(x)))
        scattered = g.op("ScatterElements", zeros, flat, g.op("Reshape", dy, g.ints([-1])), axis=0)
    return g.op("Reshape", scattered, g.shape_tensor(x))


def _scatter_add(g: GradNode, op: str, shape: str, indices: str, updates: str, dtype, **attrs) -> str:
    """Zeros of ``shape`` (a shape tensor) in ``dtype`` with ``updates`` added at ``indices``
    by ``op`` (ScatterND, ScatterElements); float16 and bfloat16 added in float32 and cast
    back (onnxruntime's CPU provider has no float16 adding scatter, and the sums of many
    addends keep their digits)."""
    dtype = np.dtype(dtype)
    narrow = dtype == np.float16 or dtype.name == "bfloat16"
    zeros = g.op("ConstantOfShape", shape, value=np.zeros(1, dtype=np.float32 if narrow else dtype))
    if not narrow:
        return g.op(op, zeros, indices, updates, reduction="add", **attrs)
    wide = g.op(op, zeros, indices, g.op("Cast", updates, to=TensorProto.FLOAT), reduction="add", **attrs)
    return g.op("Cast", wide, to=helper.np_dtype_to_tensor_dtype(dtype))


def _scalar_size(g: GradNode, name: str) -> str:
    return g.op("Reshape", g.op("Size", name), g.ints([1]))


@gradient("Slice")
def _slice_grad(g: GradNode) -> list:
    """dy written back at the positions the slice took (a slice takes each at most once)."""
    x = g.x(0)
    picked = g.op("Slice", _positions(g, x), *g.inputs[1:])
    return [_scatter_back(g, picked, g.dy(0), x, add=False)] + [None] * (len(g.inputs) - 1)


@gradient("Gather")
def _gather_grad(g: GradNode) -> list:
    """dy added back at the rows the indices took (a row taken twice gets both addends): on
    axis 0 (an embedding's lookup) one ScatterND of whole rows, elsewhere by flat positions."""
    x = g.x(0)
    axis = int(g.attr("axis", 0)) % g.rank(x)
    if axis != 0:
        picked = g.op("Gather", _positions(g, x), g.x(1), axis=axis)
        return [_scatter_back(g, picked, g.dy(0), x, add=True), None]
    ids = g.x(1)
    rows = g.op("Gather", g.shape_tensor(x), g.const(np.int64(0)))
    if g.dtype(ids) != np.int64:
        ids = g.op("Cast", ids, to=7)   # int64
    ids = g.op("Where", g.op("Less", ids, g.const(np.int64(0))), g.op("Add", ids, rows), ids)
    return [_scatter_add(g, "ScatterND", g.shape_tensor(x), g.op("Unsqueeze", ids, g.ints([-1])), g.dy(0),
                         g.dtype(x)), None]


@gradient("GatherElements")
def _gather_elements_grad(g: GradNode) -> list:
    """dy added back where each element was taken: ScatterElements is GatherElements'
    adjoint on the same axis (and keeps every other dim where it is, so a split batch
    stays split)."""
    x = g.x(0)
    return [_scatter_add(g, "ScatterElements", g.shape_tensor(x), g.x(1), g.dy(0), g.dtype(x),
                         axis=int(g.attr("axis", 0))), None]


@gradient("GatherND")
def _gather_nd_grad(g: GradNode) -> list:
    x = g.x(0)
    picked = g.op("GatherND", _positions(g, x), g.x(1), batch_dims=int(g.attr("batch_dims", 0)))
    return [_scatter_back(g, picked, g.dy(0), x, add=True), None]


@gradient("Concat")
def _concat_grad(g: GradNode) -> list:
    axis = int(g.attr("axis"))
    sizes = g.op("Concat", *[g.op("Gather", g.shape_tensor(x), g.ints([axis])) for x in g.inputs], axis=0)
    parts = g.op("Split", g.dy(0), sizes, axis=axis, outputs=len(g.inputs))
    parts = parts if isinstance(parts, list) else [parts]
    return [p if g.need(i) else None for i, p in enumerate(parts)]


@gradient("Split")
def _split_grad(g: GradNode) -> list:
    axis = int(g.attr("axis", 0))
    return [g.op("Concat", *[g.dy(i) for i in range(len(g.outputs))], axis=axis)] + [None] * (len(g.inputs) - 1)


@gradient("Pad")
def _pad_grad(g: GradNode) -> list:
    """Constant padding: dy at the positions the input was copied to."""
    mode = g.attr("mode", "constant")
    if mode not in ("constant", b"constant"):
        raise GradientError(f"Pad node '{g.name}': only constant padding has a gradient rule (mode {mode})")
    x = g.x(0)
    fill = g.const(np.int64(-1))
    picked = g.op("Pad", _positions(g, x), g.x(1), fill, *([g.x(3)] if g.has_input(3) else []))
    keep = g.op("GreaterOrEqual", picked, g.const(np.int64(0)))
    # the padded positions write their dy to an extra slot past the end, then dropped
    count = g.op("Size", x)
    slot = g.op("Where", keep, picked, count)
    flat = g.op("ConstantOfShape", g.op("Add", _scalar_size(g, x), g.ints([1])),
                value=np.zeros(1, dtype=g.dtype(x)))
    scattered = g.op("ScatterElements", flat, g.op("Reshape", slot, g.ints([-1])),
                     g.op("Reshape", g.dy(0), g.ints([-1])), axis=0)
    body = g.op("Slice", scattered, g.ints([0]), _scalar_size(g, x))
    return [g.op("Reshape", body, g.shape_tensor(x))] + [None] * (len(g.inputs) - 1)


@gradient("Trilu")
def _trilu_grad(g: GradNode) -> list:
    """dx = Trilu(dy): the same triangle kept."""
    return [g.op("Trilu", g.dy(0), *g.inputs[1:], upper=int(g.attr("upper", 1))), None]


@gradient("Resize")
def _resize_grad(g: GradNode) -> list:
    """Resize is linear in x and separable: along each resized axis d, y = x ×_d A_d (A_d: m×n);
    dx = dy ×_d A_dᵀ, A_dᵀ the resize of the n×n identity by the node's own attributes along
    its last axis (so every mode: nearest, linear, cubic, antialias, coordinate transforms)."""
    x, dy = g.x(0), g.dy(0)
    coordinates = _text(g.attr("coordinate_transformation_mode"), "half_pixel")
    if coordinates == "tf_crop_and_resize":
        raise GradientError(f"Resize node '{g.name}': tf_crop_and_resize has no gradient rule")
    src, dst = g.shape(x), g.shape(g.y(0))
    rank = len(src)
    axes = [int(a) % rank for a in g.attr("axes", list(range(rank)))]
    scales = g.value(2) if g.has_input(2) else np.zeros(0)
    if scales is None:
        raise GradientError(f"Resize node '{g.name}': the scales are not a constant")
    if scales.size == 0 and _text(g.attr("keep_aspect_ratio_policy"), "stretch") != "stretch":
        raise GradientError(f"Resize node '{g.name}': only keep_aspect_ratio_policy 'stretch' has a gradient rule")
    keep = ("mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside", "nearest_mode", "antialias")
    attrs = {k: v for k, v in g.attrs.items() if k in keep}
    grad = dy
    for k, axis in enumerate(axes):
        n, m = src[axis], dst[axis]
        scale = float(scales.reshape(-1)[k]) if scales.size else None
        if scale == 1.0 or (scale is None and n == m):
            continue
        if not isinstance(n, int) or not isinstance(m, int):
            raise GradientError(f"Resize node '{g.name}': axis {axis} has a size not known ({n} → {m})")
        eye = g.const(np.eye(n, dtype=g.dtype(x)))
        if scale is not None:
            weights = g.op("Resize", eye, "", g.const(np.array([1.0, scale], dtype=np.float32)), **attrs)
        else:
            weights = g.op("Resize", eye, "", "", g.ints([n, m]), **attrs)
        perm = [d for d in range(rank) if d != axis] + [axis]
        moved = g.op("MatMul", g.op("Transpose", grad, perm=perm), g.op("Transpose", weights, perm=[1, 0]))
        grad = g.op("Transpose", moved, perm=[perm.index(d) for d in range(rank)])
    return [grad] + [None] * (len(g.inputs) - 1)


def _scatter_grad(gather: str):
    """data with updates written at indices (ScatterElements, ScatterND): reduction none:
    ddata = dy with the written positions zeroed, dupdates = dy gathered at the indices
    (indices distinct, as the operator's result assumes); add: ddata = dy, dupdates as for none."""
    def rule(g: GradNode) -> list:
        reduction = _text(g.attr("reduction"), "none")
        if reduction not in ("none", "add"):
            raise GradientError(f"{g.op_type} node '{g.name}': reduction '{reduction}' has no gradient rule")
        attrs = {"axis": int(g.attr("axis", 0))} if g.op_type == "ScatterElements" else {}
        dy, indices = g.dy(0), g.x(1)
        ddata = dupdates = None
        if g.need(0):
            ddata = dy if reduction == "add" else g.op(g.op_type, dy, indices, g.zeros(g.x(2)), **attrs)
        if g.need(2):
            dupdates = g.op(gather, dy, indices, **attrs)
        return [ddata, None, dupdates]
    return rule


gradient("ScatterElements")(_scatter_grad("GatherElements"))
gradient("ScatterND")(_scatter_grad("GatherND"))


def _rearranged_back(g: GradNode, viewed: list, perm: list[int]) -> str:
    """dx of y = Reshape(Transpose(Reshape(x, viewed), perm)): dy viewed as the transposed
    shape, transposed back, reshaped to x (the batch dim as 0: copied)."""
    moved = [viewed[p] for p in perm]
    back = g.op("Transpose", g.op("Reshape", g.dy(0), g.ints(moved)), perm=[perm.index(d) for d in range(len(perm))])
    return g.op("Reshape", back, g.shape_tensor(g.x(0)))


def _blocks(g: GradNode) -> tuple[int, int, int, int]:
    _, c, h, w = g.shape(g.x(0))
    if not all(isinstance(d, int) for d in (c, h, w)):
        raise GradientError(f"{g.op_type} node '{g.name}': channels or spatial dims of unknown size")
    return int(g.attr("blocksize")), c, h, w


@gradient("DepthToSpace")
def _depth_to_space_grad(g: GradNode) -> list:
    """The inverse rearrangement of dy: DCR views x as [N, b, b, C/b², H, W] and transposes it
    by (0, 3, 4, 1, 5, 2); CRD as [N, C/b², b, b, H, W] by (0, 1, 4, 2, 5, 3)."""
    b, c, h, w = _blocks(g)
    if _text(g.attr("mode"), "DCR") == "DCR":
        return [_rearranged_back(g, [0, b, b, c // (b * b), h, w], [0, 3, 4, 1, 5, 2])]
    return [_rearranged_back(g, [0, c // (b * b), b, b, h, w], [0, 1, 4, 2, 5, 3])]


@gradient("SpaceToDepth")
def _space_to_depth_grad(g: GradNode) -> list:
    """The inverse rearrangement of dy: x viewed as [N, C, H/b, b, W/b, b], transposed by
    (0, 3, 5, 1, 2, 4)."""
    b, c, h, w = _blocks(g)
    return [_rearranged_back(g, [0, c, h // b, b, w // b, b], [0, 3, 5, 1, 2, 4])]
