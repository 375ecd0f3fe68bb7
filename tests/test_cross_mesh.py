"""Cross-mesh resharding without MPI: unit tasks, in-memory execution, schedulers, simulator."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshplan.cost.cluster import GB, Cluster, DeviceSpec, LinkSpec
from meshplan.reshard import schedulers
from meshplan.reshard.schedulers import ALGORITHMS, schedule_tasks
from meshplan.reshard.send_spec import (
    allgather_seconds,
    best_resharding,
    clear_best_resharding_cache,
    prepare_seconds,
    send_spec_candidates,
)
from meshplan.reshard.simulator import Schedule, Simulator, lower_bound, simulate
from meshplan.reshard.steps import CollectiveModel, mesh_links, reshard_seconds, reshard_steps
from meshplan.reshard.tasks import (
    CrossMeshTransfer,
    UnitTask,
    as_send_recv,
    box_slices,
    cross_mesh_tasks,
    plan_resharding,
)
from meshplan.runtime.cross_mesh_mpi import reshard_in_memory
from meshplan.sharding import R, S0, S01, S1, LogicalMesh, ShardingSpec

MESH_SHAPES = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (1, 4), (2, 4), (4, 2)]
FAST = {"trials": 6, "polish": 24}


def make_cluster(per_host: int, hosts: int = 32, intra=(300, 5e-6), inter=(25, 20e-6)) -> Cluster:
    device = DeviceSpec("test", 1e10, 1e12, 1e12, 1e-6)
    return Cluster(hosts, per_host, device, LinkSpec(intra[0] * GB, intra[1]), LinkSpec(inter[0] * GB, inter[1]))


def meshes(shape_a, shape_b, offset: int = 0) -> tuple[LogicalMesh, LogicalMesh]:
    na = shape_a[0] * shape_a[1]
    a = LogicalMesh(shape_a, tuple(range(na)))
    b = LogicalMesh(shape_b, tuple(range(na + offset, na + offset + shape_b[0] * shape_b[1])))
    return a, b


@st.composite
def spec_for(draw, ndim: int) -> ShardingSpec:
    """A random non-partial spec: each mesh axis splits one dimension or none."""
    dims = [R] * ndim
    axis0 = draw(st.sampled_from([None, *range(ndim)]))
    axis1 = draw(st.sampled_from([None, *range(ndim)]))
    if axis0 is not None:
        dims[axis0] = S0
    if axis1 is not None:
        dims[axis1] = S01 if axis1 == axis0 else S1
    return ShardingSpec(tuple(dims))


@st.composite
def problems(draw, max_factor: int = 2):
    """(shape, src spec, src mesh, dst spec, dst mesh) with every split dividing evenly."""
    ndim = draw(st.integers(1, 3))
    shape_a, shape_b = draw(st.sampled_from(MESH_SHAPES)), draw(st.sampled_from(MESH_SHAPES))
    offset = draw(st.integers(0, 2))
    mesh_a, mesh_b = meshes(shape_a, shape_b, offset)
    spec_a, spec_b = draw(spec_for(ndim)), draw(spec_for(ndim))
    shape = []
    for d in range(ndim):
        unit = math.lcm(spec_a.shards(d, mesh_a), spec_b.shards(d, mesh_b))
        shape.append(unit * draw(st.integers(1, max_factor)))
    assume(math.prod(shape) <= 4096)
    return tuple(shape), spec_a, mesh_a, spec_b, mesh_b


def full_tensor(shape) -> np.ndarray:
    return np.arange(math.prod(shape), dtype=np.float32).reshape(shape)


def source_locals(rs: CrossMeshTransfer, full: np.ndarray) -> dict[int, np.ndarray]:
    return {r: full[box_slices(rs.src_box(r))].copy() for r in rs.src_mesh.ranks}


def check_schedule(schedule: Schedule, tasks, cluster) -> None:
    """Every task once, from a sender that holds it; no two tasks sharing a rank overlap;
    the makespan is the simulated one and not below the lower bound."""
    assert sorted(schedule.order) == list(range(len(tasks)))
    entries = schedule.entries
    for e in entries:
        assert e.sender in tasks[e.task].senders
        assert e.end >= e.start >= 0
    for x, y in itertools.combinations(entries, 2):
        shared = ({x.sender, *tasks[x.task].receivers} & {y.sender, *tasks[y.task].receivers})
        if shared:
            assert x.end <= y.start or y.end <= x.start, (x, y, shared)
    assert schedule.makespan == pytest.approx(max((e.end for e in entries), default=0.0))
    assert schedule.makespan == pytest.approx(simulate(schedule, cluster), rel=1e-9)
    assert schedule.makespan >= lower_bound(tasks, cluster) * (1 - 1e-9)


# --- unit tasks and in-memory execution ------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(problems(), st.booleans())
def test_tasks_hold_and_cover_exactly_once(problem, allgather):
    shape, spec_a, mesh_a, spec_b, mesh_b = problem
    rs = plan_resharding(shape, spec_a, mesh_a, spec_b, mesh_b, 2, allow_local_allgather=allgather)
    for t in rs.tasks:
        assert t.senders and t.receivers
        assert t.nbytes == math.prod(t.shape) * 2
        for s in t.senders:          # the sender really holds the slice
            box = rs.src_box(s)
            assert all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(t.slice, box))
        holders = [r for r in mesh_a.ranks if all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(t.slice, rs.src_box(r)))]
        assert list(t.senders) == holders
    for r in mesh_b.ranks:           # each receiver's (sent) shard covered exactly once
        box = rs.sent_box(r)
        count = np.zeros(tuple(b - a for a, b in box), dtype=np.int32)
        for t in rs.tasks:
            if r in t.receivers:
                count[box_slices(t.slice, box)] += 1
            else:                    # a task skips only ranks that need none of it
                assert any(hi <= a or lo >= b for (lo, hi), (a, b) in zip(t.slice, box)) or not t.slice
        assert (count == 1).all()
    assert len({t.slice for t in rs.tasks}) == len(rs.tasks)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(problems(), st.booleans(), st.sampled_from([None, "naive", "randomized_greedy"]), st.sampled_from([1, 2, 4]))
def test_in_memory_gives_every_device_its_slice(problem, allgather, algorithm, per_host):
    shape, spec_a, mesh_a, spec_b, mesh_b = problem
    rs = plan_resharding(shape, spec_a, mesh_a, spec_b, mesh_b, 4, allow_local_allgather=allgather)
    full = full_tensor(shape)
    schedule = None if algorithm is None else schedule_tasks(rs.tasks, make_cluster(per_host), algorithm, **FAST)
    out = reshard_in_memory(source_locals(rs, full), rs, schedule)
    assert set(out) == set(mesh_b.ranks)
    for r in mesh_b.ranks:
        want = full[spec_b.local_slices(shape, mesh_b, mesh_b.coord(r))]
        np.testing.assert_array_equal(out[r], want)


def test_three_paper_cases():
    # (a) equal mesh shapes: with the local all-gather every slice goes to ONE receiver
    a, b = meshes((2, 2), (2, 2))
    plain = plan_resharding((8, 8), "S0R", a, "S0R", b)
    assert len(plain.tasks) == 2 and all(len(t.receivers) == 2 and len(t.senders) == 2 for t in plain.tasks)
    scattered = plan_resharding((8, 8), "S0R", a, "S0R", b, allow_local_allgather=True)
    assert str(scattered.sent_spec) == "S01R"
    assert len(scattered.tasks) == 4 and all(len(t.receivers) == 1 for t in scattered.tasks)
    assert [(s.axis, str(s.before), str(s.after)) for s in scattered.allgathers] == [(1, "S01R", "S0R")]
    # (b) unequal shapes, send/recv: 1x2 → 2x1 with the split moving to the other axis
    a, b = meshes((1, 2), (2, 1))
    tasks = cross_mesh_tasks((4, 6), "RS1", a, "S0R", b)
    assert len(tasks) == 4 and all(len(t.senders) == 1 and len(t.receivers) == 1 for t in tasks)
    # (c) unequal shapes with a local all-gather: 1x1 → 1x3 replicated
    a, b = meshes((1, 1), (1, 3))
    bcast = plan_resharding((6, 2), "RR", a, "RR", b)
    assert len(bcast.tasks) == 1 and bcast.tasks[0].receivers == (1, 2, 3)
    local = plan_resharding((6, 2), "RR", a, "RR", b, allow_local_allgather=True)
    assert str(local.sent_spec) == "S1R" and len(local.tasks) == 3
    assert all(len(t.receivers) == 1 and t.nbytes == 16 for t in local.tasks)


def test_allgather_axes_and_indivisible_dims():
    a, b = meshes((1, 1), (2, 2))
    both = plan_resharding((4, 4), "RR", a, "RR", b, allow_local_allgather=True)
    assert str(both.sent_spec) == "S01R" and [s.axis for s in both.allgathers] == [1, 0]
    inner = plan_resharding((4, 4), "RR", a, "RR", b, allow_local_allgather=True, allgather_axes=(1,))
    assert str(inner.sent_spec) == "S1R"
    odd = plan_resharding((3, 4), "RR", a, "RR", b, allow_local_allgather=True)
    assert str(odd.sent_spec) == "RS01"          # dim 0 cannot be split in two
    nothing = plan_resharding((3, 5), "RR", a, "RR", b, allow_local_allgather=True)
    assert nothing.sent_spec == nothing.dst_spec and nothing.allgathers == ()


def test_scalar_and_bad_inputs():
    a, b = meshes((1, 2), (1, 3))
    rs = plan_resharding((), "", a, "", b)
    assert len(rs.tasks) == 1 and rs.tasks[0].nbytes == 4 and rs.tasks[0].slice == ()
    out = reshard_in_memory({0: np.array(5.0, np.float32), 1: np.array(5.0, np.float32)}, rs)
    assert all(float(v) == 5.0 for v in out.values())
    with pytest.raises(ValueError, match="non-partial"):
        plan_resharding((4,), "R+P1", a, "R", b)
    with pytest.raises(ValueError, match="does not divide"):
        plan_resharding((4,), "R", a, "S1", b)
    with pytest.raises(ValueError, match="share ranks"):
        plan_resharding((4,), "R", a, "R", LogicalMesh((1, 2), (1, 2)))
    with pytest.raises(ValueError, match="unknown cross-mesh scheduling algorithm"):
        schedule_tasks(rs.tasks, make_cluster(2), "magic")
    with pytest.raises(ValueError, match="shape"):
        reshard_in_memory({0: np.zeros(3, np.float32)}, plan_resharding((4,), "R", a, "R", b))


def test_serialization_round_trip():
    a, b = meshes((2, 2), (1, 3))
    rs = plan_resharding((4, 6), "S0S1", a, "RR", b, allow_local_allgather=True)
    assert CrossMeshTransfer.from_dict(json.loads(json.dumps(rs.to_dict()))) == rs
    schedule = schedule_tasks(rs.tasks, make_cluster(2), **FAST)
    again = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
    assert again == schedule and again.stats == schedule.stats
    with pytest.raises(ValueError, match="version"):
        Schedule.from_dict({**schedule.to_dict(), "version": 99})


# --- simulator and lower bound ---------------------------------------------------------


def test_simulator_shares_a_hosts_nic():
    cluster = make_cluster(4)           # hosts of 4: ranks 0-3 host 0, 4-7 host 1, 8-11 host 2, ...
    one = UnitTask(((0, 1000),), (0,), (4,), 25_000_000)
    other = UnitTask(((1000, 2000),), (1,), (5,), 25_000_000)
    alone = simulate([one], cluster)
    assert alone == pytest.approx(20e-6 + 1e-3)
    # two tasks leaving host 0 for host 1 at once share the NIC: twice as long
    assert simulate([one, other], cluster, [0, 1]) == pytest.approx(20e-6 + 2e-3)
    # to different hosts from different hosts: no sharing
    third = UnitTask(((1000, 2000),), (8,), (5,), 25_000_000)
    far = UnitTask(((1000, 2000),), (8,), (12,), 25_000_000)
    assert simulate([one, far], cluster, [0, 8]) == pytest.approx(alone)
    # ingress of host 1 shared by senders on two hosts
    assert simulate([one, third], cluster, [0, 8]) == pytest.approx(20e-6 + 2e-3)
    # inside a host: the fast link, no NIC
    local = UnitTask(((0, 1000),), (0,), (1,), 30_000_000)
    assert simulate([local], cluster) == pytest.approx(5e-6 + 1e-4)
    # a broadcast to three hosts: log2(4) = 2 latencies, the slow link's bandwidth
    bcast = UnitTask(((0, 1000),), (0,), (4, 8, 12), 25_000_000)
    assert simulate([bcast], cluster) == pytest.approx(40e-6 + 1e-3)
    assert lower_bound([one, other], cluster) == pytest.approx(20e-6 + 2e-3)


def test_broadcast_beats_send_recv_across_hosts():
    cluster = make_cluster(4)
    a = LogicalMesh((1, 4), (0, 1, 2, 3))
    b = LogicalMesh((2, 4), tuple(range(4, 12)))
    rs = plan_resharding((1024, 1024), "RR", a, "RR", b)
    bcast = schedule_tasks(rs.tasks, cluster, **FAST).makespan
    sendrecv = schedule_tasks(as_send_recv(rs.tasks), cluster, "naive").makespan
    assert sendrecv > 3 * bcast


def test_allgather_seconds():
    cluster = make_cluster(4)
    a, b = LogicalMesh((1, 1), (0,)), LogicalMesh((1, 4), (4, 5, 6, 7))
    rs = plan_resharding((4096, 1024), "RR", a, "RR", b, allow_local_allgather=True)
    piece = 1024 * 1024 * 4
    assert allgather_seconds(rs, cluster) == pytest.approx(3 * (5e-6 + piece / 300e9))
    assert allgather_seconds(plan_resharding((8,), "R", a, "R", b), cluster) == 0.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(problems(), st.booleans(), st.sampled_from([1, 2, 4]))
def test_every_scheduler_gives_a_valid_schedule(problem, allgather, per_host):
    shape, spec_a, mesh_a, spec_b, mesh_b = problem
    rs = plan_resharding(shape, spec_a, mesh_a, spec_b, mesh_b, 4, allow_local_allgather=allgather)
    cluster = make_cluster(per_host)
    for algorithm in ALGORITHMS:
        schedule = schedule_tasks(rs.tasks, cluster, algorithm, node_budget=3000, **FAST)
        assert schedule.algorithm == algorithm
        check_schedule(schedule, rs.tasks, cluster)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(problems(max_factor=1), st.booleans(), st.sampled_from([1, 2, 4]))
def test_dfs_is_no_worse_than_the_others_on_small_cases(problem, allgather, per_host):
    shape, spec_a, mesh_a, spec_b, mesh_b = problem
    rs = plan_resharding(shape, spec_a, mesh_a, spec_b, mesh_b, 4, allow_local_allgather=allgather)
    assume(len(rs.tasks) <= 6)
    cluster = make_cluster(per_host)
    dfs = schedule_tasks(rs.tasks, cluster, "dfs", node_budget=500_000)
    assert dfs.stats["complete"]
    for algorithm in ("naive", "load_balance", "randomized_greedy"):
        other = schedule_tasks(rs.tasks, cluster, algorithm, **FAST)
        assert dfs.makespan <= other.makespan * (1 + 1e-9), algorithm


def brute_force(tasks, cluster) -> float:
    model = Simulator(tasks, cluster)
    best = math.inf
    for senders in itertools.product(*(t.senders for t in tasks)):
        for order in itertools.permutations(range(len(tasks))):
            best = min(best, model.makespan(senders, order))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dfs_is_exact_against_brute_force(seed):
    """Random small task sets with overlapping senders and receivers, uneven sizes and a
    mix of intra- and inter-host links: dfs finds the optimum over all orders and senders,
    and the lower bound is below it."""
    rng = np.random.default_rng(seed)
    cluster = make_cluster(2, hosts=4)
    tasks = []
    for k in range(int(rng.integers(2, 5))):
        senders = tuple(sorted(rng.choice(4, size=int(rng.integers(1, 3)), replace=False).tolist()))
        receivers = tuple(sorted((4 + rng.choice(4, size=int(rng.integers(1, 3)), replace=False)).tolist()))
        tasks.append(UnitTask(((k, k + 1),), senders, receivers, int(rng.integers(1, 40)) * 1_000_000))
    exact = brute_force(tasks, cluster)
    dfs = schedule_tasks(tasks, cluster, "dfs", node_budget=1_000_000)
    assert dfs.stats["complete"]
    assert dfs.makespan == pytest.approx(exact, rel=1e-9)
    assert lower_bound(tasks, cluster) <= exact * (1 + 1e-9)
    check_schedule(dfs, tasks, cluster)


def test_randomized_greedy_is_deterministic_and_not_worse_than_naive():
    cluster = make_cluster(2)
    a, b = meshes((2, 4), (4, 2))
    rs = plan_resharding((64, 64), "RS1", a, "S0R", b)
    one = schedule_tasks(rs.tasks, cluster, seed=3, **FAST)
    two = schedule_tasks(rs.tasks, cluster, seed=3, **FAST)
    assert one == two
    assert one.makespan <= schedule_tasks(rs.tasks, cluster, "naive").makespan * (1 + 1e-9)
    assert schedule_tasks([], cluster).makespan == 0.0


class SlowClock:
    """A clock that advances ``step`` seconds at every reading: a much slower machine."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def slow_clock_case():
    cluster = make_cluster(4)
    a, b = meshes((1, 4), (2, 4))
    return cluster, plan_resharding((64, 64), "RS1", a, "S0R", b).tasks


@pytest.mark.parametrize("algorithm,options,step", [("randomized_greedy", {"trials": 16, "polish": 64}, 0.5),
                                                    ("dfs", {"node_budget": 1500}, 5.0)])
def test_a_slow_clock_does_not_change_the_schedule(algorithm, options, step, monkeypatch):
    """Work limits, not the clock, end the search: a clock that runs ``step`` seconds per
    reading (past the old 5 s budget, within the safety limit) gives the same schedule."""
    cluster, tasks = slow_clock_case()
    expected = schedule_tasks(tasks, cluster, algorithm, **options)
    clock = SlowClock(step)
    monkeypatch.setattr(schedulers, "time", SimpleNamespace(monotonic=clock, perf_counter=clock))
    slow = schedule_tasks(tasks, cluster, algorithm, **options)
    assert clock.now > 5.0
    assert slow == expected and slow.stats == expected.stats
    assert "stopped_at_time_limit" not in slow.stats


def test_the_safety_time_limit_is_reported(monkeypatch):
    cluster, tasks = slow_clock_case()
    monkeypatch.setattr(schedulers, "time", SimpleNamespace(monotonic=SlowClock(1000.0)))
    with pytest.warns(UserWarning, match="safety time limit"):
        schedule = schedule_tasks(tasks, cluster, trials=16, polish=64)
    assert schedule.stats["stopped_at_time_limit"] and schedule.stats["trials"] == 1
    check_schedule(schedule, tasks, cluster)


# --- rearranging inside the source mesh ------------------------------------------------


@st.composite
def problems_with_send_spec(draw, max_factor: int = 2):
    """(shape, src spec, src mesh, send spec, dst spec, dst mesh): every split of the
    three specs divides evenly (the send spec lives on the source mesh)."""
    ndim = draw(st.integers(1, 3))
    shape_a, shape_b = draw(st.sampled_from(MESH_SHAPES)), draw(st.sampled_from(MESH_SHAPES))
    mesh_a, mesh_b = meshes(shape_a, shape_b, draw(st.integers(0, 2)))
    spec_a, send, spec_b = draw(spec_for(ndim)), draw(spec_for(ndim)), draw(spec_for(ndim))
    shape = []
    for d in range(ndim):
        unit = math.lcm(spec_a.shards(d, mesh_a), send.shards(d, mesh_a), spec_b.shards(d, mesh_b))
        shape.append(unit * draw(st.integers(1, max_factor)))
    assume(math.prod(shape) <= 4096)
    return tuple(shape), spec_a, mesh_a, send, spec_b, mesh_b


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(problems_with_send_spec(), st.booleans(), st.sampled_from([None, "naive", "randomized_greedy"]))
def test_in_memory_with_a_send_spec_gives_every_device_its_slice(problem, allgather, algorithm):
    shape, spec_a, mesh_a, send, spec_b, mesh_b = problem
    rs = plan_resharding(shape, spec_a, mesh_a, spec_b, mesh_b, 4, allow_local_allgather=allgather, send_spec=send)
    assert rs.send_spec == send and (rs.prepare == ()) == (send == spec_a)
    assert rs.prepare == reshard_steps(spec_a, send) or send == spec_a
    for t in rs.tasks:               # senders hold the slice after the rearrangement
        for s in t.senders:
            assert all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(t.slice, rs.send_box(s)))
    full = full_tensor(shape)
    schedule = None if algorithm is None else schedule_tasks(rs.tasks, make_cluster(2), algorithm, **FAST)
    out = reshard_in_memory(source_locals(rs, full), rs, schedule)
    assert set(out) == set(mesh_b.ranks)
    for r in mesh_b.ranks:
        np.testing.assert_array_equal(out[r], full[spec_b.local_slices(shape, mesh_b, mesh_b.coord(r))])


def test_send_spec_serialization_and_older_dicts():
    a, b = meshes((2, 2), (1, 3))
    rs = plan_resharding((4, 6), "S0S1", a, "RR", b, allow_local_allgather=True, send_spec="S01R")
    assert [s.kind.name for s in rs.prepare] == ["all_to_all"]
    data = json.loads(json.dumps(rs.to_dict()))
    assert data["send_spec"] == "S01R" and data["prepare"][0]["to_dim"] == 0
    assert CrossMeshTransfer.from_dict(data) == rs
    older = {k: v for k, v in plan_resharding((4, 6), "S0S1", a, "RR", b).to_dict().items()
             if k not in ("send_spec", "prepare")}
    again = CrossMeshTransfer.from_dict(older)
    assert again.send_spec == again.src_spec and again.prepare == ()
    assert again == plan_resharding((4, 6), "S0S1", a, "RR", b)
    gather = plan_resharding((4, 6), "S0S1", a, "RR", b, send_spec="RR")
    assert [(s.kind.name, s.axis, s.dim) for s in gather.prepare] == [("all_gather", 0, 0), ("all_gather", 1, 1)]
    assert CrossMeshTransfer.from_dict(json.loads(json.dumps(gather.to_dict()))) == gather


def test_bad_send_specs():
    a, b = meshes((2, 2), (1, 2))
    with pytest.raises(ValueError, match="non-partial send spec"):
        plan_resharding((4, 4), "S0R", a, "RR", b, send_spec="RR+P1")
    with pytest.raises(ValueError, match="send spec S01R does not divide"):
        plan_resharding((6, 4), "RS0", a, "RR", b, send_spec="S01R")
    with pytest.raises(ValueError, match="send spec S0 does not divide"):   # wrong rank
        plan_resharding((4, 4), "S0R", a, "RR", b, send_spec="S0")
    rs = plan_resharding((4, 4), "S0R", a, "RR", b, send_spec="RS1")
    with pytest.raises(ValueError, match="shape"):   # the shard must still be the src_spec one
        reshard_in_memory({r: np.zeros((4, 2), np.float32) for r in a.ranks}, rs)


def test_send_spec_candidates():
    a = LogicalMesh((2, 4), tuple(range(8)))
    found = send_spec_candidates((8, 8), "S0R", a)
    assert found[0] == ShardingSpec.parse("S0R")
    assert len(found) == len(set(found)) == 9          # each axis: dim 0, dim 1 or none
    assert all(not s.partial and s.is_valid_for((8, 8), a) for s in found)
    assert ShardingSpec.parse("S01R") in found and ShardingSpec.parse("S1S0") in found
    odd = send_spec_candidates((6, 8), "RR", a)          # 6 does not split in 4 or 8
    assert all(s.is_valid_for((6, 8), a) for s in odd) and ShardingSpec.parse("S1R") not in odd
    assert ShardingSpec.parse("S0R") in odd
    row = LogicalMesh((1, 4), (4, 5, 6, 7))               # axis 0 has size 1: no S0 layouts again
    found = send_spec_candidates((8, 8), "S0S1", row)
    assert found[0] == ShardingSpec.parse("S0S1") and [str(s) for s in found[1:]] == ["RR", "S1R"]
    assert send_spec_candidates((), "", a) == [ShardingSpec(())]


def test_prepare_seconds_use_the_links_of_the_actual_ranks():
    cluster = make_cluster(4)
    inside = LogicalMesh((1, 4), (4, 5, 6, 7))             # one host
    across = LogicalMesh((1, 4), (2, 3, 4, 5))             # two hosts
    assert mesh_links(cluster, inside)[1] == cluster.intra_host
    assert mesh_links(cluster, across)[1] == cluster.inter_host
    b = LogicalMesh((1, 2), (8, 9))
    slow = plan_resharding((64, 64), "S1R", across, "RR", b, send_spec="RS1")
    fast = plan_resharding((64, 64), "S1R", inside, "RR", b, send_spec="RS1")
    model = CollectiveModel({0: cluster.intra_host, 1: cluster.inter_host})
    assert prepare_seconds(slow, cluster) == pytest.approx(
        reshard_seconds(slow.src_spec, slow.send_spec, (64, 64), 4, across, model))
    assert prepare_seconds(slow, cluster) > prepare_seconds(fast, cluster) > 0
    assert prepare_seconds(plan_resharding((64, 64), "S1R", inside, "RR", b), cluster) == 0.0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(problems(), st.sampled_from([False, True]), st.sampled_from(["naive", "load_balance", "randomized_greedy"]),
       st.sampled_from([1, 2, 4]))
def test_best_resharding_is_never_worse_than_no_rearrangement(problem, allgather, algorithm, per_host):
    shape, spec_a, mesh_a, spec_b, mesh_b = problem
    cluster = make_cluster(per_host)
    choice = best_resharding(shape, spec_a, mesh_a, spec_b, mesh_b, 4, cluster, algorithm,
                             local_allgather=allgather, **FAST)
    direct = plan_resharding(shape, spec_a, mesh_a, spec_b, mesh_b, 4, allow_local_allgather=allgather)
    plain = schedule_tasks(direct.tasks, cluster, algorithm, **FAST).makespan + allgather_seconds(direct, cluster)
    assert choice.seconds <= plain * (1 + 1e-12)
    rs = choice.transfer
    assert choice.seconds == pytest.approx(prepare_seconds(rs, cluster) + choice.schedule.makespan
                                           + allgather_seconds(rs, cluster))
    assert choice.schedule.tasks == rs.tasks and choice.schedule.algorithm == algorithm
    full = full_tensor(shape)
    out = reshard_in_memory(source_locals(rs, full), rs, choice.schedule)
    for r in mesh_b.ranks:
        np.testing.assert_array_equal(out[r], full[spec_b.local_slices(shape, mesh_b, mesh_b.coord(r))])
    clear_best_resharding_cache()   # deterministic: recomputed, the same choice
    again = best_resharding(shape, spec_a, mesh_a, spec_b, mesh_b, 4, cluster, algorithm,
                            local_allgather=allgather, **FAST)
    assert again is not choice and again == choice


def test_best_resharding_fixes_the_many_small_slices_case():
    """2x8 S01R -> 4x8 RS1 (hosts of 8): sent directly, every B device receives 16 small
    slices from 16 devices, one after another, each paying its latency; an all-to-all
    inside A's hosts first leaves 2 large slices per B device."""
    cluster = make_cluster(8)
    a = LogicalMesh((2, 8), tuple(range(16)))
    b = LogicalMesh((4, 8), tuple(range(16, 48)))
    shape = (8192, 2048)
    direct = plan_resharding(shape, "S01R", a, "RS1", b)
    plain = schedule_tasks(direct.tasks, cluster, **FAST)
    choice = best_resharding(shape, "S01R", a, "RS1", b, 4, cluster, local_allgather=False, **FAST)
    rs = choice.transfer
    assert rs.send_spec != rs.src_spec and rs.prepare and choice.prepare_seconds > 0
    assert all(s.axis == 1 for s in rs.prepare)            # only inside A's hosts
    assert choice.seconds < plain.makespan
    per_device = max(sum(r in t.receivers for t in rs.tasks) for r in b.ranks)
    assert per_device < max(sum(r in t.receivers for t in direct.tasks) for r in b.ranks)
    assert choice.schedule.makespan <= lower_bound(rs.tasks, cluster) * 1.15
    # without rearrangement allowed, it is the direct transfer
    same = best_resharding(shape, "S01R", a, "RS1", b, 4, cluster, local_allgather=False, rearrange=False, **FAST)
    assert same.transfer == direct and same.seconds == pytest.approx(plain.makespan)
