"""The layout a stage's inputs arrive in is chosen with what arriving so costs
(``intra.chain``: ``arrival``): replicated inputs need an all-gather in the stage's mesh
that batch-split ones do not, so where the stage's own layers cost the same either way the
inputs arrive split; the seconds reported are the stage's own (the resharding into it is
counted where the plan is built)."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.intra.chain import best_chain, chain_tables
from meshplan.intra.layer_ilp import BOUNDARY_KINDS, LayerSolution


def _layers(costs: dict):
    """``solution(layer, b_in, b_out)`` with the seconds ``costs[(b_in, b_out)]`` for every layer."""
    def solution(layer, b_in, b_out):
        return LayerSolution(costs[(b_in, b_out)], [], 0.0)
    return solution


TIED = {(a, b): 1.0 for a in BOUNDARY_KINDS for b in BOUNDARY_KINDS}
SPLIT_DEARER = {**TIED, ("B", "R"): 1.1, ("B", "B"): 1.1}   # a layer fed split costs 0.1 more


@pytest.mark.parametrize("costs,arrival,first,seconds", [
    (TIED, None, "R", 3.0),                       # no arrival cost: ties keep the replicated layout
    (TIED, {"R": 0.5, "B": 0.0}, "B", 3.0),       # the all-gather saved decides
    (SPLIT_DEARER, {"R": 0.5, "B": 0.0}, "B", 3.1),   # 0.1 more inside, 0.5 less arriving
    (SPLIT_DEARER, {"R": 0.05, "B": 0.0}, "R", 3.0),  # not worth it
])
def test_arrival_decides_the_first_layout(costs, arrival, first, seconds):
    chained = best_chain(range(3), _layers(costs), False, arrival)
    assert chained.boundaries[0] == first
    assert chained.seconds == pytest.approx(seconds)
    table = None if arrival is None else np.array([[arrival[k] for k in BOUNDARY_KINDS]] * 3)
    assert chained.arrival == (0.0 if arrival is None else arrival[first])
    tables, _ = chain_tables(3, _layers(costs), False, arrival=table)
    assert tables[0, 2] == pytest.approx(seconds + chained.arrival)   # the DP's tables count the arrival
    # later starts see their own row of arrivals: each one-layer stage as its own chain
    one = best_chain(range(1), _layers(costs), False, arrival)
    assert np.allclose(np.diag(tables), one.seconds + one.arrival)


def test_arrival_table_is_not_changed():
    table = np.array([[0.5, 0.0]] * 2)
    chain_tables(2, _layers(SPLIT_DEARER), False, arrival=table)
    assert np.array_equal(table, np.array([[0.5, 0.0]] * 2))
