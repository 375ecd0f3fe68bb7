"""Sparse mixtures of experts plan and match onnxruntime on 1x2, 1x4 and 2x2, and with
devices holding 40% of their parameters their experts' weights are split across devices:

- ``sample_models/moe.py``: Mixtral's MoE block as the loop over experts unrolls, one
  NonZero per expert, so each expert sees a data-dependent number of tokens (1x2 and 1x4
  under mpiexec with two microbatches: test_end_to_end);
- ``sample_models/mixtral_dynamo.onnx``: transformers' MixtralForCausalLM exported by
  torch's dynamo exporter, its stacked expert weights gathered per token (GatherND)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from sample_models import SAMPLE_DIR, SAMPLES, make_inputs
from tests.conftest import assert_close, check_against_onnxruntime

SAMPLE = SAMPLES["moe"]
MIXTRAL = SAMPLE_DIR / "mixtral_dynamo.onnx"
MESHES = [(1, 2), (1, 4), (2, 2)]


def _mixtral_inputs(batch: int, seq: int, seed: int) -> dict:
    return {"input_ids": np.random.default_rng(seed).integers(0, 128, (batch, seq)).astype(np.int64)}


def _limited_cluster(mesh, model: onnx.ModelProto, fraction: float):
    total = sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                for t in model.graph.initializer)
    cluster = make_cluster(mesh, "cpu")
    return replace(cluster, device=replace(cluster.device, memory_bytes=fraction * total)), fraction * total


def _stored(plan_dir, program) -> dict[str, int]:
    """The initializers of a rank's program: name → bytes."""
    stored = onnx.load(str(plan_dir / program.file), load_external_data=False).graph.initializer
    return {t.name: int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize for t in stored}


def _expert_weights() -> dict[str, int]:
    model = SAMPLE.load()
    return {t.name: int(np.prod(t.dims)) * 4 for t in model.graph.initializer if ".experts." in t.name}


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_moe_plans_and_runs_in_process(mesh, tmp_path):
    plan = make_plan(SAMPLE.path, make_cluster(mesh, "cpu"), dict(SAMPLE.dims), tmp_path / "plan", PlanOptions())
    for seed in (0, 1):   # different tokens, so different numbers routed to each expert
        feeds = make_inputs("moe", seed=seed)
        assert_close(run_in_process(plan, tmp_path / "plan", feeds), reference_outputs(plan, feeds))


@pytest.mark.mpi
def test_moe_on_2x2_under_mpiexec(tmp_path):
    # On H100 figures the four one-device stages cut inside an expert: its token indices and
    # rows cross stages whole, their shapes first.
    plan = make_plan(SAMPLE.path, make_cluster((2, 2), "h100-80g"), dict(SAMPLE.dims), tmp_path / "plan",
                     PlanOptions(microbatches=2))
    assert any(t.dst_stage >= 0 and t.is_dynamic for t in plan.transfers)
    check_against_onnxruntime(plan, tmp_path / "plan", make_inputs("moe", seed=3), tmp_path)


@pytest.mark.mpi
def test_moe_experts_split_when_devices_hold_40_percent(tmp_path):
    cluster, limit = _limited_cluster((1, 4), SAMPLE.load(), 0.4)
    plan = make_plan(SAMPLE.path, cluster, dict(SAMPLE.dims), tmp_path / "plan", PlanOptions())
    assert all(stage.memory_bytes <= limit for stage in plan.stages)
    experts = _expert_weights()
    held = []
    for program in plan.programs:
        mine = {name: size for name, size in _stored(tmp_path / "plan", program).items() if ".experts." in name}
        held.append(sum(mine.values()))
        assert any("@" in name for name in mine), f"rank {program.rank} holds no slice of an expert weight"
    # No device holds more than half of the experts' bytes: they are spread out.
    assert max(held) <= 0.5 * sum(experts.values())
    check_against_onnxruntime(plan, tmp_path / "plan", make_inputs("moe", seed=2), tmp_path)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_mixtral_export_plans_and_runs_in_process(mesh, tmp_path):
    plan = make_plan(MIXTRAL, make_cluster(mesh, "cpu"), {"batch": 2, "seq": 8}, tmp_path / "plan", PlanOptions())
    feeds = _mixtral_inputs(2, 8, seed=0)
    assert_close(run_in_process(plan, tmp_path / "plan", feeds), reference_outputs(plan, feeds))


@pytest.mark.mpi
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_mixtral_export_under_mpiexec(mesh, tmp_path):
    plan = make_plan(MIXTRAL, make_cluster(mesh, "cpu"), {"batch": 2, "seq": 8}, tmp_path / "plan",
                     PlanOptions(microbatches=2))
    check_against_onnxruntime(plan, tmp_path / "plan", _mixtral_inputs(2, 8, seed=1), tmp_path)


@pytest.mark.mpi
def test_mixtral_stacked_experts_split_when_devices_hold_40_percent(tmp_path):
    # Each token gathers its experts' weights (batch × seq × top-k copies of an expert's
    # matrices as activations), so few tokens: at 2 × 8 tokens the copies alone outgrow 40%.
    model = onnx.load(str(MIXTRAL), load_external_data=False)
    stacks = {t.name: int(np.prod(t.dims)) * 4 for t in model.graph.initializer if len(t.dims) == 3}
    assert len(stacks) == 4   # gate_up and down of 2 layers: [experts, out, in]
    cluster, limit = _limited_cluster((1, 4), model, 0.4)
    plan = make_plan(MIXTRAL, cluster, {"batch": 1, "seq": 4}, tmp_path / "plan", PlanOptions())
    assert all(stage.memory_bytes <= limit for stage in plan.stages)
    for program in plan.programs:
        mine = {name: size for name, size in _stored(tmp_path / "plan", program).items() if name.split("@")[0] in stacks}
        assert mine and all("@" in name for name in mine), f"rank {program.rank} stores a whole expert stack"
        assert sum(mine.values()) <= 0.5 * sum(stacks.values())
    check_against_onnxruntime(plan, tmp_path / "plan", _mixtral_inputs(1, 4, seed=2), tmp_path)
