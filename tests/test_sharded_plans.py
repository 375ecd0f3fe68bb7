"""Two-level plans: stages sharded over their submesh by the ILP, run in-process and under
mpiexec, compared with onnxruntime on the unpartitioned model."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import load_cluster_file
from meshplan.make_plan import make_plan
from meshplan.inter.pipeline import PlanOptions
from meshplan.emit.report import text_report
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from sample_models import SAMPLES, make_gpt, make_inputs
from tests.conftest import assert_close, check_against_onnxruntime

DIMS = {"batch": 2, "seq": 32}


@pytest.fixture(scope="module")
def wide_gpt(tmp_path_factory):
    """A GPT-style stack with 8.5 MB of weights: more than the 4 MiB devices below hold."""
    path = tmp_path_factory.mktemp("gpt") / "gpt_wide.onnx"
    onnx.save(make_gpt(layers=2, hidden=256, heads=8, vocab=1024, max_seq=64), str(path))
    return path


def _cluster(tmp_path, hosts, per_host, memory_gb=0.004):
    path = tmp_path / "cluster.toml"
    path.write_text(f"hosts = {hosts}\ndevices_per_host = {per_host}\n[device]\npreset = 'h100-80g'\n"
                    f"memory_gb = {memory_gb}\n")
    return load_cluster_file(path)


def _param_bytes(path) -> int:
    return sum(np.prod(t.dims) * 4 for t in onnx.load(str(path)).graph.initializer)


@pytest.mark.mpi
def test_tensor_parallel_1x4(wide_gpt, tmp_path):
    """One stage over 1x4 whose weights cannot be replicated: the ILP must shard them."""
    plan_dir = tmp_path / "plan"
    plan = make_plan(wide_gpt, _cluster(tmp_path, 1, 4), DIMS, plan_dir, PlanOptions(max_stages=1))
    assert len(plan.stages) == 1 and plan.stages[0].devices == [0, 1, 2, 3]
    sharded = plan.stages[0].strategies
    assert any("MatMul" in op or "matmul" in op for op in sharded), sharded
    # plan.json names the spec of every tensor at each segment boundary (collective).
    collectives = plan.stages[0].collectives
    assert collectives and all({"tensor", "op", "axis", "from_spec", "to_spec"} <= set(c) for c in collectives)
    program = onnx.load(str(plan_dir / "rank0.onnx"), load_external_data=False)
    assert len(collectives) == sum(1 for node in program.graph.node if node.domain == "meshplan")
    total = _param_bytes(wide_gpt)
    for program in plan.programs:
        size = (plan_dir / program.file).stat().st_size
        assert size <= 0.30 * total, (program.file, size, total)
    check_against_onnxruntime(plan, plan_dir, make_inputs(onnx.load(str(wide_gpt)), DIMS, seed=1), tmp_path)


@pytest.mark.mpi
def test_two_stages_each_sharded_2x2(wide_gpt, tmp_path):
    plan_dir = tmp_path / "plan"
    plan = make_plan(wide_gpt, _cluster(tmp_path, 2, 2), DIMS, plan_dir, PlanOptions(max_stages=2))
    assert [len(s.devices) for s in plan.stages] == [2, 2]
    assert all(s.strategies for s in plan.stages), "each stage should be sharded"
    assert plan.reshardings and "tensor(s) resharded" in text_report(plan)
    check_against_onnxruntime(plan, plan_dir, make_inputs(onnx.load(str(wide_gpt)), DIMS, seed=2), tmp_path)


CASES = [(name, policy) for name in ("mlp", "resnet", "gpt") for policy in ("data", "megatron")
         if (name, policy) != ("resnet", "megatron")]   # a CNN has no Megatron matrix products


@pytest.mark.parametrize("mesh", [(1, 2), (2, 2), (1, 4)], ids=lambda m: f"{m[0]}x{m[1]}")
@pytest.mark.parametrize("name, policy", CASES)
def test_sample_models_sharded_in_process(name, mesh, policy, tmp_path):
    """Every sample on one stage over the whole mesh, sharded data parallel or with
    Megatron-style matrix products, run in-process against onnxruntime."""
    sample = SAMPLES[name]
    cluster = _cluster(tmp_path, *mesh, memory_gb=80)
    plan_dir = tmp_path / "plan"
    plan = make_plan(sample.path, cluster, dict(sample.dims), plan_dir, PlanOptions(max_stages=1, policy=policy))
    strategies = plan.stages[0].strategies
    assert strategies, "the policy should shard something"
    if policy == "megatron":
        assert any("S1" in s.split("->")[0].split(",")[1] for s in strategies.values()), strategies
    inputs = make_inputs(name, sample.dims, seed=3)
    assert_close(run_in_process(plan, plan_dir, inputs), reference_outputs(plan, inputs))
    data = json.loads((plan_dir / "plan.json").read_text())
    assert data["solver"]["ilp"]["solved"] > 0


def test_sharded_programs_with_external_weights(wide_gpt, tmp_path):
    """Programs split into segments keep their weights in external files (the path that
    lets programs over 2 GB run)."""
    plan_dir = tmp_path / "plan"
    plan = make_plan(wide_gpt, _cluster(tmp_path, 1, 4), DIMS, plan_dir, PlanOptions(max_stages=1),
                     external_threshold=0)
    assert all(p.data_files for p in plan.programs)
    assert plan.stages[0].collectives
    inputs = make_inputs(onnx.load(str(wide_gpt)), DIMS, seed=4)
    assert_close(run_in_process(plan, plan_dir, inputs), reference_outputs(plan, inputs))
