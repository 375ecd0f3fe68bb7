"""Plans depend on their inputs alone: a slow clock or a slow solver gives the same plan
(the ILP stops on a work limit, not on the clock), and a solve cut short by the
wall-clock safety stop is reported in the plan, never silently."""

from __future__ import annotations

import itertools
import json
import time

import mip
import numpy as np
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.intra import ilp
from meshplan.make_plan import make_plan
from sample_models import SAMPLES
from tests.conftest import plan_digest


def _plan(tmp_path, name="gpt", mesh=(2, 2)):
    out = tmp_path / f"plan-{len(list(tmp_path.iterdir()))}"
    make_plan(SAMPLES[name].path, make_cluster(mesh, "h100-80g"), dict(SAMPLES[name].dims), out,
              PlanOptions(microbatches=2))
    return out


def test_plan_is_identical_with_a_slow_clock(tmp_path, monkeypatch):
    reference = plan_digest(_plan(tmp_path))
    real = time.perf_counter
    monkeypatch.setattr(ilp, "clock", lambda: 1000.0 * real())   # every second lasts 1000
    assert plan_digest(_plan(tmp_path)) == reference


def test_plan_is_identical_with_a_slow_solver(tmp_path, monkeypatch):
    reference = plan_digest(_plan(tmp_path))
    optimize = mip.Model.optimize

    def slow(self, *args, **kwargs):
        time.sleep(0.002)
        return optimize(self, *args, **kwargs)

    monkeypatch.setattr(mip.Model, "optimize", slow)
    assert plan_digest(_plan(tmp_path)) == reference


def _problem():
    a = ilp.IlpNode("a", np.array([1.0, 2.0]))
    b = ilp.IlpNode("b", np.array([2.0, 1.0]))
    return ilp.ShardingProblem([a, b], [ilp.IlpEdge(0, 1, np.array([[0.0, 5.0], [5.0, 0.0]]))])


def test_solver_uses_a_work_limit_and_no_tight_clock(monkeypatch):
    seen = {}
    optimize = mip.Model.optimize

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        return optimize(self, *args, **kwargs)

    monkeypatch.setattr(mip.Model, "optimize", spy)
    solution = ilp.solve(_problem())
    assert seen["max_nodes"] == ilp.MAX_NODES and seen["max_seconds"] == ilp.SAFETY_SECONDS
    assert solution.warning is None


@pytest.mark.parametrize("slow_clock", [False, True])
def test_a_solve_cut_short_is_reported(monkeypatch, tmp_path, slow_clock):
    """A FEASIBLE (not proven optimal) answer carries a warning naming the limit that stopped
    it, and the warning reaches the plan's solver statistics."""
    optimize = mip.Model.optimize

    def cut_short(self, *args, **kwargs):
        optimize(self, *args, **kwargs)
        return mip.OptimizationStatus.FEASIBLE

    monkeypatch.setattr(mip.Model, "optimize", cut_short)
    if slow_clock:
        real = time.perf_counter
        monkeypatch.setattr(ilp, "clock", lambda: 1e6 * real())
    warning = ilp.solve(_problem()).warning
    assert warning and ("wall-clock" in warning) == slow_clock
    plan = json.loads((_plan(tmp_path) / "plan.json").read_text())
    assert plan["solver"]["ilp"]["warnings"]


@pytest.mark.parametrize("name,mesh", [("gpt", (2, 4)), ("resnet", (2, 2))])
def test_plan_does_not_depend_on_the_clock(name, mesh, tmp_path, monkeypatch):
    """Every reading of every Python clock ten seconds later than the last: no wall-clock
    limit anywhere (ILP, schedulers, search) may decide anything."""
    reference = plan_digest(_plan(tmp_path, name, mesh))
    ticks = itertools.count()
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + 10.0 * next(ticks))
    monkeypatch.setattr(time, "monotonic", lambda: real() + 10.0 * next(ticks))
    assert plan_digest(_plan(tmp_path, name, mesh)) == reference
