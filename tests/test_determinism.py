"""The same command writes the same plan on any machine: no wall-clock limit may decide
anything. Planning under a clock that runs a thousand times too fast must give a plan
byte-identical to planning under the real one."""

from __future__ import annotations

import itertools
import time

import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from sample_models import SAMPLES
from tests.conftest import plan_digest


@pytest.mark.parametrize("name,mesh", [("gpt", (2, 4)), ("resnet", (2, 2))])
def test_plan_does_not_depend_on_the_clock(name, mesh, tmp_path, monkeypatch):
    sample = SAMPLES[name]

    def plan(directory):
        make_plan(sample.path, make_cluster(mesh, "h100-80g"), dict(sample.dims), directory,
                  PlanOptions(microbatches=2))
        return plan_digest(directory)

    expected = plan(tmp_path / "real")
    ticks = itertools.count()
    real = time.perf_counter
    # Every reading of the clock is ten more seconds later than the last.
    monkeypatch.setattr(time, "perf_counter", lambda: real() + 10.0 * next(ticks))
    monkeypatch.setattr(time, "monotonic", lambda: real() + 10.0 * next(ticks))
    assert plan(tmp_path / "slow") == expected
