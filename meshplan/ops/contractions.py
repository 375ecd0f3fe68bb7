"""Products written as einsums: every dim carries a label; an output label splits on the
inputs that have it, a contracted label splits on every input that has it and leaves a
partial output, and the product is linear in each operand. MatMul, Gemm and Einsum are
one labelling each; Conv is written out."""

from __future__ import annotations

from math import prod
from typing import Sequence

from meshplan.ops.registry import MATRIX, define, rule
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
