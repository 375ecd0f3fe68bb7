"""The stage DP against exhaustive enumeration (and its slow reference) on small instances."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.errors import PlanError
from meshplan.inter.stage_dp import StageSolution, plan_objective, solve_stages
from meshplan.testing.stage_dp import brute_force_stages, reference_stages


def make_instance(rng: np.random.Generator, L: int, sizes, K: int, ties: bool, inf_frac: float, tight: bool):
    """Random cost/memory tables; ``ties`` uses small integers so equal latencies abound."""
    S = len(sizes)
    shape = (L, L, S, K)
    if ties:
        cost = rng.integers(1, 6, shape).astype(float)
    else:
        cost = rng.uniform(0.1, 5.0, shape)
    cost[rng.random(shape) < inf_frac] = np.inf
    # lower triangle (j < i) is ignored: fill it with tempting garbage
    i, j = np.tril_indices(L, -1)
    cost[i, j] = 0.0
    smem = rng.uniform(0.0, 6.0, shape)
    amem = rng.uniform(0.0, 3.0, shape)
    limit = 8.0 if tight else 1e9
    return cost, smem, amem, limit


def check_plan(sol: StageSolution, cost, smem, amem, limit, sizes, D, B):
    """The returned plan is valid and its objective is the reported total."""
    L = cost.shape[0]
    stages = sol.stages
    assert stages[0].start == 0 and stages[-1].stop == L
    for a, b in zip(stages, stages[1:]):
        assert a.stop == b.start
    assert all(s.start < s.stop for s in stages)
    assert sum(int(sizes[s.submesh]) for s in stages) == D
    n = len(stages)
    for p, s in enumerate(stages):
        i, j, m, c = s.start, s.stop - 1, s.submesh, s.logical
        assert s.seconds == cost[i, j, m, c] and np.isfinite(s.seconds)
        assert smem[i, j, m, c] + (n - p) * amem[i, j, m, c] <= limit
    assert sol.max_stage_seconds == max(s.seconds for s in stages)
    assert plan_objective([s.seconds for s in stages], B) == pytest.approx(sol.total_seconds, rel=1e-12)


def compare(cost, smem, amem, limit, sizes, D, B, **kw):
    """solve_stages and brute_force_stages agree (both raise, or equal totals)."""
    try:
        expected = brute_force_stages(cost, smem, amem, limit, sizes, D, B, **kw)
    except PlanError:
        with pytest.raises(PlanError):
            solve_stages(cost, smem, amem, limit, sizes, D, B, **kw)
        with pytest.raises(PlanError):
            reference_stages(cost, smem, amem, limit, sizes, D, B, **kw)
        return None
    got = solve_stages(cost, smem, amem, limit, sizes, D, B, **kw)
    assert got.total_seconds == pytest.approx(expected.total_seconds, rel=1e-9)
    check_plan(got, cost, smem, amem, limit, sizes, D, B)
    check_plan(expected, cost, smem, amem, limit, sizes, D, B)
    for full in (False, True):
        ref = reference_stages(cost, smem, amem, limit, sizes, D, B, full=full, **kw)
        assert ref.total_seconds == pytest.approx(expected.total_seconds, rel=1e-9)
        check_plan(ref, cost, smem, amem, limit, sizes, D, B)
        _check_count(ref, kw)
    _check_count(got, kw)
    _check_count(expected, kw)
    return got


def _check_count(solution, kw) -> None:
    """An exact stage count (``stages=``) is held by every solver's answer."""
    if kw.get("stages") is not None:
        assert len(solution.stages) == kw["stages"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    L=st.integers(1, 6),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True),
    D=st.integers(1, 6),
    K=st.integers(1, 2),
    B=st.integers(1, 8),
    ties=st.booleans(),
    inf_frac=st.sampled_from([0.0, 0.2, 0.5]),
    tight=st.booleans(),
)
def test_matches_brute_force(seed, L, sizes, D, K, B, ties, inf_frac, tight):
    rng = np.random.default_rng(seed)
    sizes = np.array(sizes)
    cost, smem, amem, limit = make_instance(rng, L, sizes, K, ties, inf_frac, tight)
    compare(cost, smem, amem, limit, sizes, D, B)


def test_seeded_instances_with_binding_memory():
    """Deterministic sweep that is sure to include binding memory and feasible plans."""
    feasible = binding = 0
    for seed in range(40):
        rng = np.random.default_rng(1000 + seed)
        L, sizes, D, B = 6, np.array([1, 2, 4]), 6, int(rng.integers(1, 9))
        cost, smem, amem, limit = make_instance(rng, L, sizes, 2, seed % 2 == 0, 0.2, True)
        got = compare(cost, smem, amem, limit, sizes, D, B)
        if got is not None:
            feasible += 1
            loose = solve_stages(cost, smem, amem, np.inf, sizes, D, B)
            binding += loose.total_seconds < got.total_seconds
    assert feasible >= 20 and binding >= 5


def structured_instance(rng, L, sizes, K, tight):
    """Costs shaped like real ones: a layer sum over a power of the submesh size."""
    S = len(sizes)
    w = rng.lognormal(0.0, 0.6, L)
    cw = np.concatenate([[0.0], np.cumsum(w)])
    i, j = np.triu_indices(L)
    cost = np.full((L, L, S, K), np.inf)
    smem = np.zeros_like(cost)
    amem = np.zeros_like(cost)
    for m, n in enumerate(sizes):
        for c in range(K):
            cost[i, j, m, c] = (cw[j + 1] - cw[i]) / n ** rng.uniform(0.6, 1.0) * rng.uniform(1, 1.3, i.shape)
            cost[i, j, m, c] += 0.1 * (n > 1)
            smem[i, j, m, c] = (j - i + 1) * rng.uniform(1, 3) / n
            amem[i, j, m, c] = (j - i + 1) * rng.uniform(0.2, 1) / n
    return cost, smem, amem, (6.0 if tight else np.inf)


def test_structured_instances_match_reference():
    """Realistic-looking tables on 8 devices: fast path against the full reference.

    About one in ten of these needs a t_max strictly between the bottleneck and the
    least-sum plan's maximum, i.e. the descent (the other generators rarely do).
    """
    sizes = np.array([1, 2, 4, 8])
    multi = 0
    for seed in range(40):
        rng = np.random.default_rng(500 + seed)
        L = int(rng.integers(4, 9))
        B = int(rng.choice([2, 3, 4, 8, 16]))
        cost, smem, amem, limit = structured_instance(rng, L, sizes, 2, seed % 2 == 0)
        got = solve_stages(cost, smem, amem, limit, sizes, 8, B)
        ref = reference_stages(cost, smem, amem, limit, sizes, 8, B, full=True)
        assert got.total_seconds == pytest.approx(ref.total_seconds, rel=1e-9)
        check_plan(got, cost, smem, amem, limit, sizes, 8, B)
        multi += got.tmax_candidates > 2
    assert multi >= 8  # the descent below the first two solves was exercised


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_max_stages(cap):
    rng = np.random.default_rng(7)
    sizes = np.array([1, 2])
    cost, smem, amem, limit = make_instance(rng, 5, sizes, 2, False, 0.1, False)
    got = compare(cost, smem, amem, limit, sizes, 4, 6, max_stages=cap)
    if got is not None:
        assert len(got.stages) <= cap


def hand_case():
    """Two layers, two devices, submesh sizes (1, 2), one logical choice.

    Plans: both layers as one stage on 2 devices (2.5 s): T = 2.5 B.
           layer 0 on 1 device (2 s) then layer 1 on 1 device (2 s): T = 4 + 2 (B - 1).
    """
    inf = np.inf
    cost = np.full((2, 2, 2, 1), inf)
    cost[0, 0, 0, 0] = 2.0  # layer 0 on 1 device
    cost[1, 1, 0, 0] = 2.0  # layer 1 on 1 device
    cost[0, 0, 1, 0] = 1.5  # layer 0 on 2 devices (leaves none for layer 1)
    cost[1, 1, 1, 0] = 1.5
    cost[0, 1, 1, 0] = 2.5  # both layers on 2 devices
    cost[0, 1, 0, 0] = 4.5  # both on 1 device (leaves a device idle: invalid)
    smem = np.zeros_like(cost)
    amem = np.ones_like(cost)
    return cost, smem, amem, np.array([1, 2])


def test_hand_case_known_answers():
    cost, smem, amem, sizes = hand_case()
    # B = 1: one stage wins (2.5 < 4)
    sol = solve_stages(cost, smem, amem, 10.0, sizes, 2, 1)
    assert sol.total_seconds == 2.5
    assert [(s.start, s.stop, s.submesh) for s in sol.stages] == [(0, 2, 1)]
    # B = 8: the pipeline wins (4 + 14 = 18 < 20)
    sol = solve_stages(cost, smem, amem, 10.0, sizes, 2, 8)
    assert sol.total_seconds == 18.0 and sol.max_stage_seconds == 2.0
    assert [(s.start, s.stop, s.submesh, s.logical) for s in sol.stages] == [(0, 1, 0, 0), (1, 2, 0, 0)]
    # memory 1.5 per device: the first of two stages holds 2 microbatches (2 > 1.5), so
    # only the single stage (1 microbatch) fits
    sol = solve_stages(cost, smem, amem, 1.5, sizes, 2, 8)
    assert sol.total_seconds == 20.0 and len(sol.stages) == 1
    # memory below one microbatch: nothing fits
    with pytest.raises(PlanError):
        solve_stages(cost, smem, amem, 0.5, sizes, 2, 8)
    for limit, B in [(10.0, 1), (10.0, 8), (1.5, 8)]:
        compare(cost, smem, amem, limit, sizes, 2, B)


def test_intermediate_t_max_wins():
    """Four layers on three single devices; three 3-stage plans trade sum against max.

    X = [0] [1] [2..3]: 1, 1, 6       (sum 8,    max 6)    the least sum (t_max = inf)
    Y = [0] [1..2] [3]: 1, 4.5, 3.5   (sum 9,    max 4.5)
    Z = [0..1] [2] [3]: 4, 4, 3.5     (sum 11.5, max 4)    the bottleneck plan
    With B = 3: X 20, Y 18, Z 19.5, so only a t_max strictly between the two extremes
    finds the optimum (the descent's first step); B = 1 picks X and B = 20 picks Z.
    """
    cost = np.full((4, 4, 1, 1), 100.0)
    entries = {(0, 0): 1.0, (1, 1): 1.0, (2, 3): 6.0, (1, 2): 4.5, (3, 3): 3.5, (0, 1): 4.0, (2, 2): 4.0}
    for (i, j), v in entries.items():
        cost[i, j, 0, 0] = v
    smem = np.zeros_like(cost)
    amem = np.zeros_like(cost)
    sizes = np.array([1])
    for B, total, cuts in [
        (1, 8.0, [(0, 1), (1, 2), (2, 4)]),
        (3, 18.0, [(0, 1), (1, 3), (3, 4)]),
        (20, 87.5, [(0, 2), (2, 3), (3, 4)]),
    ]:
        sol = solve_stages(cost, smem, amem, 1.0, sizes, 3, B)
        assert sol.total_seconds == total
        assert [(st.start, st.stop) for st in sol.stages] == cuts
        compare(cost, smem, amem, 1.0, sizes, 3, B)


def frontier_instance(rng, L):
    """Two stages on two single devices; cut c gives a plan with max and sum on a random
    trade-off curve (max falls, sum rises with c), so many t_max values are contenders and
    the descent takes many steps."""
    n = L - 1
    mx = np.sort(rng.uniform(5, 10, n))[::-1]
    frac = np.sort(rng.uniform(0.0, 1.0, n))
    cost = np.full((L, L, 1, 1), np.inf)
    for c in range(1, L):
        big, small = mx[c - 1], mx[c - 1] * frac[c - 1]
        a, b = (big, small) if rng.random() < 0.5 else (small, big)
        cost[0, c - 1, 0, 0] = a
        cost[c, L - 1, 0, 0] = b
    zero = np.zeros_like(cost)
    return cost, zero, zero, 1.0, np.array([1]), 2


def test_trade_off_curves_match_brute_force():
    for seed in range(200):
        rng = np.random.default_rng(seed)
        L, B = int(rng.integers(3, 12)), int(rng.integers(1, 30))
        inst = frontier_instance(rng, L)
        got = solve_stages(*inst, B)
        expected = brute_force_stages(*inst, B)
        assert got.total_seconds == pytest.approx(expected.total_seconds, rel=1e-9)
        check_plan(got, *inst, B)


def test_infeasible_cases_raise_plan_error():
    rng = np.random.default_rng(3)
    cost, smem, amem, limit = make_instance(rng, 3, np.array([2]), 1, False, 0.0, False)
    # devices cannot be tiled by size-2 submeshes
    compare(cost, smem, amem, limit, np.array([2]), 3, 4)
    with pytest.raises(PlanError):
        solve_stages(cost, smem, amem, limit, np.array([2]), 3, 4)
    # every entry infeasible
    inf = np.full_like(cost, np.inf)
    with pytest.raises(PlanError):
        solve_stages(inf, smem, amem, limit, np.array([2]), 2, 4)
    with pytest.raises(PlanError):
        brute_force_stages(inf, smem, amem, limit, np.array([2]), 2, 4)
    # submesh larger than the cluster
    with pytest.raises(PlanError):
        solve_stages(cost, smem, amem, limit, np.array([8]), 4, 4)


def test_bad_arguments():
    cost, smem, amem, sizes = hand_case()
    with pytest.raises(ValueError):
        solve_stages(cost, smem, amem, 10.0, sizes, 2, 0)
    with pytest.raises(ValueError):
        solve_stages(cost, smem[:1], amem, 10.0, sizes, 2, 1)
    with pytest.raises(ValueError):
        solve_stages(cost, smem, amem, 10.0, np.array([1, 0]), 2, 1)
    bad = cost.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError):
        solve_stages(bad, smem, amem, 10.0, sizes, 2, 1)


def test_medium_instance_matches_reference():
    """Larger than brute force can do: fast path against the unpruned reference."""
    rng = np.random.default_rng(11)
    sizes = np.array([1, 2, 4, 8])
    L, D = 10, 8
    w = rng.uniform(1, 3, L)
    cw = np.concatenate([[0], np.cumsum(w)])
    cost = np.full((L, L, 4, 2), np.inf)
    smem = np.zeros_like(cost)
    amem = np.zeros_like(cost)
    for i in range(L):
        for j in range(i, L):
            for m, n in enumerate(sizes):
                for c in range(2):
                    cost[i, j, m, c] = (cw[j + 1] - cw[i]) / n**0.8 * rng.uniform(1.0, 1.3)
                    smem[i, j, m, c] = (j - i + 1) * 4.0 / n * (1 + c)
                    amem[i, j, m, c] = (j - i + 1) * 1.0 / n * (2 - c)
    for B in (1, 2, 8, 32):
        got = solve_stages(cost, smem, amem, 12.0, sizes, D, B)
        ref = reference_stages(cost, smem, amem, 12.0, sizes, D, B, full=True)
        assert got.total_seconds == pytest.approx(ref.total_seconds, rel=1e-9)
        check_plan(got, cost, smem, amem, 12.0, sizes, D, B)


def hosts_instance(rng, L, hosts, per_host, K, limit_scale):
    """Random tables over meshplan's own submesh list ((1, 1) … (1, per_host), (2, per_host)
    … (hosts, per_host)): latencies falling with the devices with noise, and memory that
    binds at a scale-controlled limit (``inf`` for none)."""
    shapes = [(1, w) for w in (1, 2, 4) if w < per_host] + [(h, per_host) for h in range(1, hosts + 1)]
    sizes = np.array([h * w for h, w in shapes])
    S = len(shapes)
    w = rng.lognormal(0.0, 0.5, L)
    p = rng.uniform(0.5, 1.5, L)
    a = rng.uniform(0.2, 1.0, L)
    cw, cp, ca = (np.concatenate([[0.0], np.cumsum(x)]) for x in (w, p, a))
    i, j = np.triu_indices(L)
    cost = np.full((L, L, S, K), np.inf)
    smem = np.zeros_like(cost)
    amem = np.zeros_like(cost)
    for m, n in enumerate(sizes):
        for c in range(K):
            cost[i, j, m, c] = (cw[j + 1] - cw[i]) / n ** rng.uniform(0.5, 1.0) * rng.uniform(1.0, 1.4, i.shape)
            cost[i, j, m, c] += rng.uniform(0.0, 0.3) * (n > 1)
            smem[i, j, m, c] = (cp[j + 1] - cp[i]) / n ** (c / max(K - 1, 1))
            amem[i, j, m, c] = (ca[j + 1] - ca[i]) / n
    return cost, smem, amem, limit_scale * float(np.median(smem[i, j])), sizes, hosts * per_host


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("limit_scale", [0.6, 1.0, 1.5, np.inf])
def test_random_host_tables_match_reference(seed, limit_scale):
    """Larger random instances on meshplan's submesh list, several seeds and memory limits
    (binding hard — some instances infeasible —, binding some, none): the same optimum as
    the reference DP."""
    rng = np.random.default_rng(9000 + seed)
    L, hosts = int(rng.integers(6, 11)), int(rng.integers(2, 5))
    cost, smem, amem, limit, sizes, D = hosts_instance(rng, L, hosts, 4, 2, limit_scale)
    for B in (1, 4, 32):
        try:
            ref = reference_stages(cost, smem, amem, limit, sizes, D, B)
        except PlanError:
            with pytest.raises(PlanError):
                solve_stages(cost, smem, amem, limit, sizes, D, B)
            continue
        got = solve_stages(cost, smem, amem, limit, sizes, D, B)
        assert got.total_seconds == pytest.approx(ref.total_seconds, rel=1e-9)
        check_plan(got, cost, smem, amem, limit, sizes, D, B)


# --- idle devices: the stages may use fewer than num_devices ---------------------------

def check_idle_plan(sol: StageSolution, cost, smem, amem, limit, sizes, D, B):
    L = cost.shape[0]
    stages = sol.stages
    assert stages[0].start == 0 and stages[-1].stop == L
    assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))
    used = sum(int(sizes[s.submesh]) for s in stages)
    assert used <= D and sol.devices_used == used
    n = len(stages)
    for p, s in enumerate(stages):
        i, j, m, c = s.start, s.stop - 1, s.submesh, s.logical
        assert s.seconds == cost[i, j, m, c] and smem[i, j, m, c] + (n - p) * amem[i, j, m, c] <= limit
    assert plan_objective([s.seconds for s in stages], B) == pytest.approx(sol.total_seconds, rel=1e-12)


def compare_idle(cost, smem, amem, limit, sizes, D, B, **kw):
    """``compare`` with idle devices allowed (``kw``: more options for all three)."""
    kw = dict(kw, idle_devices=True)
    try:
        expected = brute_force_stages(cost, smem, amem, limit, sizes, D, B, **kw)
    except PlanError:
        with pytest.raises(PlanError):
            solve_stages(cost, smem, amem, limit, sizes, D, B, **kw)
        with pytest.raises(PlanError):
            reference_stages(cost, smem, amem, limit, sizes, D, B, **kw)
        return None
    got = solve_stages(cost, smem, amem, limit, sizes, D, B, **kw)
    assert got.total_seconds == pytest.approx(expected.total_seconds, rel=1e-9)
    check_idle_plan(got, cost, smem, amem, limit, sizes, D, B)
    ref = reference_stages(cost, smem, amem, limit, sizes, D, B, **kw)
    assert ref.total_seconds == pytest.approx(expected.total_seconds, rel=1e-9)
    for solution in (got, expected, ref):
        _check_count(solution, kw)
    return got


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    L=st.integers(1, 6),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True),
    D=st.integers(1, 6),
    K=st.integers(1, 2),
    B=st.integers(1, 8),
    ties=st.booleans(),
    inf_frac=st.sampled_from([0.0, 0.2, 0.5]),
    tight=st.booleans(),
)
def test_idle_devices_match_brute_force(seed, L, sizes, D, K, B, ties, inf_frac, tight):
    rng = np.random.default_rng(seed)
    sizes = np.array(sizes)
    cost, smem, amem, limit = make_instance(rng, L, sizes, K, ties, inf_frac, tight)
    got = compare_idle(cost, smem, amem, limit, sizes, D, B)
    if got is not None:   # leaving devices idle is never worse than using every one
        try:
            exact = solve_stages(cost, smem, amem, limit, sizes, D, B)
        except PlanError:
            return
        assert got.total_seconds <= exact.total_seconds * (1 + 1e-12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), L=st.integers(1, 5), D=st.integers(1, 5), B=st.integers(1, 6),
       idle=st.booleans())
def test_activations_that_free_memory_match_brute_force(seed, L, D, B, idle):
    """act_mem below zero (a stage that fits only with enough microbatches in flight): the
    memory intervals rise, and fewer stages after a prefix no longer dominate."""
    rng = np.random.default_rng(seed)
    sizes = np.array([1, 2])
    cost, smem, amem, _ = make_instance(rng, L, sizes, 2, False, 0.2, True)
    amem = rng.uniform(-2.0, 2.0, cost.shape)
    smem = rng.uniform(0.0, 10.0, cost.shape)
    if idle:
        compare_idle(cost, smem, amem, 8.0, sizes, D, B)
    else:
        compare(cost, smem, amem, 8.0, sizes, D, B)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("limit_scale", [0.6, 1.0, np.inf])
def test_idle_devices_on_host_tables_match_reference(seed, limit_scale):
    rng = np.random.default_rng(7000 + seed)
    L, hosts = int(rng.integers(6, 11)), int(rng.integers(2, 5))
    cost, smem, amem, limit, sizes, D = hosts_instance(rng, L, hosts, 4, 2, limit_scale)
    for B in (1, 4, 32):
        try:
            ref = reference_stages(cost, smem, amem, limit, sizes, D, B, idle_devices=True)
        except PlanError:
            with pytest.raises(PlanError):
                solve_stages(cost, smem, amem, limit, sizes, D, B, idle_devices=True)
            continue
        got = solve_stages(cost, smem, amem, limit, sizes, D, B, idle_devices=True)
        assert got.total_seconds == pytest.approx(ref.total_seconds, rel=1e-9)
        check_idle_plan(got, cost, smem, amem, limit, sizes, D, B)
        # a larger cluster (one more host) is never worse when devices may stay idle
        bigger = solve_stages(cost, smem, amem, limit, sizes, D + 4, B, idle_devices=True)
        assert bigger.total_seconds <= got.total_seconds * (1 + 1e-12)


# --- the small-stage rule (min_stage_fraction) -------------------------------------------


def _obeys(sol: StageSolution, fraction: float) -> bool:
    return min(s.seconds for s in sol.stages) >= fraction * sol.max_stage_seconds


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    L=st.integers(1, 6),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True),
    D=st.integers(1, 6),
    K=st.integers(1, 2),
    B=st.integers(1, 8),
    inf_frac=st.sampled_from([0.0, 0.2]),
    tight=st.booleans(),
    idle=st.booleans(),
    fraction=st.sampled_from([0.1, 0.3, 0.6]),
)
def test_min_stage_fraction_against_reference_and_brute_force(seed, L, sizes, D, K, B, inf_frac, tight, idle,
                                                              fraction):
    """Latencies spread over three decades, so that small stages tempt the plain optimum.
    The rule's answer equals the reference's under the same rule (round by round), is a
    valid plan, obeys the rule unless no plan is left without its small stages, and is
    never better than the exact optimum under the rule (the brute force); where the plain
    optimum obeys the rule, it is the answer."""
    rng = np.random.default_rng(seed)
    sizes = np.array(sizes)
    cost, smem, amem, limit = make_instance(rng, L, sizes, K, False, inf_frac, tight)
    finite = np.isfinite(cost)
    cost[finite] = np.exp(rng.uniform(-4.0, 2.0, int(finite.sum())))
    kw = dict(idle_devices=idle)
    try:
        plain = solve_stages(cost, smem, amem, limit, sizes, D, B, **kw)
    except PlanError:
        with pytest.raises(PlanError):
            solve_stages(cost, smem, amem, limit, sizes, D, B, min_stage_fraction=fraction, **kw)
        return
    got = solve_stages(cost, smem, amem, limit, sizes, D, B, min_stage_fraction=fraction, **kw)
    ref = reference_stages(cost, smem, amem, limit, sizes, D, B, min_stage_fraction=fraction, **kw)
    assert got.total_seconds == pytest.approx(ref.total_seconds, rel=1e-9)
    (check_idle_plan if idle else check_plan)(got, cost, smem, amem, limit, sizes, D, B)
    if _obeys(plain, fraction):
        assert got.total_seconds == pytest.approx(plain.total_seconds, rel=1e-12)
    if _obeys(got, fraction):
        exact = brute_force_stages(cost, smem, amem, limit, sizes, D, B, min_stage_fraction=fraction, **kw)
        assert _obeys(exact, fraction)
        assert got.total_seconds >= exact.total_seconds * (1 - 1e-12)
    else:   # kept: no plan is left once the stages below the bound are ruled out
        masked = np.where(cost < fraction * got.max_stage_seconds, np.inf, cost)
        with pytest.raises(PlanError):
            brute_force_stages(masked, smem, amem, limit, sizes, D, B, **kw)


def test_min_stage_fraction_merges_a_trivial_stage():
    """Two layers, one of them trivial: with every device in use (two one-device stages on
    two devices) the trivial stage must stay; with idle devices it joins its neighbour;
    with memory that holds no layer pair, it stays apart."""
    cost = np.full((2, 2, 1, 1), np.inf)
    cost[0, 0], cost[1, 1], cost[0, 1] = 10.0, 0.2, 10.1
    smem = np.zeros_like(cost)
    smem[0, 1] = 5.0
    amem = np.zeros_like(cost)
    sizes = np.array([1])
    plain = solve_stages(cost, smem, amem, 10.0, sizes, 2, 4, idle_devices=True)
    assert len(plain.stages) == 2    # pipelining the trivial layer pays under the plain objective
    kept = solve_stages(cost, smem, amem, 10.0, sizes, 2, 4, min_stage_fraction=0.1)
    assert [s.seconds for s in kept.stages] == [10.0, 0.2]
    merged = solve_stages(cost, smem, amem, 10.0, sizes, 2, 4, idle_devices=True, min_stage_fraction=0.1)
    assert [s.seconds for s in merged.stages] == [10.1] and merged.devices_used == 1
    apart = solve_stages(cost, smem, amem, 4.0, sizes, 2, 4, idle_devices=True, min_stage_fraction=0.1)
    assert [s.seconds for s in apart.stages] == [10.0, 0.2]
    with pytest.raises(ValueError):
        solve_stages(cost, smem, amem, 10.0, sizes, 2, 4, min_stage_fraction=1.5)


# --- the prefix bounds: the batched, early-stopping recurrence against a direct one ------

def direct_prefix_table(prob, t_max, value):
    """``out[s, k]``: the least sum of ``value(entry, choice)`` over prefixes of layers
    ``0..k-1`` whose last stage fits with ``s + 1`` in flight, the one before ``s + 2``, …
    (each choice up to the deepest count it fits at), written as plainly as possible."""
    from functools import lru_cache

    S, L = prob.n_max, prob.L
    ends = {}
    for e in range(prob.k.size):
        for c in range(prob.cost.shape[1]):
            if prob.cost[e, c] <= t_max:
                ends.setdefault(int(prob.j[e]) + 1, []).append((int(prob.k[e]), min(int(prob.hi[e, c]), S),
                                                                value(e, c)))

    @lru_cache(maxsize=None)
    def best(s, k):
        if k == 0:
            return 0.0
        if s + 1 > S:
            return np.inf
        return min((v + best(s + 1, start) for start, hi, v in ends.get(k, []) if hi >= s + 1), default=np.inf)

    return np.array([[best(s, k) for k in range(L + 1)] for s in range(S + 2)])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("idle", [False, True])
def test_prefix_bounds_match_a_direct_recurrence(seed, idle):
    """Every price row of the prefix bounds, and the least and greatest device counts,
    equal a plain recursion over layer cuts, on tables where memory binds (groups join
    level by level) and where it does not (rows settle early and are copied up). Device
    counts are compared up to D + 1 and D: beyond, only "more than D" matters."""
    from meshplan.inter.stage_dp import _Bounds, _Problem, check_stage_inputs

    rng = np.random.default_rng(500 + seed)
    L, sizes = int(rng.integers(3, 9)), np.array([1, 2, 4])
    cost, smem, amem, limit = make_instance(rng, L, sizes, 2, False, 0.2, tight=seed % 2 == 0)
    args = check_stage_inputs(cost, smem, amem, limit, sizes, 8, 4)
    prob = _Problem(*args[:6])
    assert prob.k.size
    t_max = float(np.quantile(prob.flat_cost, 0.7))
    bounds = _Bounds(prob, t_max, idle)
    bounds._price()
    for row, lam in enumerate(bounds.lams):
        expected = direct_prefix_table(prob, t_max, lambda e, c: prob.cost[e, c] + lam * float(prob.z[e]))
        np.testing.assert_allclose(bounds.Q[row], expected, rtol=1e-12)
    D = prob.D
    least = direct_prefix_table(prob, t_max, lambda e, c: float(prob.z[e]))
    np.testing.assert_array_equal(np.minimum(bounds.Dmin, D + 1), np.minimum(least, D + 1))
    if idle:
        assert bounds.Dmax is None
    else:
        most = -direct_prefix_table(prob, t_max, lambda e, c: -float(prob.z[e]))
        np.testing.assert_array_equal(np.minimum(bounds.Dmax, D), np.minimum(most, D))


# --- an exact stage count ---------------------------------------------------------------

@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    L=st.integers(1, 6),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3, unique=True),
    D=st.integers(1, 6),
    B=st.integers(1, 8),
    stages=st.integers(1, 4),
    idle=st.booleans(),
    tight=st.booleans(),
)
def test_exact_stage_count_matches_brute_force(seed, L, sizes, D, B, stages, idle, tight):
    """With ``stages`` = N the best plan of exactly N stages, as enumeration and the
    reference find it (a plan of fewer stages that is better must not be returned), or no
    plan from all three."""
    rng = np.random.default_rng(seed)
    sizes = np.array(sizes)
    cost, smem, amem, limit = make_instance(rng, L, sizes, 2, False, 0.2, tight)
    (compare_idle if idle else compare)(cost, smem, amem, limit, sizes, D, B, stages=stages)


def test_exact_stage_count_is_not_the_unconstrained_optimum():
    """A table whose best plan has one stage: asked for two, the DP returns the best of
    two stages (with idle devices and without), and both oracles agree."""
    L, sizes = 4, np.array([1, 2])
    cost = np.full((L, L, 2, 1), np.inf)
    cost[0, 3, 1, 0] = 1.0                        # all layers on 2 devices: the best alone
    cost[0, 1, 0, 0], cost[2, 3, 0, 0] = 1.5, 2.0  # two stages of one device each
    cost[0, 0, 0, 0], cost[1, 3, 0, 0] = 0.4, 3.0
    zeros = np.zeros_like(cost)
    for idle in (False, True):
        alone = solve_stages(cost, zeros, zeros, 1.0, sizes, 2, 4, idle_devices=idle)
        assert len(alone.stages) == 1
        two = solve_stages(cost, zeros, zeros, 1.0, sizes, 2, 4, stages=2, idle_devices=idle)
        assert [(s.start, s.stop) for s in two.stages] == [(0, 2), (2, 4)]
        assert two.total_seconds == pytest.approx(1.5 + 2.0 + 3 * 2.0)
        for oracle in (brute_force_stages, reference_stages):
            assert oracle(cost, zeros, zeros, 1.0, sizes, 2, 4, stages=2, idle_devices=idle).total_seconds == \
                pytest.approx(two.total_seconds)
    with pytest.raises(PlanError):
        solve_stages(cost, zeros, zeros, 1.0, sizes, 2, 4, stages=3)
    with pytest.raises(ValueError, match="not both"):
        solve_stages(cost, zeros, zeros, 1.0, sizes, 2, 4, stages=2, max_stages=2)
