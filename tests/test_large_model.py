"""A model over 2 GB (the protobuf limit): loaded with external data, canonicalised,
planned and run in-process against onnxruntime. Slow (writes and reads several GB)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshplan.cost.cluster import make_cluster
from meshplan.make_plan import make_plan
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from tests.conftest import assert_close

SIZE = 14_000          # three [SIZE, SIZE] float32 weights: 2.35 GB in all


@pytest.mark.slow
def test_model_over_2gb(tmp_path):
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    previous = "x"
    for i in range(3):
        weight = (rng.standard_normal((SIZE, SIZE), dtype=np.float32) / np.sqrt(SIZE)).astype(np.float32)
        weights.append(numpy_helper.from_array(weight, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"))
        previous = f"r{i}"
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SIZE])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", SIZE])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "big.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="big.onnx.data")
    del model, graph, weights
    assert (tmp_path / "big.onnx.data").stat().st_size > 2**31

    plan_dir = tmp_path / "plan"
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {"batch": 2}, plan_dir)
    assert plan.num_ranks == 2
    # Each program keeps its weights (hundreds of MB at least) in an external data file.
    assert all(p.data_files and (plan_dir / p.file).stat().st_size < 2**20 for p in plan.programs)
    inputs = {"x": rng.standard_normal((2, SIZE), dtype=np.float32)}
    assert_close(run_in_process(plan, plan_dir, inputs), reference_outputs(plan, inputs))
