"""The sparse mixture-of-experts sample (``sample_models/moe.py``: top-2 routing, one
NonZero per expert, so each expert sees a data-dependent number of tokens) plans and
matches onnxruntime; with devices holding 40% of its parameters its experts' weights are
split across devices. (1x2 and 1x4 under mpiexec with two microbatches: test_end_to_end.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from sample_models import SAMPLES, make_inputs
from tests.conftest import assert_close, check_against_onnxruntime

SAMPLE = SAMPLES["moe"]


def _expert_weights() -> dict[str, int]:
    model = SAMPLE.load()
    return {t.name: int(np.prod(t.dims)) * 4 for t in model.graph.initializer if ".experts." in t.name}


@pytest.mark.parametrize("mesh", [(1, 2), (1, 4), (2, 2)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_moe_plans_and_runs_in_process(mesh, tmp_path):
    plan = make_plan(SAMPLE.path, make_cluster(mesh, "cpu"), dict(SAMPLE.dims), tmp_path / "plan", PlanOptions())
    for seed in (0, 1):   # different tokens, so different numbers routed to each expert
        feeds = make_inputs("moe", seed=seed)
        assert_close(run_in_process(plan, tmp_path / "plan", feeds), reference_outputs(plan, feeds))


@pytest.mark.mpi
def test_moe_on_2x2_under_mpiexec(tmp_path):
    plan = make_plan(SAMPLE.path, make_cluster((2, 2), "cpu"), dict(SAMPLE.dims), tmp_path / "plan",
                     PlanOptions(microbatches=2))
    check_against_onnxruntime(plan, tmp_path / "plan", make_inputs("moe", seed=3), tmp_path)


@pytest.mark.mpi
def test_moe_experts_split_when_devices_hold_40_percent(tmp_path):
    model = SAMPLE.load()
    total = sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                for t in model.graph.initializer)
    cluster = make_cluster((1, 4), "cpu")
    limit = 0.4 * total
    cluster = replace(cluster, device=replace(cluster.device, memory_bytes=limit))
    plan = make_plan(SAMPLE.path, cluster, dict(SAMPLE.dims), tmp_path / "plan", PlanOptions())
    assert all(stage.memory_bytes <= limit for stage in plan.stages)
    experts = _expert_weights()
    held = []
    for program in plan.programs:
        stored = onnx.load(str(tmp_path / "plan" / program.file), load_external_data=False).graph.initializer
        mine = {t.name: int(np.prod(t.dims)) * 4 for t in stored if ".experts." in t.name}
        held.append(sum(mine.values()))
        assert any("@" in name for name in mine), f"rank {program.rank} holds no slice of an expert weight"
    # No device holds more than half of the experts' bytes: they are spread out.
    assert max(held) <= 0.5 * sum(experts.values())
    check_against_onnxruntime(plan, tmp_path / "plan", make_inputs("moe", seed=2), tmp_path)
