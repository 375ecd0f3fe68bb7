"""Plan → per-device programs → run, compared with onnxruntime on the unpartitioned model:
in-process for every case, and under mpiexec with 2 and 4 ranks."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.make_plan import make_plan
from meshplan.inter.pipeline import PlanOptions
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from sample_models import SAMPLES, make_inputs
from sample_models.zoo import light_models, with_varied_weights
from tests.conftest import assert_close, check_against_onnxruntime, run_mpi

MESHES = [(1, 2), (1, 4)]


def _plan_and_check(model_path, dims, mesh, microbatches, inputs, tmp_path, **plan_kwargs):
    """Plan, check the in-process run, then the mpiexec run; return the plan."""
    plan_dir = tmp_path / f"plan-{mesh[0]}x{mesh[1]}"
    plan = make_plan(model_path, make_cluster(mesh, "cpu"), dims, plan_dir,
                     PlanOptions(microbatches=microbatches), **plan_kwargs)
    assert plan.num_ranks == mesh[0] * mesh[1]
    # every rank works in one stage or is idle (and says why)
    assert sorted([r for s in plan.stages for r in s.devices] + plan.idle_ranks) == list(range(plan.num_ranks))
    assert not plan.idle_ranks or plan.idle["reason"]
    check_against_onnxruntime(plan, plan_dir, inputs, tmp_path)
    return plan


@pytest.mark.mpi
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("name", list(SAMPLES))
def test_sample_model(name, mesh, tmp_path):
    sample = SAMPLES[name]
    inputs = make_inputs(name, sample.dims, seed=1)
    plan = _plan_and_check(sample.path, dict(sample.dims), mesh, 2, inputs, tmp_path)
    assert plan.microbatches == 2 and plan.batch["microbatch_size"] * 2 == plan.batch["size"]
    # Every operator of the canonical model is in exactly one stage.
    operators = [op for stage in plan.stages for op in stage.operators]
    assert len(operators) == len(set(operators)) == plan.solver["nodes"]


def _data_input(model: onnx.ModelProto):
    """The one true input of a zoo model (older IR versions also list weights as inputs)."""
    weights = {t.name for t in model.graph.initializer}
    value = next(v for v in model.graph.input if v.name not in weights)
    return value.name, [d.dim_value for d in value.type.tensor_type.shape.dim]


def _zoo_cases():
    return [pytest.param(name, id=name) for name in light_models()]


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(_zoo_cases()))
def test_light_model_zoo_varied_weights(name, zoo_dir, tmp_path):
    model = with_varied_weights(onnx.load(str(light_models()[name])), seed=3)
    path = zoo_dir / f"{name}.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location=f"{name}.onnx.data")
    name, shape = _data_input(model)
    inputs = {name: np.random.default_rng(5).standard_normal(shape).astype(np.float32)}
    for mesh in MESHES:
        _plan_and_check(path, {}, mesh, 1, inputs, tmp_path / f"{mesh[1]}")


@pytest.mark.parametrize("name", ["squeezenet", "inception_v1"])
def test_light_model_zoo_as_shipped(name, tmp_path):
    """The unmodified files (constant weights) plan and run in-process too."""
    path = light_models()[name]
    plan = make_plan(path, make_cluster((1, 4), "cpu"), {}, tmp_path / "plan")
    name, shape = _data_input(onnx.load(str(path), load_external_data=False))
    inputs = {name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    assert_close(run_in_process(plan, tmp_path / "plan", inputs), reference_outputs(plan, inputs))


def test_external_data_programs(tmp_path):
    """A model stored with external data, and programs whose weights go to external files."""
    sample = SAMPLES["gpt"]
    model = onnx.load(str(sample.path))
    path = tmp_path / "gpt_ext.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="gpt_ext.data")
    inputs = make_inputs("gpt", sample.dims, seed=2)
    plan_dir = tmp_path / "plan"
    plan = make_plan(path, make_cluster((1, 2), "cpu"), dict(sample.dims), plan_dir, external_threshold=0)
    assert all(p.data_files for p in plan.programs)
    for program in plan.programs:
        onnx.checker.check_model(str(plan_dir / program.file))
    assert_close(run_in_process(plan, plan_dir, inputs), reference_outputs(plan, inputs))


def test_plan_json_contents(tmp_path):
    sample = SAMPLES["gpt"]
    plan_dir = tmp_path / "plan"
    make_plan(sample.path, make_cluster((1, 4), "cpu"), {"batch": 8, "seq": 16}, plan_dir, PlanOptions(microbatches=4))
    data = json.loads((plan_dir / "plan.json").read_text())
    for key in ("format_version", "model_sha256", "cluster", "stages", "microbatches", "programs", "estimate", "solver"):
        assert key in data
    est = data["estimate"]
    stage_seconds = est["stage_seconds"]
    assert est["latency_seconds"] == pytest.approx(sum(stage_seconds) + 3 * max(stage_seconds))
    assert est["throughput_per_second"] == pytest.approx(8 / est["latency_seconds"])
    assert len(est["memory_bytes_per_device"]) == 4 and min(est["memory_bytes_per_device"]) > 0
    assert data["solver"]["layers"] >= 4
    # Wall-clock times are reported, not written: the same command writes the same plan.
    assert not any(key.endswith("seconds") for key in data["solver"]) and "seconds" not in data["solver"]["ilp"]
    for stage in data["stages"]:
        assert stage["operators"] and len(stage["devices"]) == 1 and stage["logical_mesh"] == [1, 1]
    assert sorted(p["file"] for p in data["programs"]) == [f"rank{r}.onnx" for r in range(4)]
    # Each program reads the boundary tensors of its stage and only those.
    for stage in data["stages"]:
        program = onnx.load(str(plan_dir / f"rank{stage['devices'][0]}.onnx"))
        assert [i.name for i in program.graph.input] == stage["inputs"]
        assert [o.name for o in program.graph.output] == stage["outputs"]
        assert program.ir_version <= 13
    svg = (plan_dir / "timeline.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<title>") == 4 * 4


@pytest.mark.mpi
def test_two_hosts_mesh_and_trace(tmp_path):
    sample = SAMPLES["gpt"]
    inputs = make_inputs("gpt", {"batch": 4, "seq": 16}, seed=4)
    plan = _plan_and_check(sample.path, {"batch": 4, "seq": 16}, (2, 2), 4, inputs, tmp_path)
    trace = tmp_path / "trace.json"
    result = run_mpi(4, "run", tmp_path / "plan-2x2", "--inputs", tmp_path / "in.npz", "--repeat", "2",
                     "--trace", trace)
    assert result.returncode == 0, result.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    boxes = [e for e in events if e["ph"] == "X" and e["name"].startswith("stage")]
    assert sorted({e["pid"] for e in boxes}) == [0, 1, 2, 3]
    assert len(boxes) == 4 * plan.microbatches
