"""Products written as einsums: every dim carries a label; an output label splits on the
inputs that have it, a contracted label splits on every input that has it and leaves a
partial output, and the product is linear in each operand. MatMul, Gemm and Einsum are
one labelling each; Conv is written out."""

from __future__ import annotations

from math import prod
from typing import Sequence

from meshplan.ops.grad_words import GradNode
from meshplan.ops.registry import gradient, MATRIX, define, rule
from meshplan.ops.view import P, R, OpView, Rule, need


def einsum_rules(op: OpView, inputs: Sequence[Sequence[str] | None], output: Sequence[str],
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


def product_flops(op: OpView) -> float:
    """2 × output elements × contraction length (A's last dim)."""
    a = op.ins[0].shape
    return 2.0 * op.outs[0].size * (a[-1] if a else 1)


@rule("MatMul", flops=product_flops, heavy=True, policy=MATRIX)
def _matmul(op: OpView) -> list[Rule]:
    """numpy matmul: batch dims (broadcast), rows M, columns N, contraction K → partial."""
    a_labels, b_labels, output = matmul_labels(op.shape(0), op.shape(1), op.out_shape)
    return einsum_rules(op, [a_labels, b_labels], output, linear=(0, 1))


def matmul_labels(a: Sequence[int], b: Sequence[int], out: Sequence[int]) -> tuple[list[str], list[str], list[str]]:
    """numpy matmul's operands and output as einsum labels: batch dims (broadcast), rows
    ``m``, columns ``n``, contraction ``k``."""
    batch = [f"b{d}" for d in range(len(out) - (len(a) > 1) - (len(b) > 1))]

    def labels(rank: int, last_two: list[str]) -> list[str]:
        return batch[len(batch) - (rank - 2):] + last_two if rank >= 2 else ["k"]

    output = batch + (["m"] if len(a) > 1 else []) + (["n"] if len(b) > 1 else [])
    return labels(len(a), ["m", "k"]), labels(len(b), ["k", "n"]), output


def _gemm_flops(op: OpView) -> float:
    a, out = op.ins[0].shape, op.outs[0].size
    k = a[0] if op.attr("transA", 0) else a[-1]
    return 2.0 * out * k + (out if op.has_input(2) else 0)


@rule("Gemm", flops=_gemm_flops, heavy=True, policy=MATRIX, partial_bias=2)
def _gemm(op: OpView) -> list[Rule]:
    """alpha·A'·B' + beta·C: M and N splits (C follows by broadcasting); K → partial, with
    C partial too when there is a bias (Megatron's row-parallel linear layer)."""
    a = ["k", "m"] if op.attr("transA", 0) else ["m", "k"]
    b = ["n", "k"] if op.attr("transB", 0) else ["k", "n"]
    c = ["m", "n"][2 - len(op.shape(2)):] if op.has_input(2) else None
    no_bias = c is None or op.attr("beta", 1.0) == 0
    rules = einsum_rules(op, [a, b, c], ["m", "n"], contract=no_bias, linear=(0, 1) if no_bias else ())
    if not no_bias:
        rules.append(((a.index("k"), b.index("k"), P), (P,)))
    return rules


def parse_einsum(equation: str, ranks: Sequence[int]) -> tuple[list[list[str]], list[str]]:
    """Labels per input and of the output; no ellipsis, no label repeated in one operand."""
    equation = equation.decode() if isinstance(equation, bytes) else equation
    equation = equation.replace(" ", "")
    need("." not in equation)
    lhs, arrow, rhs = equation.partition("->")
    inputs = [list(term) for term in lhs.split(",")]
    if not arrow:   # implicit output: the labels seen once, in alphabetical order
        every = [label for labels in inputs for label in labels]
        rhs = "".join(sorted(label for label in set(every) if every.count(label) == 1))
    output = list(rhs)
    need(len(inputs) == len(ranks) and all(len(labels) == rank for labels, rank in zip(inputs, ranks)))
    need(all(len(set(labels)) == len(labels) for labels in inputs + [output]))
    return inputs, output


def _einsum_flops(op: OpView) -> float:
    """2 × the product of every label's size (multiply-adds over the full index space)."""
    try:
        inputs, _ = parse_einsum(op.attr("equation", ""), [len(i.shape) for i in op.ins])
    except Exception:
        return float(op.outs[0].size)
    sizes = {label: size for labels, info in zip(inputs, op.ins) for label, size in zip(labels, info.shape)}
    return 2.0 * prod(sizes.values())


@rule("Einsum", flops=_einsum_flops, heavy=True)
def _einsum(op: OpView) -> list[Rule]:
    """Batch and free labels split; contracted labels → partial; linear in each operand."""
    inputs, output = parse_einsum(op.attr("equation", ""), [len(i.shape) for i in op.ins])
    return einsum_rules(op, inputs, output, linear=range(len(inputs)))


def _conv_flops(op: OpView) -> float:
    w = op.shape(1)
    return 2.0 * op.outs[0].size * w[1] * prod(w[2:])


@rule("Conv", flops=_conv_flops, heavy=True)
def _conv(op: OpView) -> list[Rule]:
    """Batch; output channels (W rows, bias); input channels (X dim 1, W dim 1) → partial."""
    rules: list[Rule] = [((0, R, R), (0,))]
    if op.attr("group", 1) == 1:
        rules.append(((R, 0, 0), (1,)))
        if not op.has_input(2):
            rules += [((1, 1), (P,)), ((P, R), (P,)), ((R, P), (P,))]
    return rules


define("ConvTranspose", flops=lambda op: 2.0 * op.ins[0].size * op.shape(1)[1] * prod(op.shape(1)[2:]), heavy=True)


# --- gradients -----------------------------------------------------------------------------

def _swap_last(g: GradNode, name: str, rank: int) -> str:
    return g.op("Transpose", name, perm=list(range(rank - 2)) + [rank - 1, rank - 2])


def _broadcast_dims(a: tuple, b: tuple) -> tuple:
    width = max(len(a), len(b))
    a, b = (1,) * (width - len(a)) + tuple(a), (1,) * (width - len(b)) + tuple(b)
    return tuple(y if x == 1 else x for x, y in zip(a, b))


@gradient("MatMul")
def _matmul_grad(g: GradNode) -> list:
    """dA = dY·Bᵀ, dB = Aᵀ·dY, each summed over the batch dims it was broadcast along; a
    1-D operand is a matrix of one row (A) or one column (B) for the products."""
    a, b, dy = g.x(0), g.x(1), g.dy(0)
    sa, sb = g.shape(a), g.shape(b)
    if len(sa) == 1:
        a, sa = g.set_shape(g.op("Unsqueeze", a, g.ints([0])), (1,) + sa), (1,) + sa
        dy = g.op("Unsqueeze", dy, g.ints([-2]))
    if len(sb) == 1:
        b, sb = g.set_shape(g.op("Unsqueeze", b, g.ints([1])), sb + (1,)), sb + (1,)
        dy = g.op("Unsqueeze", dy, g.ints([-1]))
    batch = _broadcast_dims(sa[:-2], sb[:-2])
    da = db = None
    if g.need(0):
        grad = g.set_shape(g.op("MatMul", dy, _swap_last(g, b, len(sb))), batch + (sa[-2], sa[-1]))
        da = g.unbroadcast(grad, a, like=grad)
        if len(g.shape(g.x(0))) == 1:
            da = g.op("Reshape", da, g.shape_tensor(g.x(0)))
    if g.need(1):
        grad = g.set_shape(g.op("MatMul", _swap_last(g, a, len(sa)), dy), batch + (sb[-2], sb[-1]))
        db = g.unbroadcast(grad, b, like=grad)
        if len(g.shape(g.x(1))) == 1:
            db = g.op("Reshape", db, g.shape_tensor(g.x(1)))
    return [da, db]


@gradient("Gemm")
def _gemm_grad(g: GradNode) -> list:
    """Y = α·A'·B' + β·C (A' = Aᵀ where transA, B' likewise): dA' = α·dY·B'ᵀ, dB' = α·A'ᵀ·dY,
    each written as one Gemm in its operand's stored layout; dC = β·dY summed to C's shape."""
    a, b, dy = g.x(0), g.x(1), g.dy(0)
    alpha, beta = float(g.attr("alpha", 1.0)), float(g.attr("beta", 1.0))
    ta, tb = int(g.attr("transA", 0)), int(g.attr("transB", 0))
    da = db = dc = None
    if g.need(0):
        da = g.op("Gemm", dy, b, alpha=alpha, transB=1 - tb) if not ta else \
            g.op("Gemm", b, dy, alpha=alpha, transA=tb, transB=1)
    if g.need(1):
        db = g.op("Gemm", a, dy, alpha=alpha, transA=1 - ta) if not tb else \
            g.op("Gemm", dy, a, alpha=alpha, transA=1, transB=ta)
    if g.has_input(2) and g.need(2):
        scaled = dy if beta == 1.0 else g.op("Mul", dy, g.const(beta))
        dc = g.unbroadcast(scaled, g.x(2))
    return [da, db, dc]
