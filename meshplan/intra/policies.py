"""Hand-written parallelisation policies, as restrictions of the automatic search.

``auto`` lets the ILP choose among every strategy. ``data`` is pure data parallelism:
where the plan knows which inputs carry the batch (``graph.memo["batch_inputs"]``), the
batch is followed through the graph (``batch_places``: the strategy of each operator's
sharding rule that splits its inputs where they carry the batch), and each operator keeps
only the strategies that split the batch where it is and nothing else — a sum over the
batch (a weight's gradient, a loss) becomes partial, every tensor without the batch (a
weight, its optimizer state, its update) stays whole, so a training step all-reduces each
gradient once, as DDP does; without that knowledge, activations split along their first
dimension and weights replicated. ``megatron`` fixes every weight-bearing matrix product to the
Megatron-LM pattern — column-parallel when it widens the hidden size (QKV, first MLP
layer) or is reshaped into heads (a Q, K or V projection, which narrows for grouped-query
attention's K and V), row-parallel with a partial result when it narrows it (output
projection, second MLP layer) — splits attention operators (GroupQueryAttention) by heads
where they can be,
and leaves the rest to the ILP. Together with the stage DP's choice of
submeshes they give the baselines meshplan's plans are measured against.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from meshplan.intra.strategies import Strategy, node_strategies
from meshplan.model.graph import Graph, Node
from meshplan.ops import ATTENTION, MATRIX, entry
from meshplan.sharding import LogicalMesh, ShardingSpec

POLICIES = ("auto", "data", "megatron")


def _batch_only(node: Node, graph: Graph, strategy: Strategy) -> bool:
    for name, spec in zip(node.inputs, strategy.inputs):
        if spec is None or not name:
            continue
        if graph.tensors[name].is_param and not spec.is_replicated:
            return False
        if spec.partial or any(p != "R" for p in spec.dims[1:]):
            return False
    outputs_ok = all(spec is None or (not spec.partial and all(p == "R" for p in spec.dims[1:]))
                     for spec in strategy.outputs)
    # Pure data parallelism: the batch is split wherever it can be.
    return outputs_ok and any(spec is not None and spec.dims and spec.dims[0] != "R" for spec in strategy.outputs)


# Where one operand of a node carries the batch under data parallelism: a dim index (split
# there), PARTIAL (a sum over the batch) or None (whole on every device).
PARTIAL = "P"
_PROBE = LogicalMesh((2, 1), (0, 1))


def _split_dim(spec: ShardingSpec | None) -> int | str | None:
    if spec is None:
        return None
    if spec.partial:
        return PARTIAL
    split = [d for d, p in enumerate(spec.dims) if p != "R"]
    return split[0] if split else None


def batch_places(graph: Graph, constants: Mapping[str, np.ndarray] | None) -> dict[str, tuple]:
    """Node name → where each of its operands (inputs, then outputs) carries the batch,
    for the nodes the batch reaches and whose rules keep it apart; from the batch axes of
    ``graph.memo["batch_inputs"]`` (input → axis). At each node: the strategy (on a mesh
    axis of two) that splits every input carrying the batch at that axis, every output
    somewhere if it can (else as a partial sum), and the fewest other inputs — never a
    graph input that does not carry the batch (a weight or optimizer state), and as
    addends only a constant (the zeros a gradient is scattered into)."""
    if "batch_places" in graph.memo:
        return graph.memo["batch_places"]
    carried: dict[str, int] = dict(graph.memo.get("batch_inputs") or {})
    inputs = set(graph.inputs)
    found: dict[str, tuple] = {}
    for node in graph.nodes:
        at = {k: carried[name] for k, name in enumerate(node.inputs) if name in carried}
        if not at:
            continue
        best, best_key = None, None
        for strategy in node_strategies(node, graph, _PROBE, constants, opset=graph.opset):
            places = [_split_dim(spec) for spec in strategy.inputs]
            if any(places[k] != axis for k, axis in at.items()):
                continue
            others = [k for k, name in enumerate(node.inputs) if name and k not in at and places[k] is not None]
            if any(node.inputs[k] in inputs or (places[k] == PARTIAL and not graph.tensors[node.inputs[k]].is_param)
                   for k in others):
                continue
            outs = [_split_dim(spec) for name, spec in zip(node.outputs, strategy.outputs) if name]
            key = (sum(place == PARTIAL for place in outs), len(others))
            if best_key is None or key < best_key:
                best, best_key = strategy, key
        if best is None:
            continue
        found[node.name] = tuple(_split_dim(spec) for spec in best.inputs + best.outputs)
        for name, spec in zip(node.outputs, best.outputs):
            place = _split_dim(spec)
            if name and isinstance(place, int):
                carried[name] = place
    graph.memo["batch_places"] = found
    return found


def _follows_batch(places: tuple, strategy: Strategy) -> bool:
    """Whether ``strategy`` splits each operand only where ``places`` says it carries the
    batch, holds the sums over the batch as partial (or whole), and everything else whole."""
    for place, spec in zip(places, strategy.inputs + strategy.outputs):
        if spec is None:
            continue
        split = [d for d, p in enumerate(spec.dims) if p != "R"]
        if isinstance(place, int):
            if spec.partial or split != [place]:
                return False
        elif place == PARTIAL:
            if split:
                return False
        elif split or spec.partial:
            return False
    return True


def _batch_axes(places: tuple, strategy: Strategy) -> int:
    """How many mesh axes ``strategy`` splits the batch over (0: it runs whole)."""
    for place, spec in zip(places, strategy.inputs + strategy.outputs):
        if isinstance(place, int) and spec is not None:
            return len(spec.dims[place].removeprefix("S"))
    return 0


def _weight_dims(node: Node, graph: Graph) -> tuple[int, int, int, int] | None:
    """(K, N, K's dim, N's dim) of the weight (input 1) of a matrix product, None if it has none:
    a parameter, or a state input the graph updates (a trained weight of a training step)."""
    weight = graph.tensors.get(node.inputs[1])
    if weight is None or not (weight.is_param or node.inputs[1] in set(graph.state.values())):
        return None
    if node.op_type == "MatMulNBits" and len(weight.shape) == 3:   # packed [N, K blocks, bytes per block]
        return node.attrs["K"], node.attrs["N"], 1, 0
    if len(weight.shape) != 2:
        return None
    if node.op_type == "Gemm" and node.attrs.get("transB", 0):
        return weight.shape[1], weight.shape[0], 1, 0
    return weight.shape[0], weight.shape[1], 0, 1


def _by_heads(strategy: Strategy) -> bool:
    """An attention operator's output split on its last (heads × head size) dim."""
    out = strategy.outputs[0]
    return out is not None and out.dims[-1] != "R"


def _feeds_heads(node: Node, graph: Graph) -> bool:
    """Whether the product's output (or its bias sum) is reshaped into heads: a Reshape
    that adds a dim (hidden → heads × head size), as the Q, K and V projections of plain-op
    attention are."""
    key = ("feeds_heads", node.name)
    if key not in graph.memo:
        readers: dict[str, list[Node]] = {}
        for other in graph.nodes:
            for name in other.inputs:
                readers.setdefault(name, []).append(other)
        found = False
        frontier = [node.outputs[0]]
        for _ in range(2):   # the product, then an Add of its bias
            following = []
            for name in frontier:
                for reader in readers.get(name, []):
                    out = graph.tensors.get(reader.outputs[0]) if reader.outputs else None
                    if reader.op_type == "Reshape" and out is not None and len(out.shape) == len(graph.tensors[name].shape) + 1:
                        found = True
                    elif reader.op_type == "Add":
                        following.append(reader.outputs[0])
            frontier = following
        graph.memo[key] = found
    return graph.memo[key]


def _megatron(node: Node, graph: Graph, strategy: Strategy) -> bool:
    policy = entry(node.op_type, node.domain).policy
    if policy == ATTENTION:
        return _by_heads(strategy)
    if policy != MATRIX or len(node.inputs) < 2:
        return True
    dims = _weight_dims(node, graph)
    if dims is None:
        return True
    k, n, k_dim, n_dim = dims
    spec = strategy.inputs[1]
    if spec is None:
        return False
    column = spec.dims[n_dim] != "R" and spec.dims[k_dim] == "R"
    row = spec.dims[k_dim] != "R" and spec.dims[n_dim] == "R"
    if _feeds_heads(node, graph):   # a Q, K or V projection (GQA's K and V narrow): column-parallel
        return column
    if n == k:   # square (an attention output projection): either, the ILP picks
        return column or row
    return column if n > k else row   # widening: column-parallel; narrowing: row-parallel


def apply_policy(policy: str, node: Node, graph: Graph, strategies: list[Strategy],
                 constants: Mapping[str, np.ndarray] | None = None) -> list[Strategy]:
    """The strategies a policy allows (the replicated one is kept when nothing else is).
    ``constants`` (the small initializers' values) let ``data`` follow the batch."""
    if policy == "auto":
        return strategies
    if policy == "data" and graph.memo.get("batch_inputs"):
        places = batch_places(graph, constants).get(node.name)
        if places is None:
            return strategies[:1]
        allowed = [s for s in strategies if _follows_batch(places, s)]
        # the batch split over every mesh axis it can be (DDP over the whole mesh)
        widest = max((_batch_axes(places, s) for s in allowed), default=0)
        allowed = [s for s in allowed if _batch_axes(places, s) == widest]
        return allowed or strategies[:1]
    keep = _batch_only if policy == "data" else _megatron
    allowed = [s for s in strategies if keep(node, graph, s)]
    return allowed or strategies[:1]
