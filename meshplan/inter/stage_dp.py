"""Inter-operator stage dynamic program: slice layers into pipeline stages on submeshes.

The problem
-----------
``L`` layers ``0..L-1`` are cut into ``n`` contiguous stages.  Stage ``p`` (0-based, in
pipeline order) runs layers ``i..j`` on a submesh ``m`` (``submesh_sizes[m]`` devices)
with a logical-mesh choice ``k``, and takes ``t_p = stage_cost[i, j, m, k]`` seconds per
microbatch.  A plan is valid when

* the stages cover all layers in order;
* the submesh sizes add up to exactly ``num_devices`` (every device has work);
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
                        stages that use exactly d devices, every stage <= t_max and
                        memory-feasible at its position.

    F(0, L, 0) = 0;  F(0, k, d) = inf otherwise;  F(s, L, d) = inf for s >= 1
    F(s, k, d) = min over j in k..L-1, submesh m, choice c with
                     stage_cost[k, j, m, c] <= t_max  and
                     stage_mem[k, j, m, c] + s * act_mem[k, j, m, c] <= mem_limit
                 of  stage_cost[k, j, m, c] + F(s - 1, j + 1, d - size[m])

The stage that starts the suffix ``k..L-1`` of ``s`` stages is at position ``p = n - s``
of the whole pipeline, so ``n - p = s``: the memory test needs only the suffix's stage
count, which is why ``s`` is part of the state.  With ``G(t_max) = min_s F(s, 0, D;
t_max)`` (``D = num_devices``) the optimum is::

    T* = min over t_max of  G(t_max) + (B - 1) * t_max

where it suffices to try ``t_max`` in the distinct feasible stage latencies: the optimal
plan's own slowest stage is one of them, and at that value ``G`` is at most that plan's
sum.

Making it fast (every step keeps the exact optimum)
---------------------------------------------------
1. *Entries and their memory* (``_Problem``).  Only finite stages ``(k, j, m)`` on
   submeshes no larger than the cluster are kept, as flat arrays sorted by start layer.
   For each logical choice the memory test ``stage_mem + s * act_mem <= mem_limit`` holds
   on an interval of ``s`` (it is linear in ``s``), found once.  Within a solve an entry's
   latency at ``s`` is its cheapest choice that fits at ``s``: replacing any feasible
   choice by that one lowers neither the sum nor the max and touches no other stage.  No
   stage fits deeper than the largest interval end, which bounds the stage count (with
   the layers and the devices: ``min(L, D // min(size))``).
2. *Bounds by pricing devices* (``_Relaxation``).  For a price ``lam`` per device,
   ``sum t_p >= sum (t_p + lam * z_p) - lam * D`` for every plan, and the least right-hand
   side is a shortest path over layer cuts, with or without a stage count, and no device
   dimension: cheap.  The price is bisected to the best bound.  From the paths come a
   lower bound for every plan that uses a given entry as the first of ``s`` stages
   (best prefix + entry + best suffix of ``s - 1`` stages), and, from every price tried,
   a lower bound for any prefix ending before layer ``k`` on ``u`` devices (with the least
   and greatest device counts such a prefix can have).
3. *Thresholded solves* (``_min_sum``).  A solve at ``t_max`` only needs ``G(t_max)``
   when it is below a threshold (see 4): entries whose bound reaches it are dropped
   before the level they would join, and states ``(s, k, d)`` whose value plus the prefix
   bound for ``D - d`` devices reaches it are dropped after their level is computed.
   Every plan below the threshold survives both, so ``G`` and the path walk are exact
   there; above it the solve says so.  The recurrence runs level by level in ``s``, each
   level one vectorised (min, +) gather over the surviving entries and the finite window
   of device counts of the states they lead to, reduced per start layer.
4. *The search over t_max* (``_search``).  First ``t_max = inf``: the least sum ``G_inf``
   (a lower bound on every ``G``), solved below a threshold just above its price bound
   and raised until a plan shows.  Then branch and bound over intervals of candidate
   values (every entry latency between a lower bound on the least possible slowest stage
   and ``min(m_inf, (T_best - G_inf) / (B - 1))``): an interval ``[a, b]`` whose ``G`` is at
   least ``g`` cannot beat ``T_best`` once ``g + (B - 1) a >= T_best``; a solve at its middle
   ``t`` with threshold ``T_best - (B - 1) a`` either finds nothing (so nothing in
   ``[a, t]`` wins) or a plan with slowest stage ``m`` (so ``[m, t]`` holds nothing better,
   and ``G(t)`` bounds ``[a, m)``).  With one microbatch the solve at ``inf`` is the answer.

Extending it
------------
* A constraint on which stages may exist (forced cuts from user hints, forbidden
  submeshes): drop those entries in ``_Problem`` (every later step only sees entries).
* Idle devices (plans on at most ``D`` devices): the top state becomes any ``d <= D`` at
  ``k = 0`` in ``_min_sum`` (``ends``), the prefix floor's device bracket in
  ``_Relaxation.prefix_floor`` and the feasibility test in ``_bottleneck_floor`` become
  "at most ``D``", and the relaxation's price must be kept non-negative.
* Any new pruning must keep every plan below the threshold: the tests compare with the
  reference and the brute force on random tables (``tests/test_stage_dp.py``).

The unpruned DP and an exhaustive oracle are in ``meshplan.testing.stage_dp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from meshplan.errors import PlanError

__all__ = [
    "StageChoice",
    "StageSolution",
    "solve_stages",
    "plan_objective",
]


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
    tmax_candidates: int  # how many t_max values were examined (stats)


def plan_objective(seconds, microbatches: int) -> float:
    """``sum(seconds) + (microbatches - 1) * max(seconds)``, summed exactly (``math.fsum``)."""
    seconds = [float(x) for x in seconds]
    return math.fsum(seconds + [(microbatches - 1) * max(seconds)])


# --------------------------------------------------------------------------------------
# input checks shared by the solver and the brute force


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
    upper = np.triu(np.ones((L, L), dtype=bool))[:, :, None, None]
    used = np.broadcast_to(upper, cost.shape)
    if np.any(np.isnan(cost[used])) or np.any(cost[used] < 0):
        raise ValueError("stage_cost must be non-negative seconds or inf (no NaN)")
    if np.any(np.isnan(smem[used])) or np.any(np.isnan(amem[used])):
        raise ValueError("stage_mem and act_mem must not contain NaN")
    # j < i entries are ignored: make them infeasible so no code path can pick them.
    cost = np.where(used, cost, np.inf)
    return cost, smem, amem, float(mem_limit), sizes.astype(np.int64), int(num_devices), int(microbatches)


def max_stage_count(L: int, sizes: np.ndarray, num_devices: int, max_stages: int | None = None) -> int:
    """Upper bound on the number of stages: one layer and ``min(size)`` devices each."""
    n = min(L, num_devices // int(sizes.min()))
    if max_stages is not None:
        if int(max_stages) != max_stages or max_stages < 1:
            raise ValueError(f"max_stages must be a positive integer, got {max_stages!r}")
        n = min(n, int(max_stages))
    return n


# --------------------------------------------------------------------------------------
# the instance: stage entries and the suffix stage counts at which each one fits


def _fit_range(smem, amem, mem_limit, n):
    """For each (entry, choice): the suffix stage counts ``s`` in ``1..n`` at which
    ``smem + s * amem <= mem_limit`` holds, as an interval ``[lo, hi]`` (empty when
    ``lo > hi``).  The test is evaluated exactly as written (as the reference does);
    ``smem + s * amem`` rounds monotonically in ``s``, so its true set is an interval,
    found by bisection where the two ends disagree."""

    def fits(s):
        with np.errstate(invalid="ignore", over="ignore"):
            return smem + s * amem <= mem_limit

    first, last = fits(1), fits(n)
    lo = np.where(first | last, 1, n + 1).astype(np.int64)
    hi = np.where(first | last, n, 0).astype(np.int64)
    for falling in (True, False):   # fits only at small s (amem > 0), or only at large s
        where = np.nonzero(first & ~last if falling else ~first & last)
        if not where[0].size:
            continue
        a = np.ones(where[0].shape, dtype=np.int64) if falling else np.ones(where[0].shape, dtype=np.int64)
        b = np.full(where[0].shape, n, dtype=np.int64)
        sm, am = smem[where], amem[where]
        # invariant: the answer is in (a, b] for "falling" (last fitting s: fits(a), not fits(b)),
        # in (a, b] for "rising" (first fitting s: not fits(a), fits(b))
        while np.any(b - a > 1):
            mid = (a + b) // 2
            with np.errstate(invalid="ignore", over="ignore"):
                ok = sm + mid * am <= mem_limit
            if falling:
                a, b = np.where(ok, mid, a), np.where(ok, b, mid)
            else:
                a, b = np.where(ok, a, mid), np.where(ok, mid, b)
        if falling:
            lo[where], hi[where] = 1, a
        else:
            lo[where], hi[where] = b, n
    return lo, hi


class _Problem:
    """The stage entries of one instance, shared by every ``t_max`` solve.

    An *entry* is a stage ``(k, j, m)``: layers ``k..j`` on submesh ``m``.  It keeps its
    ``K`` logical choices' latencies and, per choice, the interval of suffix stage counts
    ``s`` at which the choice fits in memory.  Within one solve, the entry's latency as the
    first stage of a suffix of ``s`` stages is its cheapest choice that fits at ``s`` (and
    is ``<= t_max``): replacing any feasible choice by that one lowers neither the sum nor
    the maximum and touches no other stage, so nothing optimal is lost.
    """

    def __init__(self, cost, smem, amem, mem_limit, sizes, num_devices, max_stages=None):
        L = cost.shape[0]
        self.L, self.D = L, num_devices
        self.sizes = sizes
        n = max_stage_count(L, sizes, num_devices, max_stages)
        k, j, m = np.nonzero(np.isfinite(cost).any(axis=-1))      # upper triangle only (see checks)
        inside = sizes[m] <= num_devices
        k, j, m = k[inside], j[inside], m[inside]
        lo, hi = _fit_range(smem[k, j, m], amem[k, j, m], mem_limit, n)
        choice_cost = np.where(lo <= hi, cost[k, j, m], np.inf)
        usable = np.isfinite(choice_cost).any(axis=-1)
        order = np.lexsort((j[usable], m[usable], k[usable]))       # by start, then submesh, then end
        self.k, self.j, self.m = k[usable][order], j[usable][order], m[usable][order]
        self.cost, self.lo, self.hi = choice_cost[usable][order], lo[usable][order], hi[usable][order]
        self.z = sizes[self.m].astype(np.int64)
        # Memory bounds the stage count: no stage fits as the first of a deeper suffix.
        self.n_max = min(n, int(self.hi.max(initial=0)))
        # The least latency of each entry over its choices and suffix counts: a lower bound
        # on it in any plan, used by the relaxations.
        self.relaxed = self.cost.min(axis=-1)

    def at_count(self, index, s, t_max):
        """(latency, logical choice) of entries ``index`` as first stage of ``s`` stages, <= t_max."""
        fits = (self.lo[index] <= s) & (s <= self.hi[index]) & (self.cost[index] <= t_max)
        masked = np.where(fits, self.cost[index], np.inf)
        arg = masked.argmin(axis=-1)
        return np.take_along_axis(masked, arg[:, None], axis=-1)[:, 0], arg

    def candidates_below(self, bound):
        """The largest entry latency (any choice) strictly below ``bound``, or None."""
        below = self.cost[self.cost < bound]
        return float(below.max()) if below.size else None


# --------------------------------------------------------------------------------------
# lower bounds: devices priced instead of counted


class _Relaxation:
    """Lower bounds for the solve at one ``t_max`` by Lagrangian relaxation of the device
    count: give each device a price ``lam`` and drop the constraint ``sum of devices = D``.
    For any ``lam`` and any plan, ``sum t_p >= sum (t_p + lam * z_p) - lam * D``, and the
    right side's least value over plans is a shortest path over layer cuts (no device
    dimension).  Memory is relaxed too (each entry at its least latency).  Gives:

    * ``bound``: a lower bound on ``G(t_max)``, the best over the prices tried;
    * ``entry_bound(index, s, lat)``: a lower bound on the sum of any plan that uses an
      entry as the first stage of a suffix of ``s`` stages (prefix + entry + suffix);
    * ``prefix_floor``: for each start layer ``k`` and prefix device count ``u``, a lower
      bound on any prefix covering layers ``0..k-1`` on ``u`` devices (the best over all
      prices tried, and ``inf`` where no prefix has that many devices).
    """

    def __init__(self, prob: _Problem, t_max: float):
        L, D = prob.L, prob.D
        self.prob, self.D = prob, D
        allowed = prob.relaxed <= t_max
        self.R = np.full((L, L, len(prob.sizes)), np.inf)
        self.R[prob.k[allowed], prob.j[allowed], prob.m[allowed]] = prob.relaxed[allowed]
        self.zs = prob.sizes.astype(np.float64)
        usable = np.isfinite(self.R)
        zmin = np.where(usable, self.zs, np.inf).min(axis=-1)
        zmax = np.where(usable, self.zs, -np.inf).max(axis=-1)
        self.pre_min, self.pre_max = _prefix_path(zmin, np.minimum), _prefix_path(zmax, np.maximum)
        self.feasible = self.pre_min[L] <= D <= self.pre_max[L]
        self.prices: list[tuple[float, np.ndarray]] = []   # (lam, prefix path costs)
        self.lam, self.bound = 0.0, -np.inf
        if self.feasible:
            self._search_price()

    def _priced(self, lam):
        V = self.R + lam * self.zs
        arg = V.argmin(axis=-1)
        W = np.take_along_axis(V, arg[..., None], axis=-1)[..., 0]
        return W, self.zs[arg]

    def _try(self, lam):
        """The relaxed optimum at price ``lam``: its bound and its device count."""
        W, Zw = self._priced(lam)
        L = self.prob.L
        P = np.full(L + 1, np.inf)
        Z = np.zeros(L + 1)
        P[0] = 0.0
        for stop in range(1, L + 1):
            vals = P[:stop] + W[:stop, stop - 1]
            i = int(np.argmin(vals))
            P[stop], Z[stop] = vals[i], Z[i] + Zw[i, stop - 1]
        self.prices.append((lam, P))
        value = P[L] - lam * self.D
        if value > self.bound:
            self.bound, self.lam = value, lam
        return Z[L]

    def _search_price(self, iterations: int = 24):
        """Bisection on the price for the relaxed optimum's device count to cross ``D``
        (the bound is concave in the price; its best is where the count crosses)."""
        finite = self.R[np.isfinite(self.R)]
        scale = max(float(np.median(finite)) / max(self.D, 1), 1e-300) if finite.size else 1.0
        z0 = self._try(0.0)
        if z0 == self.D:
            return
        sign = 1.0 if z0 > self.D else -1.0    # too many devices: make them dearer
        inner, outer = 0.0, sign * scale
        for _ in range(60):
            z = self._try(outer)
            if (z <= self.D) if sign > 0 else (z >= self.D):
                break
            inner, outer = outer, outer * 4
        else:
            return
        for _ in range(iterations):
            mid = 0.5 * (inner + outer)
            z = self._try(mid)
            if z == self.D:
                return
            if (z > self.D) == (sign > 0):
                inner = mid
            else:
                outer = mid

    def prefix_at_best(self):
        """The priced prefix sums (``[k]``, layers ``0..k-1``) at the best price."""
        return next(P for lam, P in self.prices if lam == self.lam)

    def suffix_counts(self, n):
        """``H[s, k]``: the least priced sum of a suffix from layer ``k`` of exactly ``s`` stages."""
        W, _ = self._priced(self.lam)
        L = self.prob.L
        H = np.full((n + 1, L + 1), np.inf)
        H[0, L] = 0.0
        for s in range(1, n + 1):
            H[s, :L] = (W + H[s - 1, 1:][None, :]).min(axis=1)
        return H

    def prefix_floor(self):
        """``floor[k, u]``: lower bound on any prefix over layers ``0..k-1`` on ``u`` devices."""
        L, D = self.prob.L, self.D
        u = np.arange(D + 1, dtype=np.float64)
        floor = np.full((L + 1, D + 1), -np.inf)
        for lam, P in self.prices:
            floor = np.maximum(floor, P[:, None] - lam * u[None, :])
        floor[(u[None, :] < self.pre_min[:, None]) | (u[None, :] > self.pre_max[:, None])] = np.inf
        return floor


def _prefix_path(weights, better):
    """``best[k]``: the best (``np.minimum`` or ``np.maximum``) sum of ``weights[i, j]`` over
    cuts of layers ``0..k-1`` into ranges (``weights`` is ``(L, L)``, non-finite where
    unusable)."""
    L = weights.shape[0]
    worst = np.inf if better is np.minimum else -np.inf
    best = np.full(L + 1, worst)
    best[0] = 0.0
    for stop in range(1, L + 1):
        vals = best[:stop] + weights[:stop, stop - 1]
        vals = vals[np.isfinite(vals)]
        if vals.size:
            best[stop] = vals.min() if better is np.minimum else vals.max()
    return best


def _bottleneck_floor(prob: _Problem) -> float:
    """A lower bound on the least possible slowest stage: the least entry latency ``t``
    at which the layers can be covered by stages ``<= t`` whose least and greatest device
    counts bracket ``D`` (bisection over the distinct latencies)."""
    values = np.unique(prob.relaxed)
    L, D = prob.L, prob.D
    zs = prob.sizes.astype(np.float64)

    def possible(t):
        allowed = prob.relaxed <= t
        zmin = np.full((L, L), np.inf)
        zmax = np.full((L, L), -np.inf)
        np.minimum.at(zmin, (prob.k[allowed], prob.j[allowed]), zs[prob.m[allowed]])
        np.maximum.at(zmax, (prob.k[allowed], prob.j[allowed]), zs[prob.m[allowed]])
        return _prefix_path(zmin, np.minimum)[L] <= D <= _prefix_path(zmax, np.maximum)[L]

    lo, hi = 0, len(values) - 1
    if hi < 0 or not possible(values[hi]):
        return np.inf
    while lo < hi:
        mid = (lo + hi) // 2
        if possible(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo])


# --------------------------------------------------------------------------------------
# one solve: the least sum at a fixed t_max, below a threshold


def _slack(x):
    """Room for rounding when a bound is compared with a threshold: pruning must never
    drop a plan whose true sum is below the threshold."""
    return 1e-9 * abs(x) + 1e-300


def _min_sum(prob: _Problem, t_max: float, threshold: float, relax: _Relaxation):
    """``G(t_max)`` and a plan achieving it, if ``G(t_max) < threshold``; else (inf, None).

    The recurrence of the module docstring over ``F[s, k, d]``, level by level in ``s``,
    on the entries no bound rules out: an entry whose ``entry_bound`` reaches the
    threshold cannot be part of a plan below it, and neither can a state ``(s, k, d)``
    whose value plus the prefix floor for ``D - d`` devices reaches it.  Every plan below
    the threshold survives both tests, so its value (and the path walk, which only
    follows equalities) is the same as without them.
    """
    L, D, n = prob.L, prob.D, prob.n_max
    if not relax.feasible or relax.bound > threshold + _slack(threshold):
        return np.inf, None
    limit = threshold + _slack(threshold)
    H = relax.suffix_counts(n)                 # [s, k]: priced suffix of s stages from layer k
    floor = relax.prefix_floor()               # [k, u]: any prefix over layers 0..k-1 on u devices
    lam, P = relax.lam, relax.prefix_at_best()  # the best price, and its priced prefixes [k]
    # Entries allowed at this t_max whose relaxed bound (least over suffix counts) is below.
    best_tail = H[:-1].min(axis=0)            # least H[s - 1, j + 1] over s, per next start
    base = np.nonzero(prob.relaxed <= t_max)[0]
    base = base[P[prob.k[base]] + prob.relaxed[base] + lam * prob.z[base] + best_tail[prob.j[base] + 1]
                - lam * D <= limit]
    F = np.full((n + 1, L + 1, D + 1), np.inf)
    F[0, L, 0] = 0.0
    reach_lo = np.full((n + 1, L + 1), D + 1, dtype=np.int64)   # finite d window of F[s, k]
    reach_hi = np.full((n + 1, L + 1), -1, dtype=np.int64)
    reach_lo[0, L] = reach_hi[0, L] = 0
    levels: list = [None]
    for s in range(1, n + 1):
        e = base[(prob.k[base] <= L - s) & (prob.j[base] <= L - s)]
        e = e[reach_hi[s - 1, prob.j[e] + 1] >= 0]
        lat, arg = prob.at_count(e, s, t_max)
        keep = np.isfinite(lat)
        keep &= P[prob.k[e]] + lat + lam * prob.z[e] + H[s - 1, prob.j[e] + 1] - lam * D <= limit
        e, lat, arg = e[keep], lat[keep], arg[keep]
        levels.append((e, lat, arg))
        if not e.size:
            break
        k, nxt, z = prob.k[e], prob.j[e] + 1, prob.z[e]
        a = reach_lo[s - 1, nxt] + z                       # output window of each entry
        b = np.minimum(reach_hi[s - 1, nxt] + z, D)
        ok = a <= b
        e, lat, k, nxt, z, a, b = e[ok], lat[ok], k[ok], nxt[ok], z[ok], a[ok], b[ok]
        if not e.size:
            break
        lo_d, hi_d = int(a.min()), int(b.max())
        d = np.arange(lo_d, hi_d + 1)
        src = d[None, :] - z[:, None]                       # (E, W) columns of F[s - 1, nxt]
        valid = (src >= 0)
        vals = F[s - 1][nxt[:, None], np.where(valid, src, 0)]
        vals = np.where(valid, vals, np.inf) + lat[:, None]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])   # entries are sorted by k
        best = np.minimum.reduceat(vals, starts, axis=0)
        F[s, k[starts], lo_d:hi_d + 1] = best
        # states that cannot be completed below the threshold by any prefix
        level = F[s]
        level[level + floor[:, ::-1] > limit] = np.inf
        finite = np.isfinite(level)
        rows = finite.any(axis=1)
        if not rows.any():
            break
        reach_lo[s, rows] = finite[rows].argmax(axis=1)
        reach_hi[s, rows] = D - finite[rows, ::-1].argmax(axis=1)
    ends = F[1:, 0, D]
    if not ends.size or not np.isfinite(ends.min()) or ends.min() > limit:
        return np.inf, None
    s = int(np.argmin(ends)) + 1
    G = float(ends[s - 1])
    return G, _walk(prob, F, levels, s)


def _walk(prob: _Problem, F, levels, s):
    """Follow one argmin path from ``(s, 0, D)``: at each state the first entry (by
    submesh, then end layer) whose latency plus the next state's value is the state's
    value.  Returns [(k, j, m, s, logical, latency)]."""
    k, d, path = 0, prob.D, []
    while s > 0:
        e, lat, arg = levels[s]
        here = np.nonzero(prob.k[e] == k)[0]
        target = F[s, k, d]
        found = None
        for x in here:       # sorted by submesh, then end layer
            idx = e[x]
            rest = d - prob.z[idx]
            if rest >= 0 and lat[x] + F[s - 1, prob.j[idx] + 1, rest] == target:
                found = (k, int(prob.j[idx]), int(prob.m[idx]), s, int(arg[x]), float(lat[x]))
                break
        assert found is not None, "internal error: DP path not found"
        path.append(found)
        k, d, s = found[1] + 1, d - int(prob.z[idx]), s - 1
    assert k == prob.L and d == 0
    return path


def no_plan_error(L, num_devices):
    return PlanError(
        f"no feasible stage plan: {L} layers cannot be sliced onto exactly {num_devices} devices "
        "within the memory limit"
    )


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
) -> StageSolution:
    """Optimal pipeline slicing (see the module docstring for the recurrence and prunings).

    ``max_stages`` optionally caps the number of stages.  Raises ``PlanError`` when no
    valid plan exists, ``ValueError`` for malformed arguments.
    """
    args = check_stage_inputs(stage_cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices, microbatches)
    cost, smem, amem, mem_limit, sizes, D, B = args
    prob = _Problem(cost, smem, amem, mem_limit, sizes, D, max_stages)
    return _search(prob, B)


def _search(prob: _Problem, B: int) -> StageSolution:
    """The search over ``t_max`` (module docstring, "the search"): branch and bound over
    intervals of candidate values.

    ``T* = min over t of G(t) + (B - 1) t`` over the candidates ``t`` (every entry
    latency).  For an interval ``[a, b]`` of candidates whose ``G`` is known to be at
    least ``g`` (the value at a solved point to its right), every objective in it is at
    least ``g + (B - 1) a``: the interval is dropped when that reaches ``best_T``.  A
    solve at ``t`` below the threshold ``best_T - (B - 1) a`` either finds no plan (then
    nothing in ``[a, t]`` can win) or a plan with sum ``G(t)`` and slowest stage ``m``
    (then ``[m, t]`` has the same ``G`` and no better objective than that plan, and
    ``G(t)`` bounds ``[a, m)``).  Intervals are taken least bound first.
    """
    import heapq

    examined = 0
    best_T, best_plan = np.inf, None

    def consider(plan):
        nonlocal best_T, best_plan
        secs = [lat for *_, lat in plan]
        T = plan_objective(secs, B)
        if T < best_T:
            best_T, best_plan = T, plan
        return max(secs)

    if prob.n_max < 1 or not prob.k.size:
        raise no_plan_error(prob.L, prob.D)
    # t_max = inf: the least sum G_inf, a lower bound on every G(t_max).  Solved below a
    # threshold a little above its relaxation bound, raised until a plan shows.
    relax = _Relaxation(prob, np.inf)
    if not relax.feasible:
        raise no_plan_error(prob.L, prob.D)
    gap = max(1e-3 * abs(relax.bound), 1e-12)
    while True:
        threshold = relax.bound + gap if gap < 1e3 * (abs(relax.bound) + 1e-12) else np.inf
        G_inf, plan = _min_sum(prob, np.inf, threshold, relax)
        examined += 1
        if plan is not None:
            break
        if threshold == np.inf:
            raise no_plan_error(prob.L, prob.D)
        gap *= 16
    m_inf = consider(plan)
    if B > 1:
        t_lo = _bottleneck_floor(prob)
        top = min(m_inf, (best_T - G_inf) / (B - 1))           # candidates at or above cannot win
        values = prob.cost[(prob.cost >= t_lo) & (prob.cost < top)]
        cands = np.unique(values)
        heap = [(G_inf + (B - 1) * float(cands[0]), 0, len(cands) - 1, G_inf)] if cands.size else []
        while heap:
            bound, lo, hi, g = heapq.heappop(heap)
            if bound >= best_T or lo > hi:
                continue
            a = float(cands[lo])
            if g + (B - 1) * a >= best_T:
                continue
            mid = (lo + hi + 1) // 2
            t = float(cands[mid])
            G_t, plan = _min_sum(prob, t, best_T - (B - 1) * a, _Relaxation(prob, t))
            examined += 1
            if plan is None:            # G(t) reaches the threshold: nothing in [a, t] wins
                if mid + 1 <= hi:
                    heapq.heappush(heap, (g + (B - 1) * float(cands[mid + 1]), mid + 1, hi, g))
                continue
            m_t = consider(plan)
            below = int(np.searchsorted(cands, m_t, side="left")) - 1     # largest candidate < m_t
            if lo <= below:
                heapq.heappush(heap, (G_t + (B - 1) * a, lo, below, G_t))
            if mid + 1 <= hi:
                heapq.heappush(heap, (g + (B - 1) * float(cands[mid + 1]), mid + 1, hi, g))
    stages = tuple(StageChoice(k, j + 1, m, c, lat) for k, j, m, s, c, lat in best_plan)
    return StageSolution(
        stages=stages,
        total_seconds=float(best_T),
        max_stage_seconds=max(st.seconds for st in stages),
        tmax_candidates=examined,
    )
