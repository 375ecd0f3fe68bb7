"""A stage's cost as a chain DP over its layers' boundary layouts.

``Chain`` extends the DP one layer at a time for one stage (``best_chain``).
``chain_tables`` runs the same DP for every start layer at once, as arrays: the cost
tables of the stage DP need every stage ``i..j``, and one pass over the layers with the
starts as rows gives all of them (the same sums in the same order, so the same numbers
as ``Chain``).

The layout a stage's inputs arrive in is chosen with what it costs them to arrive so
(``arrival``: per start layer and boundary kind, the seconds that layout adds to the
cross-mesh resharding into the stage; replicated inputs need an all-gather in the stage's
mesh that batch-split ones do not). The stage DP's tables count them in a stage's seconds;
``StageSharding`` keeps them apart (``arrival``), since a built plan counts the resharding
itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from meshplan.intra.layer_ilp import BOUNDARY_KINDS, LayerSolution
from meshplan.intra.operator_cost import held_bytes


@dataclass
class StageSharding:
    """The chosen strategies of every operator of a stage, and the stage's estimates."""

    seconds: float
    param_bytes: float
    boundaries: list[str] = field(default_factory=list)
    lean: bool = False
    arrival: float = 0.0    # what its inputs' layout adds to their resharding into it (not in ``seconds``)


def _tied(seconds):
    """Seconds to the picosecond: layouts whose sums differ by rounding alone tie, and the
    first boundary kind (replicated) is kept, whichever order the sums were made in.
    (numpy's rounding, for scalars and the arrays of ``chain_tables`` alike.)"""
    return np.round(seconds, 12)


class Chain:
    """Cheapest boundary layouts through a growing run of layers; ``solution(layer, b_in,
    b_out)`` is a layer's optimum between those layouts, its ``param_bytes`` the weights
    only it reads and its ``slices`` those of weights other layers read too (a tied
    embedding), which count once per layout over the stage."""

    def __init__(self, solution: Callable[[int, str, str], LayerSolution], lean: bool,
                 arrival: dict[str, float] | None = None):
        self.solution = solution
        self.lean = lean
        # kind → (seconds, own bytes, shared slices, their held bytes, path as nested (kind, parent)
        # pairs, the arrival seconds of the path's first layout)
        self.best = {kind: (0.0, 0.0, {}, 0.0, None, (arrival or {}).get(kind, 0.0)) for kind in BOUNDARY_KINDS}

    def extend(self, layer: int) -> None:
        nxt = {}
        for b_out in BOUNDARY_KINDS:
            options = []
            for b_in, (seconds, memory, shared, held, path, arrival) in self.best.items():
                found = self.solution(layer, b_in, b_out)
                if found.slices and not found.slices.keys() <= shared.keys():   # (a slice's bytes never vary)
                    shared = {**shared, **found.slices}
                    held = held_bytes(shared)
                options.append((seconds + found.seconds, memory + found.param_bytes, shared, held, (b_in, path),
                                arrival))
            nxt[b_out] = min(options, key=lambda o: _tied(o[0] + o[5]))
        self.best = nxt

    def _end(self) -> str:
        return min(BOUNDARY_KINDS, key=lambda kind: _tied(self.best[kind][0] + self.best[kind][5]))

    def result(self) -> StageSharding:
        end = self._end()
        seconds, memory, shared, _, path, arrival = self.best[end]
        kinds = [end]
        while path is not None:
            kinds.append(path[0])
            path = path[1]
        return StageSharding(seconds, memory + held_bytes(shared), boundaries=kinds[::-1], lean=self.lean,
                             arrival=arrival)


def best_chain(layers: range, solution: Callable[[int, str, str], LayerSolution], lean: bool,
               arrival: dict[str, float] | None = None) -> StageSharding:
    """Cheapest boundary layouts through ``layers`` (see ``Chain``)."""
    chain = Chain(solution, lean, arrival)
    for layer in layers:
        chain.extend(layer)
    return chain.result()


def chain_tables(num_layers: int, solution: Callable[[int, str, str], LayerSolution], lean: bool,
                 first: int = 0, arrival: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(L, L) arrays: [i, j] is ``best_chain(range(i, j + 1), …, arrival[i])``'s seconds with
    its arrival, and its weight bytes per device, for every start ``i >= first`` (other
    entries inf); ``arrival`` (L, kinds): each start's arrival seconds per boundary kind
    (default none).

    The state of every start is a row: extending by a layer updates the rows of the starts
    at or before it in a few array operations, where ``Chain`` would take one Python pass
    per start. Weights read by several layers (``slices``) count once per layout along a
    row's path: each row keeps the id of its set of slices, and a new set is made only where
    a layer adds slices the set lacks."""
    L, kinds = num_layers, len(BOUNDARY_KINDS)
    seconds = np.full((L, L), np.inf)
    weights = np.full((L, L), np.inf)
    best_seconds = np.zeros((L, kinds))    # [start, kind the layers so far leave in]
    best_bytes = np.zeros((L, kinds))
    best_set = np.zeros((L, kinds), dtype=np.int64)
    best_arrival = np.zeros((L, kinds)) if arrival is None else np.array(arrival, dtype=float)   # of a path's start
    sets: list[dict] = [{}]                # id → slices; id 0 holds none
    ids = {frozenset(): 0}                 # each distinct set once
    held = [0.0]
    grown: dict[tuple[int, int], int] = {}   # (set id, id of a layer's solution) → the set with its slices
    for layer in range(first, L):
        rows = slice(first, layer + 1)
        found = [[solution(layer, b_in, b_out) for b_out in BOUNDARY_KINDS] for b_in in BOUNDARY_KINDS]
        step_seconds = np.array([[f.seconds for f in row] for row in found])       # [b_in, b_out]
        step_bytes = np.array([[f.param_bytes for f in row] for row in found])
        totals = best_seconds[rows, :, None] + step_seconds[None]                 # [start, b_in, b_out]
        pick = np.argmin(_tied(totals + best_arrival[rows, :, None]), axis=1)     # [start, b_out]: b_in
        new_seconds = np.take_along_axis(totals, pick[:, None, :], axis=1)[:, 0, :]
        new_arrival = np.take_along_axis(best_arrival[rows], pick, axis=1)
        new_bytes = np.take_along_axis(best_bytes[rows, :, None] + step_bytes[None], pick[:, None, :], axis=1)[:, 0, :]
        new_set = np.take_along_axis(best_set[rows], pick, axis=1)
        for a in range(kinds):
            for b in range(kinds):
                step = found[a][b]
                if not step.slices:
                    continue
                chosen = np.flatnonzero(pick[:, b] == a)
                olds, inverse = np.unique(new_set[chosen, b], return_inverse=True)
                for n, old in enumerate(olds):
                    key = (int(old), id(step))
                    if key not in grown:
                        if step.slices.keys() <= sets[old].keys():   # (a slice's bytes never vary)
                            grown[key] = int(old)
                        else:
                            union = {**sets[old], **step.slices}
                            frozen = frozenset(union)
                            if frozen not in ids:
                                ids[frozen] = len(sets)
                                sets.append(union)
                                held.append(held_bytes(union))
                            grown[key] = ids[frozen]
                    olds[n] = grown[key]
                new_set[chosen, b] = olds[inverse]
        best_seconds[rows], best_bytes[rows], best_set[rows] = new_seconds, new_bytes, new_set
        best_arrival[rows] = new_arrival
        end = np.argmin(_tied(new_seconds + new_arrival), axis=1)[:, None]
        seconds[rows, layer] = np.take_along_axis(new_seconds, end, axis=1)[:, 0] \
            + np.take_along_axis(new_arrival, end, axis=1)[:, 0]
        weights[rows, layer] = (np.take_along_axis(new_bytes, end, axis=1)[:, 0]
                                + np.asarray(held)[np.take_along_axis(new_set, end, axis=1)[:, 0]])
    return seconds, weights
