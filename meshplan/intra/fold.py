"""Shrinking a layer's ILP before it is solved: cheap operators follow their producer."""

from __future__ import annotations

import numpy as np

from meshplan.intra.ilp import IlpEdge, IlpNode, ShardingProblem


def fold_followers(problem: ShardingProblem, heavy: list[bool]):
    """Shrink the ILP: a cheap node u with a single incoming edge v→u gets no variables;
    for each strategy i of v it takes the strategy f(i) cheapest for it given i, its costs
    (and memory) are added to v's, and its outgoing edges start from v with rows f(i).

    "Cheapest for it" counts what u's choice costs its readers at the least: for each
    outgoing edge, the cheapest resharding into any of the reader's strategies. Without
    that bound a follower split because splitting saved it a fraction of a microsecond,
    and every reader that takes the tensor whole then gathered it (an RMSNorm's Pow split
    after a whole residual, its ReduceMean gathering it: plans solved to the optimum of the
    folded problem that were 8% slower, by the solver's own costs, than Megatron's).

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
        outgoing = [other for other in edges if other.src == u and other is not edge]
        least = sum((np.min(other.costs, axis=1) for other in outgoing), np.zeros(total.shape[1]))
        f = np.argmin(total + least[None, :], axis=1)
        rows = np.arange(len(f))
        nodes[v].costs = nodes[v].costs + total[rows, f]
        if nodes[u].memory is not None:
            base = nodes[v].memory if nodes[v].memory is not None else np.zeros(len(f))
            nodes[v].memory = base + nodes[u].memory[f]
        for other in outgoing:
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
