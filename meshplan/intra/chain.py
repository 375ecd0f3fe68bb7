"""A stage's cost as a chain DP over its layers' boundary layouts.

``Chain`` extends the DP one layer at a time, so that the costs of every stage starting at
one layer (``start..start``, ``start..start+1``, …) come from one pass over the layers
instead of one pass per stage: the cost tables of the stage DP need all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from meshplan.intra.layer_ilp import BOUNDARY_KINDS, LayerSolution
from meshplan.intra.operator_cost import held_bytes


@dataclass
class StageSharding:
    """The chosen strategies of every operator of a stage, and the stage's estimates."""

    seconds: float
    param_bytes: float
    boundaries: list[str] = field(default_factory=list)
    lean: bool = False


def _tied(seconds: float) -> float:
    """Seconds to the picosecond: layouts whose sums differ by rounding alone tie, and the
    first boundary kind (replicated) is kept, whichever order the sums were made in."""
    return round(seconds, 12)


class Chain:
    """Cheapest boundary layouts through a growing run of layers; ``solution(layer, b_in,
    b_out)`` is a layer's optimum between those layouts, its ``param_bytes`` the weights
    only it reads and its ``slices`` those of weights other layers read too (a tied
    embedding), which count once per layout over the stage."""

    def __init__(self, solution: Callable[[int, str, str], LayerSolution], lean: bool):
        self.solution = solution
        self.lean = lean
        # kind → (seconds, own bytes, shared slices, their held bytes, path as nested (kind, parent) pairs)
        self.best = {kind: (0.0, 0.0, {}, 0.0, None) for kind in BOUNDARY_KINDS}

    def extend(self, layer: int) -> None:
        nxt = {}
        for b_out in BOUNDARY_KINDS:
            options = []
            for b_in, (seconds, memory, shared, held, path) in self.best.items():
                found = self.solution(layer, b_in, b_out)
                if found.slices and not found.slices.keys() <= shared.keys():   # (a slice's bytes never vary)
                    shared = {**shared, **found.slices}
                    held = held_bytes(shared)
                options.append((seconds + found.seconds, memory + found.param_bytes, shared, held, (b_in, path)))
            nxt[b_out] = min(options, key=lambda o: _tied(o[0]))
        self.best = nxt

    def _end(self) -> str:
        return min(BOUNDARY_KINDS, key=lambda kind: _tied(self.best[kind][0]))

    def totals(self) -> tuple[float, float]:
        """(seconds, weight bytes per device) of the layers so far."""
        seconds, memory, _, held, _ = self.best[self._end()]
        return seconds, memory + held

    def result(self) -> StageSharding:
        end = self._end()
        seconds, memory, shared, _, path = self.best[end]
        kinds = [end]
        while path is not None:
            kinds.append(path[0])
            path = path[1]
        return StageSharding(seconds, memory + held_bytes(shared), boundaries=kinds[::-1], lean=self.lean)


def best_chain(layers: range, solution: Callable[[int, str, str], LayerSolution], lean: bool) -> StageSharding:
    """Cheapest boundary layouts through ``layers`` (see ``Chain``)."""
    chain = Chain(solution, lean)
    for layer in layers:
        chain.extend(layer)
    return chain.result()
