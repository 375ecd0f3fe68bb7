"""When no plan fits: how much memory per device the best plan would need, and what decides it.

The stage DP only says "no plan". ``memory_need`` finds the least device memory at which
one exists — bisecting the DP's memory limit on the same cost tables, then taking the
exact footprint of the plan found there — and the stage of that plan whose footprint it
is (its weights, its activations times the microbatches in flight) with its largest
tensor. A stage's layout (fastest or memory-lean) depends on the device memory, so the
tables are rebuilt at the memory found until the answer holds at it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.errors import PlanError
from meshplan.inter.stage_cost import StageCosts
from meshplan.inter.stage_dp import StageSolution, solve_stages

PRECISION = 1e-3     # the bisection stops within this fraction of the answer
ROUNDS = 4           # table rebuilds at the memory found


@dataclass(frozen=True)
class MemoryNeed:
    needed: float              # bytes per device
    layers: tuple[int, int]    # the deciding stage: layers [start, stop)
    submesh: tuple[int, int]
    weights: float             # its bytes per device held for the whole run
    activations: float         # its activation bytes per device per microbatch
    in_flight: int             # microbatches in flight at its position
    largest: tuple[str, tuple, str, float]   # its largest tensor: name, shape, dtype, bytes


def memory_need(costs: StageCosts, submeshes: list[tuple[int, int]], num_devices: int, memory: float,
                max_stages: int | None, idle: bool) -> MemoryNeed | None:
    """The least memory per device at which some plan fits (None when none does at any
    memory: too few layers for the devices, say), and its deciding stage."""
    sizes = np.array([n * m for n, m in submeshes])
    limit = memory
    found = None
    for _ in range(ROUNDS):
        _, params, acts = costs.tables(submeshes, memory=limit)
        seconds = np.where(np.isfinite(params) & np.isfinite(acts), 1.0, np.inf)   # any plan will do
        result = _least(seconds, params, acts, sizes, num_devices, max_stages, idle, limit)
        if result is None:
            return None
        need, solution = result
        found = (need, solution, params, acts)
        if need <= limit * (1 + 1e-12) or _footprint(costs, submeshes, need, sizes, num_devices, max_stages, idle):
            break
        limit = need
    need, solution, params, acts = found
    return _describe(costs, submeshes, need, solution, params, acts)


def _solve(seconds, params, acts, limit, sizes, devices, max_stages, idle) -> StageSolution | None:
    try:
        return solve_stages(seconds, params, acts, limit, sizes, devices, 1, max_stages=max_stages,
                            idle_devices=idle)
    except PlanError:
        return None


def _peak(solution: StageSolution, params, acts) -> float:
    n = len(solution.stages)
    return max(params[s.start, s.stop - 1, s.submesh, s.logical] + (n - p) * acts[s.start, s.stop - 1, s.submesh, s.logical]
               for p, s in enumerate(solution.stages))


def _least(seconds, params, acts, sizes, devices, max_stages, idle, low: float):
    """(least memory limit admitting a plan, within PRECISION; that plan) on these tables."""
    if _solve(seconds, params, acts, np.inf, sizes, devices, max_stages, idle) is None:
        return None
    high = max(low, 1.0)
    while (plan := _solve(seconds, params, acts, high, sizes, devices, max_stages, idle)) is None:
        low, high = high, high * 2
    best = plan
    while high - low > PRECISION * high:
        middle = (low + high) / 2
        plan = _solve(seconds, params, acts, middle, sizes, devices, max_stages, idle)
        if plan is None:
            low = middle
        else:
            high, best = middle, plan
    return _peak(best, params, acts), best


def _footprint(costs, submeshes, need, sizes, devices, max_stages, idle) -> bool:
    """Whether a plan fits devices of ``need`` bytes on the tables built for that memory."""
    _, params, acts = costs.tables(submeshes, memory=need)
    seconds = np.where(np.isfinite(params) & np.isfinite(acts), 1.0, np.inf)
    return _solve(seconds, params, acts, need, sizes, devices, max_stages, idle) is not None


def _describe(costs: StageCosts, submeshes, need, solution: StageSolution, params, acts) -> MemoryNeed:
    n = len(solution.stages)
    position, stage = max(enumerate(solution.stages),
                          key=lambda item: params[item[1].start, item[1].stop - 1, item[1].submesh, item[1].logical]
                          + (n - item[0]) * acts[item[1].start, item[1].stop - 1, item[1].submesh, item[1].logical])
    entry = (stage.start, stage.stop - 1, stage.submesh, stage.logical)
    graph, bounds = costs.graph, costs.layering.bounds
    largest = None
    for i in range(bounds[stage.start], bounds[stage.stop]):
        node = graph.nodes[i]
        for name in list(node.inputs) + list(node.outputs):
            if not name:
                continue
            info = graph.tensors[name]
            size = float(info.peak_nbytes)
            if largest is None or size > largest[3]:
                largest = (name, tuple(info.shape), info.dtype.name, size)
    return MemoryNeed(float(need), (stage.start, stage.stop), tuple(submeshes[stage.submesh]), float(params[entry]),
                      float(acts[entry]), n - position, largest)


def _size(nbytes: float) -> str:
    """Three significant digits: ``12.3 MiB``, ``1.23 GiB``."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {unit}"
    return f"{nbytes:.0f} B"


def memory_error(need: MemoryNeed, memory: float, num_layers: int) -> PlanError:
    """One line: the memory the best plan needs, the memory given, and what decided it."""
    start, stop = need.layers
    layers = f"layer {start}" if stop - start == 1 else f"layers {start}-{stop - 1}"
    devices = need.submesh[0] * need.submesh[1]
    name, shape, dtype, size = need.largest
    error = PlanError(
        f"no plan fits in {_size(memory)} per device: the best plan needs {_size(need.needed)} per device; "
        f"its stage of {layers} (of {num_layers}) on {devices} device(s) holds {_size(need.weights)} of weights and "
        f"{_size(need.activations)} of activations per microbatch, {need.in_flight} in flight; its largest tensor is "
        f"'{name}' {list(shape)} {dtype}, {_size(size)}",
        hint="use devices with more memory, more devices, or more microbatches (smaller ones)")
    error.needed_bytes, error.given_bytes = need.needed, memory   # for callers that act on the numbers
    return error
