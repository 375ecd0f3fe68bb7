"""Analytic cost of operators and transfers on a cluster.

time(node) = max(FLOPs / peak, bytes moved / memory bandwidth) + per-operator overhead.
FLOPs are counted per operator family; bytes moved are the node's inputs (weights
included) and outputs. Transfers between devices use the cluster's link model
(latency + bytes / bandwidth, slower between hosts).
"""

from __future__ import annotations

from math import prod

from meshplan.cost.cluster import Cluster
from meshplan.model.graph import Graph, Node

# Elementwise-like work per output element for ops with more than one FLOP per element.
_PER_ELEMENT = {
    "Softmax": 5, "LogSoftmax": 5, "LayerNormalization": 8, "BatchNormalization": 4,
    "InstanceNormalization": 8, "GroupNormalization": 8, "Erf": 8, "Tanh": 6, "Sigmoid": 4,
    "Gelu": 10, "Exp": 4, "Log": 4, "Pow": 4, "Sqrt": 2, "LRN": 6,
}
# Operators that only move or relabel data: no arithmetic.
_DATA_MOVEMENT = {
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice",
    "Gather", "GatherElements", "Identity", "Expand", "Tile", "Shape", "Cast", "Pad",
    "ConstantOfShape", "Range", "Dropout",
}


def node_flops(node: Node, graph: Graph) -> float:
    t = graph.tensors
    ins = [t[n] for n in node.inputs if n]
    outs = [t[n] for n in node.outputs if n]
    out_size = outs[0].size if outs else 0
    op = node.op_type
    if op == "MatMul" or op == "MatMulInteger":
        k = ins[0].shape[-1] if ins[0].shape else 1
        return 2.0 * out_size * k
    if op == "Gemm":
        a = ins[0].shape
        k = a[0] if node.attrs.get("transA", 0) else a[-1]
        return 2.0 * out_size * k + (out_size if len(ins) > 2 else 0)
    if op in ("Conv", "ConvTranspose"):
        w = ins[1].shape
        per_output = (w[1] if op == "Conv" else w[0] // max(1, node.attrs.get("group", 1))) * prod(w[2:])
        if op == "ConvTranspose":
            return 2.0 * ins[0].size * w[1] * prod(w[2:])
        return 2.0 * out_size * per_output
    if op in ("MaxPool", "AveragePool", "LpPool"):
        return float(out_size * prod(node.attrs.get("kernel_shape", [1])))
    if op.startswith("Reduce") or op in ("GlobalAveragePool", "GlobalMaxPool", "ArgMax", "ArgMin"):
        return float(ins[0].size)
    if op in _DATA_MOVEMENT:
        return 0.0
    return float(out_size * _PER_ELEMENT.get(op, 1))


def node_bytes(node: Node, graph: Graph) -> float:
    names = [n for n in dict.fromkeys(node.inputs) if n] + [n for n in node.outputs if n]
    return float(sum(graph.tensors[n].nbytes for n in names))


class CostModel:
    """Seconds per node and per transfer on a given cluster."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def node_seconds(self, node: Node, graph: Graph) -> float:
        device = self.cluster.device
        if node.op_type in ("Shape", "Size"):
            return device.kernel_overhead
        compute = node_flops(node, graph) / device.peak_flops
        memory = node_bytes(node, graph) / device.memory_bandwidth
        return max(compute, memory) + device.kernel_overhead

    def graph_seconds(self, graph: Graph) -> list[float]:
        return [self.node_seconds(node, graph) for node in graph.nodes]

    def transfer_seconds(self, nbytes: float, src: int, dst: int) -> float:
        if nbytes <= 0 or src == dst:
            return 0.0
        return self.cluster.link(src, dst).seconds(nbytes)

    def worst_transfer_seconds(self, nbytes: float) -> float:
        """A transfer between two devices not yet placed: across hosts when there are several."""
        if nbytes <= 0:
            return 0.0
        link = self.cluster.inter_host if self.cluster.hosts > 1 else self.cluster.intra_host
        return link.seconds(nbytes)
