"""0-d (scalar) tensors: scalar inputs and outputs plan, and run in-process and under
mpiexec like any other tensor (their spec prints and parses as '()')."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from meshplan.sharding import ShardingSpec
from tests.conftest import assert_close, check_against_onnxruntime

CASES = {
    "pow_by_scalar": (helper.make_node("Pow", ["x", "y"], ["z"]), [("x", [3, 4]), ("y", [])], [3, 4]),
    "clip_scalar_bounds": (helper.make_node("Clip", ["x", "lo", "hi"], ["z"]), [("x", [3, 4]), ("lo", []), ("hi", [])], [3, 4]),
    "matmul_1d_by_1d": (helper.make_node("MatMul", ["x", "y"], ["z"]), [("x", [4]), ("y", [4])], []),
}


def _case(name, tmp_path):
    node, inputs, out = CASES[name]
    graph = helper.make_graph([node], name, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, out)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(0)
    feeds = {n: np.asarray(rng.random(s) + 0.5, dtype=np.float32) for n, s in inputs}
    return path, feeds


def test_scalar_spec_round_trips():
    for text in ("()", "()+P0", "()+P01"):
        assert str(ShardingSpec.parse(text)) == text


@pytest.mark.parametrize("name", list(CASES))
def test_scalar_tensors_plan_and_run_in_process(name, tmp_path):
    path, feeds = _case(name, tmp_path)
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan", PlanOptions())
    assert_close(run_in_process(plan, tmp_path / "plan", feeds), reference_outputs(plan, feeds))


@pytest.mark.mpi
def test_scalar_tensors_run_under_mpiexec(tmp_path):
    path, feeds = _case("clip_scalar_bounds", tmp_path)
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan", PlanOptions())
    check_against_onnxruntime(plan, tmp_path / "plan", feeds, tmp_path)
