"""Unit tests for meshplan.model.layers: cut traffic and layer clustering, against brute force."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from onnx import TensorProto, helper

from meshplan.model.graph import Graph, build_graph
from meshplan.model.layers import MAX_CANDIDATES, cluster_layers, cut_traffic
from meshplan.model.load import infer_shapes

F32 = TensorProto.FLOAT
WIDTH = 3  # every activation is [rows, WIDTH]


def _model_to_graph(nodes, inputs, outputs, initializers):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, F32, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, F32, None) for n in outputs],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return build_graph(infer_shapes(model))


def random_dag(seed: int, num_nodes: int, skip_prob: float = 0.5) -> Graph:
    """A random DAG: a chain with skip connections, random sizes, weights and several outputs.

    Ops: Relu (one input), Add (same-shape activations, or an activation plus a weight),
    Concat on axis 0 (any two activations; sizes add up).
    """
    rng = random.Random(seed)
    rows: dict[str, int] = {}
    inputs = []
    for i in range(rng.randint(1, 2)):
        name = f"in{i}"
        rows[name] = rng.randint(1, 6)
        inputs.append((name, [rows[name], WIDTH]))
    weights = []
    available = [name for name, _ in inputs]
    nodes = []
    for i in range(num_nodes):
        out = f"t{i}"
        # mostly the latest tensor (a chain), sometimes any earlier one (a skip connection)
        a = available[-1] if rng.random() > skip_prob else rng.choice(available)
        kind = rng.random()
        if kind < 0.35:
            nodes.append(helper.make_node("Relu", [a], [out], name=f"n{i}"))
            rows[out] = rows[a]
        elif kind < 0.55:
            w = f"w{i}"
            weights.append(helper.make_tensor(w, F32, [WIDTH], [0.5] * WIDTH))
            nodes.append(helper.make_node("Add", [a, w], [out], name=f"n{i}"))
            rows[out] = rows[a]
        else:
            b = rng.choice(available)
            if rows[b] == rows[a] and rng.random() < 0.5:
                nodes.append(helper.make_node("Add", [a, b], [out], name=f"n{i}"))
                rows[out] = rows[a]
            elif rows[a] + rows[b] <= 40:
                nodes.append(helper.make_node("Concat", [a, b], [out], axis=0, name=f"n{i}"))
                rows[out] = rows[a] + rows[b]
            else:
                nodes.append(helper.make_node("Relu", [b], [out], name=f"n{i}"))
                rows[out] = rows[b]
        available.append(out)
    produced = [f"t{i}" for i in range(num_nodes)]
    outputs = [produced[-1]]
    # sometimes an extra output from the middle (which may also be read later)
    for name in rng.sample(produced[:-1], k=min(len(produced) - 1, rng.randint(0, 2))):
        outputs.append(name)
    graph = _model_to_graph(nodes, inputs, outputs, weights)
    for name, r in rows.items():
        assert graph.tensors[name].shape == (r, WIDTH)
    return graph


def brute_traffic(graph: Graph) -> list[float]:
    n = len(graph.nodes)
    producer = {}
    for i, node in enumerate(graph.nodes):
        for out in node.outputs:
            producer[out] = i
    traffic = []
    for p in range(n + 1):
        if p in (0, n):
            traffic.append(0.0)
            continue
        total = 0
        for name, i in producer.items():
            if i >= p or graph.tensors[name].is_param:
                continue
            if any(name in graph.nodes[j].inputs for j in range(p, n)):
                total += graph.tensors[name].nbytes
        traffic.append(float(total))
    return traffic


def _segments_ok(bounds, prefix, cap):
    return all(prefix[b] - prefix[a] <= cap for a, b in zip(bounds[:-1], bounds[1:]))


def brute_best(traffic, cost, num_layers, slack):
    """Least total traffic over all splits into num_layers non-empty layers within the cap."""
    n = len(cost)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(cost, dtype=np.float64))])
    cap = (1.0 + slack) * prefix[-1] / num_layers
    best = None
    for cuts in itertools.combinations(range(1, n), num_layers - 1):
        bounds = (0, *cuts, n)
        if _segments_ok(bounds, prefix, cap):
            total = sum(traffic[c] for c in cuts)
            best = total if best is None else min(best, total)
    return best, prefix, cap


def _check_valid(layering, n, expected_layers):
    bounds = layering.bounds
    assert bounds[0] == 0
    assert bounds[-1] == n
    assert all(a < b for a, b in zip(bounds[:-1], bounds[1:]))
    assert layering.num_layers == expected_layers
    owner = layering.layer_of_node()
    assert len(owner) == n
    assert list(owner) == sorted(owner)
    assert [int(np.sum(owner == k)) for k in range(expected_layers)] == [b - a for a, b in zip(bounds[:-1], bounds[1:])]


# --- cut_traffic -----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(60))
def test_cut_traffic_matches_brute_force(seed):
    rng = random.Random(1000 + seed)
    graph = random_dag(seed, rng.randint(1, 14), skip_prob=rng.choice([0.0, 0.3, 0.7]))
    got = cut_traffic(graph)
    assert got.shape == (len(graph.nodes) + 1,)
    assert list(got) == pytest.approx(brute_traffic(graph))


def test_cut_traffic_chain_by_hand():
    # in -> Relu a [2,3] -> Relu b [2,3] -> Concat(b, a) c [4,3] (output)
    nodes = [
        helper.make_node("Relu", ["in"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Concat", ["b", "a"], ["c"], axis=0),
    ]
    graph = _model_to_graph(nodes, [("in", [2, 3])], ["c"], [])
    # cut 1: a (24 B); cut 2: a and b (48 B); the input is never traffic
    assert list(cut_traffic(graph)) == [0.0, 24.0, 48.0, 0.0]


def test_cut_traffic_ignores_weights_and_outputs_no_later_node_reads():
    """A graph output leaves the stage that makes it for the output writer, whatever the
    cuts after it: it crosses none of them (counted, each layer's present key and value of
    an LLM export would pull every cut to before the next one is made, inside attention)."""
    w = helper.make_tensor("w", F32, [1000, 3], np.zeros(3000, dtype=np.float32).tolist())
    nodes = [
        helper.make_node("Add", ["in", "w"], ["a"]),     # a: [1000, 3], a graph output
        helper.make_node("Relu", ["in"], ["b"]),
        helper.make_node("Add", ["b", "w"], ["c"]),
        helper.make_node("Relu", ["a"], ["d"]),          # read once more after b and c
    ]
    graph = _model_to_graph(nodes, [("in", [1000, 3])], ["a", "c", "d"], [w])
    # a (12000 B) crosses cuts 1 to 3 for its last reader; b crosses cut 2; c, an output
    # nobody reads, crosses cut 3 not at all
    assert list(cut_traffic(graph)) == [0.0, 12000.0, 24000.0, 12000.0, 0.0]


# --- cluster_layers --------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(120))
def test_cluster_layers_is_optimal_on_small_graphs(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    graph = random_dag(seed, n, skip_prob=rng.choice([0.0, 0.4, 0.8]))
    cost = [rng.choice([rng.uniform(0.1, 2.0), rng.uniform(0.9, 1.1), 0.0 if rng.random() < 0.2 else 1.0]) for _ in range(n)]
    if sum(cost) == 0:
        cost[0] = 1.0
    num_layers = rng.randint(2, min(5, n))
    slack = rng.choice([0.0, 0.3, 0.5, 1.0])
    layering = cluster_layers(graph, cost, num_layers, slack)
    _check_valid(layering, n, num_layers)
    traffic = brute_traffic(graph)
    assert list(layering.cut_bytes) == pytest.approx(traffic)
    best, prefix, cap = brute_best(traffic, cost, num_layers, slack)
    if best is None:
        # cap infeasible: the balance is relaxed, but stays within 1.5x of the best achievable
        least_max = min(
            max(prefix[b] - prefix[a] for a, b in zip((0, *cuts), (*cuts, n)))
            for cuts in itertools.combinations(range(1, n), num_layers - 1)
        )
        got_max = max(prefix[b] - prefix[a] for a, b in zip(layering.bounds[:-1], layering.bounds[1:]))
        assert got_max <= 1.5 * least_max + 1e-9
        return
    assert _segments_ok(layering.bounds, prefix, cap), (layering.bounds, cost, cap)
    got = sum(traffic[c] for c in layering.bounds[1:-1])
    assert got == pytest.approx(best), (layering.bounds, traffic, cost, cap)


def _growing_chain():
    """in [1,3] -> a [1,3] -> b [2,3] -> c [4,3] -> d -> e -> f (all [4,3]); f is the output."""
    nodes = [
        helper.make_node("Relu", ["in"], ["a"]),
        helper.make_node("Concat", ["a", "a"], ["b"], axis=0),
        helper.make_node("Concat", ["b", "b"], ["c"], axis=0),
        helper.make_node("Relu", ["c"], ["d"]),
        helper.make_node("Relu", ["d"], ["e"]),
        helper.make_node("Relu", ["e"], ["f"]),
    ]
    return _model_to_graph(nodes, [("in", [1, WIDTH])], ["f"], [])


def test_cluster_layers_by_hand():
    graph = _growing_chain()
    assert list(cut_traffic(graph)) == [0.0, 12.0, 24.0, 48.0, 48.0, 48.0, 0.0]
    # loose cap: the cheapest cut (after the first node) wins
    assert cluster_layers(graph, [1.0] * 6, 2, slack=1.0).bounds == (0, 1, 6)
    # no slack: only the even split is allowed
    assert cluster_layers(graph, [1.0] * 6, 2, slack=0.0).bounds == (0, 3, 6)
    # slack 0.5 (cap 4.5 nodes): cuts 2..4 allowed, 2 is cheapest
    assert cluster_layers(graph, [1.0] * 6, 2, slack=0.5).bounds == (0, 2, 6)
    # three layers, cap 3 nodes: the first cut after node 0 (12 B), the second at 3 or 4 (48 B each)
    three = cluster_layers(graph, [1.0] * 6, 3, slack=0.5)
    assert three.bounds in ((0, 1, 3, 6), (0, 1, 4, 6))
    # one costly first node (cap 1.3 * 8 / 2 = 5.2): cutting after it leaves 5 units, allowed
    assert cluster_layers(graph, [3.0, 1, 1, 1, 1, 1], 2, slack=0.3).bounds == (0, 1, 6)
    # a costly last node pushes the cut late: the second layer may hold at most 5.2 units,
    # so the cut is at 3, 4 or 5 (48 B each), never at the cheap positions 1 or 2
    assert cluster_layers(graph, [1, 1, 1, 1, 1, 3.0], 2, slack=0.3).bounds[1] in (3, 4, 5)


def test_cluster_layers_one_layer_and_too_many_layers():
    graph = random_dag(7, 5)
    assert cluster_layers(graph, [1.0] * 5, 1).bounds == (0, 5)
    many = cluster_layers(graph, [1.0] * 5, 20)
    _check_valid(many, 5, 5)
    assert many.bounds == (0, 1, 2, 3, 4, 5)


def test_cluster_layers_single_heavy_node_relaxes_cap():
    graph = random_dag(3, 6, skip_prob=0.0)
    cost = [1.0, 1.0, 100.0, 1.0, 1.0, 1.0]
    layering = cluster_layers(graph, cost, 3, slack=0.1)
    _check_valid(layering, 6, 3)


def _big_graph(num_nodes: int, seed: int) -> Graph:
    """A long chain with skip connections (Add of same-shape tensors) and occasional wide tensors."""
    rng = random.Random(seed)
    nodes = []
    prev, rows = "in", {"in": 4}
    names = ["in"]
    for i in range(num_nodes):
        out = f"t{i}"
        skip = rng.choice(names[-8:])
        if rows[skip] == rows[prev] and rng.random() < 0.3:
            nodes.append(helper.make_node("Add", [prev, skip], [out]))
            rows[out] = rows[prev]
        elif rng.random() < 0.1 and rows[prev] < 16:
            nodes.append(helper.make_node("Concat", [prev, prev], [out], axis=0))
            rows[out] = 2 * rows[prev]
        else:
            nodes.append(helper.make_node("Relu", [prev], [out]))
            rows[out] = rows[prev]
        names.append(out)
        prev = out
    return _model_to_graph(nodes, [("in", [4, WIDTH])], [prev], [])


@pytest.mark.parametrize("num_layers, slack", [(4, 0.3), (8, 0.2), (16, 0.3)])
def test_cluster_layers_large_graph_candidate_thinning(num_layers, slack):
    n = 3 * MAX_CANDIDATES // 2 + 17
    graph = _big_graph(n, seed=num_layers)
    assert len(graph.nodes) == n > MAX_CANDIDATES
    rng = np.random.default_rng(num_layers)
    cost = rng.uniform(0.5, 1.5, size=n)
    layering = cluster_layers(graph, list(cost), num_layers, slack)
    _check_valid(layering, n, num_layers)
    prefix = np.concatenate([[0.0], np.cumsum(cost)])
    layer_costs = [prefix[b] - prefix[a] for a, b in zip(layering.bounds[:-1], layering.bounds[1:])]
    average = prefix[-1] / num_layers
    assert max(layer_costs) <= (1 + slack) * average + 1e-9
    assert min(layer_costs) > 0
    traffic = cut_traffic(graph)
    assert list(traffic) == pytest.approx(brute_traffic_fast(graph))


def brute_traffic_fast(graph: Graph) -> list[float]:
    """Same definition as brute_traffic, O(n * tensors), for the big graph."""
    n = len(graph.nodes)
    producer, readers = {}, {}
    for i, node in enumerate(graph.nodes):
        for out in node.outputs:
            producer[out] = i
        for name in node.inputs:
            readers.setdefault(name, set()).add(i)
    out = []
    for p in range(n + 1):
        if p in (0, n):
            out.append(0.0)
            continue
        total = 0
        for name, i in producer.items():
            if i < p and not graph.tensors[name].is_param and any(r >= p for r in readers.get(name, ())):
                total += graph.tensors[name].nbytes
        out.append(float(total))
    return out


def test_cluster_layers_large_graph_zero_cost_stretch():
    """A long cost-free stretch must still be cuttable (the evenly spaced candidates)."""
    n = 2 * MAX_CANDIDATES
    graph = _big_graph(n, seed=99)
    cost = [0.0] * n
    cost[0] = cost[-1] = 1.0
    layering = cluster_layers(graph, cost, 4, 0.3)
    _check_valid(layering, n, 4)
