"""``fold_followers`` shrinks a layer's ILP; a small one is solved as it is."""

from __future__ import annotations

import numpy as np

from meshplan.intra.fold import fold_followers
from meshplan.intra.ilp import IlpEdge, IlpNode, ShardingProblem, evaluate, solve
from meshplan.intra.layer_ilp import EXACT_SIZE, ilp_size

INF = np.inf


def norm_like() -> ShardingProblem:
    """A whole residual v (R or split), a cheap follower u that may split it for free (a
    slice) and saves a little by splitting, and a reader w that takes only the whole
    tensor (a reduction): split, u's output has to be gathered for w."""
    v = IlpNode("residual", np.array([0.0, 0.0]))
    u = IlpNode("pow", np.array([1.0, 0.9]))
    w = IlpNode("reduce", np.array([1.0]))
    gather = 30.0
    return ShardingProblem([v, u, w], [IlpEdge(0, 1, np.array([[0.0, 0.0], [gather, 0.0]])),
                                       IlpEdge(1, 2, np.array([[0.0], [gather]]))])


def test_a_follower_counts_what_its_readers_pay():
    problem = norm_like()
    small, recover = fold_followers(problem, [True, False, True])
    assert len(small.nodes) == 2
    choices = recover(solve(small).choices)
    assert choices[1] == 0                            # the follower stays whole
    assert evaluate(problem, choices) == min(evaluate(problem, [a, b, 0]) for a in (0, 1) for b in (0, 1))


def test_ilp_size_counts_strategies_and_pairs():
    problem = norm_like()
    assert ilp_size(problem) == (2 + 2 + 1) + (4 + 2)
    assert ilp_size(problem) <= EXACT_SIZE
