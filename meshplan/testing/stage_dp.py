"""Oracles of the stage DP (``meshplan.inter.stage_dp``): ``reference_stages``, the DP
without the fast path's prunings (every candidate t_max, for the benchmark's --check and
medium-sized tests), and ``brute_force_stages``, which enumerates every plan (small inputs
only)."""

from __future__ import annotations

import numpy as np

from meshplan.inter.stage_dp import (StageChoice, StageSolution, balanced, check_stage_inputs, max_stage_count,
                                     no_plan_error, plan_objective)


# --------------------------------------------------------------------------------------
# slow reference (for the benchmark's --check and medium-sized tests)


def reference_stages(stage_cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices, microbatches, *,
                     max_stages: int | None = None, stages: int | None = None, full: bool = False,
                     idle_devices: bool = False, min_stage_fraction: float = 0.0) -> StageSolution:
    """The recurrence without the prunings of ``solve_stages``: a slow independent check.
    ``min_stage_fraction`` applies the small-stage rule around it as ``solve_stages`` does
    (``stage_dp.balanced``), so the two agree round by round.

    Written separately from the fast path (its own DP loop and path walk).  Candidates
    are all distinct finite values of the raw ``stage_cost`` (not of the collapsed
    table), tried in increasing order; each DP keeps the logical choices and the memory
    test inside the recurrence (no precomputed collapse, no bottleneck pass, no descent).

    ``full=True``: try every candidate, stopping only once ``(B - 1) * t_max >= T_best``
    (valid because latencies are non-negative, so ``G >= 0``).  Minutes at 32 x 32.

    ``full=False`` (default) adds two obviously safe shortcuts: a binary search for the
    least candidate that admits any plan (feasibility is monotone in ``t_max``), and the
    stop rule ``G(inf) + (B - 1) * t_max >= T_best`` (``G`` never drops below ``G(inf)``).
    ``tmax_candidates`` counts the DP solves.
    """
    if min_stage_fraction:
        return balanced(lambda cost: reference_stages(cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices,
                                                      microbatches, max_stages=max_stages, stages=stages, full=full,
                                                      idle_devices=idle_devices),
                        stage_cost, min_stage_fraction)
    args = check_stage_inputs(stage_cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices, microbatches)
    cost, smem, amem, mem_limit, sizes, D, B = args
    L, _, S, K = cost.shape
    n_max = max_stage_count(L, sizes, D, max_stages if stages is None else stages)
    if stages is not None and n_max < stages:
        raise no_plan_error(L, D, idle_devices)
    fits = [None] + [smem + s * amem <= mem_limit for s in range(1, n_max + 1)]  # (i, j, m, c) each
    solves = 0

    def dp(t):
        """Least sum at ``t_max = t``: returns (G, plan as [(i, j, m, c)]) or (inf, None)."""
        nonlocal solves
        solves += 1
        allowed = cost <= t
        F = np.full((n_max + 1, L + 1, D + 1), np.inf)
        F[0, L, 0] = 0.0
        lats = [None]
        for s in range(1, n_max + 1):
            lat = np.where(fits[s] & allowed, cost, np.inf).min(axis=-1)  # (k, j, m)
            lats.append(lat)
            # shifted[x, m, d] = F[s - 1, x, d - size[m]]
            shifted = np.full((L + 1, S, D + 1), np.inf)
            for m in range(S):
                z = int(sizes[m])
                if z <= D:
                    shifted[:, m, z:] = F[s - 1, :, : D + 1 - z]
            for k in range(L - 1, -1, -1):
                vals = lat[k, k:, :, None] + shifted[k + 1 :]  # (j, m, d)
                F[s, k] = vals.min(axis=(0, 1))
        if idle_devices:   # the fewest devices among the best ends of each stage count
            ends = F[:, 0, :].min(axis=1)
            ends_d = F[:, 0, :].argmin(axis=1)
        else:
            ends = F[:, 0, D]
            ends_d = np.full(ends.shape, D)
        if stages is not None:   # plans of exactly that many stages only
            ends = np.where(np.arange(ends.size) == stages, ends, np.inf)
        n = int(np.argmin(ends))
        if not np.isfinite(ends[n]):
            return np.inf, None
        plan, k, d = [], 0, int(ends_d[n])
        for s in range(n, 0, -1):
            found = None
            for j in range(k, L):
                for m in range(S):
                    z = int(sizes[m])
                    if z <= d and lats[s][k, j, m] + F[s - 1, j + 1, d - z] == F[s, k, d]:
                        c = int(np.argmin(np.where(fits[s][k, j, m] & allowed[k, j, m], cost[k, j, m], np.inf)))
                        found = (k, j, m, c)
                        break
                if found:
                    break
            assert found is not None, "internal error: reference DP path not found"
            plan.append(found)
            k, d = found[1] + 1, d - int(sizes[found[2]])
        return float(ends[n]), plan

    values = np.unique(cost[np.isfinite(cost)])
    G_inf, plan = dp(np.inf)
    if plan is None:
        raise no_plan_error(L, D, idle_devices)
    best_T, best_plan = plan_objective([cost[st] for st in plan], B), plan
    if B > 1:
        first = 0
        if not full:
            lo, hi = 0, len(values) - 1  # values[-1] admits every stage, so it is feasible
            while lo < hi:
                mid = (lo + hi) // 2
                if dp(values[mid])[1] is None:
                    lo = mid + 1
                else:
                    hi = mid
            first = lo
        floor = 0.0 if full else G_inf
        for t in values[first:]:
            if floor + (B - 1) * t >= best_T:
                break
            G, plan = dp(t)
            if plan is None:
                continue
            T = plan_objective([cost[st] for st in plan], B)
            if T < best_T:
                best_T, best_plan = T, plan
    stages = tuple(StageChoice(i, j + 1, m, c, float(cost[i, j, m, c])) for i, j, m, c in best_plan)
    return StageSolution(
        stages=stages,
        total_seconds=float(best_T),
        max_stage_seconds=max(st.seconds for st in stages),
        tmax_candidates=solves,
    )


# --------------------------------------------------------------------------------------
# test oracle


def brute_force_stages(stage_cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices, microbatches, *,
                       max_stages: int | None = None, stages: int | None = None, idle_devices: bool = False,
                       min_stage_fraction: float = 0.0) -> StageSolution:
    """Enumerate every valid plan and return the best (for tests; exponential).
    ``min_stage_fraction``: the best among the plans whose every stage takes at least that
    fraction of their slowest one, exactly (no such plan: no plan). ``stages``: plans of
    exactly that many stages only.

    Recursively chooses each stage's end layer, submesh and logical choice, abandoning a
    branch only when its devices already exceed ``num_devices``; a complete plan is kept
    when it uses exactly ``num_devices`` and every stage passes the memory test for its
    position.  ``tmax_candidates`` is the number of complete valid plans seen.
    """
    args = check_stage_inputs(stage_cost, stage_mem, act_mem, mem_limit, submesh_sizes, num_devices, microbatches)
    cost, smem, amem, mem_limit, sizes, D, B = args
    L, _, S, K = cost.shape
    if max_stages is not None or stages is not None:
        max_stage_count(L, sizes, D, max_stages or stages)  # validates it
    cap = L if max_stages is None and stages is None else int(max_stages or stages)
    best = [np.inf, None]
    count = [0]

    def finish(chosen):
        n = len(chosen)
        if stages is not None and n != stages:
            return
        for p, (i, j, m, c) in enumerate(chosen):
            if not smem[i, j, m, c] + (n - p) * amem[i, j, m, c] <= mem_limit:
                return
        if min_stage_fraction:
            seconds = [cost[i, j, m, c] for i, j, m, c in chosen]
            if min(seconds) < min_stage_fraction * max(seconds):
                return
        count[0] += 1
        T = plan_objective([cost[i, j, m, c] for i, j, m, c in chosen], B)
        if T < best[0]:
            best[0], best[1] = T, list(chosen)

    def extend(i, used, chosen):
        if i == L:
            if used == D or (idle_devices and used <= D):
                finish(chosen)
            return
        if len(chosen) == cap:
            return
        for j in range(i, L):
            for m in range(S):
                if used + sizes[m] > D:
                    continue
                for c in range(K):
                    if np.isfinite(cost[i, j, m, c]):
                        chosen.append((i, j, m, c))
                        extend(j + 1, used + int(sizes[m]), chosen)
                        chosen.pop()

    extend(0, 0, [])
    if best[1] is None:
        raise no_plan_error(L, D, idle_devices)
    stages = tuple(StageChoice(i, j + 1, m, c, float(cost[i, j, m, c])) for i, j, m, c in best[1])
    return StageSolution(
        stages=stages,
        total_seconds=float(best[0]),
        max_stage_seconds=max(st.seconds for st in stages),
        tmax_candidates=count[0],
    )
