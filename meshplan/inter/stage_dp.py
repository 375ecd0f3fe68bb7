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
1. *Collapse the logical choices and the memory test* (``_collapse``).  For a stage
   ``(i, j, m)`` that is first of a suffix of ``s`` stages, replacing any feasible
   logical choice by the cheapest memory-feasible one lowers neither the sum nor the max
   and affects no other stage, so some optimal plan uses only cheapest choices.  We
   precompute ``best[s, i, j, m]`` and its argmin once per instance, removing the ``K``
   axis and the memory test from every DP solve.
2. *Vectorise.*  For a fixed ``s`` the recurrence is a (min, +) product over ``j`` between
   the ``(k, j)`` latency table of each submesh and the previous level shifted by that
   submesh's size along ``d``; one numpy broadcast computes all ``(k, d)`` at once.  Level
   ``s`` only needs starts and ends ``<= L - s`` (the other ``s - 1`` stages need a layer
   each), and once a level is entirely infeasible so are all deeper ones.  At most
   ``min(L, num_devices // min(size))`` stages are possible.
3. *Candidate set.*  Only distinct values of the collapsed table are candidates: the
   feasible set changes nowhere else, and by 1. some optimal plan has its slowest stage
   equal to one of them.  None below the bottleneck ``t_lo`` (the least possible slowest
   stage, from one (min, max) pass of the same recurrence) admits a plan.
4. *Bounds and descent over t_max* (``_solve``).  ``G`` is non-increasing in ``t_max``.
   We solve at ``t_max = inf`` (giving ``G_inf``, a lower bound on every ``G``) and at
   ``t_lo``, then walk the candidates downwards.  After solving at ``t`` and getting a
   plan with sum ``G(t)`` and slowest stage ``m <= t``:

   * every ``t'`` in ``[m, t]`` has ``G(t') = G(t)`` (the plan is feasible there and ``G``
     cannot go lower than at the larger ``t``), so its objective is at least the plan's:
     skip to below ``m``;
   * every ``t' < t`` has ``G(t') >= G(t)``, so it can only beat the best objective found
     so far, ``T_best``, if ``G(t) + (B - 1) t' < T_best``: skip to below
     ``(T_best - G(t)) / (B - 1)``.  Before the descent the same test with ``G_inf``
     discards everything from ``(T_best - G_inf) / (B - 1)`` upwards (a sharper form of
     "stop once ``(B - 1) t_max >= T_best``").

   The walk stops when the bound falls to ``t_lo``.  It solves at most one ``t_max`` per
   distinct value of ``G`` in the range that can still win, typically a handful.  With
   one microbatch (``B = 1``) the single solve at ``inf`` is the answer.
5. *Shared work.*  The collapsed tables, their argmins and the candidate list are built
   once and reused by every solve; each solve only masks the table by ``t_max``.

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
# pruning 1: collapse logical choices and the memory test


def _collapse(cost, smem, amem, mem_limit, n_max):
    """Return ``best[s, i, j, m]`` and ``arg[s, i, j, m]`` for ``s = 0..n_max``.

    ``best[s, i, j, m]`` is the least latency over logical choices of stage ``i..j`` on
    submesh ``m`` that fit in memory as the first stage of a suffix of ``s`` stages
    (``stage_mem + s * act_mem <= mem_limit``); ``inf`` when none does.  ``arg`` is that
    choice.  Row ``s = 0`` is unused and all ``inf``.  Replacing any feasible choice by the
    cheapest one never makes a plan worse (sum and max both only go down) nor infeasible
    (the choice of one stage does not affect the others), so this loses no optimum.
    """
    L, _, S, K = cost.shape
    best = np.full((n_max + 1, L, L, S), np.inf)
    arg = np.zeros((n_max + 1, L, L, S), dtype=np.int64)
    for s in range(1, n_max + 1):
        with np.errstate(invalid="ignore"):  # inf - inf style corner cases are infeasible
            fits = smem + s * amem <= mem_limit
        masked = np.where(fits, cost, np.inf)
        a = masked.argmin(axis=-1)
        arg[s] = a
        best[s] = np.take_along_axis(masked, a[..., None], axis=-1)[..., 0]
    return best, arg


# --------------------------------------------------------------------------------------
# pruning 2: vectorised level-by-level recurrence


def _levels(table, sizes, num_devices, combine):
    """Run the recurrence for every stage count on a collapsed ``table[s, k, j, m]``.

    ``combine`` is ``np.add`` (least sum, ``F``) or ``np.maximum`` (least bottleneck).
    Returns ``V[s, k, d]`` for ``s = 0..n_max``, ``k = 0..L``, ``d = 0..num_devices``.
    For level ``s`` only starts ``k <= L - s`` and ends ``j <= L - s`` can lead to a
    complete plan, so the (min, combine) product is restricted to that square.
    """
    n_max, L, _, S = table.shape[0] - 1, table.shape[1], table.shape[2], table.shape[3]
    D = num_devices
    base = 0.0 if combine is np.add else -np.inf
    V = np.full((n_max + 1, L + 1, D + 1), np.inf)
    V[0, L, 0] = base
    for s in range(1, n_max + 1):
        hi = L - s  # last admissible start k and end j
        if hi < 0:
            break
        prev = V[s - 1, 1 : hi + 2]  # next start j + 1 for j = 0..hi: shape (hi+1, D+1)
        if not (prev < np.inf).any():
            break  # every deeper level is infeasible too
        shifted = np.full((S, hi + 1, D + 1), np.inf)
        for m, z in enumerate(sizes):
            if z <= D:
                shifted[m, :, z:] = prev[:, : D + 1 - z]
        # (m, k, j, 1) with (m, 1, j, d) -> reduce over m and j
        lat = np.moveaxis(table[s, : hi + 1, : hi + 1, :], -1, 0)[:, :, :, None]
        cand = combine(lat, shifted[:, None, :, :])
        V[s, : hi + 1] = cand.min(axis=(0, 2))
    return V


def _reconstruct(F, table, sizes, num_devices, s):
    """Follow one argmin path of ``F`` from ``(s, 0, D)``; returns [(k, j, m), ...]."""
    L = table.shape[1]
    k, d, path = 0, num_devices, []
    while s > 0:
        target = F[s, k, d]
        best = None
        for m, z in enumerate(sizes):
            if z > d:
                continue
            vals = table[s, k, k:L, m] + F[s - 1, k + 1 : L + 1, d - z]
            jj = int(np.argmin(vals))
            if vals[jj] == target:
                best = (k, k + jj, m)
                break
        assert best is not None, "internal error: DP path not found"
        path.append(best)
        k, d, s = best[1] + 1, d - sizes[best[2]], s - 1
    assert k == L and d == 0
    return path


class _Problem:
    """Collapsed tables shared by all ``t_max`` solves of one instance."""

    def __init__(self, cost, smem, amem, mem_limit, sizes, num_devices, max_stages=None):
        self.L = cost.shape[0]
        self.sizes = sizes
        self.D = num_devices
        self.n_max = max_stage_count(self.L, sizes, num_devices, max_stages)
        self.best, self.arg = _collapse(cost, smem, amem, mem_limit, self.n_max)

    def min_sum(self, t_max):
        """Solve ``F`` for one ``t_max``: (G, plan as (k, j, m, s) list) or (inf, None)."""
        table = self.best if t_max == np.inf else np.where(self.best <= t_max, self.best, np.inf)
        F = _levels(table, self.sizes, self.D, np.add)
        ends = F[:, 0, self.D]
        s = int(np.argmin(ends))
        if not np.isfinite(ends[s]):
            return np.inf, None
        path = _reconstruct(F, table, self.sizes, self.D, s)
        return float(ends[s]), [(k, j, m, s - p) for p, (k, j, m) in enumerate(path)]

    def bottleneck(self):
        """Least possible slowest stage over all valid plans (``inf`` if none)."""
        V = _levels(self.best, self.sizes, self.D, np.maximum)
        return float(V[:, 0, self.D].min())

    def choices(self, plan):
        return tuple(
            StageChoice(k, j + 1, m, int(self.arg[s, k, j, m]), float(self.best[s, k, j, m]))
            for k, j, m, s in plan
        )

    def candidates(self):
        vals = self.best[1:][np.isfinite(self.best[1:])]
        return np.unique(vals)


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
    return _solve(prob, B)


def _solve(prob: _Problem, B: int) -> StageSolution:
    """The pruned search over ``t_max`` (module docstring, point 4).

    Invariants: ``best_T`` is the objective of a real plan (``best_plan``); every
    ``t_max`` not yet solved and not below ``t_lo`` that could give an objective below
    ``best_T`` is ``< bound``.
    """
    examined = 0
    best_T, best_plan = np.inf, None

    def consider(plan):
        nonlocal best_T, best_plan
        secs = [float(prob.best[s, k, j, m]) for k, j, m, s in plan]
        T = plan_objective(secs, B)
        if T < best_T:
            best_T, best_plan = T, plan
        return max(secs)

    # t_max = inf: the unconstrained least sum G_inf, a lower bound on every G(t_max).
    G_inf, plan = prob.min_sum(np.inf)
    examined += 1
    if plan is None:
        raise no_plan_error(prob.L, prob.D)
    m_inf = consider(plan)
    if B > 1:
        # The least possible slowest stage: no t_max below it admits a plan.
        t_lo = prob.bottleneck()
        cands = prob.candidates()
        # t >= m_inf gives G = G_inf and T >= the plan above; G(t) >= G_inf for all t.
        bound = min(m_inf, (best_T - G_inf) / (B - 1))
        if t_lo < bound:
            _, plan = prob.min_sum(t_lo)
            examined += 1
            consider(plan)
            bound = min(bound, (best_T - G_inf) / (B - 1))
        # Descent over candidates in (t_lo, bound).
        while bound > t_lo:
            idx = int(np.searchsorted(cands, bound, side="left")) - 1  # largest cand < bound
            if idx < 0 or cands[idx] <= t_lo:
                break
            t = float(cands[idx])
            G_t, plan = prob.min_sum(t)
            examined += 1
            assert plan is not None, "internal error: no plan above the bottleneck"  # t > t_lo
            m_t = consider(plan)
            bound = min(m_t, (best_T - G_t) / (B - 1))
    stages = prob.choices(best_plan)
    return StageSolution(
        stages=stages,
        total_seconds=float(best_T),
        max_stage_seconds=max(st.seconds for st in stages),
        tmax_candidates=examined,
    )
