"""A chosen stage's sharding, solved again over windows wider than the stage DP's layers.

The stage DP's layers are small, and a tensor crossing a layer boundary is replicated or
batch-split (``layer_ilp``): at batch 1, where nothing splits by batch, every boundary
gathers. That keeps a column-parallel matrix product from handing its split output on to
a row-parallel one a layer later (the Megatron pairing), and a decode step cut into one
operator a layer gathers after every product. Once the DP has chosen its stages, each
multi-device stage whose chain spends time resharding at its layer boundaries is solved
again in windows of whole layers up to ``WINDOW_NODES`` operators, each ending at the
cheapest cut it can reach (where the least crosses, between blocks), and the result kept
where it is faster and still fits. The windows only widen the ILP's choices, but a
window's ILP is far larger than a layer's: they are solved only for stages on one host
viewed as 1xk (tensor parallelism over a host's devices, the Megatron pairing) where the
chain replicates every boundary inside the stage (at batch 1, or a batch the mesh does
not divide), which is where it loses most. On a 2x4 view a node has several times the
strategies and a window's ILP grows with their square (the GPT sample at batch 8 on 2x4:
windows gained 0.4 % of the estimate and took planning from 1.6 s to 4.0 s); a stage over
many hosts flattened to 1x128 is a whole model's windows on 128 devices (a 70B-shaped
decoder on 16x8 took 169 s to plan with them and 154 s without, beside a test suite, for
the same estimate).
"""

from __future__ import annotations

from typing import Callable

from meshplan.intra.chain import StageSharding
from meshplan.intra.intra_op import IntraOpPass
from meshplan.intra.strategies import Strategy
from meshplan.model.layers import Layering

WINDOW_NODES = 96   # operators a window's ILP takes at most (more than one layer can exceed it)
MIN_BOUNDARY_SHARE = 0.01   # a stage is solved again where its layer boundaries cost more of its time


def window_layering(layering: Layering, cuts: set[int], budget: int = WINDOW_NODES) -> Layering:
    """``layering``'s layers joined into windows of up to ``budget`` operators, never across a
    node index in ``cuts`` (stage boundaries); a window ends at the boundary with the least
    traffic in the second half of its reach."""
    fine = layering.bounds
    traffic = layering.cut_bytes
    bounds = [0]
    k = 1
    while k < len(fine):
        start = bounds[-1]
        # the fine boundaries this window may end at: up to the budget (at least one layer)
        # and never past a stage cut
        reach = [k]
        while reach[-1] + 1 < len(fine) and fine[reach[-1]] not in cuts and fine[reach[-1] + 1] - start <= budget:
            reach.append(reach[-1] + 1)
        if fine[reach[-1]] in cuts or reach[-1] == len(fine) - 1:
            end = reach[-1]
        else:
            half = [j for j in reach if fine[j] - start >= (fine[reach[-1]] - start) / 2]
            end = min(half, key=lambda j: (traffic[fine[j]], -j))
        bounds.append(fine[end])
        k = end + 1
    return Layering(tuple(bounds), traffic)


class StageWindows:
    """Re-solves chosen stages over windows (see the module's doc); ``make_pass`` builds the
    sharding pass of a layering (the stage DP's own settings)."""

    def __init__(self, layering: Layering, make_pass: Callable[[Layering], IntraOpPass]):
        self.layering = layering
        self.make_pass = make_pass
        self._passes: dict[tuple[int, ...], IntraOpPass] = {}

    def improve(self, layers: IntraOpPass, start: int, stop: int, cuts: set[int], submesh: tuple[int, int],
                logical: tuple[int, int], chained: StageSharding,
                room: float) -> tuple[StageSharding, dict[int, Strategy]] | None:
        """Layers [start, stop) of the stage DP's layering (``layers``, whose chain gave
        ``chained``) solved in windows, with every operator's strategy by node index, where
        that is faster and its weights fit (no more than the chain's, or ``room`` bytes);
        ``cuts`` are the node indices where the plan's stages begin. None on a stage over
        several hosts or a two-dimensional view, where the chain splits a boundary inside
        the stage by batch, where it spends under ``MIN_BOUNDARY_SHARE`` of its time at its
        layer boundaries (nothing for windows to save), where the windows are the layers
        themselves, or where they are no faster."""
        if submesh[0] > 1 or min(logical) > 1 or any(kind != "R" for kind in chained.boundaries[1:-1]) or (
                layers.boundary_seconds(start, stop, submesh, logical, chained) <= MIN_BOUNDARY_SHARE * chained.seconds):
            return None
        bounds = self.layering.bounds
        windows = window_layering(self.layering, cuts | {bounds[start], bounds[stop]}, WINDOW_NODES)
        first, last = windows.bounds.index(bounds[start]), windows.bounds.index(bounds[stop])
        if last - first == stop - start:
            return None
        wide = self._pass(windows)
        sharding = wide.stage(first, last, submesh, logical, room)
        if sharding.seconds >= chained.seconds or sharding.param_bytes > max(chained.param_bytes, room):
            return None
        return sharding, wide.stage_strategies(first, last, submesh, logical, sharding)

    def _pass(self, windows: Layering) -> IntraOpPass:
        if windows.bounds not in self._passes:
            self._passes[windows.bounds] = self.make_pass(windows)
        return self._passes[windows.bounds]
