"""When no plan fits: one line with the memory per device the best plan would need, the
memory given and what decided it; the need is the least memory at which the planner
finds a plan (checked by bisecting the device memory)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.errors import PlanError
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from sample_models import SAMPLES


def _attempt(memory: float, mesh, tmp_path, name: str):
    cluster = make_cluster(mesh, "cpu")
    cluster = replace(cluster, device=replace(cluster.device, memory_bytes=memory))
    sample = SAMPLES["mlp"]
    try:
        make_plan(sample.path, cluster, dict(sample.dims), tmp_path / name, PlanOptions(microbatches=2), programs=False)
    except PlanError as error:
        return error
    return None


@pytest.mark.parametrize("mesh", [(1, 2)], ids=["1x2"])
def test_infeasible_error_states_needed_and_given_memory(mesh, tmp_path):
    error = _attempt(4096, mesh, tmp_path, "tiny")
    assert error is not None
    text = str(error)
    assert re.search(r"no plan fits in 4\.00 KiB per device: the best plan needs [\d.]+ (KiB|MiB) per device; "
                     r"its stage of layers? [\d-]+ \(of \d+\) on \d device\(s\) holds .* largest tensor is '[^']+'",
                     text), text
    needed = error.needed_bytes
    assert error.given_bytes == 4096
    # bisect the device memory: the least memory at which a plan is found
    low, high = needed / 2, needed * 2
    assert _attempt(low, mesh, tmp_path, "low") is not None and _attempt(high, mesh, tmp_path, "high") is None
    step = 0
    while high - low > 0.01 * high:
        middle = (low + high) / 2
        if _attempt(middle, mesh, tmp_path, f"m{step}") is None:
            high = middle
        else:
            low = middle
        step += 1
    assert low <= needed * (1 + 1e-6) and needed <= high * (1 + 1e-3), (low, needed, high)
