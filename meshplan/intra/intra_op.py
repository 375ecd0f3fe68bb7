"""The intra-operator pass: shard a stage's operators over its logical mesh with the ILP.

The stage DP asks for the cost of many (layer range, submesh, logical mesh) triples, so
the ILP is solved per *layer*, not per range: for each layer, logical mesh and choice of
boundary layout on each side (``R``: tensors crossing the layer boundary replicated;
``B``: split along their first (batch) dimension over the whole mesh), one ILP picks every
operator's strategy. Layers with the same structure share one solve (a transformer stack
solves one layer per distinct cluster shape). A stage's cost is then a chain DP over its
layers' boundary layouts.

Operators without a sharding rule get the replicated strategy only, which is always
correct; so is any plan this pass returns, because the emitter inserts whatever
resharding the chosen specs need. Tensors move between stages in their boundary layout,
by cross-mesh resharding (see ``cross_mesh``).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from meshplan.cost.cluster import Cluster
from meshplan.cost.analytic import CostModel
from meshplan.errors import PlanError
from meshplan.model.graph import Graph, Node
from meshplan.intra.ilp import IlpEdge, IlpNode, ShardingProblem, solve
from meshplan.inter.layers import Layering
from meshplan.intra.policies import apply_policy
from meshplan.reshard.steps import CollectiveModel, MeasuredCollectiveModel, axis_links, reshard_seconds
from meshplan.sharding import R, S0, S01, S1, LogicalMesh, ShardingSpec
from meshplan.intra.strategies import Strategy, node_strategies

BOUNDARY_KINDS = ("R", "B")
LEAN_FACTOR = 1.25   # a lean layer keeps its weights within this factor of an even split


def boundary_spec(kind: str, shape: tuple[int, ...], mesh: LogicalMesh) -> ShardingSpec:
    """Layout of a tensor crossing a layer boundary: replicated, or batch-split."""
    spec = ShardingSpec.replicated(len(shape))
    if kind == "B" and shape:
        n, m = mesh.shape
        first = S01 if n > 1 and m > 1 else S0 if n > 1 else S1 if m > 1 else R
        split = ShardingSpec((first,) + (R,) * (len(shape) - 1))
        if split.is_valid_for(shape, mesh):
            return split
    return spec


@dataclass
class LayerSolution:
    seconds: float
    strategies: list[Strategy]                # chosen strategy per node of the layer, in order
    param_bytes: float
    variables: int = 0
    constraints: int = 0


@dataclass
class StageSharding:
    """The chosen strategies of every operator of a stage, and the stage's estimates."""

    seconds: float
    param_bytes: float
    boundaries: list[str] = field(default_factory=list)
    lean: bool = False


@dataclass
class IntraOpStats:
    ilps: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    variables: int = 0
    constraints: int = 0
    largest: int = 0


# Operators that always get ILP variables of their own; any other operator with exactly one
# producer inside its layer follows that producer's choice.
HEAVY_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Gather", "Einsum", "MatMulInteger"}


def fold_followers(problem: ShardingProblem, heavy: list[bool]):
    """Shrink the ILP: a cheap node u with a single incoming edge v→u gets no variables;
    for each strategy i of v it takes the strategy f(i) cheapest for it given i, its costs
    (and memory) are added to v's, and its outgoing edges start from v with rows f(i).

    Returns the smaller problem and a function mapping its solution back to every node."""
    nodes = [IlpNode(n.name, np.array(n.costs, dtype=float), None if n.memory is None else np.array(n.memory, dtype=float))
             for n in problem.nodes]
    edges = [IlpEdge(e.src, e.dst, np.array(e.costs, dtype=float)) for e in problem.edges]
    incoming: dict[int, list[int]] = {}
    for k, e in enumerate(edges):
        incoming.setdefault(e.dst, []).append(k)
    leader = list(range(len(nodes)))          # node → the node whose variables decide it
    mapping: list[np.ndarray | None] = [None] * len(nodes)  # leader's choice → this node's choice
    removed = set()
    for u in range(len(nodes)):
        into = incoming.get(u, [])
        if heavy[u] or len(into) != 1:
            continue
        edge = edges[into[0]]
        v = edge.src
        total = edge.costs + nodes[u].costs[None, :]          # (k_v, k_u)
        f = np.argmin(total, axis=1)
        rows = np.arange(len(f))
        nodes[v].costs = nodes[v].costs + total[rows, f]
        if nodes[u].memory is not None:
            base = nodes[v].memory if nodes[v].memory is not None else np.zeros(len(f))
            nodes[v].memory = base + nodes[u].memory[f]
        for other in edges:
            if other.src == u and other is not edge:
                other.src, other.costs = v, other.costs[f, :]
        removed.add(into[0])
        leader[u], mapping[u] = v, f
    kept = [u for u in range(len(nodes)) if leader[u] == u]
    position = {u: k for k, u in enumerate(kept)}
    small = ShardingProblem(
        [nodes[u] for u in kept],
        [IlpEdge(position[e.src], position[e.dst], e.costs) for k, e in enumerate(edges)
         if k not in removed and e.src != e.dst],
        problem.memory_limit,
    )

    def recover(choices: list[int]) -> list[int]:
        full = [0] * len(nodes)
        for u in range(len(nodes)):          # leaders come before their followers
            full[u] = choices[position[u]] if leader[u] == u else int(mapping[u][full[leader[u]]])
        return full

    return small, recover


def layer_fingerprints(graph: Graph, layering: Layering, constants: dict[str, np.ndarray]) -> list[str]:
    """One structural fingerprint per layer: operators, attributes, shapes, small constants,
    wiring inside the layer and which outputs leave it. Equal fingerprints, equal ILPs."""
    producers, consumers = graph.producers(), graph.consumers()
    owner = layering.layer_of_node()
    outputs = set(graph.outputs)
    keys = []
    for layer in range(layering.num_layers):
        start, stop = layering.bounds[layer], layering.bounds[layer + 1]
        digest = hashlib.sha256()
        for i in range(start, stop):
            node = graph.nodes[i]
            parts = [node.op_type, node.domain, repr(sorted((k, repr(v)) for k, v in node.attrs.items()))]
            for name in node.inputs:
                if not name:
                    parts.append("-")
                    continue
                info = graph.tensors[name]
                where = producers.get(name)
                origin = f"n{where - start}" if where is not None and start <= where < stop else "in"
                if info.is_param:
                    value = constants.get(name)
                    origin = "c" + (repr(value.tolist()) if value is not None and value.size <= 16 else "")
                parts.append(f"{origin}:{info.shape}:{info.dtype}")
            for name in node.outputs:
                escapes = name in outputs or any(owner[c] != layer for c in consumers.get(name, []))
                parts.append(f"o:{graph.tensors[name].shape}:{graph.tensors[name].dtype}:{escapes}")
            digest.update("|".join(parts).encode())
            digest.update(b";")
        keys.append(digest.hexdigest())
    return keys


class IntraOpPass:
    """Answers "cost of layers [start, stop) on submesh S viewed as logical mesh M"."""

    def __init__(self, graph: Graph, layering: Layering, cost_model: CostModel, cluster: Cluster,
                 constants: dict[str, np.ndarray], solver: str = "cbc", policy: str = "auto"):
        self.graph = graph
        self.layering = layering
        self.cost_model = cost_model
        self.cluster = cluster
        self.constants = constants
        self.solver = solver
        self.policy = policy
        self.stats = IntraOpStats()
        self._producers = graph.producers()
        self._consumers = graph.consumers()
        self._owner = layering.layer_of_node()
        self._outputs = set(graph.outputs)
        self._cache: dict[tuple, LayerSolution] = {}
        self._splittable: dict[tuple, bool] = {}
        self._graph_inputs = set(graph.inputs)
        self._layer_keys: list[str] = []

    # --- costs of one operator under a strategy ----------------------------------------

    def _compute_seconds(self, node: Node, strategy: Strategy, mesh: LogicalMesh) -> float:
        """Work splits over every mesh axis that some operand is split or partial along."""
        axes = set()
        for spec in list(strategy.inputs) + list(strategy.outputs):
            if spec is not None:
                axes.update(spec.split_axes())
                axes.update(spec.partial)
        shards = 1
        for axis in axes:
            shards *= mesh.axis_size(axis)
        measure = getattr(self.cost_model, "shape_seconds", None)
        if measure is not None and shards > 1:
            shapes = [spec.local_shape(self.graph.tensors[n].shape, mesh) if n and spec is not None else None
                      for n, spec in zip(node.inputs, strategy.inputs)]
            measured = measure(node, self.graph, shapes)
            if measured is not None:
                return measured
        # The whole operator's time (measured when profiled), its work divided over the shards.
        overhead = self.cluster.device.kernel_overhead
        whole = self.cost_model.node_seconds(node, self.graph)
        return max(whole - overhead, 0.0) / shards + overhead

    def _param_bytes(self, node: Node, strategy: Strategy, mesh: LogicalMesh) -> float:
        total = 0.0
        for name, spec in zip(node.inputs, strategy.inputs):
            info = self.graph.tensors.get(name) if name else None
            if info is not None and info.is_param:
                total += spec.local_bytes(info.shape, info.dtype.itemsize, mesh) if spec else info.nbytes
        return total

    # --- one layer ------------------------------------------------------------------

    def _layer_key(self, layer: int) -> str:
        """Structural fingerprint: layers with equal keys have equal ILPs."""
        if not self._layer_keys:
            self._layer_keys = layer_fingerprints(self.graph, self.layering, self.constants)
        return self._layer_keys[layer]

    def layer_solution(self, layer: int, submesh: tuple[int, int], logical: tuple[int, int],
                       b_in: str, b_out: str, lean: bool = False) -> LayerSolution:
        """The layer's ILP optimum (shared by every layer with the same structure).

        ``lean`` adds a memory row holding the layer's weights near an even split over the
        mesh, for stages whose fastest layout does not fit the devices."""
        b_in = self._effective_kind(layer, b_in, logical, entering=True)
        b_out = self._effective_kind(layer, b_out, logical, entering=False)
        key = (self._layer_key(layer), submesh, logical, b_in, b_out, lean)
        if key in self._cache:
            self.stats.cache_hits += 1
        else:
            limit = None
            if lean:
                start, stop = self.layering.bounds[layer], self.layering.bounds[layer + 1]
                full = sum(self.graph.tensors[p].nbytes for p in {p for i in range(start, stop) for p in self.graph.params_of(i)})
                limit = LEAN_FACTOR * full / (logical[0] * logical[1])
            try:
                self._cache[key] = self._solve_layer(layer, submesh, logical, b_in, b_out, limit)
            except PlanError:
                if not lean:
                    raise
                self._cache[key] = self.layer_solution(layer, submesh, logical, b_in, b_out)
        return self._cache[key]

    def _effective_kind(self, layer: int, kind: str, logical: tuple[int, int], entering: bool) -> str:
        """``B`` is the same layout as ``R`` when no tensor crossing that side of the layer can
        be batch-split on this mesh (batch 1, say): then both share one ILP."""
        if kind == "R":
            return kind
        key = (layer, logical, entering)
        if key not in self._splittable:
            mesh = LogicalMesh(logical, tuple(range(logical[0] * logical[1])))
            start, stop = self.layering.bounds[layer], self.layering.bounds[layer + 1]
            if entering:
                names = {n for i in range(start, stop) for n in self.graph.nodes[i].inputs
                         if n and not self.graph.tensors[n].is_param and n not in self._graph_inputs
                         and not (start <= self._producers.get(n, -1) < stop)}
            else:
                names = {n for i in range(start, stop) for n in self.graph.nodes[i].outputs
                         if n and any(not (start <= c < stop) for c in self._consumers.get(n, []))}
            self._splittable[key] = any(
                not boundary_spec("B", self.graph.tensors[n].shape, mesh).is_replicated for n in names)
        return kind if self._splittable[key] else "R"

    def _collectives(self, submesh, logical) -> CollectiveModel:
        """Collective costs on this view: measured fits when the cost model has a profile's,
        else the alpha-beta model on the cluster's links."""
        links = axis_links(self.cluster, submesh, logical)
        measured = getattr(self.cost_model, "collective_seconds", None)
        if measured is None:
            return CollectiveModel(links)
        crosses = {axis: links[axis] == self.cluster.inter_host and self.cluster.hosts > 1 for axis in (0, 1)}
        return MeasuredCollectiveModel(links, measured, crosses)

    def _solve_layer(self, layer, submesh, logical, b_in, b_out, memory_limit=None) -> LayerSolution:
        started = time.perf_counter()
        mesh = LogicalMesh(logical, tuple(range(logical[0] * logical[1])))
        collectives = self._collectives(submesh, logical)
        start, stop = self.layering.bounds[layer], self.layering.bounds[layer + 1]
        tensors = self.graph.tensors
        index_of = {}
        nodes: list[IlpNode] = []
        choices: list[list[Strategy]] = []
        inputs_set = set(self.graph.inputs)

        def reshard(src: ShardingSpec, dst: ShardingSpec | None, name: str) -> float:
            if dst is None:
                return 0.0
            info = tensors[name]
            try:
                return reshard_seconds(src, dst, info.shape, info.dtype.itemsize, mesh, collectives)
            except ValueError:
                return float("inf")

        for i in range(start, stop):
            node = self.graph.nodes[i]
            strategies = apply_policy(self.policy, node, self.graph,
                                      node_strategies(node, self.graph, mesh, self.constants, opset=self.graph.opset))
            costs = np.array([self._compute_seconds(node, s, mesh) for s in strategies])
            memory = np.array([self._param_bytes(node, s, mesh) for s in strategies])
            # Inputs from outside the layer arrive in the boundary layout (model inputs replicated).
            for k, name in enumerate(node.inputs):
                if not name or tensors[name].is_param:
                    continue
                where = self._producers.get(name)
                if where is not None and start <= where < stop:
                    continue
                kind = "R" if name in inputs_set else b_in
                arriving = boundary_spec(kind, tensors[name].shape, mesh)
                costs = costs + np.array([reshard(arriving, s.inputs[k], name) for s in strategies])
            # Outputs that leave the layer are handed on in the boundary layout.
            for k, name in enumerate(node.outputs):
                if not name:
                    continue
                leaves = name in self._outputs or any(
                    not (start <= c < stop) for c in self._consumers.get(name, []))
                if leaves:
                    kind = "R" if name in self._outputs else b_out
                    target = boundary_spec(kind, tensors[name].shape, mesh)
                    costs = costs + np.array([reshard(s.outputs[k], target, name) for s in strategies])
            index_of[i] = len(nodes)
            nodes.append(IlpNode(node.name, costs, memory))
            choices.append(strategies)
        edges = []
        for i in range(start, stop):
            node = self.graph.nodes[i]
            for k, name in enumerate(node.inputs):
                where = self._producers.get(name) if name else None
                if where is None or not (start <= where < stop):
                    continue
                out_index = self.graph.nodes[where].outputs.index(name)
                src, dst = choices[index_of[where]], choices[index_of[i]]
                matrix = np.array([[reshard(a.outputs[out_index], b.inputs[k], name) for b in dst] for a in src])
                edges.append(IlpEdge(index_of[where], index_of[i], matrix))
        heavy = [self.graph.nodes[i].op_type in HEAVY_OPS for i in range(start, stop)]
        problem, recover = fold_followers(ShardingProblem(nodes, edges, memory_limit), heavy)
        result = solve(problem, self.solver)
        full = recover(result.choices)
        self.stats.ilps += 1
        self.stats.seconds += time.perf_counter() - started
        self.stats.variables += result.variables
        self.stats.constraints += result.constraints
        self.stats.largest = max(self.stats.largest, result.variables)
        picked = [choices[index_of[i]][full[index_of[i]]] for i in range(start, stop)]
        param_bytes = sum(float(nodes[index_of[i]].memory[full[index_of[i]]]) for i in range(start, stop))
        return LayerSolution(result.objective, picked, param_bytes, result.variables, result.constraints)

    # --- a stage: chain of layers --------------------------------------------------------

    def stage(self, start: int, stop: int, submesh: tuple[int, int], logical: tuple[int, int]) -> StageSharding:
        """Best boundary layouts for layers [start, stop): ``boundaries[0]`` is the layout the
        stage's inputs arrive in, ``boundaries[-1]`` the one its outputs leave in (model
        outputs always leave replicated). The fastest layout is used when its weights fit a
        device, else the memory-lean one."""
        fast = self._chain(start, stop, submesh, logical, lean=False)
        if fast.param_bytes <= self.cluster.device.memory_bytes:
            return fast
        return self._chain(start, stop, submesh, logical, lean=True)

    def _chain(self, start, stop, submesh, logical, lean: bool) -> StageSharding:
        best = {kind: (0.0, 0.0, []) for kind in BOUNDARY_KINDS}   # kind → (seconds, bytes, path)
        for layer in range(start, stop):
            nxt = {}
            for b_out in BOUNDARY_KINDS:
                options = []
                for b_in, (seconds, memory, path) in best.items():
                    solution = self.layer_solution(layer, submesh, logical, b_in, b_out, lean)
                    options.append((seconds + solution.seconds, memory + solution.param_bytes, path + [b_in]))
                nxt[b_out] = min(options, key=lambda o: o[0])
            best = nxt
        end = min(BOUNDARY_KINDS, key=lambda kind: best[kind][0])
        seconds, memory, path = best[end]
        return StageSharding(seconds, memory, boundaries=path + [end], lean=lean)

    def stage_strategies(self, start: int, stop: int, submesh, logical, sharding: StageSharding) -> dict[int, Strategy]:
        chosen: dict[int, Strategy] = {}
        boundaries = sharding.boundaries
        for offset, layer in enumerate(range(start, stop)):
            solution = self.layer_solution(layer, submesh, logical, boundaries[offset], boundaries[offset + 1],
                                           sharding.lean)
            first = self.layering.bounds[layer]
            chosen.update({first + k: strategy for k, strategy in enumerate(solution.strategies)})
        return chosen
