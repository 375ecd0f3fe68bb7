"""Quantized operators: (de)quantization with per-tensor, per-axis or blocked scales, and
products of quantized operands (onnxruntime's ``com.microsoft`` MatMulNBits among them).

A scale and its zero point always follow the quantized tensor: replicated when they are
per-tensor, split with it along the quantization axis when per-axis, and, when blocked,
split with it on every dim (along the blocked axis only on block boundaries). Integer
results are never partial.
"""

from __future__ import annotations

from math import prod

import numpy as np

from meshplan.ops.contractions import einsum_rules, matmul_labels, product_flops
from meshplan.ops.registry import MATRIX, define, per_element, rule
from meshplan.ops.view import P, R, OpView, Rule, need

MICROSOFT = "com.microsoft"


def _blocked_scale_stays_blocked(op: OpView, inputs, outputs, mesh) -> tuple | None:
    """onnxruntime reads a one-element scale as per-tensor and then rejects ``block_size``:
    a blocked split must leave each device more than one scale (None: not runnable)."""
    if not op.attr("block_size", 0) or prod(op.shape(1)) == 1:
        return ()
    return None if prod(inputs[1].local_shape(op.shape(1), mesh)) == 1 else ()


@rule("DequantizeLinear", "QuantizeLinear", flops=per_element(2), rewrite=_blocked_scale_stays_blocked)
def _quantize_linear(op: OpView) -> list[Rule]:
    """Inputs (x, scale, zero point); any dim of x splits with the output. Per-tensor (one
    scale): scale and zero point replicated. Per-axis (1-D scale along ``axis``): they split
    exactly when x splits along ``axis``. Blocked (``block_size``; scale of x's rank,
    ``ceil(size / block_size)`` along ``axis``): they split with x on every dim; along
    ``axis`` only when the blocks tile it exactly, and then the scale's own divisibility
    keeps every shard on block boundaries."""
    x, scale = op.shape(0), op.shape(1)
    rank = len(x)
    need(rank > 0 and scale is not None)
    axis = op.axis(op.attr("axis", 1), rank)
    block = op.attr("block_size", 0)
    if block:
        need(len(scale) == rank)
        return [((d, d, d), (d,)) for d in range(rank) if d != axis or x[d] % block == 0]
    if len(scale) == 0 or (len(scale) == 1 and scale[0] == 1):
        return [((d, R, R), (d,)) for d in range(rank)]
    need(len(scale) == 1 and scale[0] == x[axis])
    return [((d, 0, 0) if d == axis else (d, R, R), (d,)) for d in range(rank)]


def _quantized_matmul(op: OpView, a: int, b: int, a_params: tuple[int, ...], b_params: tuple[int, ...]) -> list[Rule]:
    """numpy matmul of quantized A (input ``a``) and B (input ``b``): batch, M and N split;
    A's per-row and B's per-column scales and zero points (1-D) follow M and N, per-tensor
    ones stay replicated. The contraction is not offered: the integer (or requantized)
    result cannot be partial."""
    a_labels, b_labels, output = matmul_labels(op.shape(a), op.shape(b), op.out_shape)
    labels: list[list[str] | None] = [None] * len(op.ins)
    labels[a], labels[b] = a_labels, b_labels
    for params, label in ((a_params, "m"), (b_params, "n")):
        for i in params:
            if op.has_input(i) and len(op.shape(i)) == 1 and label in output:
                labels[i] = [label]
    return einsum_rules(op, labels, output, contract=False)


# (A, B, a_zero_point, b_zero_point) -> int32
define("MatMulInteger", rule=lambda op: _quantized_matmul(op, 0, 1, (2,), (3,)), flops=product_flops, heavy=True)
# (a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp) -> quantized y; y's scale is per-tensor
define("QLinearMatMul", rule=lambda op: _quantized_matmul(op, 0, 3, (1, 2), (4, 5)), flops=product_flops, heavy=True)
# Replicated only: its scale and zero point come from the min and max of the WHOLE input,
# so a shard quantized on its own would get other values.
define("DynamicQuantizeLinear", flops=per_element(4))


# --- com.microsoft MatMulNBits ------------------------------------------------------------
# Inputs: A [..., K]; B uint8 [N, n_blocks, block_size * bits / 8] (K in blocks of
# block_size, packed); scales [N * n_blocks] or [N, n_blocks]; zero_points packed uint8
# [N * ceil(n_blocks * bits / 8)] or [N, ceil(n_blocks * bits / 8)], or of A's type
# (unpacked) like the scales; g_idx [K]; bias [N]. Output: A's shape with last dim N.

def _nbits_flops(op: OpView) -> float:
    """2·M·N·K."""
    return 2.0 * op.outs[0].size * op.attr("K", op.shape(0)[-1])


@rule("MatMulNBits", domain=MICROSOFT, flops=_nbits_flops, heavy=True, policy=MATRIX, partial_bias=5,
      rewrite=lambda op, inputs, outputs, mesh: _nbits_whole_bytes(op, inputs, mesh),
      local_attrs=lambda op, ins, outs: {"K": ins[0][-1], "N": outs[0][-1]})
def _matmul_nbits(op: OpView) -> list[Rule]:
    """A's leading dims split with the output. N (column-parallel): B, scales, zero points
    and bias split along N (dim 0 in every layout, N-major), the output on its last dim.
    K (row-parallel): A's last dim and B, scales and zero points along the block axis, the
    output partial and the bias held by one device (Gemm's partial bias); only with 2-D
    scales and zero points (the 1-D ones are N-major: a K shard is not contiguous), no
    g_idx (its block indices would need renumbering) and whole blocks."""
    rank = len(op.shape(0))
    need(rank >= 1 and len(op.shape(1)) == 3)
    rules: list[Rule] = [((d,), (d,)) for d in range(rank - 1)]
    rules.append(((R, 0, 0, 0, R, 0), (rank - 1,)))
    two_d = all(not op.has_input(i) or len(op.shape(i)) == 2 for i in (2, 3))
    if two_d and not op.has_input(4) and op.attr("K") % op.attr("block_size") == 0:
        rules.append(((rank - 1, 1, 1, 1, R, P), (P,)))
    return rules


def _nbits_whole_bytes(op: OpView, inputs, mesh) -> tuple | None:
    """A K split of packed zero points must leave each device whole bytes: its block count
    times ``bits`` a multiple of 8 (None: the strategy cannot be run)."""
    if not op.has_input(3) or op.ins[3].dtype.kind != "u" or op.ins[3].dtype.itemsize != 1:
        return ()
    blocks = inputs[1].local_shape(op.shape(1), mesh)[1]
    return () if blocks == op.shape(1)[1] or blocks * op.attr("bits", 4) % 8 == 0 else None


# --- com.microsoft GatherBlockQuantized -------------------------------------------------------
# Inputs: data (int4/uint4, or uint8 packing 8 / bits values per byte along quantize_axis),
# indices, scales (data's shape with quantize_axis in blocks of block_size), zero_points
# (like data, or packed like it); output: the scales' type, data's shape (unpacked) with
# gather_axis replaced by the indices' shape. onnxruntime-genai's tied int4 embedding.

@rule("GatherBlockQuantized", domain=MICROSOFT, flops=per_element(2), heavy=True, lookups=(0, 2, 3))
def _gather_block_quantized(op: OpView) -> list[Rule]:
    """The lookups split with the table whole; the table split on a dim it is not gathered
    along (an embedding's hidden dim), its scales and zero points with it; along the
    quantized axis only in whole blocks (the table's and the scales' dims divide alike),
    and not with packed zero points (two blocks per byte)."""
    data = op.shape(0)
    rank = len(data)
    gather_axis = op.axis(op.attr("gather_axis", 0), rank)
    quantize_axis = op.axis(op.attr("quantize_axis", 1), rank)
    q = len(op.shape(1))
    rules: list[Rule] = [((R, e, R, R), (gather_axis + e,)) for e in range(q)]
    block = op.attr("block_size", 128)
    packed = 8 // op.attr("bits", 4) if op.ins[0].dtype == np.uint8 else 1
    for d in range(rank):
        if d == gather_axis:
            continue
        if d == quantize_axis:
            whole_blocks = data[d] * packed % block == 0 and op.shape(2)[d] * block == data[d] * packed
            if not whole_blocks or (op.has_input(3) and op.ins[3].dtype == np.uint8):
                continue
        out = d if d < gather_axis else d + q - 1
        rules.append(((d, R, d, d), (out,)))
    return rules
