"""Products written as einsums: every dim carries a label; an output label splits on the
inputs that have it, a contracted label splits on every input that has it and leaves a
partial output, and the product is linear in each operand. MatMul, Gemm and Einsum are
one labelling each; Conv is written out."""

from __future__ import annotations

import string
from math import prod
from typing import Sequence

from meshplan.ops.grad_words import GradientError, GradNode
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
    if len(sb) == 1:   # (b first: with both 1-D, dy is a scalar)
        b, sb = g.set_shape(g.op("Unsqueeze", b, g.ints([1])), sb + (1,)), sb + (1,)
        dy = g.op("Unsqueeze", dy, g.ints([-1]))
    if len(sa) == 1:
        a, sa = g.set_shape(g.op("Unsqueeze", a, g.ints([0])), (1,) + sa), (1,) + sa
        dy = g.op("Unsqueeze", dy, g.ints([-2]))
    batch = _broadcast_dims(sa[:-2], sb[:-2])
    da = db = None
    if g.need(0):
        grad = g.set_shape(g.op("MatMul", dy, _swap_last(g, b, len(sb))), batch + (sa[-2], sa[-1]))
        da = g.unbroadcast(grad, a, like=grad)
        if len(g.shape(g.x(0))) == 1:
            da = g.op("Reshape", da, g.shape_tensor(g.x(0)))
    if g.need(1):
        if len(sb) == 2 and len(sa) > 2 and isinstance(sa[-1], int) and isinstance(sb[-1], int):
            db = _rows_product(g, a, dy, sa[-1], sb[-1])
        else:
            grad = g.set_shape(g.op("MatMul", _swap_last(g, a, len(sa)), dy), batch + (sb[-2], sb[-1]))
            db = g.unbroadcast(grad, b, like=grad)
        if len(g.shape(g.x(1))) == 1:
            db = g.op("Reshape", db, g.shape_tensor(g.x(1)))
    return [da, db]


def _rows_product(g: GradNode, a: str, dy: str, k: int, n: int) -> str:
    """Aᵀ·dY for a matrix B broadcast over every batch dim of A (a weight applied to each
    position): A's and dY's batch dims and rows become one dim of rows, and one Gemm
    contracts them — not a product per batch entry summed afterwards, which takes longer per
    FLOP and holds a [batch…, K, N] tensor the size of B times the batch."""
    rows = g.op("Reshape", a, g.ints([-1, k]))
    return g.set_shape(g.op("Gemm", rows, g.op("Reshape", dy, g.ints([-1, n])), transA=1), (k, n))


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


# --- Einsum ----------------------------------------------------------------------------------

def einsum_terms(equation, ranks: Sequence[int]) -> tuple[list[list[str]], list[str]]:
    """Labels per operand and of the output, an ellipsis written out as labels of its own
    (the implicit output: the ellipsis, then the labels seen once, in alphabetical order)."""
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise GradientError(f"einsum '{equation}' has {len(terms)} operands, not {len(ranks)}")
    free = [c for c in string.ascii_letters if c not in equation]
    width = max((rank - (len(t) - 3) for t, rank in zip(terms, ranks) if "..." in t), default=0)
    ellipsis = free[:width]

    def expand(term: str, rank: int) -> list[str]:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        n = rank - len(head) - len(tail)
        return list(head) + ellipsis[width - n:] + list(tail)

    inputs = [expand(t, r) for t, r in zip(terms, ranks)]
    if arrow:
        output = expand(rhs, width + len(rhs) - 3) if "..." in rhs else list(rhs)
    else:
        every = [label for t in terms for label in t.replace("...", "")]
        output = ellipsis + sorted(label for label in set(every) if every.count(label) == 1)
    return inputs, output


@gradient("Einsum")
def _einsum_grad(g: GradNode) -> list:
    """d operand i = einsum(dy, the other operands → operand i's labels); a label only operand
    i has (summed away) is broadcast back, one it holds at size 1 that others hold bigger (an
    ellipsis broadcast) is summed."""
    ranks = [g.rank(x) for x in g.inputs]
    inputs, output = einsum_terms(g.attr("equation", ""), ranks)
    if any(len(set(labels)) != len(labels) for labels in inputs + [output]):
        raise GradientError(f"Einsum node '{g.name}': a label repeated in one operand (a diagonal) "
                            f"has no gradient rule ({g.attr('equation')})")
    sizes: dict[str, set] = {}
    for labels, x in zip(inputs + [output], g.inputs + [g.y(0)]):
        for label, d in zip(labels, g.shape(x)):
            sizes.setdefault(label, set()).add(d)
    grads = []
    for i, (x, labels) in enumerate(zip(g.inputs, inputs)):
        if not g.need(i):
            grads.append(None)
            continue
        operands = [(g.dy(0), output)] if output else []
        operands += [(g.x(j), inputs[j]) for j in range(len(inputs)) if j != i]
        present = {label for _, term in operands for label in term}
        kept = [label for label in labels if label in present]
        if operands:
            grad = g.op("Einsum", *[name for name, _ in operands], equation=",".join(
                "".join(term) for _, term in operands) + "->" + "".join(kept))
        else:
            grad = g.dy(0)
        if not output and operands:   # a scalar result: dy multiplies the product
            grad = g.op("Mul", grad, g.dy(0))
        shape = g.shape(x)
        summed = [p for p, label in enumerate(kept) if shape[labels.index(label)] == 1
                  and any(d != 1 for d in sizes[label])]
        if summed:
            grad = g.op("ReduceSum", grad, g.ints(summed), keepdims=1)
        missing = [p for p, label in enumerate(labels) if label not in present]
        if missing:
            grad = g.op("Expand", g.op("Unsqueeze", grad, g.ints(missing)), g.shape_tensor(x))
        grads.append(grad)
    return grads


# --- Conv: the products of a sliding window ----------------------------------------------------

def _spatial(g: GradNode, name: str) -> list[int]:
    dims = list(g.shape(name)[2:])
    if not all(isinstance(d, int) for d in dims):
        raise GradientError(f"{g.op_type} node '{g.name}': tensor '{name}' has spatial dims of unknown size {dims}")
    return dims


def window_geometry(g: GradNode, kernel: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(input sizes, output sizes, strides, dilations, begin pads) of a window operator
    (Conv, the pools) over x = input 0 into y = output 0, ``auto_pad`` made explicit."""
    sizes, outs = _spatial(g, g.x(0)), _spatial(g, g.y(0))
    n = len(sizes)
    strides = list(g.attr("strides", [1] * n))
    dilations = list(g.attr("dilations", [1] * n))
    auto = g.attr("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        totals = [max(0, (o - 1) * s + (k - 1) * d + 1 - i)
                  for i, o, s, d, k in zip(sizes, outs, strides, dilations, kernel)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in totals]
    elif auto == "VALID":
        begin = [0] * n
    else:
        begin = list(g.attr("pads", [0] * 2 * n))[:n]
    return sizes, outs, strides, dilations, begin


def transposed_window(g: GradNode, dy: str, weight: str, kernel: Sequence[int], group: int) -> str:
    """Σ over the windows that read each input position of dy·weight: a ConvTranspose of dy
    (output 0's gradient) back to input 0's size, its end pads chosen for that size (and
    zeros padded on where the windows never reached the end)."""
    sizes, outs, strides, dilations, begin = window_geometry(g, kernel)
    ends = [s * (o - 1) + (k - 1) * d + 1 - b - i
            for i, o, s, d, k, b in zip(sizes, outs, strides, dilations, kernel, begin)]
    grad = g.op("ConvTranspose", dy, weight, strides=strides, dilations=dilations, group=group,
                pads=begin + [max(e, 0) for e in ends], kernel_shape=list(kernel))
    if any(e < 0 for e in ends):
        grad = g.op("Pad", grad, g.ints([0, 0] + [0] * len(ends) + [0, 0] + [max(-e, 0) for e in ends]))
    return grad


def _weight_grad(g: GradNode, source: str, dout: str, sizes, outs, strides, dilations, begin, kernel,
                 group: int, per_group: int) -> str:
    """Σ_n Σ_o dout[n, m, o]·source[n, c, o·s + k·d − b]: the [M, C/group, *kernel] gradient of
    a window's weights, as a Conv of ``source`` (its batch as the channels, group by group) with
    ``dout`` as the kernel (strides and dilations swapped)."""
    spatial = list(range(2, 2 + len(kernel)))
    if group == 1:
        moved = g.op("Transpose", source, perm=[1, 0] + spatial)
    else:   # [N, C, …] → [C/g, g·N, …]
        grouped = g.op("Reshape", source, g.ints([-1, group, per_group] + list(sizes)))
        moved = g.op("Reshape", g.op("Transpose", grouped, perm=[2, 1, 0] + [d + 1 for d in spatial]),
                     g.ints([per_group, -1] + list(sizes)))
    ends = [max(0, (k - 1) * d + (o - 1) * s + 1 - i - b)
            for i, o, s, d, k, b in zip(sizes, outs, strides, dilations, kernel, begin)]
    full = g.op("Conv", moved, g.op("Transpose", dout, perm=[1, 0] + spatial), strides=list(dilations),
                dilations=list(strides), group=group, pads=list(begin) + ends)
    reach = [(i + b + e - (o - 1) * s - 1) // d + 1
             for i, o, s, d, b, e in zip(sizes, outs, strides, dilations, begin, ends)]
    if reach != list(kernel):
        full = g.op("Slice", full, g.ints([0] * len(kernel)), g.ints(kernel), g.ints(spatial))
    return g.op("Transpose", full, perm=[1, 0] + spatial)


def _static_weight(g: GradNode) -> list[int]:
    found = g.shape(g.x(1))
    if not all(isinstance(d, int) for d in found):
        raise GradientError(f"{g.op_type} node '{g.name}': the weight '{g.x(1)}' has dims of unknown size {found}")
    return list(found)


@gradient("Conv")
def _conv_grad(g: GradNode) -> list:
    """dX = ConvTranspose(dY, W) (same strides, pads, dilations, group); dW = a Conv of X (its
    batch as channels, by group) with dY as the kernel (strides and dilations swapped); dB = Σ dY
    over the batch and spatial dims."""
    x, w, dy = g.x(0), g.x(1), g.dy(0)
    wshape = _static_weight(g)
    kernel = list(g.attr("kernel_shape", wshape[2:]))
    group = int(g.attr("group", 1))
    dx = transposed_window(g, dy, w, kernel, group) if g.need(0) else None
    dw = None
    if g.need(1):
        sizes, outs, strides, dilations, begin = window_geometry(g, kernel)
        dw = _weight_grad(g, x, dy, sizes, outs, strides, dilations, begin, kernel, group, wshape[1])
    db = None
    if g.has_input(2) and g.need(2):
        db = g.op("ReduceSum", dy, g.ints([0] + list(range(2, len(wshape)))), keepdims=0)
    return [dx, dw, db]


@gradient("ConvTranspose")
def _conv_transpose_grad(g: GradNode) -> list:
    """Y = ConvTranspose(X, W): dX = Conv(dY, W) (same strides, pads, dilations, group: the
    conv it transposes); dW = the Conv weight gradient with the roles of X and dY swapped;
    dB = Σ dY over the batch and spatial dims. Pads from output_shape or auto_pad as
    onnxruntime computes them."""
    x, w, dy = g.x(0), g.x(1), g.dy(0)
    wshape = _static_weight(g)
    kernel = list(g.attr("kernel_shape", wshape[2:]))
    group = int(g.attr("group", 1))
    sizes, outs = _spatial(g, x), _spatial(g, g.y(0))
    n = len(kernel)
    strides = list(g.attr("strides", [1] * n))
    dilations = list(g.attr("dilations", [1] * n))
    extra = list(g.attr("output_padding", [0] * n))
    auto = g.attr("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if g.attr("output_shape") is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        totals = [s * (i - 1) + e + (k - 1) * d + 1 - o
                  for i, o, s, d, k, e in zip(sizes, outs, strides, dilations, kernel, extra)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in totals]
    elif auto == "VALID":
        begin = [0] * n
    else:
        begin = list(g.attr("pads", [0] * 2 * n))[:n]
    dx = dw = db = None
    if g.need(0):   # the conv of dY whose windows start at i·s − b: it has X's size with these end pads
        ends = [max(0, s * (i - 1) + (k - 1) * d + 1 - b - o)
                for i, o, s, d, k, b in zip(sizes, outs, strides, dilations, kernel, begin)]
        dx = g.op("Conv", dy, w, strides=strides, dilations=dilations, group=group, pads=begin + ends,
                  kernel_shape=kernel)
        reach = [(o + b + e - (k - 1) * d - 1) // s + 1
                 for o, s, d, k, b, e in zip(outs, strides, dilations, kernel, begin, ends)]
        if reach != sizes:
            dx = g.op("Slice", dx, g.ints([0] * n), g.ints(sizes), g.ints(range(2, 2 + n)))
    if g.need(1):
        dw = _weight_grad(g, dy, x, outs, sizes, strides, dilations, begin, kernel, group, wshape[1])
    if g.has_input(2) and g.need(2):
        db = g.op("ReduceSum", dy, g.ints([0] + list(range(2, 2 + n))), keepdims=0)
    return [dx, dw, db]
