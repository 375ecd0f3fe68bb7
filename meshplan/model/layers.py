"""Cluster operators into layers: contiguous runs of the topological order with balanced
cost and little traffic across their boundaries.

A cut between node p-1 and node p carries every activation produced before p and read
at or after p (weights are not traffic: each stage holds its own). We pick the cuts by
dynamic programming: split the node sequence into L layers, each costing at most
``(1 + slack)`` times the average, minimising the total bytes crossing the cuts. Cuts
are restricted to a bounded set of candidate positions (the cheapest cut in each of a
few hundred equal-cost windows), which keeps the DP fast on graphs of any size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.model.graph import Graph

MAX_CANDIDATES = 384


@dataclass(frozen=True)
class Layering:
    bounds: tuple[int, ...]          # node index where each layer starts, plus len(nodes) at the end
    cut_bytes: np.ndarray            # bytes crossing the cut before node p, for p in 0..n

    @property
    def num_layers(self) -> int:
        return len(self.bounds) - 1

    def layer_of_node(self) -> np.ndarray:
        n = self.bounds[-1]
        owner = np.empty(n, dtype=np.int64)
        for layer, (start, stop) in enumerate(zip(self.bounds[:-1], self.bounds[1:])):
            owner[start:stop] = layer
        return owner


def cut_traffic(graph: Graph, peak: bool = False) -> np.ndarray:
    """bytes[p] = activation bytes crossing a cut placed just before node p (p = 0..n): made
    before it and read after it; at the largest sizes a ranged plan accepts with ``peak``.
    A graph output that no later node reads crosses nothing: it goes from the stage that
    makes it to the output writer wherever the cuts are."""
    def size(name: str) -> int:
        return graph.tensors[name].peak_nbytes if peak else graph.tensors[name].nbytes

    n = len(graph.nodes)
    diff = np.zeros(n + 2, dtype=np.float64)
    producers = graph.producers()
    for name, readers in graph.consumers().items():
        if name not in producers:
            continue  # graph inputs and weights are read by each stage directly
        start, stop = producers[name] + 1, readers[-1]
        if stop >= start:
            diff[start] += size(name)
            diff[stop + 1] -= size(name)
    traffic = np.cumsum(diff)[: n + 1]
    traffic[0] = traffic[n] = 0.0
    return traffic


def cluster_layers(graph: Graph, node_seconds: list[float], num_layers: int, slack: float = 0.3) -> Layering:
    """Split the nodes into at most ``num_layers`` layers (fewer when the graph is small)."""
    n = len(graph.nodes)
    traffic = cut_traffic(graph)
    cost = np.asarray(node_seconds, dtype=np.float64)
    num_layers = max(1, min(num_layers, n))
    if num_layers == 1:
        return Layering((0, n), traffic)
    prefix = np.concatenate([[0.0], np.cumsum(cost)])
    candidates = _candidate_cuts(prefix, traffic, max(MAX_CANDIDATES, 4 * num_layers))
    num_layers = min(num_layers, len(candidates) + 1)
    positions = np.concatenate([[0], candidates, [n]])
    cap = (1.0 + slack) * prefix[-1] / num_layers
    while True:
        cuts = _best_cuts(positions, prefix, traffic, num_layers, cap)
        if cuts is not None:
            return Layering(tuple(int(p) for p in cuts), traffic)
        cap *= 1.5  # a single costly node or sparse candidates: relax the balance


def _candidate_cuts(prefix: np.ndarray, traffic: np.ndarray, limit: int) -> np.ndarray:
    """Inner cut positions 1..n-1, thinned to the least-traffic one per equal-cost window."""
    n = len(traffic) - 1
    inner = np.arange(1, n)
    if len(inner) <= limit:
        return inner
    window = np.minimum((prefix[inner] / max(prefix[-1], 1e-30) * limit).astype(np.int64), limit - 1)
    order = np.lexsort((inner, traffic[inner], window))  # by window, then traffic, then position
    first_in_window = np.ones(len(order), dtype=bool)
    first_in_window[1:] = window[order][1:] != window[order][:-1]
    chosen = inner[order][first_in_window]
    # Also keep evenly spaced positions so that cost-free stretches can still be cut.
    even = np.linspace(1, n - 1, num=limit, dtype=np.int64)
    return np.unique(np.concatenate([chosen, even]))


def _best_cuts(positions, prefix, traffic, num_layers, cap):
    """DP over candidate positions: G[k][b] = least traffic splitting nodes[:positions[b]] into k layers."""
    count = len(positions)
    seg_cost = prefix[positions][None, :] - prefix[positions][:, None]  # [a, b] = cost of positions a..b
    allowed = (seg_cost <= cap) & (np.arange(count)[None, :] > np.arange(count)[:, None])
    cut_cost = traffic[positions]
    best = np.full(count, np.inf)
    best[0] = 0.0
    choice = np.zeros((num_layers + 1, count), dtype=np.int64)
    for k in range(1, num_layers + 1):
        # entering layer k at position a costs the traffic of cut a (none at the start)
        start = best + np.where(np.arange(count) == 0, 0.0, cut_cost)
        table = np.where(allowed, start[:, None], np.inf)
        choice[k] = np.argmin(table, axis=0)
        best = table[choice[k], np.arange(count)]
    if not np.isfinite(best[-1]):
        return None
    cuts = [count - 1]
    for k in range(num_layers, 0, -1):
        cuts.append(choice[k][cuts[-1]])
    cuts.reverse()
    if cuts[0] != 0:
        return None
    return [positions[c] for c in cuts]


def repeat_period(graph: Graph, tolerance: float = 0.05) -> int | None:
    """The length of the block a model repeats (a transformer layer, a residual block), read
    off the sequence of operator types: the least shift p under which at most ``tolerance``
    of the sequence disagrees with itself. None when nothing repeats."""
    kinds = {}
    sequence = np.array([kinds.setdefault(n.op_type, len(kinds)) for n in graph.nodes])
    n = len(sequence)
    for period in range(2, n // 2 + 1):
        overlap = n - period
        if np.count_nonzero(sequence[:-period] != sequence[period:]) <= tolerance * overlap:
            return period
    return None
