"""Seconds and weight bytes of one operator under a sharding strategy, and the cost of
collectives on a logical view of a submesh."""

from __future__ import annotations

from meshplan.cost.analytic import read_write_bytes
from meshplan.cost.cluster import Cluster
from meshplan.cost.protocol import CostModelProtocol
from meshplan.intra.strategies import Strategy, source_specs
from meshplan.model.graph import Graph, Node
from meshplan.ops import entry
from meshplan.reshard.steps import CollectiveModel, MeasuredCollectiveModel, axis_links
from meshplan.sharding import LogicalMesh, ShardingSpec


def held_bytes(slices: dict[tuple[str, ShardingSpec], int]) -> float:
    """Bytes a device stores for these (initializer, layout) slices: each layout of an
    initializer once, and only the whole one where it is also needed whole (the emitter
    cuts the other layouts from it on the device)."""
    whole = {name for name, spec in slices if spec.is_replicated}
    return float(sum(size for (name, spec), size in slices.items() if name not in whole or spec.is_replicated))


def held_outputs(node: Node, graph: Graph) -> list[int]:
    """The outputs of ``node`` a device holds beyond the call: its cache outputs and its
    state outputs."""
    found = [k for k in entry(node.op_type, node.domain).cache_outputs if k < len(node.outputs) and node.outputs[k]]
    found += [k for k, name in enumerate(node.outputs) if name and name in graph.state and k not in found]
    return found


class OperatorCosts:
    reshard_factor = 1.0    # times a resharding between operators happens a call (a training step's: 2)
    lean_gap = 0.0          # a memory-lean ILP stops within this fraction of its bound (0: the solver's default)
    lean_nodes = 0          # ... or at this many branch-and-bound nodes (0: the ILP's work limit)
    call_factor = 1.0       # an unsharded operator's seconds a call, in forwards (a training step's: 3)

    def __init__(self, graph: Graph, cost_model: CostModelProtocol, cluster: Cluster, constants=None):
        self.graph, self.cost_model, self.cluster = graph, cost_model, cluster
        self.constants = constants
        self._held: dict[int, list[int]] = {}   # id(node) → ``held_outputs`` (asked a million times a plan)

    def strategy_seconds(self, node: Node, strategy: Strategy, mesh: LogicalMesh, collectives: CollectiveModel) -> float:
        """What the ILP weighs a strategy by: its compute seconds (a training step adds the
        backward and the gradients' collectives: ``inter.training_costs``)."""
        return self.compute_seconds(node, strategy, mesh)

    def stored_bytes(self, name: str) -> float:
        """Bytes an initializer is held as, whole (a trained weight: with its gradient and slots)."""
        return float(self.graph.tensors[name].nbytes)

    def compute_seconds(self, node: Node, strategy: Strategy, mesh: LogicalMesh) -> float:
        """Work splits over every mesh axis that some operand is split or partial along; the
        bytes a device reads and writes are its own slices of the operands (a replicated
        weight is read whole however the batch is split). Where devices share their host
        (``Cluster.work_scale``) the mesh's devices divide the host's cores and bandwidth
        among them: the work beyond the operator's fixed overhead is scaled."""
        return float(self.cluster.shared_seconds(self._device_seconds(node, strategy, mesh), mesh.size))

    def _device_seconds(self, node: Node, strategy: Strategy, mesh: LogicalMesh) -> float:
        axes = set()
        for spec in list(strategy.inputs) + list(strategy.outputs):
            if spec is not None:
                axes.update(spec.split_axes())
                axes.update(spec.partial)
        shards = 1
        for axis in axes:
            shards *= mesh.axis_size(axis)
        if shards > 1:
            shapes = [spec.local_shape(self.graph.tensors[n].shape, mesh) if n and spec is not None else None
                      for n, spec in zip(node.inputs, strategy.inputs)]
            measured = self.cost_model.shape_seconds(node, self.graph, shapes)
            if measured is not None:
                return measured
            return self.cost_model.split_seconds(node, self.graph, shards, self.local_bytes(node, strategy, mesh))
        return self.cost_model.node_seconds(node, self.graph)

    def local_bytes(self, node: Node, strategy: Strategy, mesh: LogicalMesh) -> float:
        """Bytes one device reads and writes for ``node`` under ``strategy``: each distinct
        operand once, at its local size (an addend is whole-sized)."""
        seen: dict[str, ShardingSpec | None] = {}
        for name, spec in list(zip(node.inputs, strategy.inputs)) + list(zip(node.outputs, strategy.outputs)):
            if name and name not in seen:
                seen[name] = spec
        sizes = {}
        for name, spec in seen.items():
            info = self.graph.tensors[name]
            sizes[name] = info.nbytes if spec is None else spec.local_bytes(info.shape, info.dtype.itemsize, mesh)
        return read_write_bytes(node, sizes)

    def held(self, node: Node) -> list[int]:
        """``held_outputs`` of ``node``, worked out once."""
        found = self._held.get(id(node))
        if found is None:
            found = self._held[id(node)] = held_outputs(node, self.graph)
        return found

    def param_bytes(self, node: Node, strategy: Strategy, mesh: LogicalMesh) -> float:
        return float(sum(self.param_slices(node, strategy, mesh).values()))

    def param_slices(self, node: Node, strategy: Strategy, mesh: LogicalMesh) -> dict[tuple[str, ShardingSpec], int]:
        """(initializer, layout) → bytes a device stores of it for ``node`` under ``strategy``;
        a parameter expression is stored as slices of its sources. An operator's cache
        outputs (an attention's present key and value, ``OpEntry.cache_outputs``) and its
        state outputs (``Graph.state``: kept for the next call) are held like weights, at
        their largest size: (tensor, layout) → the device's share."""
        found: dict[tuple[str, ShardingSpec], int] = {}
        for index in self.held(node):
            name, spec = node.outputs[index], strategy.outputs[index] if index < len(strategy.outputs) else None
            if spec is not None:
                info = self.graph.tensors[name]
                found[(name, spec)] = spec.local_bytes(info.peak or info.shape, info.dtype.itemsize, mesh)
        for name, spec in zip(node.inputs, strategy.inputs):
            info = self.graph.tensors.get(name) if name else None
            if info is None or not info.is_param:
                continue
            spec = spec or ShardingSpec.replicated(len(info.shape))
            stored = source_specs(self.graph, name, spec, mesh, self.constants, self.graph.opset)
            if stored is None:   # not derivable (never offered): held whole
                stored = {source: ShardingSpec.replicated(len(self.graph.tensors[source].shape))
                          for source in info.sources}
            for source, layout in stored.items():
                held = self.graph.tensors[source]
                found[(source, layout)] = layout.local_bytes(held.shape, held.dtype.itemsize, mesh)
        return found

    def collectives(self, submesh: tuple[int, int], logical: tuple[int, int]) -> CollectiveModel:
        """Collective costs on this view: the cost model's measured fits when it has them,
        else the alpha-beta model on the cluster's links."""
        links = axis_links(self.cluster, submesh, logical)
        if not self.cost_model.measures_collectives:
            return CollectiveModel(links)
        crosses = {axis: links[axis] == self.cluster.inter_host and self.cluster.hosts > 1 for axis in (0, 1)}
        return MeasuredCollectiveModel(links, self.cost_model.collective_seconds, crosses)
