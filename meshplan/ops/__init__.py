"""The op registry: one entry per ONNX op type (sharding rule, FLOP formula, heaviness,
policy class), defined in the module of its family."""

from meshplan.ops import attention, contractions, fused_norms, pointwise, quantized, reductions, shapes  # noqa: F401  (they define the entries)
from meshplan.ops.registry import ATTENTION, MATRIX, OpEntry, entry, heavy_ops, ops_with_rules, rule_of
from meshplan.ops.view import SMALL_CONSTANT_ELEMENTS, OpView

__all__ = ["ATTENTION", "MATRIX", "OpEntry", "OpView", "SMALL_CONSTANT_ELEMENTS", "entry", "heavy_ops", "ops_with_rules", "rule_of", "node_flops"]


def node_flops(node, graph) -> float:
    """FLOPs of ``node`` by its op type's formula (its domain's entry, else the default domain's)."""
    return entry(node.op_type, node.domain).flops(OpView(node, graph, {}, None))
