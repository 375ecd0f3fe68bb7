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
