"""The canonical model is the user's computation: folding removes shape sub-computations
and nothing else, adds no cast or fusion (float16 models stay float16), never reads large
weights, and keeps onnx's and onnxruntime's rejections as one-line errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshplan.cost.cluster import make_cluster
from meshplan.errors import ModelError
from meshplan.make_plan import make_plan
from meshplan.model.weights import tensor_value
from meshplan.model.load import canonicalize
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from sample_models import make_gpt
from tests.conftest import assert_close

SHAPE_OPS = {"Shape", "Gather", "Unsqueeze", "Concat", "Range", "Slice"}


def _ops(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def _gpt_fp16(path):
    """The sample GPT in float16 (weights, activations, inputs and outputs), weights external."""
    model = make_gpt(layers=2, hidden=64, heads=4, vocab=128, max_seq=16)
    for tensor in model.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float16)))
    for value in list(model.graph.output) + list(model.graph.input):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    del model.graph.value_info[:]
    onnx.checker.check_model(model, full_check=True)
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    return path


def test_float16_model_keeps_its_ops_and_dtypes(tmp_path):
    path = _gpt_fp16(tmp_path / "gpt16.onnx")
    source = onnx.load(str(path), load_external_data=False)
    canonical = canonicalize(path, {"batch": 2, "seq": 8}, tmp_path / "work").model
    removed = _ops(source) - _ops(canonical)
    assert not (_ops(canonical) - _ops(source)), "folding added operators"
    assert set(removed) <= SHAPE_OPS and removed["Shape"] == _ops(source)["Shape"]
    assert "Cast" not in _ops(canonical)
    for tensor in canonical.graph.initializer:
        assert tensor.data_type != TensorProto.FLOAT, tensor.name
    floats = [v for v in canonical.graph.value_info if v.type.tensor_type.elem_type == TensorProto.FLOAT]
    assert not floats, [v.name for v in floats]


def test_float16_model_plans_and_runs(tmp_path):
    path = _gpt_fp16(tmp_path / "gpt16.onnx")
    dims = {"batch": 4, "seq": 8}
    plan_dir = tmp_path / "plan"
    plan = make_plan(path, make_cluster((1, 4), "cpu"), dims, plan_dir)
    ids = np.random.default_rng(0).integers(0, 128, size=(4, 8)).astype(np.int64)
    expected = reference_outputs(plan, {"input_ids": ids})
    actual = run_in_process(plan, plan_dir, {"input_ids": ids})
    assert actual["logits"].dtype == np.float16
    assert_close(actual, expected, rtol=1e-2, atol=1e-2)


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_large_weights_are_never_read(tmp_path):
    """A weight over the folding limit enters as dims only: a corrupt data file for it
    is noticed when it is copied, not loaded into onnxruntime or folded; a chain on it
    (Transpose of a weight) stays in the graph."""
    weight = numpy_helper.from_array(np.arange(256 * 300, dtype=np.float32).reshape(256, 300), "w")
    model = _model(
        [helper.make_node("Transpose", ["w"], ["wt"]),
         helper.make_node("MatMul", ["x", "wt"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 300])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 256])], [weight])
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="m.onnx.data")
    canonical = canonicalize(path, {"n": 2}, tmp_path / "work")
    assert _ops(canonical.model) == Counter({"Transpose": 1, "MatMul": 1})
    (w,) = canonical.model.graph.initializer
    assert w.data_location == TensorProto.EXTERNAL and not w.raw_data
    # Not copied: the canonical model reads the source's data file through a link.
    location = {e.key: e.value for e in w.external_data}["location"]
    assert (canonical.path.parent / location).resolve() == (tmp_path / "m.onnx.data").resolve()
    np.testing.assert_array_equal(tensor_value(w, canonical.path.parent), numpy_helper.to_array(weight))
    (tmp_path / "m.onnx.data").write_bytes(b"\0" * 16)
    with pytest.raises(ModelError, match="tensor 'w'"):
        canonicalize(path, {"n": 2}, tmp_path / "work2")


def test_folds_constants_and_shape_chains_but_not_large_results(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    nodes = [
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array([2], np.int64))),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Mul", ["s", "two"], ["s2"]),                    # [2n, 16]: folded
        helper.make_node("ConstantOfShape", ["big_shape"], ["big"],        # 300×300: stays
                         value=numpy_helper.from_array(np.array([0.5], np.float32))),
        helper.make_node("Tile", ["x", "s2"], ["unused"]),                  # dead
        helper.make_node("Size", ["x"], ["size"]),
        helper.make_node("Unsqueeze", ["size", "axes"], ["flat"]),          # [24]: folded by onnxruntime
        helper.make_node("Reshape", ["x", "flat"], ["xf"]),
        helper.make_node("ReduceSum", ["big"], ["b"], keepdims=0),
        helper.make_node("Add", ["xf", "b"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array([300, 300], np.int64), "big_shape"),
             numpy_helper.from_array(np.array([0], np.int64), "axes"),
             numpy_helper.from_array(np.zeros(3, np.float32), "unused_weight")]
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [24])], inits)
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path))
    canonical = canonicalize(path, {"n": 3}, tmp_path / "work").model
    assert _ops(canonical) == Counter({"ConstantOfShape": 1, "Reshape": 1, "ReduceSum": 1, "Add": 1})
    assert {t.name for t in canonical.graph.initializer} == {"big_shape", "flat"}


def test_dropout_mask_nothing_reads_is_dropped(tmp_path):
    model = _model([helper.make_node("Dropout", ["x"], ["y", "mask"], ratio=0.5)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], opset=9)
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path))
    (node,) = canonicalize(path, {}, tmp_path / "work").model.graph.node
    assert node.op_type == "Dropout" and list(node.output) == ["y"]


def test_model_onnxruntime_rejects_is_one_line(tmp_path):
    model = _model([helper.make_node("NoSuchOp", ["x"], ["y"], domain="example.custom")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model.opset_import.append(helper.make_opsetid("example.custom", 1))
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path))
    with pytest.raises(ModelError) as info:
        canonicalize(path, {}, tmp_path / "work")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("ranged", [False, True], ids=["fixed", "ranged"])
def test_an_unnamed_dynamic_dim_is_one_error_naming_the_input(ranged, tmp_path):
    """A dynamic input dim without a name cannot be sized by --dim: planning stops with a
    ModelError naming the input, for fixed and ranged plans alike."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", None])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    x.type.tensor_type.shape.dim[1].Clear()
    model.graph.input[0].type.tensor_type.shape.dim[1].Clear()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    from meshplan.model.sizes import DimRange

    dims = {"n": DimRange(1, 4)} if ranged else {"n": 2}
    with pytest.raises(ModelError, match="input 'x' has an unnamed dynamic dimension"):
        make_plan(path, make_cluster((1, 2), "cpu"), dims, tmp_path / "plan")
    assert not (tmp_path / "plan").exists()
