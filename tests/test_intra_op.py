"""Shrinking the sharding ILP: followers folded into their producer."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.intra.ilp import IlpEdge, IlpNode, ShardingProblem, evaluate, solve
from meshplan.testing.ilp import brute_force
from meshplan.intra.intra_op import fold_followers


def _random_dag(rng: np.random.Generator, size: int) -> tuple[ShardingProblem, list[bool]]:
    nodes = [IlpNode(f"n{i}", rng.uniform(0, 5, int(rng.integers(1, 4))), None) for i in range(size)]
    edges = []
    for u in range(1, size):
        parents = rng.choice(u, size=min(u, int(rng.integers(1, 3))), replace=False)
        for v in parents:
            edges.append(IlpEdge(int(v), u, rng.uniform(0, 4, (len(nodes[v].costs), len(nodes[u].costs)))))
    heavy = [bool(rng.random() < 0.4) for _ in range(size)]
    return ShardingProblem(nodes, edges), heavy


@pytest.mark.parametrize("seed", range(20))
def test_folded_objective_is_the_recovered_assignments_cost(seed):
    rng = np.random.default_rng(seed)
    problem, heavy = _random_dag(rng, int(rng.integers(2, 8)))
    small, recover = fold_followers(problem, heavy)
    assert len(small.nodes) <= len(problem.nodes)
    solution = solve(small)
    full = recover(solution.choices)
    # The folded problem accounts for every follower's compute and resharding exactly.
    assert evaluate(problem, full) == pytest.approx(solution.objective)
    # Folding only restricts the search: never better than the true optimum.
    assert solution.objective >= brute_force(problem).objective - 1e-9


def test_follower_with_one_producer_takes_its_cheapest_choice():
    producer = IlpNode("matmul", np.array([1.0, 2.0]))
    follower = IlpNode("relu", np.array([0.0, 0.0]))
    # Matching layouts are free, mismatched ones cost a resharding.
    edge = IlpEdge(0, 1, np.array([[0.0, 5.0], [5.0, 0.0]]))
    small, recover = fold_followers(ShardingProblem([producer, follower], [edge]), [True, False])
    assert len(small.nodes) == 1 and not small.edges
    assert recover(solve(small).choices) == [0, 0]


# --- views that share one ILP ------------------------------------------------------------

def _one_layer_pass(shape: tuple[int, ...], mesh: tuple[int, int]):
    import onnx
    from onnx import TensorProto, helper

    from meshplan.cost.analytic import CostModel
    from meshplan.cost.cluster import make_cluster
    from meshplan.intra.intra_op import IntraOpPass
    from meshplan.model.graph import build_graph
    from meshplan.model.layers import cluster_layers

    graph_proto = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]))
    graph = build_graph(model)
    cluster = make_cluster(mesh, "cpu")
    cost_model = CostModel(cluster)
    layering = cluster_layers(graph, cost_model.graph_seconds(graph), 1)
    return graph, IntraOpPass(graph, layering, cost_model, cluster, {})


def test_an_axis_that_divides_no_dim_leaves_the_view_of_the_ilp():
    """13x8 and 1x8 views of a layer of power-of-two dims are one ILP; 2x8 is not."""
    graph, intra = _one_layer_pass((16, 64), (13, 8))
    view = intra._effective_view(0, (13, 8), (13, 8))
    assert view[0] is None and view[1] is not None
    assert intra._effective_view(0, (13, 8), (1, 104)) == (None, None)
    graph, intra = _one_layer_pass((16, 64), (2, 8))
    assert None not in intra._effective_view(0, (2, 8), (2, 8))


def test_a_segmented_dim_keeps_an_axis_that_divides_no_dim():
    """Two heads of size 3 (a dim of 6) split over 4 devices, each head held by two: the
    axis of 4 divides no dim of the layer but splits the segmented one, so its view is
    its own; over 5 it splits nothing alone but does with the other axis (5 x 4 = 20
    devices, ten a head)."""
    graph, intra = _one_layer_pass((1, 6), (5, 4))
    assert intra._effective_view(0, (1, 4), (1, 4)) == (None, None)
    assert intra._effective_view(0, (5, 4), (5, 4)) == (None, None)
    graph, intra = _one_layer_pass((1, 6), (5, 4))
    graph.memo["segments"] = {"x": {1: ((6, 2),)}, "y": {1: ((6, 2),)}}
    view = intra._effective_view(0, (1, 4), (1, 4))
    assert view[0] is None and view[1] is not None
    assert None not in intra._effective_view(0, (5, 4), (5, 4))
