"""Resharding plans executed in memory give back the tensor; the collective cost model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost.cluster import LinkSpec, make_cluster
from meshplan.reshard.kinds import ALL_TO_ALL, SLICE
from meshplan.reshard.steps import CollectiveModel, Step, apply_steps, axis_links, reshard_seconds, reshard_steps
from meshplan.testing.reshard import shard, simulate, unshard
from meshplan.sharding import PLACEMENTS, R, LogicalMesh, ShardingSpec, placement_axes

MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4)]


def mesh_of(shape) -> LogicalMesh:
    return LogicalMesh(tuple(shape), tuple(range(shape[0] * shape[1])))


@st.composite
def spec_for(draw, rank: int, partial_ok: bool = True) -> ShardingSpec:
    """Any valid spec of ``rank`` dims (each mesh axis used at most once)."""
    dims = [R] * rank
    free = [0, 1]
    for d in draw(st.permutations(range(rank))) if rank else []:
        choices = [p for p in PLACEMENTS if all(a in free for a in placement_axes(p))]
        dims[d] = draw(st.sampled_from(choices))
        free = [a for a in free if a not in placement_axes(dims[d])]
    partial = tuple(a for a in free if partial_ok and draw(st.booleans()))
    return ShardingSpec(tuple(dims), partial)


@st.composite
def case(draw):
    mesh = mesh_of(draw(st.sampled_from(MESHES)))
    rank = draw(st.integers(0, 3))
    src = draw(spec_for(rank))
    if draw(st.booleans()):
        # dst partial over a subset of src's partial axes, split elsewhere
        keep = tuple(a for a in src.partial if draw(st.booleans()))
        dst = draw(spec_for(rank, partial_ok=False).filter(lambda s: not set(s.split_axes()) & set(keep)))
        dst = ShardingSpec(dst.dims, keep)
    else:
        dst = draw(spec_for(rank, partial_ok=False))
    n, m = mesh.shape
    # every dim divisible by the mesh size (so any split fits), times a small factor
    shape = tuple(n * m * draw(st.integers(1, 3)) for _ in range(rank))
    return mesh, src, dst, shape


@settings(max_examples=400, deadline=None)
@given(case(), st.sampled_from([np.float64, np.int64, np.float32]))
def test_plan_round_trip(c, dtype):
    mesh, src, dst, shape = c
    # small integers: every partial sum is exact, so results compare bit for bit
    x = np.random.default_rng(len(shape)).integers(-50, 50, shape).astype(dtype)
    steps = reshard_steps(src, dst)
    out = apply_steps(shard(x, src, mesh), steps, mesh)
    np.testing.assert_array_equal(unshard(out, dst, mesh), x)
    n, m = mesh.shape
    for i in range(n):
        for j in range(m):
            assert out[(i, j)].shape == dst.local_shape(shape, mesh)
            assert out[(i, j)].dtype == x.dtype
            if not dst.partial:
                np.testing.assert_array_equal(out[(i, j)], x[dst.local_slices(shape, mesh, (i, j))])
    assert simulate(x, steps, mesh, src).keys() == out.keys()


@given(case())
def test_each_step_leaves_the_spec_its_kind_says(c):
    """Following ``Step.spec_after`` along a plan ends at its target, and every local array
    after each step has that spec's local shape."""
    mesh, src, dst, shape = c
    spec, locals_ = src, shard(np.zeros(shape), src, mesh)
    for step in reshard_steps(src, dst):
        spec, locals_ = step.spec_after(spec), apply_steps(locals_, (step,), mesh)
        assert all(a.shape == spec.local_shape(shape, mesh) for a in locals_.values()), (step, spec)
    assert spec == dst


def test_step_kinds_keep_their_plan_json_names():
    step = Step("all_to_all", 1, 0, 2)
    assert step.kind is ALL_TO_ALL and Step.from_dict(step.to_dict()) == step
    assert step.to_dict() == {"kind": "all_to_all", "axis": 1, "dim": 0, "to_dim": 2}
    with pytest.raises(ValueError, match="unknown resharding step kind"):
        Step("gather", 0, 0)


def test_plans_use_the_expected_collectives():
    def plan(a, b):
        return [str(s) for s in reshard_steps(ShardingSpec.parse(a), ShardingSpec.parse(b))]

    assert plan("S0R", "S0R") == []
    assert plan("RR", "S0S1") == ["slice(axis=0, dim=0)", "slice(axis=1, dim=1)"]
    assert plan("RR+P1", "RR") == ["all_reduce(axis=1)"]
    assert plan("RR+P1", "RS1") == ["reduce_scatter(axis=1, dim=1)"]
    assert plan("RR+P01", "S01R") == ["reduce_scatter(axis=0, dim=0)", "reduce_scatter(axis=1, dim=0)"]
    # slicing before reducing moves less data
    assert plan("RR+P1", "S0R") == ["slice(axis=0, dim=0)", "all_reduce(axis=1)"]
    assert plan("S01R", "RR") == ["all_gather(axis=1, dim=0)", "all_gather(axis=0, dim=0)"]
    assert plan("S1R", "S0R") == ["all_gather(axis=1, dim=0)", "slice(axis=0, dim=0)"]
    # a split that moves to another dim along the same axis is one all-to-all
    assert plan("S0R", "RS0") == ["all_to_all(axis=0, dim=0->1)"]
    assert plan("S1RR", "RRS1") == ["all_to_all(axis=1, dim=0->2)"]


def test_partial_destination_needs_partial_source():
    with pytest.raises(ValueError, match="partial"):
        reshard_steps(ShardingSpec.parse("RR"), ShardingSpec.parse("RR+P0"))
    with pytest.raises(ValueError, match="rank"):
        reshard_steps(ShardingSpec.parse("RR"), ShardingSpec.parse("R"))
    with pytest.raises(ValueError):
        Step("broadcast", 0, 1)


def test_steps_over_both_axes():
    """Axis 2 groups are the whole mesh in row-major order: the chunk order of S01."""
    mesh = mesh_of((2, 2))
    x = np.arange(32.0).reshape(8, 4)
    s01, rep, p01 = ShardingSpec.parse("S01R"), ShardingSpec.parse("RR"), ShardingSpec.parse("RR+P01")
    for src, step, dst in [(s01, Step("all_gather", 2, 0), rep), (rep, Step("slice", 2, 0), s01),
                           (p01, Step("reduce_scatter", 2, 0), s01), (p01, Step("all_reduce", 2), rep)]:
        out = apply_steps(shard(x, src, mesh), (step,), mesh)
        for c, local in out.items():
            np.testing.assert_array_equal(local, x[dst.local_slices(x.shape, mesh, c)])


def test_unreachable_spec_costs_infinity():
    model = CollectiveModel({0: FAST, 1: FAST})
    cost = reshard_seconds(ShardingSpec.parse("RR"), ShardingSpec.parse("RR+P1"), (4, 4), 4, mesh_of((2, 2)), model)
    assert cost == float("inf")


def test_shard_partial_addends_are_unequal_and_sum_back():
    mesh = mesh_of((2, 2))
    x = np.arange(16.0).reshape(4, 4)
    parts = shard(x, ShardingSpec.parse("RR+P01"), mesh)
    assert not np.array_equal(parts[(0, 0)], parts[(0, 1)])
    assert not np.array_equal(parts[(0, 0)], x)
    np.testing.assert_array_equal(sum(parts.values()), x)
    np.testing.assert_array_equal(unshard(parts, ShardingSpec.parse("RR+P01"), mesh), x)


def test_apply_steps_rejects_bad_input():
    mesh = mesh_of((1, 2))
    with pytest.raises(ValueError, match="mesh"):
        apply_steps({(0, 0): np.zeros(2)}, (), mesh)
    with pytest.raises(ValueError, match="split"):
        apply_steps({(0, 0): np.zeros(3), (0, 1): np.zeros(3)}, (Step("slice", 1, 0),), mesh)


FAST = LinkSpec(bandwidth=100e9, latency=2e-6)
SLOW = LinkSpec(bandwidth=10e9, latency=20e-6)


def test_cost_formulas():
    model = CollectiveModel({0: SLOW, 1: FAST})
    mesh = mesh_of((2, 4))
    b = 1e6
    # all-reduce: the faster of the ring and recursive doubling (log2 4 = 2 steps)
    ring = 2 * 3 / 4 * b / FAST.bandwidth + 6 * FAST.latency
    doubling = 2 * (FAST.latency + b / FAST.bandwidth)
    assert model.all_reduce_seconds(b, 1, mesh) == pytest.approx(min(ring, doubling))
    # a short message over 4 devices: doubling's 2 latencies, not the ring's 6
    assert model.all_reduce_seconds(8, 1, mesh) == pytest.approx(2 * (FAST.latency + 8 / FAST.bandwidth))
    # a long one: the ring's bandwidth term
    assert model.all_reduce_seconds(1e12, 1, mesh) == pytest.approx(2 * 3 / 4 * 1e12 / FAST.bandwidth + 6 * FAST.latency)
    # on two devices doubling is one exchange: one latency (the ring takes two) and the same bytes
    assert model.all_reduce_seconds(b, 0, mesh) == pytest.approx(SLOW.latency + b / SLOW.bandwidth)
    assert model.all_gather_seconds(b, 0, mesh) == pytest.approx(1 / 2 * b / SLOW.bandwidth + SLOW.latency)
    assert model.reduce_scatter_seconds(b, 1, mesh) == pytest.approx(3 / 4 * b / FAST.bandwidth + 3 * FAST.latency)
    assert model.all_to_all_seconds(b, 1, mesh) == pytest.approx(3 / 16 * b / FAST.bandwidth + 3 * FAST.latency)
    # both axes: the slower link, all 8 devices
    assert model.all_gather_seconds(b, 2, mesh) == pytest.approx(7 / 8 * b / SLOW.bandwidth + 7 * SLOW.latency)
    one = mesh_of((1, 4))
    assert model.all_reduce_seconds(b, 0, one) == 0.0


@settings(max_examples=200, deadline=None)
@given(case(), st.integers(1, 8))
def test_reshard_costs(c, itemsize):
    mesh, src, dst, shape = c
    model = CollectiveModel({0: FAST, 1: FAST})
    cost = reshard_seconds(src, dst, shape, itemsize, mesh, model)
    assert cost >= 0
    assert reshard_seconds(src, src, shape, itemsize, mesh, model) == 0
    if shape:
        bigger = (shape[0] * 2,) + shape[1:]
        assert reshard_seconds(src, dst, bigger, itemsize, mesh, model) >= cost
        assert reshard_seconds(src, dst, shape, itemsize * 2, mesh, model) >= cost
    if any(s.kind is not SLICE and mesh.axis_size(s.axis) > 1 for s in reshard_steps(src, dst)):
        assert cost > 0
        # a slower link on every axis costs more
        assert reshard_seconds(src, dst, shape, itemsize, mesh, CollectiveModel({0: SLOW, 1: SLOW})) > cost


def test_inter_host_axis_is_slower():
    cluster = make_cluster((2, 4))
    links = axis_links(cluster, (2, 4), (2, 4))
    assert links == {0: cluster.inter_host, 1: cluster.intra_host}
    assert axis_links(cluster, (2, 4), (1, 8)) == {0: cluster.intra_host, 1: cluster.inter_host}
    assert axis_links(cluster, (2, 4), (8, 1)) == {0: cluster.inter_host, 1: cluster.intra_host}
    assert axis_links(cluster, (1, 4), (2, 2)) == {0: cluster.intra_host, 1: cluster.intra_host}
    assert axis_links(cluster, (2, 4), (4, 2)) == {0: cluster.inter_host, 1: cluster.intra_host}
    with pytest.raises(ValueError):
        axis_links(cluster, (2, 4), (2, 2))
    model = CollectiveModel(links)
    mesh = mesh_of((2, 4))
    src, shape = ShardingSpec.parse("RR+P01"), (64, 64)
    across = reshard_seconds(ShardingSpec.parse("RR+P0"), ShardingSpec.parse("RR"), shape, 4, mesh, model)
    within = reshard_seconds(ShardingSpec.parse("RR+P1"), ShardingSpec.parse("RR"), shape, 4, mesh, model)
    assert across > within > 0
    assert reshard_seconds(src, ShardingSpec.parse("RR"), shape, 4, mesh, model) > across


def test_measured_collective_model_asks_the_profile():
    """With measured fits, each step's cost comes from them, with the profile's byte
    conventions (all-to-all: one device's send buffer) and the axis's host crossing."""
    from meshplan.cost.cluster import make_cluster
    from meshplan.reshard.steps import MeasuredCollectiveModel

    cluster = make_cluster((2, 2), "cpu")
    asked = []

    def measured(collective, nbytes, group, inter_host):
        asked.append((collective, nbytes, group, inter_host))
        return 1e-3

    model = MeasuredCollectiveModel({0: cluster.inter_host, 1: cluster.intra_host}, measured, {0: True, 1: False})
    mesh = LogicalMesh((2, 2), (0, 1, 2, 3))
    full = (8, 8)
    assert reshard_seconds(ShardingSpec.parse("RR+P0"), ShardingSpec.parse("RR"), full, 4, mesh, model) == 1e-3
    assert asked[-1] == ("all_reduce", 256.0, 2, True)
    assert reshard_seconds(ShardingSpec.parse("S1R"), ShardingSpec.parse("RS1"), full, 4, mesh, model) == 1e-3
    assert asked[-1] == ("all_to_all", 128.0, 2, False)   # each device holds 8x4 floats
    assert reshard_seconds(ShardingSpec.parse("S0R"), ShardingSpec.parse("RR"), full, 4, mesh, model) == 1e-3
    assert asked[-1] == ("all_gather", 256.0, 2, True)


def test_spec_and_mesh_axes_algebra():
    spec = ShardingSpec.parse
    assert spec("S0R").refined(0, 1) == spec("S01R") and spec("RR").refined(1, 2) == spec("RS01")
    assert spec("S01R").coarsened(0, 1) == spec("S0R") and spec("S01R").coarsened(0, 2) == spec("RR")
    assert spec("RR+P01").reduced(2) == spec("RR") and spec("S01R").normalised(mesh_of((1, 4))) == spec("S1R")
    for bad in (lambda: spec("S1R").refined(0, 0), lambda: spec("S01R").coarsened(0, 0)):
        with pytest.raises(ValueError):
            bad()
    mesh = mesh_of((2, 4))
    assert mesh.position((1, 2), (0, 1)) == (6, 8) and mesh.position((1, 2), ()) == (0, 1)
    assert [mesh.axis_index((1, 2), a) for a in (0, 1, 2)] == [1, 2, 6]
    assert [mesh.group_index((1, 2), a) for a in (0, 1, 2)] == [2, 1, 0]
