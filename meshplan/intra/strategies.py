"""Sharding strategies of ONNX operators on a 2-D logical mesh.

Rules are written for ONE mesh axis, as a placement per operand (inputs, then outputs):
a tensor dim index to split that dim, ``R`` (replicated) or ``P`` (partial sum). For
example MatMul's contraction rule is ``(1, 0) → (P,)``: split A's columns and B's rows,
and each device holds an addend of the product. ``node_strategies`` combines a rule for
axis 0 with a rule for axis 1 (the same dim split on both axes becomes S01), drops what
the shapes cannot divide, and always puts the all-replicated strategy first: an operator
with no rule gets only that one, which is always correct.

Partial placements are only offered on floating-point tensors, never on parameters (a
weight is sliced, not split into addends), and nonlinear operators never take them.
Shape-like constant inputs (a Reshape target, Slice starts, reduction axes…) are always
replicated; when a split changes one (Reshape's target, Expand's shape), the strategy
carries a *rewrite*: the new int64 value of that input on every device (the local shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from meshplan.model.graph import Graph, Node, TensorInfo
from meshplan.sharding import S0, S01, S1, LogicalMesh, ShardingSpec

R, P = "R", "P"
Place = int | str                                    # dim to split, R or P
Rule = tuple[tuple[Place, ...], tuple[Place, ...]]   # (per input, per output); missing trailing inputs are R


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[ShardingSpec | None, ...]     # one per node input; None for an omitted optional input
    outputs: tuple[ShardingSpec | None, ...]    # one per node output; None for an omitted optional output
    rewrites: tuple[tuple[int, tuple[int, ...]], ...] = ()   # input index → its new int64 value on every device

    def __str__(self) -> str:
        def show(specs):
            return ",".join("_" if s is None else str(s) for s in specs)
        return f"{show(self.inputs)}->{show(self.outputs)}"

    @property
    def is_replicated(self) -> bool:
        return all(s is None or s.is_replicated for s in self.inputs + self.outputs)


# --- what a rule sees -------------------------------------------------------------------

class OpView:
    """A node with its operands' shapes and dtypes, attributes and known constants."""

    def __init__(self, node: Node, graph: Graph, constants: Mapping[str, np.ndarray], opset: int | None):
        self.node, self.graph, self.constants, self.opset = node, graph, constants, opset

        def info(name: str) -> TensorInfo | None:
            if not name:
                return None
            if name not in graph.tensors:
                raise ValueError(f"tensor '{name}' of {node.op_type} node '{node.name}' has no shape in the graph")
            return graph.tensors[name]

        self.ins = [info(n) for n in node.inputs]
        self.outs = [info(n) for n in node.outputs]

    @property
    def rank(self) -> int:
        """Rank of the first input."""
        return len(self.ins[0].shape)

    def shape(self, index: int) -> tuple[int, ...] | None:
        return self.ins[index].shape if index < len(self.ins) and self.ins[index] is not None else None

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.outs[0].shape

    def attr(self, name: str, default=None):
        return self.node.attrs.get(name, default)

    def has_input(self, index: int) -> bool:
        return index < len(self.ins) and self.ins[index] is not None

    def const(self, index: int) -> np.ndarray | None:
        """Value of input ``index`` when it is a known constant."""
        if not self.has_input(index):
            return None
        value = self.constants.get(self.node.inputs[index])
        return None if value is None else np.asarray(value)

    def is_constant(self, index: int) -> bool:
        """Whether input ``index`` is an initializer (so a per-device value can replace it)."""
        return self.has_input(index) and (self.ins[index].is_param or self.node.inputs[index] in self.constants)

    def ints(self, attr: str | None, index: int | None) -> list[int] | None:
        """An int list given as attribute ``attr`` or as constant input ``index``; None if unknown or absent."""
        if attr is not None and attr in self.node.attrs:
            return [int(v) for v in self.node.attrs[attr]]
        value = None if index is None else self.const(index)
        return None if value is None else [int(v) for v in value.reshape(-1)]

    def axis(self, value: int, rank: int | None = None) -> int:
        rank = self.rank if rank is None else rank
        return value + rank if value < 0 else value


class _NoRule(Exception):
    """Raised by a rule function when only the replicated strategy is correct."""


def _need(condition) -> None:
    if not condition:
        raise _NoRule


RuleFn = Callable[[OpView], Iterable[Rule]]
_RULES: dict[str, RuleFn] = {}
# op type → f(op, strategy, mesh): the strategy's rewrites, or None when it cannot be run
_REWRITES: dict[str, Callable[[OpView, Strategy, LogicalMesh], tuple | None]] = {}


def _register(*op_types: str):
    def add(fn: RuleFn) -> RuleFn:
        for op in op_types:
            _RULES[op] = fn
        return fn
    return add


def ops_with_rules() -> tuple[str, ...]:
    """The ONNX op types (default domain) that have sharding rules."""
    return tuple(sorted(_RULES))


# --- pointwise ops ----------------------------------------------------------------------

def _broadcast(op: OpView, operands: int | None = None) -> list[Rule]:
    """Split any output dim; each input splits its matching dim or broadcasts it (R).

    Only the first ``operands`` inputs (default all) take part; the others stay R.
    """
    out = op.out_shape
    rank = len(out)
    rules = []
    for d in range(rank):
        ins = []
        for info in op.ins[:operands]:
            shape = info.shape if info is not None else ()
            e = d - (rank - len(shape))
            ins.append(e if e >= 0 and shape[e] == out[d] else R)
        rules.append((tuple(ins), (d,) * len(op.outs)))
    return rules


def _all_partial(op: OpView) -> Rule:
    return (P,) * len(op.ins), (P,) * len(op.outs)


# Nonlinear: splits only.
_UNARY = (
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "BitwiseNot", "Ceil", "Celu", "Cos", "Cosh",
    "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "IsInf", "IsNaN", "LeakyRelu", "Log",
    "Mish", "Not", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh",
    "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu",
)
_NONLINEAR_BROADCAST = (
    "And", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Clip", "Equal", "Greater", "GreaterOrEqual",
    "Less", "LessOrEqual", "Max", "Min", "Mod", "Or", "PRelu", "Pow", "Xor",
)
# f(x1 + x2) = f(x1) + f(x2): a partial input gives a partial output.
_UNARY_LINEAR = ("Neg", "Identity")
# Sums of their inputs: all inputs partial over the same axes give a partial output.
_ADDITIVE = ("Add", "Sub", "Sum", "Mean")


@_register(*_UNARY, *_NONLINEAR_BROADCAST)
def _pointwise(op: OpView) -> list[Rule]:
    return _broadcast(op)


@_register(*_UNARY_LINEAR, *_ADDITIVE)
def _pointwise_additive(op: OpView) -> list[Rule]:
    return _broadcast(op) + [_all_partial(op)]


@_register("Mul")
def _mul(op: OpView) -> list[Rule]:
    """Linear in each factor: one partial factor times replicated ones."""
    return _broadcast(op) + [(tuple(P if j == i else R for j in range(len(op.ins))), (P,)) for i in range(len(op.ins))]


@_register("Div")
def _div(op: OpView) -> list[Rule]:
    """Linear in the numerator only."""
    return _broadcast(op) + [((P, R), (P,))]


@_register("Where")
def _where(op: OpView) -> list[Rule]:
    """Linear in (X, Y) together: both partial, the condition replicated."""
    return _broadcast(op) + [((R, P, P), (P,))]


@_register("Cast")
def _cast(op: OpView) -> list[Rule]:
    """Linear between floating types that do not lose precision."""
    src, dst = op.ins[0].dtype, op.outs[0].dtype
    exact = np.issubdtype(src, np.floating) and np.issubdtype(dst, np.floating) and dst.itemsize >= src.itemsize
    return _broadcast(op) + ([_all_partial(op)] if exact else [])


@_register("Dropout")
def _dropout(op: OpView) -> list[Rule]:
    """Inference dropout is the identity (the mask output is all true)."""
    if op.has_input(2):
        mode = op.const(2)
        _need(mode is not None and not bool(mode))
    if "is_test" in op.node.attrs or (op.opset is not None and op.opset < 7):
        _need(op.attr("is_test", 0))   # opset 1-6: is_test=0 means training
    return _broadcast(op)


# --- contractions -----------------------------------------------------------------------

def _einsum(op: OpView, inputs: Sequence[Sequence[str] | None], output: Sequence[str],
            contract: bool = True, linear: Sequence[int] = ()) -> list[Rule]:
    """Rules of a product written with dim labels, as an einsum.

    An output label splits on every input that has it at full size (broadcast inputs
    stay R); a contracted label (when ``contract``) splits on every input that has it
    and gives a partial output; each input in ``linear`` may be partial alone.
    """
    out = op.out_shape
    rules: list[Rule] = []
    for d, label in enumerate(output):
        rules.append((tuple(
            labels.index(label) if labels and label in labels and op.shape(i)[labels.index(label)] == out[d] else R
            for i, labels in enumerate(inputs)
        ), (d,)))
    contracted = [label for labels in inputs if labels for label in labels if label not in output]
    if contract:
        for label in dict.fromkeys(contracted):
            rules.append((tuple(labels.index(label) if labels and label in labels else R for labels in inputs), (P,)))
    for i in linear:
        rules.append((tuple(P if j == i else R for j in range(len(inputs))), (P,)))
    return rules


@_register("MatMul")
def _matmul(op: OpView) -> list[Rule]:
    """numpy matmul: batch dims (broadcast), rows M, columns N, contraction K → partial."""
    a, b, out = op.shape(0), op.shape(1), op.out_shape
    batch = [f"b{d}" for d in range(len(out) - (len(a) > 1) - (len(b) > 1))]

    def labels(rank: int, last_two: list[str]) -> list[str]:
        return batch[len(batch) - (rank - 2):] + last_two if rank >= 2 else ["k"]

    output = batch + (["m"] if len(a) > 1 else []) + (["n"] if len(b) > 1 else [])
    return _einsum(op, [labels(len(a), ["m", "k"]), labels(len(b), ["k", "n"])], output, linear=(0, 1))


@_register("Gemm")
def _gemm(op: OpView) -> list[Rule]:
    """alpha·A'·B' + beta·C: M and N splits (C follows by broadcasting); K → partial, with
    C partial too when there is a bias (Megatron's row-parallel linear layer)."""
    a = ["k", "m"] if op.attr("transA", 0) else ["m", "k"]
    b = ["n", "k"] if op.attr("transB", 0) else ["k", "n"]
    c = ["m", "n"][2 - len(op.shape(2)):] if op.has_input(2) else None
    no_bias = c is None or op.attr("beta", 1.0) == 0
    rules = _einsum(op, [a, b, c], ["m", "n"], contract=no_bias, linear=(0, 1) if no_bias else ())
    if not no_bias:
        rules.append(((a.index("k"), b.index("k"), P), (P,)))
    return rules


@_register("Conv")
def _conv(op: OpView) -> list[Rule]:
    """Batch; output channels (W rows, bias); input channels (X dim 1, W dim 1) → partial."""
    rules: list[Rule] = [((0, R, R), (0,))]
    if op.attr("group", 1) == 1:
        rules.append(((R, 0, 0), (1,)))
        if not op.has_input(2):
            rules += [((1, 1), (P,)), ((P, R), (P,)), ((R, P), (P,))]
    return rules


# --- normalisations and reductions -------------------------------------------------------

@_register("Softmax", "LogSoftmax", "Hardmax")
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


@_register("LayerNormalization")
def _layer_norm(op: OpView) -> list[Rule]:
    """Dims before ``axis``; scale and bias (over axis…) stay replicated; Mean/InvStdDev follow X."""
    axis = op.axis(op.attr("axis", -1))
    return [((d, R, R), (d, d, d)) for d in range(axis)]


@_register("BatchNormalization")
def _batch_norm(op: OpView) -> list[Rule]:
    """Inference form only: batch, or channels with scale, B, mean and var sliced."""
    _need(not op.attr("training_mode", 0) and sum(o is not None for o in op.outs) == 1)
    return [((0, R, R, R, R), (0,)), ((1, 0, 0, 0, 0), (1,))]


@_register("InstanceNormalization")
def _instance_norm(op: OpView) -> list[Rule]:
    return [((0, R, R), (0,)), ((1, 0, 0), (1,))]


@_register("LRN")
def _lrn(op: OpView) -> list[Rule]:
    """Normalises across channels: every other dim splits."""
    return [((d,), (d,)) for d in range(op.rank) if d != 1]


@_register("MaxPool", "LpPool", "GlobalMaxPool", "GlobalLpPool")
def _pool(op: OpView) -> list[Rule]:
    """Batch and channels. MaxPool's Indices output counts over the whole tensor: not split."""
    _need(len(op.outs) < 2 or op.outs[1] is None)
    return [((0,), (0,)), ((1,), (1,))]


@_register("AveragePool", "GlobalAveragePool")
def _average_pool(op: OpView) -> list[Rule]:
    return _pool(op) + [((P,), (P,))]


_REDUCE = (
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
)


@_register(*_REDUCE)
def _reduce(op: OpView) -> list[Rule]:
    """Split kept dims; ReduceSum over a split dim gives a partial sum; Sum/Mean are linear."""
    rank = op.rank
    if "axes" in op.node.attrs:
        axes = [op.axis(a) for a in op.attr("axes")]
    elif op.has_input(1):
        given = op.const(1)
        _need(given is not None)
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


@_register("ArgMax", "ArgMin")
def _arg_reduce(op: OpView) -> list[Rule]:
    axis = op.axis(op.attr("axis", 0))
    keep = op.attr("keepdims", 1)
    return [((d,), (d if keep or d < axis else d - 1,)) for d in range(op.rank) if d != axis]


# --- shape ops --------------------------------------------------------------------------

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
                raise _NoRule
        groups.append((gi, go))
    return groups


@_register("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(op: OpView) -> list[Rule]:
    """Split the leading dim of a run of dims and the leading dim of the run it becomes.

    Row-major order is kept, so the k-th chunk of a run's leading dim is the same
    elements as the k-th chunk of its image's leading dim (e.g. hidden → heads × head_dim:
    hidden split ↔ heads split). Shape inputs stay replicated; Reshape's target becomes
    the local shape.
    """
    src, dst = op.shape(0), op.out_shape
    _need(0 not in src and 0 not in dst and prod(src) == prod(dst))
    return [((gi[0],), (go[0],)) for gi, go in _reshape_groups(src, dst)] + [((P,), (P,))]


def _rewrite_to_local_shape(index: int):
    """The shape input ``index`` becomes the local output shape (needs an initializer)."""
    def rewrite(op: OpView, strategy: Strategy, mesh: LogicalMesh):
        local = strategy.outputs[0].local_shape(op.out_shape, mesh)
        if local == tuple(op.out_shape):
            return ()
        return ((index, local),) if op.is_constant(index) else None
    return rewrite


def _squeeze_keeps_split_dims(op: OpView, strategy: Strategy, mesh: LogicalMesh):
    """Squeeze without axes drops every size-1 dim: a split must not leave a local size of 1."""
    if op.has_input(1) or "axes" in op.node.attrs:
        return ()
    local = strategy.inputs[0].local_shape(op.shape(0), mesh)
    return None if any(size == 1 != full for size, full in zip(local, op.shape(0))) else ()


_REWRITES["Reshape"] = _rewrite_to_local_shape(1)
_REWRITES["Expand"] = _rewrite_to_local_shape(1)
_REWRITES["Squeeze"] = _squeeze_keeps_split_dims


@_register("Transpose")
def _transpose(op: OpView) -> list[Rule]:
    perm = op.attr("perm") or list(reversed(range(op.rank)))
    return [((p,), (d,)) for d, p in enumerate(perm)] + [((P,), (P,))]


@_register("Expand")
def _expand(op: OpView) -> list[Rule]:
    """X broadcasts to the output; the shape input becomes the local output shape."""
    return _broadcast(op, operands=1) + [((P, R), (P,))]


@_register("Tile")
def _tile(op: OpView) -> list[Rule]:
    """Dims repeated once split."""
    repeats = op.ints(None, 1)
    _need(repeats is not None)
    return [((d, R), (d,)) for d, r in enumerate(repeats) if r == 1] + [((P, R), (P,))]


@_register("Concat")
def _concat(op: OpView) -> list[Rule]:
    axis = op.axis(op.attr("axis"))
    n = len(op.ins)
    return [((d,) * n, (d,)) for d in range(op.rank) if d != axis] + [((P,) * n, (P,))]


@_register("Split")
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


@_register("Slice")
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
    if starts is None or ends is None:
        return linear
    axes = [op.axis(a) for a in (axes if axes is not None else range(len(starts)))]
    steps = steps if steps is not None else [1] * len(starts)
    cut = {a for a, s, e, st in zip(axes, starts, ends, steps) if not _untouched(shape[a], s, e, st)}
    return [((d,), (d,)) for d in range(len(shape)) if d not in cut] + linear


@_register("Pad")
def _pad(op: OpView) -> list[Rule]:
    """Dims with no padding split; zero padding (or reflect/edge) is linear."""
    pads = op.ints("pads", 1)
    _need(pads is not None)
    rank = op.rank
    axes = list(range(rank))
    if op.has_input(3):
        given = op.const(3)
        _need(given is not None)
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


@_register("Gather")
def _gather(op: OpView) -> list[Rule]:
    """Indices split with the data replicated; data split on a dim other than ``axis``
    (an embedding table on its last dim) with the indices replicated; linear in the data."""
    axis = op.axis(op.attr("axis", 0))
    q = len(op.shape(1))
    rules: list[Rule] = [((R, e), (axis + e,)) for e in range(q)]
    rules += [((d, R), (d if d < axis else d + q - 1,)) for d in range(op.rank) if d != axis]
    return rules + [((P, R), (P,))]


# --- expansion over the 2-D mesh ---------------------------------------------------------

def _normalize(op: OpView, rule: Rule) -> Rule:
    ins, outs = rule
    ins = tuple(ins) + (R,) * (len(op.ins) - len(ins))
    ins = tuple(None if info is None else p for p, info in zip(ins, op.ins))
    outs = tuple(None if info is None else p for p, info in zip(outs, op.outs))
    return ins, outs


def _allowed(op: OpView, rule: Rule) -> bool:
    """Partial only on floating tensors, and on a weight only as Gemm's bias: a partial
    weight is stored whole on one device of each partial group and as zeros on the others
    (see shard_emit), which lets the bias ride along with a partial product; any other
    partial weight would be correct but never useful."""
    for index, (place, info) in enumerate(zip(rule[0] + rule[1], op.ins + op.outs)):
        if place != P:
            continue
        if not np.issubdtype(info.dtype, np.floating):
            return False
        if info.is_param and not (op.node.op_type == "Gemm" and index == 2):
            return False
    return True


def _combine(p0: Place | None, p1: Place | None, shape: tuple[int, ...], mesh: LogicalMesh) -> ShardingSpec | None | bool:
    """The spec of one operand under rule placements for axis 0 and 1; False if it does not fit."""
    if p0 is None:
        return None
    dims = ["R"] * len(shape)
    partial = []
    if p0 == P:
        partial.append(0)
    elif p0 != R:
        dims[p0] = S0
    if p1 == P:
        partial.append(1)
    elif p1 != R:
        dims[p1] = S01 if dims[p1] == S0 else S1
    spec = ShardingSpec(tuple(dims), tuple(partial))
    for d, size in enumerate(shape):
        shards = spec.shards(d, mesh)
        if shards > 1 and (size < shards or size % shards):
            return False
    return spec


def _conflicts(r0: Rule, r1: Rule) -> bool:
    """Two different rules that split the same dim of one operand do not compose."""
    return r0 != r1 and any(isinstance(a, int) and a == b for a, b in zip(r0[0] + r0[1], r1[0] + r1[1]))


def node_strategies(node: Node, graph: Graph, mesh: LogicalMesh,
                    constants: Mapping[str, np.ndarray] | None = None, opset: int | None = None) -> list[Strategy]:
    """The sharding strategies of ``node`` on ``mesh``, all-replicated first, deduplicated.

    ``constants`` holds the values of small initializers (reduction axes, Slice bounds,
    Pad pads…); a rule that needs a value it cannot find offers nothing. ``opset`` is
    the model's default-domain opset (it changes Softmax's semantics); None is read
    conservatively.
    """
    op = OpView(node, graph, constants or {}, opset)
    replicated = Strategy(
        tuple(None if i is None else ShardingSpec.replicated(len(i.shape)) for i in op.ins),
        tuple(None if o is None else ShardingSpec.replicated(len(o.shape)) for o in op.outs),
    )
    rule_fn = _RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if rule_fn is None or not op.ins or op.ins[0] is None or any(o is None for o in op.outs[:1]):
        return [replicated]
    try:
        rules = [_normalize(op, rule) for rule in rule_fn(op)]
    except _NoRule:
        return [replicated]
    everything_r = _normalize(op, ((), tuple(R for _ in op.outs)))
    rules = [everything_r] + [r for r in dict.fromkeys(rules) if r != everything_r and _allowed(op, r)]
    per_axis = [rules if mesh.shape[axis] > 1 else [everything_r] for axis in (0, 1)]
    shapes = [None if i is None else i.shape for i in op.ins + op.outs]
    rewrite = _REWRITES.get(node.op_type)
    found: dict[Strategy, None] = {replicated: None}
    for r0 in per_axis[0]:
        for r1 in per_axis[1]:
            if _conflicts(r0, r1):
                continue
            specs = [_combine(a, b, shape, mesh) for a, b, shape in zip(r0[0] + r0[1], r1[0] + r1[1], shapes)]
            if any(s is False for s in specs):
                continue
            strategy = Strategy(tuple(specs[:len(op.ins)]), tuple(specs[len(op.ins):]))
            if rewrite is not None:
                rewrites = rewrite(op, strategy, mesh)
                if rewrites is None:
                    continue
                strategy = Strategy(strategy.inputs, strategy.outputs, rewrites)
            found[strategy] = None
    return list(found)
