"""A stage's cost as a chain DP over its layers' boundary layouts."""

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


def best_chain(layers: range, solution: Callable[[int, str, str], LayerSolution], lean: bool) -> StageSharding:
    """Cheapest boundary layouts through ``layers``; ``solution(layer, b_in, b_out)`` is a
    layer's optimum between those layouts, its ``param_bytes`` the weights only it reads
    and its ``slices`` those of weights other layers read too (a tied embedding), which
    count once per layout over the stage."""
    best = {kind: (0.0, 0.0, {}, []) for kind in BOUNDARY_KINDS}   # kind → (seconds, bytes, shared slices, path)
    for layer in layers:
        nxt = {}
        for b_out in BOUNDARY_KINDS:
            options = []
            for b_in, (seconds, memory, shared, path) in best.items():
                found = solution(layer, b_in, b_out)
                options.append((seconds + found.seconds, memory + found.param_bytes, {**shared, **found.slices},
                                path + [b_in]))
            nxt[b_out] = min(options, key=lambda o: o[0])
        best = nxt
    end = min(BOUNDARY_KINDS, key=lambda kind: best[kind][0])
    seconds, memory, shared, path = best[end]
    return StageSharding(seconds, memory + held_bytes(shared), boundaries=path + [end], lean=lean)
