"""Exhaustive oracle of the intra-operator ILP, for tests on small problems."""

from __future__ import annotations

import itertools

from meshplan.errors import PlanError
from meshplan.intra.ilp import ShardingProblem, ShardingSolution, evaluate


def brute_force(problem: ShardingProblem) -> ShardingSolution:
    """Exhaustive search over every assignment."""
    best, best_choices = float("inf"), None
    for choices in itertools.product(*(range(len(n.costs)) for n in problem.nodes)):
        value = evaluate(problem, list(choices))
        if value < best:
            best, best_choices = value, list(choices)
    if best_choices is None:
        raise PlanError("no feasible sharding (every assignment breaks a constraint)")
    return ShardingSolution(best_choices, best, solver="brute-force")
