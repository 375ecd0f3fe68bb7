"""A stage's cost as a chain DP over its layers' boundary layouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from meshplan.intra.layer_ilp import BOUNDARY_KINDS, LayerSolution


@dataclass
class StageSharding:
    """The chosen strategies of every operator of a stage, and the stage's estimates."""

    seconds: float
    param_bytes: float
    boundaries: list[str] = field(default_factory=list)
    lean: bool = False


def best_chain(layers: range, solution: Callable[[int, str, str], LayerSolution], lean: bool) -> StageSharding:
    """Cheapest boundary layouts through ``layers``; ``solution(layer, b_in, b_out)`` is a
    layer's optimum between those layouts."""
    best = {kind: (0.0, 0.0, []) for kind in BOUNDARY_KINDS}   # kind → (seconds, bytes, path)
    for layer in layers:
        nxt = {}
        for b_out in BOUNDARY_KINDS:
            options = []
            for b_in, (seconds, memory, path) in best.items():
                found = solution(layer, b_in, b_out)
                options.append((seconds + found.seconds, memory + found.param_bytes, path + [b_in]))
            nxt[b_out] = min(options, key=lambda o: o[0])
        best = nxt
    end = min(BOUNDARY_KINDS, key=lambda kind: best[kind][0])
    seconds, memory, path = best[end]
    return StageSharding(seconds, memory, boundaries=path + [end], lean=lean)
