"""Inter-operator stage dynamic program: slice layers into pipeline stages on submeshes.

The problem
-----------
``L`` layers ``0..L-1`` are cut into ``n`` contiguous stages.  Stage ``p`` (0-based, in
pipeline order) runs layers ``i..j`` on a submesh ``m`` (``submesh_sizes[m]`` devices)
with a logical-mesh choice ``c``, and takes ``t_p = stage_cost[i, j, m, c]`` seconds per
microbatch.  A plan is valid when

* the stages cover all layers in order;
* the submesh sizes add up to exactly ``num_devices`` (every device has work), or, with
  ``idle_devices=True``, to at most ``num_devices`` (the rest stay idle: a cluster larger
  than a model can use is never worse than a smaller one);
* every stage fits in memory at its position: ``stage_mem + (n - p) * act_mem <=
  mem_limit``, because with the 1F1B schedule stage ``p`` keeps at most ``n - p``
  microbatches' activations alive (the first stage keeps the most).

With ``B`` microbatches the pipeline latency is ``T = sum_p t_p + (B - 1) * max_p t_p``
(fill and drain once, then the slowest stage sets the pace).  We minimise ``T``.

The recurrence
--------------
``T`` is not additive because of the ``max`` term, so we fix an upper bound ``t_max`` on
every stage latency and solve an additive problem for it::

    F(s, k, d; t_max) = least sum of latencies when slicing layers k..L-1 into exactly s
                        stages on d devices, every stage <= t_max and fitting in memory
                        at its position

    F(0, L, 0) = 0
    F(s, k, d) = min over j >= k, submesh m, choice c with stage_cost[k, j, m, c] <= t_max
                 and stage_mem[k, j, m, c] + s * act_mem[k, j, m, c] <= mem_limit
                 of  stage_cost[k, j, m, c] + F(s - 1, j + 1, d - size[m])

The stage that starts a suffix of ``s`` stages keeps ``s`` microbatches in flight, so the
memory test needs only ``s``.  With ``G(t_max) = min over s of F(s, 0, D)`` (or over
``d <= D`` with idle devices), ``T* = min over t_max of G(t_max) + (B - 1) t_max``, and it
suffices to try ``t_max`` among the stage latencies (the optimal plan's slowest stage is
one; ``G`` there is at most that plan's sum).

How it is solved (each step keeps the exact optimum)
----------------------------------------------------
1. *Entries* (``_Problem``).  A stage ``(k, j, m)`` keeps its ``K`` choices' latencies and,
   per choice, the interval of ``s`` at which it fits in memory.  As the first stage of
   ``s`` stages its latency is its cheapest choice fitting at ``s`` (and ``<= t_max``):
   any other feasible choice is no better for the sum or the max and touches no other
   stage.  No stage fits deeper than the largest such ``s``, which bounds the stage count.
2. *Sparse states.*  ``F(s, k, .)`` is kept only at the device counts that are reached
   and can still lead to a plan below a threshold (point 4), as arrays of ``(d, value)``
   per ``(s, k)``, computed level by level in ``s``: each entry extends the points of the
   state after it.  A point is dropped when another with no more stages (fewer stages
   after a prefix mean fewer microbatches in flight for every prefix stage, so every
   prefix that fits with it fits with the other), the same devices (with idle devices:
   no more devices) and no larger sum exists: with idle devices each ``(s, k)`` keeps a
   Pareto front of devices against sum.
3. *Prefix bounds* (``_Bounds``).  A suffix state ``(s, k, d)`` is completed by a prefix
   over layers ``0..k-1`` whose last stage keeps ``s + 1`` microbatches in flight, the one
   before ``s + 2``, and so on, on ``D - d`` devices (at most that with idle devices).
   For a price ``lam`` per device, ``sum t >= sum (t + lam z) - lam (D - d)`` for every
   such prefix, and the least ``sum (t + lam z)`` over prefixes, ``Q_lam[s, k]``, is a
   shortest path over layer cuts with the in-flight count exact and no device dimension.
   Maximised over a grid of prices (both signs for an exact device count, ``lam >= 0``
   with idle devices) this bounds the prefix within a fraction of a percent on the
   benchmark tables; the least and greatest device counts of such prefixes
   (``Dmin``/``Dmax``, the same recurrence) rule out states no prefix can complete.  The
   recurrence runs from the deepest count up for every price at once; a price whose row a
   level leaves unchanged, once every stage has joined, keeps that row at every level
   above and drops out.
4. *Thresholded solves* (``_solve_at``).  A solve at ``t_max`` looks for ``G(t_max)``
   only below a threshold ``theta``: an entry whose cheapest continuation plus prefix
   bound reaches ``theta`` is not extended, and a point whose value plus prefix bound
   reaches it is dropped.  Every plan below ``theta`` survives, so the answer is exact
   below it, and "no plan" proves ``G(t_max) >= theta``.  Near-tight thresholds keep the
   states few: a solve starts just above its prefix bound and raises the threshold until
   a plan shows or the cap is reached (``_Search.deepen``); a bound that the coarse price grid
   alone lifts to the cap ends it before the fine grid is built.
5. *The walk over t_max* (``_Search.run``).  Candidates are the distinct usable latencies,
   from the least at which a memory- and device-aware relaxation admits a plan, upwards,
   in intervals of about 5 %.  An interval ``(a, b]`` is settled by solves at its top with
   cap ``T_best - (B - 1) a``: a plan found with slowest stage ``m`` settles ``[m, b]``
   (nothing there has a smaller sum or a smaller max), and the walk descends below ``m``;
   no plan settles all of it.  The walk ends where ``LB + (B - 1) a >= T_best``, with
   ``LB`` a prefix bound at the last ``t_max`` that can still win (``G >= 0`` gives the
   first such point, ``T_best / (B - 1)``).  With one microbatch the solve at
   ``t_max = inf`` is the answer.

Small stages
------------
``min_stage_fraction = f`` asks for plans whose every stage takes at least ``f`` times the
slowest one (a stage of one trivial operator is not worth its devices and its transfers;
the planner uses ``f = 0.1``).  It is met through the entries only, around the exact solve
(``balanced``): solve; while some stage takes less than ``f`` times the plan's slowest,
make every entry below that bound ``inf`` and solve again.  Each round's bound is above
the last one's (the small stage was allowed before), so the rounds end.  Each solve is
exact for its masked entries: the result is the best plan whose stages all take at least
the last bound, and the exact optimum under the rule whenever that bound is at most ``f``
times the optimum's slowest stage (always when the first solve already obeys the rule).
When a round finds no plan at all, the stages of the previous plan are kept as they are:
memory (or, with exactly ``num_devices``, the devices) needs them apart.

Extending it
------------
* A constraint on which stages may exist (forced cuts from user hints, forbidden
  submeshes): make those entries ``inf`` in ``stage_cost`` (every step only sees entries).
* An exact stage count (``stages``): plans end at that level only, and no point is dropped
  for one of fewer stages (point 2's dominance would keep plans of the wrong count); the
  prefix bounds and the relaxation stay valid as they are.
* Any new pruning must keep every plan below the threshold: the tests compare with the
  reference and the brute force on random tables (``tests/test_stage_dp.py``), in both
  device modes.

The unpruned DP and an exhaustive oracle are in ``meshplan.testing.stage_dp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from meshplan.errors import PlanError

__all__ = [
    "balanced",
    "StageChoice",
    "StageSolution",
    "solve_stages",
    "plan_objective",
]

# Width of the walk's intervals over t_max, relative to their top: wider ones build fewer
# prefix bounds and need more threshold solves. 5 % was the fastest in all of 1–40 % on the
# GPT-2 and 70B-shape tables of docs/benchmarks.md (1.2–2× faster than 1 %; at 10 % the
# 70B's solve on every device took twice as long as at 1 %).
WALK_STEP = 0.05
# Device prices of the prefix bounds: multiples of (median latency / median submesh size).
PRICE_STEPS = 2.0 ** np.arange(-3.0, 8.0, 0.25)
NEGATIVE_PRICE_STEPS = 2.0 ** np.arange(-3.0, 8.0, 1.0)


@dataclass(frozen=True)
class StageChoice:
    """One pipeline stage: layers ``start..stop-1`` on ``submesh`` with ``logical`` choice."""

    start: int  # first layer (inclusive)
    stop: int  # last layer + 1
    submesh: int  # index into submesh_sizes
    logical: int  # logical-mesh choice index
    seconds: float  # stage_cost[start, stop - 1, submesh, logical]


@dataclass(frozen=True)
class StageSolution:
    """An optimal plan and its pipeline latency ``T = sum t + (B - 1) max t``."""

    stages: tuple[StageChoice, ...]
    total_seconds: float  # T
    max_stage_seconds: float
    tmax_candidates: int  # how many threshold solves were run (stats)
    devices_used: int = 0  # sum of the stages' submesh sizes (< num_devices: idle devices)


def plan_objective(seconds, microbatches: int) -> float:
    """``sum(seconds) + (microbatches - 1) * max(seconds)``, summed exactly (``math.fsum``)."""
    seconds = [float(x) for x in seconds]
    return math.fsum(seconds + [(microbatches - 1) * max(seconds)])


# --------------------------------------------------------------------------------------
# input checks shared by the solver and the oracles


def check_stage_inputs(stage_cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices, microbatches):
    cost = np.asarray(stage_cost, dtype=np.float64)
    smem = np.asarray(stage_mem, dtype=np.float64)
    amem = np.asarray(act_mem, dtype=np.float64)
    sizes = np.asarray(submesh_sizes)
    if cost.ndim != 4 or cost.shape[0] != cost.shape[1]:
        raise ValueError(f"stage_cost must have shape (L, L, S, K), got {cost.shape}")
    if smem.shape != cost.shape or amem.shape != cost.shape:
        raise ValueError(f"stage_mem {smem.shape} and act_mem {amem.shape} must match stage_cost {cost.shape}")
    L, _, S, K = cost.shape
    if L < 1 or S < 1 or K < 1:
        raise ValueError(f"stage_cost must be non-empty, got shape {cost.shape}")
    if (
        sizes.shape != (S,)
        or not (np.issubdtype(sizes.dtype, np.integer) or np.issubdtype(sizes.dtype, np.floating))
        or not np.all(np.isfinite(sizes))
        or np.any(sizes != np.round(sizes))
        or np.any(sizes < 1)
    ):
        raise ValueError(f"submesh_sizes must be {S} positive integers, got {submesh_sizes!r}")
    if int(num_devices) != num_devices or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    if int(microbatches) != microbatches or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    upper = np.triu(np.ones((L, L), dtype=bool))
    with np.errstate(invalid="ignore"):
        bad_cost = (np.isnan(cost) | (cost < 0)).any(axis=(2, 3))
    if (bad_cost & upper).any():
        raise ValueError("stage_cost must be non-negative seconds or inf (no NaN)")
    if ((np.isnan(smem) | np.isnan(amem)).any(axis=(2, 3)) & upper).any():
        raise ValueError("stage_mem and act_mem must not contain NaN")
    # j < i entries are ignored: make them infeasible so no code path can pick them.
    cost = np.where(upper[:, :, None, None], cost, np.inf)
    return cost, smem, amem, float(mem_limit), sizes.astype(np.int64), int(num_devices), int(microbatches)


def max_stage_count(L: int, sizes: np.ndarray, num_devices: int, max_stages: int | None = None) -> int:
    """Upper bound on the number of stages: one layer and ``min(size)`` devices each."""
    n = min(L, num_devices // int(sizes.min()))
    if max_stages is not None:
        if int(max_stages) != max_stages or max_stages < 1:
            raise ValueError(f"max_stages must be a positive integer, got {max_stages!r}")
        n = min(n, int(max_stages))
    return n


def small_stages(solution: StageSolution, fraction: float) -> list[int]:
    """Indices of the stages that take less than ``fraction`` of the slowest one."""
    bound = fraction * solution.max_stage_seconds
    return [p for p, stage in enumerate(solution.stages) if stage.seconds < bound]


def balanced(solve, stage_cost, fraction: float) -> StageSolution:
    """``solve(stage_cost)`` under the small-stage rule (module docstring, "Small stages"):
    re-solved with the entries below ``fraction`` of the slowest stage made ``inf`` until no
    stage is below it, or until no plan is left (the last plan is then returned)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"min_stage_fraction must be in [0, 1), got {fraction!r}")
    cost = np.asarray(stage_cost, dtype=np.float64)
    best = solve(cost)
    if fraction == 0.0:
        return best
    solves = best.tmax_candidates
    while small_stages(best, fraction):
        bound = fraction * best.max_stage_seconds
        try:
            found = solve(np.where(cost < bound, np.inf, cost))
        except PlanError:
            break
        solves += found.tmax_candidates
        best = found
    return StageSolution(best.stages, best.total_seconds, best.max_stage_seconds, solves, best.devices_used)


def no_plan_error(L, num_devices, idle_devices: bool = False):
    how = "at most" if idle_devices else "exactly"
    return PlanError(
        f"no feasible stage plan: {L} layers cannot be sliced onto {how} {num_devices} devices "
        "within the memory limit"
    )


# --------------------------------------------------------------------------------------
# the instance: stage entries and the suffix stage counts at which each choice fits


def _fit_range(smem, amem, mem_limit, n):
    """For each (entry, choice): the interval ``[lo, hi]`` of suffix stage counts ``s`` in
    ``1..n`` at which ``smem + s * amem <= mem_limit`` holds, evaluated exactly as written
    (empty when ``lo > hi``).  The test is linear in ``s``: the quotient gives the end,
    corrected by one where rounding disagrees with the test itself."""

    def fits(s):
        with np.errstate(invalid="ignore", over="ignore"):
            return smem + s * amem <= mem_limit

    lo = np.ones(smem.shape, dtype=np.int64)
    hi = np.full(smem.shape, n, dtype=np.int64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        edge = np.floor((mem_limit - smem) / amem)
    edge = np.where(np.isfinite(edge), np.clip(edge, 0, n + 1), np.where(amem > 0, n + 1, 0)).astype(np.int64)
    falling = amem > 0     # fits for s <= edge
    rising = amem < 0      # fits for s >= edge (activations that free memory: kept general)
    # rounding: move the edge by one where the test itself disagrees
    up = falling & (edge < n) & fits(edge + 1)
    down = falling & (edge >= 1) & ~fits(np.maximum(edge, 1))
    edge = edge + up - down
    hi = np.where(falling, np.minimum(edge, n), hi)
    flat = amem == 0
    hi = np.where(flat & ~fits(1), 0, hi)
    if rising.any():
        first = np.where(rising, np.clip(np.ceil((mem_limit - smem) / np.where(rising, amem, 1)), 1, n + 1), 1)
        first = first.astype(np.int64)
        for _ in range(2):
            down = rising & (first > 1) & fits(first - 1)
            up = rising & (first <= n) & ~fits(np.minimum(first, n))
            first = first - down + up
        lo = np.where(rising, first, lo)
    return lo, hi


class _Problem:
    """The stage entries of one instance, shared by every solve.

    An *entry* is a stage ``(k, j, m)``: layers ``k..j`` on submesh ``m`` (``z`` devices),
    with its ``K`` choices' latencies and, per choice, the interval of suffix stage counts
    at which it fits in memory; entries are sorted by start layer.
    """

    def __init__(self, cost, smem, amem, mem_limit, sizes, num_devices, max_stages=None, exact=False):
        L = cost.shape[0]
        self.L, self.D = L, num_devices
        # exactly ``max_stages`` stages: plans end at that level only, and a point is never
        # dropped for one with fewer stages (its plans would have fewer)
        self.exact = int(max_stages) if exact else None
        self.sizes = sizes
        n = max_stage_count(L, sizes, num_devices, max_stages)
        finite = np.isfinite(cost).any(axis=-1)
        finite &= (sizes <= num_devices)[None, None, :]
        k, j, m = np.nonzero(finite)                       # sorted by k, then j, then m
        lo, hi = _fit_range(smem[k, j, m], amem[k, j, m], mem_limit, n)
        choice_cost = np.where(lo <= hi, cost[k, j, m], np.inf)
        usable = np.isfinite(choice_cost).any(axis=-1)
        self.k, self.j, self.m = k[usable], j[usable], m[usable]
        self.cost, self.lo, self.hi = choice_cost[usable], lo[usable], hi[usable]
        self.z = sizes[self.m].astype(np.int64)
        self.least = self.cost.min(axis=1)
        # Memory bounds the stage count: no stage fits as the first of a deeper suffix.
        self.n_max = min(n, int(self.hi.max(initial=0)))
        # Fewer stages after a prefix never make it worse only when no choice needs more
        # microbatches in flight to fit (act_mem >= 0 everywhere): the dominance of point 2.
        self.monotone = bool(np.all((self.lo <= 1) | ~np.isfinite(self.cost)))
        # Every usable choice, sorted by latency: those at most t_max are a prefix.
        E, K = self.cost.shape
        flat = np.flatnonzero(np.isfinite(self.cost).ravel())
        flat = flat[np.argsort(self.cost.ravel()[flat])]
        self.flat_cost = self.cost.ravel()[flat]
        self.flat_entry = flat // K
        self.flat_hi = np.minimum(self.hi.ravel()[flat], self.n_max)

    def at_count(self, index, s, t_max):
        """(latency, logical choice) of entries ``index`` as first stage of ``s`` stages, <= t_max."""
        fits = (self.lo[index] <= s) & (s <= self.hi[index]) & (self.cost[index] <= t_max)
        masked = np.where(fits, self.cost[index], np.inf)
        arg = masked.argmin(axis=-1)
        return np.take_along_axis(masked, arg[:, None], axis=-1)[:, 0], arg

    def candidates(self):
        """The distinct usable latencies: the optimal plan's slowest stage is one of them."""
        c = self.flat_cost                      # sorted already
        return c[np.r_[True, c[1:] != c[:-1]]] if c.size else c


# --------------------------------------------------------------------------------------
# prefix bounds


class _Bounds:
    """Lower bounds on the prefix that completes a suffix state (module docstring, 3),
    built from the choices at most ``t_max`` (valid for every solve at or below it).

    ``Q[l, s, k]``: the least ``sum (t + lam_l z)`` over prefixes of layers ``0..k-1``
    whose last stage keeps ``s + 1`` microbatches in flight (the one before ``s + 2``, ...),
    each choice allowed at any count up to the deepest it fits at.  ``Dmin``/``Dmax``:
    the least and greatest device counts of such prefixes, kept at most ``D + 1`` and ``D``
    (the greatest only for an exact device count; None with idle devices).
    """

    def __init__(self, prob: _Problem, t_max: float, idle: bool, coarse: bool = False):
        L, S = prob.L, prob.n_max
        self.L, self.S, self.D, self.idle, self.coarse = L, S, prob.D, idle, coarse
        keep = int(np.searchsorted(prob.flat_cost, t_max, side="right"))
        entry, c, hi = prob.flat_entry[:keep], prob.flat_cost[:keep], prob.flat_hi[:keep]
        self.empty = keep == 0
        if self.empty:
            return
        # groups of choices by (layer range, deepest count they fit at)
        pair = prob.k[entry] * L + prob.j[entry]
        key = pair * (S + 2) + hi
        order = np.argsort(key, kind="stable")
        key, pair = key[order], pair[order]
        self.c, self.z = c[order], prob.z[entry][order].astype(np.float64)
        self.starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        self.group_hi = hi[order][self.starts]
        self.pairs, self.group_pair = np.unique(pair[self.starts], return_inverse=True)
        # the pairs in order of their end layer, so that each level is one reduceat
        by_stop = np.argsort(self.pairs % L, kind="stable")
        self.rank = np.empty_like(by_stop)
        self.rank[by_stop] = np.arange(by_stop.size)
        self.pair_start = (self.pairs // L)[by_stop]
        stop = (self.pairs % L)[by_stop] + 1
        self.stop_bounds = np.flatnonzero(np.r_[True, stop[1:] != stop[:-1]])
        self.stops = stop[self.stop_bounds]
        # groups from the deepest count they fit at down (one pair per (pair, hi) group)
        self.group_order = np.argsort(-self.group_hi, kind="stable")
        self.group_hi_sorted = self.group_hi[self.group_order]
        self.group_rank_sorted = self.rank[self.group_pair][self.group_order]
        # The greatest count as the least of its negation: one recurrence for both (the
        # greatest is needed only for an exact device count). Only whether a count reaches
        # D matters, so the least is kept at most D + 1 and the greatest at most D, exactly
        # (min(D, z + min(D, x)) = min(D, z + x) for z >= 0): rows settle within a few levels.
        least, most = np.minimum.reduceat(self.z, self.starts), -np.maximum.reduceat(self.z, self.starts)
        counts = self._levels(least[None] if idle else np.stack([least, most]), np.minimum,
                              clip=[(-np.inf, self.D + 1.0), (-float(self.D), np.inf)][:1 if idle else 2])
        self.Dmin = counts[0]
        self.Dmax = None if idle else -counts[1]
        self.Q = None

    def _prices(self, coarse: bool) -> np.ndarray:
        base = float(np.median(self.c)) / float(np.median(self.z)) or 1.0
        lams = [0.0, *(base * (NEGATIVE_PRICE_STEPS if coarse else PRICE_STEPS))]
        if not self.idle:
            lams += list(-base * NEGATIVE_PRICE_STEPS)
        return np.array(lams)

    def _priced(self, lams: np.ndarray) -> np.ndarray:
        values = self.c[None, :] + lams[:, None] * self.z[None, :]
        return self._levels(np.minimum.reduceat(values, self.starts, axis=1), np.minimum)

    def _price(self):
        """The priced recurrence ``Q`` (built on first use: infeasible intervals and the
        floor's probes need only the device counts)."""
        if self.Q is None:
            self.lams = self._prices(self.coarse)
            self.Q = self._priced(self.lams)
            rising, falling = self.lams <= 0, self.lams >= 0
            # each half as its own array, taken once (not copied out of Q at every probe)
            self.lam_r, self.Q_r = self.lams[rising], np.ascontiguousarray(self.Q[rising])
            self.lam_f, self.Q_f = self.lams[falling], np.ascontiguousarray(self.Q[falling])
        return self.Q

    def _levels(self, group_values, better, clip=None):
        """The prefix recurrence for a batch of group values (rows): ``out[row, s, k]``.
        Levels go from the deepest in-flight count up, so each pair's best group grows
        as groups that fit at fewer microbatches join it.  Once every group has joined, a
        row that a level leaves unchanged stays so at every level above (the same step
        from the same values): it is copied up and no longer computed.  ``clip``: per row,
        the (least, greatest) value kept at each level."""
        L, S = self.L, self.S
        rows = group_values.shape[0]
        worst = np.inf if better is np.minimum else -np.inf
        best = np.full((rows, self.pairs.size), worst)
        out = np.full((rows, S + 2, L + 1), worst)
        out[:, :, 0] = 0.0
        live = np.arange(rows)
        if clip is not None:
            low, high = (np.array(side, dtype=np.float64) for side in zip(*clip))
        joins = np.searchsorted(-self.group_hi_sorted, -np.arange(S + 3), side="right")   # [h]: groups with hi >= h
        for s in range(S, -1, -1):
            # groups fitting with s + 1 in flight: hi >= s + 1
            new = slice(joins[min(s + 2, S + 2)], joins[s + 1]) if s + 1 <= S + 2 else slice(0, 0)
            cols = self.group_rank_sorted[new]
            if cols.size:
                best[:, cols] = better(best[:, cols], group_values[:, self.group_order[new]])
            vals = best + out[live, s + 1][:, self.pair_start]
            level = out[live, s]
            level[:, self.stops] = better.reduceat(vals, self.stop_bounds, axis=1)
            if clip is not None:
                np.clip(level, low[:, None], high[:, None], out=level)
            out[live, s] = level
            if joins[s + 1] == joins[0]:
                still = (level == out[live, s + 1]).all(axis=1)
                if still.any():
                    out[live[still], :s] = level[still, None]
                    live, best, group_values = live[~still], best[~still], group_values[~still]
                    if clip is not None:
                        low, high = low[~still], high[~still]
                    if not live.size:
                        break
        return out

    def total(self, cap: float = np.inf) -> float:
        """The bound on a whole plan (the empty suffix at layer L on no devices). Where it
        is compared with a finite ``cap``, the coarse price grid (a quarter of the rows) is
        tried first: when it already reaches the cap, the fine one is not built."""
        L, D = np.array([self.L]), np.array([self.D])
        if np.isfinite(cap) and self.Q is None and not self.coarse and not self.empty \
                and self.devices_ok(0, L, D, D)[0]:
            lams = self._prices(coarse=True)
            rough = float((self._priced(lams)[:, 0, self.L] - lams * self.D).max())
            if rough >= cap:
                return rough
        return float(self.at(0, L, D)[0])

    def devices_ok(self, s, k, u_lo, u_hi):
        """Whether some prefix before a suffix of ``s`` stages at ``k`` can have a device
        count in ``[u_lo, u_hi]`` (at most ``u_hi`` with idle devices)."""
        if self.empty:   # no stage: only the empty prefix (no layer, no device)
            return (k == 0) & (u_hi >= 0) & ((u_lo <= 0) | self.idle)
        ok = (u_hi >= self.Dmin[s, k]) & (u_hi >= 0)
        if not self.idle:
            ok &= u_lo <= self.Dmax[s, k]
        return ok

    def at(self, s, k, u):
        """Bound on the prefix of a state ``(s, k)`` left ``u`` devices (inf: none fits)."""
        return self.over(s, k, u, u)

    def over(self, s, k, u_lo, u_hi):
        """A bound valid for every count in ``[u_lo, u_hi]``: prices >= 0 give a part that
        falls with ``u`` (taken at ``u_hi``), prices <= 0 one that rises (at ``u_lo``)."""
        out = np.full(np.shape(k), np.inf)
        ok = self.devices_ok(s, k, u_lo, u_hi)
        if self.empty:
            out[ok] = 0.0
            return out
        if ok.any():
            self._price()
            kg = k[ok]
            hi_u, lo_u = u_hi[ok].astype(np.float64), u_lo[ok].astype(np.float64)
            falling = (self.Q_f[:, s, kg] - self.lam_f[:, None] * hi_u[None, :]).max(axis=0)
            rising = (self.Q_r[:, s, kg] - self.lam_r[:, None] * lo_u[None, :]).max(axis=0)
            out[ok] = np.maximum(falling, rising)
        return out


# --------------------------------------------------------------------------------------
# one solve: the least sum at a fixed t_max, below a threshold


def _slack(x):
    """Room for rounding when a bound is compared with a threshold: pruning must never
    drop a plan whose true sum is below the threshold."""
    return 1e-9 * abs(x) + 1e-300


def _solve_at(prob: _Problem, t_max: float, theta: float, bounds: _Bounds, idle: bool):
    """``G(t_max)`` and a plan achieving it if ``G(t_max) < theta``, else ``(inf, None)``
    (module docstring, 2 and 4).  A plan is ``[(k, j, m, s, choice, latency)]``."""
    L, D = prob.L, prob.D
    limit = theta + _slack(theta)
    empty = np.zeros(0, dtype=np.int64)
    levels = [dict(k=np.array([L]), d=np.array([0]), f=np.array([0.0]))]
    lower = np.full((L + 1, D + 1), np.inf)     # least value at (k, d) over the levels so far
    base = np.nonzero(prob.least <= t_max)[0]
    finals = []
    for s in range(1, prob.n_max + 1):
        prev = levels[-1]
        pk, pd, pf = prev["k"], prev["d"], prev["f"]
        if not pk.size:
            break
        # entries whose next state has points
        e = base[prob.j[base] <= L - s]
        nxt = prob.j[e] + 1
        lo = np.searchsorted(pk, nxt, side="left")
        hi = np.searchsorted(pk, nxt, side="right")
        has = hi > lo
        e, lo, hi = e[has], lo[has], hi[has]
        lat, arg = prob.at_count(e, s, t_max)
        has = np.isfinite(lat)
        e, lo, hi, lat, arg = e[has], lo[has], hi[has], lat[has], arg[has]
        k, z = prob.k[e], prob.z[e]
        # the entry's cheapest continuation with its best-case prefix bound
        if idle:   # each next state is a Pareto front: its last point has the least value
            floor = pf[hi - 1] + lat + bounds.at(s, k, D - z - pd[lo])
        else:
            group = np.flatnonzero(np.r_[True, pk[1:] != pk[:-1]])
            least = np.minimum.reduceat(pf, group)[np.searchsorted(group, lo)]
            floor = least + lat + bounds.over(s, k, D - z - pd[hi - 1], D - z - pd[lo])
        keep = floor < limit
        e, lo, hi, lat, arg, k, z = e[keep], lo[keep], hi[keep], lat[keep], arg[keep], k[keep], z[keep]
        # extend every point of each entry's next state
        counts = hi - lo
        which = np.repeat(np.arange(e.size), counts)
        src = lo[which] + (np.arange(which.size) - np.repeat(np.cumsum(counts) - counts, counts))
        d = pd[src] + z[which]
        f = pf[src] + lat[which]
        kk = k[which]
        keep = d <= D
        which, src, d, f, kk = which[keep], src[keep], d[keep], f[keep], kk[keep]
        keep = f + bounds.at(s, kk, D - d) < limit
        which, src, d, f, kk = which[keep], src[keep], d[keep], f[keep], kk[keep]
        if not d.size:
            break
        # the least value per (k, d)
        key = kk * (D + 1) + d
        order = np.lexsort((f, key))
        first = order[np.r_[True, key[order][1:] != key[order][:-1]]]
        which, src, d, f, kk = which[first], src[first], d[first], f[first], kk[first]
        # dominated by a point of a lower level (fewer stages) or, with idle devices, of
        # fewer devices
        if idle:   # (over the layers these points start at only)
            rows, at = np.unique(kk, return_inverse=True)
            seen = np.minimum.accumulate(lower[rows], axis=1) if prob.exact is None \
                else np.full((rows.size, D + 1), np.inf)
            here = np.full((rows.size, D + 1), np.inf)
            here[at, d] = f
            ahead = np.minimum.accumulate(np.minimum(here, seen), axis=1)
            beaten = np.minimum(seen[at, d], np.where(d > 0, ahead[at, np.maximum(d - 1, 0)], np.inf))
        elif prob.monotone and prob.exact is None:
            beaten = lower[kk, d]
        else:
            beaten = np.full(f.shape, np.inf)
        keep = f < beaten
        which, src, d, f, kk = which[keep], src[keep], d[keep], f[keep], kk[keep]
        lower[kk, d] = np.minimum(lower[kk, d], f)
        order = np.lexsort((d, kk))
        level = dict(k=kk[order], d=d[order], f=f[order], src=src[order],
                     entry=e[which[order]], choice=arg[which[order]], lat=lat[which[order]])
        levels.append(level)
        done = np.nonzero((level["k"] == 0) & ((level["d"] <= D) if idle else (level["d"] == D)))[0]
        if done.size and prob.exact in (None, s):
            i = done[np.argmin(level["f"][done])]
            finals.append((float(level["f"][i]), s, int(i)))
    if not finals:
        return np.inf, None
    value, s, i = min(finals)
    if value >= limit:
        return np.inf, None
    plan = []
    while s > 0:
        level = levels[s]
        idx = int(level["entry"][i])
        plan.append((int(prob.k[idx]), int(prob.j[idx]), int(prob.m[idx]), s, int(level["choice"][i]),
                     float(level["lat"][i])))
        i, s = int(level["src"][i]), s - 1
    return value, plan


# --------------------------------------------------------------------------------------
# the walk over t_max


class _Search:
    def __init__(self, prob: _Problem, B: int, idle: bool):
        self.prob, self.B, self.idle = prob, B, idle
        self.solves = 0
        self.best_T, self.best_plan = np.inf, None

    def consider(self, plan) -> float:
        """Keep ``plan`` if it is the best so far; its slowest stage."""
        seconds = [lat for *_, lat in plan]
        T = plan_objective(seconds, self.B)
        if T < self.best_T:
            self.best_T, self.best_plan = T, plan
        return max(seconds)

    def deepen(self, t_max, bounds, cap, known=0.0):
        """``G(t_max)`` and its plan if below ``cap``: thresholds rising from the bound (or
        from ``known``, a value ``G(t_max)`` is already known not to be below)."""
        floor = max(bounds.total(cap), known)
        if not floor < cap:
            return np.inf, None
        gap = 1e-3 * abs(floor) + (1e-6 * t_max if np.isfinite(t_max) else 0.0) + 1e-12
        while True:
            theta = min(floor + gap, cap)
            self.solves += 1
            value, plan = _solve_at(self.prob, t_max, theta, bounds, self.idle)
            if plan is not None or theta >= cap:
                return value, plan
            floor, gap = theta, gap * 8

    def run(self):
        prob, B = self.prob, self.B
        if B == 1:
            value, plan = self.deepen(np.inf, _Bounds(prob, np.inf, self.idle), np.inf)
            if plan is not None:
                self.consider(plan)
            return
        cands = prob.candidates()
        first = self._feasible_floor(cands)
        if first is None:
            return
        settled = first - 1      # every plan whose slowest stage is cands[<= settled] is settled
        end = end_floor = None
        i = first
        while i < cands.size:
            a = float(cands[settled + 1])     # the least slowest stage still open
            if np.isfinite(self.best_T):
                if end is None:       # beyond `end` nothing wins; up to it G >= end_floor
                    end, end_floor = self.best_T / (B - 1), 0.0
                    for coarse in (True, False):
                        end_floor = max(end_floor, _Bounds(prob, end, self.idle, coarse).total())
                        end = min(end, (self.best_T - end_floor) / (B - 1))
                if a > end or end_floor + (B - 1) * a >= self.best_T:
                    break
            bounds = _Bounds(prob, float(cands[i]), self.idle)
            top, known = i, 0.0
            while True:   # settle cands[settled + 1 .. i]
                value, plan = self.deepen(float(cands[top]), bounds, self.best_T - (B - 1) * a, known)
                if plan is None:      # G(top) >= cap: nothing up to top beats the best
                    break
                known = value         # G only grows as t_max falls
                slowest = self.consider(plan)
                # [slowest, top] holds nothing better than this plan: look below it
                top = int(np.searchsorted(cands, slowest, side="left")) - 1
                if top <= settled:
                    break
            settled = i
            # the next interval ends at the first candidate a step above (or the last one)
            i = max(min(int(np.searchsorted(cands, float(cands[i]) * (1 + WALK_STEP), side="left")),
                        cands.size - 1), i + 1)

    def _feasible_floor(self, cands):
        """Index of a candidate at or below the least one at which the relaxation of
        ``_Bounds`` admits a plan (so none below it can be the slowest stage of a plan):
        from the least latency every layer's stage must have, steps growing from
        ``WALK_STEP`` up to a value that admits, then bisection to within ``WALK_STEP``."""
        prob = self.prob
        L = prob.L

        def admits(t):
            b = _Bounds(prob, t, self.idle)
            return (not b.empty) and bool(b.devices_ok(0, np.array([L]), np.array([prob.D]), np.array([prob.D]))[0])

        # each layer lies in some stage: the slowest stage is at least, over the layers, the
        # least latency of a stage holding it
        least = np.full((L, L), np.inf)
        np.minimum.at(least, (prob.k, prob.j), prob.cost.min(axis=1))
        reach = np.minimum.accumulate(np.minimum.accumulate(least[:, ::-1], axis=1)[:, ::-1], axis=0)
        low = float(np.diagonal(reach).max())
        top = float(cands[-1])
        if not np.isfinite(low):
            return None
        if admits(low):
            return int(np.searchsorted(cands, low, side="left"))
        # low does not admit; find a value that does (steps doubling from WALK_STEP)
        step = WALK_STEP
        while True:
            high = min(low * (1 + step), top)
            if admits(high):
                break
            if high >= top:
                return None
            low, step = high, step * 2
        while high > low * (1 + WALK_STEP):
            mid = math.sqrt(low * high) if low > 0 else 0.5 * high
            if admits(mid):
                high = mid
            else:
                low = mid
        return int(np.searchsorted(cands, low, side="right"))   # the least candidate above a failing value


def solve_stages(
    stage_cost,
    stage_mem,
    act_mem,
    mem_limit,
    submesh_sizes,
    num_devices,
    microbatches,
    *,
    max_stages: int | None = None,
    stages: int | None = None,
    idle_devices: bool = False,
    min_stage_fraction: float = 0.0,
) -> StageSolution:
    """Optimal pipeline slicing (see the module docstring for the recurrence and how it is
    solved).  ``max_stages`` optionally caps the number of stages, ``stages`` fixes it
    exactly (the two exclude each other); ``idle_devices`` lets the
    stages use fewer than ``num_devices``; ``min_stage_fraction`` keeps every stage at or
    above that fraction of the slowest one (see "Small stages").  Raises ``PlanError`` when
    no valid plan exists, ``ValueError`` for malformed arguments."""
    if stages is not None and max_stages is not None:
        raise ValueError("give max_stages or stages, not both")
    if min_stage_fraction:
        def solve(cost):
            return solve_stages(cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices, microbatches,
                                max_stages=max_stages, stages=stages, idle_devices=idle_devices)
        return balanced(solve, stage_cost, min_stage_fraction)
    args = check_stage_inputs(stage_cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices, microbatches)
    cost, smem, amem, mem_limit, sizes, D, B = args
    prob = _Problem(cost, smem, amem, mem_limit, sizes, D, max_stages if stages is None else stages,
                    exact=stages is not None)
    if prob.n_max < 1 or not prob.k.size or (stages is not None and prob.n_max < stages):
        raise no_plan_error(prob.L, D, idle_devices)
    search = _Search(prob, B, idle_devices)
    search.run()
    if search.best_plan is None:
        raise no_plan_error(prob.L, D, idle_devices)
    stages = tuple(StageChoice(k, j + 1, m, c, lat) for k, j, m, s, c, lat in search.best_plan)
    return StageSolution(
        stages=stages,
        total_seconds=float(search.best_T),
        max_stage_seconds=max(st.seconds for st in stages),
        tmax_candidates=search.solves,
        devices_used=int(sum(int(sizes[st.submesh]) for st in stages)),
    )
