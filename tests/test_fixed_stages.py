"""``--stages N``: exactly N pipeline stages (the planner still chooses their layers,
submeshes and sharding), plans that compute the model, and one error line where N
cannot be met or conflicts with another option."""

from __future__ import annotations

import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from sample_models import SAMPLES, make_inputs
from tests.conftest import assert_close, check_against_onnxruntime, run_cli
from tests.test_cli_errors import _one_error_line

GPT = SAMPLES["gpt"]
DIMS = {"batch": 4, "seq": 32}


@pytest.mark.parametrize("count", [1, 2, 4])
def test_the_plan_has_exactly_the_stages_asked_for_and_computes_the_model(count, tmp_path):
    """The gpt sample on 2x2 plans itself in 4 stages; asked for 1, 2 or 4 it has that
    many, each estimated no faster than the free plan, and the programs (in process)
    give onnxruntime's outputs."""
    free = make_plan(GPT.path, make_cluster((2, 2), "h100-80g"), DIMS, tmp_path / "free",
                     PlanOptions(microbatches=2), programs=False)
    plan = make_plan(GPT.path, make_cluster((2, 2), "h100-80g"), DIMS, tmp_path / "plan",
                     PlanOptions(microbatches=2, stages=count))
    assert len(plan.stages) == count
    assert plan.estimate["latency_seconds"] >= free.estimate["latency_seconds"] * (1 - 1e-9)
    inputs = make_inputs("gpt", DIMS, seed=4)
    assert_close(run_in_process(plan, tmp_path / "plan", inputs), reference_outputs(plan, inputs))


@pytest.mark.mpi
def test_a_fixed_stage_plan_runs_under_mpiexec(tmp_path):
    plan = make_plan(GPT.path, make_cluster((2, 2), "h100-80g"), DIMS, tmp_path / "plan",
                     PlanOptions(microbatches=2, stages=3))
    assert len(plan.stages) == 3
    check_against_onnxruntime(plan, tmp_path / "plan", make_inputs("gpt", DIMS, seed=5), tmp_path)


@pytest.mark.parametrize("extra,fragments", [
    (["--stages", "9"], ["no plan of exactly 9 stage(s) fits"]),
    (["--stages", "2", "--max-stages", "2"], ["--stages", "--max-stages"]),
    (["--stages", "2", "--policy", "megatron"], ["--policy megatron chooses its own stages"]),
])
def test_stages_that_cannot_be_met_are_one_error_line(extra, fragments, tmp_path):
    result = run_cli("plan", GPT.path, "--mesh", "2x2", "--dim", "batch=4", "--dim", "seq=32", *extra,
                     "-o", tmp_path / "out")
    _one_error_line(result, *fragments)
    assert not (tmp_path / "out").exists()
