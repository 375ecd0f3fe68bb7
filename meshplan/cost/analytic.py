"""Analytic cost of operators and transfers on a cluster.

time(node) = max(FLOPs / peak, bytes moved / memory bandwidth) + per-operator overhead.
FLOPs come from each op type's registry entry (``meshplan.ops``); the peak is the device's
for the dtype the node computes in (``compute_dtype``); bytes moved are the node's inputs
(weights included) and outputs at their element sizes. One device's part of a sharded
operator is costed the same way on its share: FLOPs over the shards, and the bytes of its
own slices (``split_seconds``): at small batches a matrix product is bound by reading its
weight, which a split weight divides and a split batch does not. Transfers between devices use the
cluster's link model (latency + bytes / bandwidth, slower between hosts).
"""

from __future__ import annotations

import math

from meshplan.cost.cluster import Cluster
from meshplan.cost.protocol import CostModelProtocol
from meshplan.model.graph import Graph, Node
from meshplan.ops import entry, node_flops

__all__ = ["CostModel", "CostModelProtocol", "compute_dtype", "compute_dtypes", "node_bytes", "node_flops",
           "read_write_bytes", "ring_fit"]

# The device peak (cluster.PEAK_KEYS) of each compute dtype; any other computes at fp32's.
PEAK_OF_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "int8"}

# Products of 8-bit integers: they run on the int8 units. Other ops reading 8-bit integers
# (DequantizeLinear, Gather of int8 rows) do next to no arithmetic and count as float32.
INTEGER_PRODUCTS = frozenset({"MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv",
                              "MatMulIntegerToFloat", "DynamicQuantizeMatMul"})


def compute_dtype(node: Node, graph: Graph) -> str:
    """The dtype ``node`` computes in: its first input's (its main operand: a product's
    left side, a pointwise op's data; MatMulNBits' activations) — "float16", "bfloat16",
    "int8" for 8-bit integer products, "float32" for everything else (float32 itself,
    and integer or bool shape arithmetic)."""
    first = next((n for n in node.inputs if n), None)
    if first is None or first not in graph.tensors:
        return "float32"
    name = graph.tensors[first].dtype.name
    if name in ("int8", "uint8"):
        return "int8" if node.op_type in INTEGER_PRODUCTS else "float32"
    return name if name in PEAK_OF_DTYPE else "float32"


def compute_dtypes(graph: Graph) -> list[str]:
    """The dtypes the model's arithmetic runs in (of nodes with FLOPs), sorted; float32 when none has."""
    return sorted({compute_dtype(node, graph) for node in graph.nodes if node_flops(node, graph) > 0}) or ["float32"]


def node_bytes(node: Node, graph: Graph) -> float:
    """Bytes ``node`` reads and writes: each distinct input once and its outputs, except
    that a lookup's table (a Gather's data) is read only where indexed: at most as many
    bytes as the node writes."""
    return read_write_bytes(node, {n: graph.tensors[n].nbytes for n in list(node.inputs) + list(node.outputs) if n})


def read_write_bytes(node: Node, sizes: dict[str, float]) -> float:
    """``node_bytes`` from each operand's size (the whole tensors', or one device's slices)."""
    written = float(sum(sizes[n] for n in dict.fromkeys(node.outputs) if n))
    lookups = entry(node.op_type, node.domain).lookups
    read, seen = 0.0, set(node.outputs)
    for k, name in enumerate(node.inputs):
        if name and name not in seen:
            seen.add(name)
            read += min(sizes[name], written) if k in lookups else sizes[name]
    return read + written


def ring_fit(collective: str, p: int, link) -> tuple[float, float]:
    """(latency, bandwidth) of a ring collective (tree broadcast) among ``p`` devices on ``link``:
    it takes latency + bytes / bandwidth seconds. An all-reduce of two is one exchange
    (recursive doubling: one latency, the ring's bandwidth), as ``CollectiveModel`` has it."""
    lat, bw = link.latency, link.bandwidth
    if collective == "all_reduce":
        return (lat if p == 2 else 2 * (p - 1) * lat), bw * p / (2 * (p - 1))
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) * lat, bw * p / (p - 1)
    if collective == "broadcast":
        return math.ceil(math.log2(p)) * lat, bw
    return lat, bw


class CostModel(CostModelProtocol):
    """Seconds per node and per transfer on a given cluster, from its figures alone."""

    measures_collectives = False

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def node_seconds(self, node: Node, graph: Graph) -> float:
        device = self.cluster.device
        if node.op_type in ("Shape", "Size"):
            return device.kernel_overhead
        compute = node_flops(node, graph) / device.peak(PEAK_OF_DTYPE[compute_dtype(node, graph)])
        memory = node_bytes(node, graph) / device.memory_bandwidth
        return max(compute, memory) + device.kernel_overhead

    def graph_seconds(self, graph: Graph) -> list[float]:
        return [self.node_seconds(node, graph) for node in graph.nodes]

    def split_seconds(self, node: Node, graph: Graph, shards: int, local_bytes: float) -> float:
        return self._analytic_split(node, graph, shards, local_bytes)

    def _analytic_split(self, node: Node, graph: Graph, shards: int, local_bytes: float) -> float:
        device = self.cluster.device
        if node.op_type in ("Shape", "Size"):
            return device.kernel_overhead
        compute = node_flops(node, graph) / shards / device.peak(PEAK_OF_DTYPE[compute_dtype(node, graph)])
        memory = local_bytes / device.memory_bandwidth
        return max(compute, memory) + device.kernel_overhead

    def transfer_seconds(self, nbytes: float, src: int, dst: int) -> float:
        if nbytes <= 0 or src == dst:
            return 0.0
        return self.cluster.link(src, dst).seconds(nbytes)

    def worst_transfer_seconds(self, nbytes: float, across_hosts: bool | None = None) -> float:
        """A transfer between two devices not yet placed: across hosts when there are several
        (or as ``across_hosts`` says)."""
        if nbytes <= 0:
            return 0.0
        across = self.cluster.hosts > 1 if across_hosts is None else across_hosts
        link = self.cluster.inter_host if across else self.cluster.intra_host
        return link.seconds(nbytes)

    def shape_seconds(self, node: Node, graph: Graph, input_shapes, output_shapes=None) -> float | None:
        """No measurements: the caller divides ``node_seconds`` over the shards."""
        return None

    def collective_seconds(self, collective: str, nbytes: float, group_size: int, inter_host: bool) -> float:
        if nbytes <= 0 or group_size <= 1:
            return 0.0
        link = self.cluster.inter_host if inter_host else self.cluster.intra_host
        latency, bandwidth = ring_fit(collective, group_size, link)
        return latency + nbytes / bandwidth

    def summary(self) -> dict:
        return {"cost_model": "analytic"}
