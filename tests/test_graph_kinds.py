"""Graphs of every kind onnxruntime runs: 0-d (scalar) tensors (their spec prints and
parses as '()'), models before IR 4 whose initializers are not graph inputs, omitted
optional inputs and outputs, outputs that fold to constants, string inputs written by
numpy, shapes onnx's strict or forward inference does not give, sequences (one clear error)."""

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


def _save(nodes, inputs, outputs, path, initializers=(), opset=17, ir_version=8):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    onnx.save(model, path)
    return path


def _plan_and_compare(path, feeds, tmp_path):
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan", PlanOptions())
    assert_close(run_in_process(plan, tmp_path / "plan", feeds), reference_outputs(plan, feeds))
    return plan


def test_ir3_model_whose_weights_are_not_inputs(tmp_path):
    path = _save([helper.make_node("Add", ["x", "w"], ["z"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                 [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 4])], tmp_path / "old.onnx",
                 [onnx.numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")], opset=8, ir_version=3)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(str(path))                 # what onnx's checker says of it
    plan = _plan_and_compare(path, {"x": np.ones((3, 4), np.float32)}, tmp_path)
    assert all(onnx.load(str(tmp_path / "plan" / p.file)).ir_version >= 4 for p in plan.programs)


def test_omitted_optional_input_and_constant_output(tmp_path):
    nodes = [helper.make_node("Clip", ["x", "", "hi"], ["z"]), helper.make_node("Shape", ["x"], ["s"])]
    path = _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                 [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 4]),
                  helper.make_tensor_value_info("s", TensorProto.INT64, [2])], tmp_path / "m.onnx",
                 [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "hi")])
    _plan_and_compare(path, {"x": np.random.default_rng(0).random((3, 4)).astype(np.float32)}, tmp_path)


def test_string_inputs_written_by_numpy(tmp_path):
    """np.savez writes str arrays as fixed-width unicode ('<U5'); they feed a string input."""
    from meshplan.runtime.tensors import read_inputs

    path = _save([helper.make_node("Identity", ["words"], ["same"])],
                 [helper.make_tensor_value_info("words", TensorProto.STRING, [2])],
                 [helper.make_tensor_value_info("same", TensorProto.STRING, [2])], tmp_path / "s.onnx")
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan", PlanOptions())
    np.savez(tmp_path / "in.npz", words=np.array(["hello", "mesh"]))
    feeds = read_inputs(tmp_path / "in.npz", plan)
    assert feeds["words"].dtype == object
    got = run_in_process(plan, tmp_path / "plan", feeds)
    assert list(got["same"]) == ["hello", "mesh"]


def test_omitted_optional_output(tmp_path):
    """A node whose optional output is left out ('' among its outputs) plans and runs."""
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y", "", "inv_std"], axis=-1)
    path = _save([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8]),
                  helper.make_tensor_value_info("inv_std", TensorProto.FLOAT, [4, 1])], tmp_path / "m.onnx",
                 [onnx.numpy_helper.from_array(np.linspace(0.5, 1.5, 8, dtype=np.float32), "scale"),
                  onnx.numpy_helper.from_array(np.zeros(8, np.float32), "bias")])
    _plan_and_compare(path, {"x": np.random.default_rng(0).random((4, 8)).astype(np.float32)}, tmp_path)


def test_old_function_body_that_strict_inference_rejects(tmp_path):
    """onnx's strict inference fails in MeanVarianceNormalization-13's function body (IR 7);
    lenient inference gives every shape, and the plan matches onnxruntime."""
    path = _save([helper.make_node("MeanVarianceNormalization", ["x"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 4])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4, 4])], tmp_path / "mvn.onnx",
                 opset=13, ir_version=7)
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
    _plan_and_compare(path, {"x": np.random.default_rng(0).random((2, 3, 4, 4)).astype(np.float32)}, tmp_path)


def test_sequences_are_one_clear_error(tmp_path):
    from meshplan.errors import ModelError

    nodes = [helper.make_node("SequenceConstruct", ["x", "x"], ["seq"]),
             helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0)]
    path = _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])], tmp_path / "seq.onnx")
    with pytest.raises(ModelError, match="'seq' .* is a sequence, not a tensor"):
        make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan", PlanOptions())


def test_zero_dim_inputs_stay_zero_dim(tmp_path):
    """Inputs read from .npz and host buffers keep 0-d arrays 0-d (numpy's
    ascontiguousarray would make them 1-d: a BitCast of a scalar would give shape [1])."""
    from meshplan.runtime.buffers import HOST
    from meshplan.runtime.tensors import read_inputs

    path = _save([helper.make_node("Identity", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], tmp_path / "s.onnx")
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan", PlanOptions())
    np.savez(tmp_path / "in.npz", x=np.array(2.5, np.float32))
    assert read_inputs(tmp_path / "in.npz", plan)["x"].shape == ()
    assert HOST.take(np.array(2.5, np.float32), ()).shape == ()


def test_shape_known_only_from_a_consumer(tmp_path):
    """A ReduceSum over axes read from an input has no inferred shape; the Sqrt of it is a
    graph output whose declared shape it shares (ReduceL2's function body)."""
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0), helper.make_node("Sqrt", ["s"], ["y"])]
    path = _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 2]),
                         helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])], tmp_path / "m.onnx", opset=18)
    feeds = {"x": np.random.default_rng(0).random((3, 4, 2)).astype(np.float32), "axes": np.array([1], np.int64)}
    plan = _plan_and_compare(path, feeds, tmp_path)
    assert [s.shape for s in plan.outputs] == [[3, 2]]
