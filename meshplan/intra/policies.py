"""Hand-written parallelisation policies, as restrictions of the automatic search.

``auto`` lets the ILP choose among every strategy. ``data`` keeps only strategies that
split activations along their first (batch) dimension and replicate every weight (the
replicated strategy only where nothing can be split): pure data parallelism. ``megatron`` fixes every weight-bearing matrix product to the
Megatron-LM pattern — column-parallel when it widens the hidden size (QKV, first MLP
layer) or is reshaped into heads (a Q, K or V projection, which narrows for grouped-query
attention's K and V), row-parallel with a partial result when it narrows it (output
projection, second MLP layer) — splits attention operators (GroupQueryAttention) by heads
where they can be,
and leaves the rest to the ILP. Together with the stage DP's choice of
submeshes they give the baselines meshplan's plans are measured against.
"""

from __future__ import annotations

from meshplan.intra.strategies import Strategy
from meshplan.model.graph import Graph, Node
from meshplan.ops import ATTENTION, MATRIX, entry

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


def _weight_dims(node: Node, graph: Graph) -> tuple[int, int, int, int] | None:
    """(K, N, K's dim, N's dim) of the weight (input 1) of a matrix product, None if it has none."""
    weight = graph.tensors.get(node.inputs[1])
    if weight is None or not weight.is_param:
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


def apply_policy(policy: str, node: Node, graph: Graph, strategies: list[Strategy]) -> list[Strategy]:
    """The strategies a policy allows (the replicated one is kept when nothing else is)."""
    if policy == "auto":
        return strategies
    keep = _batch_only if policy == "data" else _megatron
    allowed = [s for s in strategies if keep(node, graph, s)]
    return allowed or strategies[:1]
