"""Hand-written policies restrict the strategies the ILP may pick."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshplan.cost.cluster import make_cluster
from meshplan.errors import PlanError
from meshplan.model.graph import build_graph
from meshplan.model.load import infer_shapes
from meshplan.make_plan import make_plan
from meshplan.inter.pipeline import PlanOptions
from meshplan.intra.policies import apply_policy
from meshplan.sharding import LogicalMesh
from meshplan.intra.strategies import node_strategies
from sample_models import SAMPLES


def _matmul_graph(k: int, n: int):
    weight = numpy_helper.from_array(np.zeros((k, n), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, n])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return build_graph(infer_shapes(model))


MESH = LogicalMesh((1, 2), (0, 1))


def _allowed(policy, k, n):
    graph = _matmul_graph(k, n)
    node = graph.nodes[0]
    return apply_policy(policy, node, graph, node_strategies(node, graph, MESH))


def test_auto_keeps_everything():
    graph = _matmul_graph(16, 64)
    node = graph.nodes[0]
    everything = node_strategies(node, graph, MESH)
    assert apply_policy("auto", node, graph, everything) == everything and len(everything) > 3


def test_data_parallel_replicates_weights_and_splits_batch():
    allowed = _allowed("data", 16, 64)
    assert allowed and all(s.inputs[1].is_replicated for s in allowed)
    assert any(s.inputs[0].dims[0] != "R" for s in allowed)


def test_megatron_widening_is_column_parallel():
    allowed = _allowed("megatron", 16, 64)
    assert allowed and all(str(s.inputs[1]) == "RS1" for s in allowed)


def test_megatron_narrowing_is_row_parallel():
    allowed = _allowed("megatron", 64, 16)
    assert allowed and all(str(s.inputs[1]) == "S1R" for s in allowed)
    assert all(s.outputs[0].partial for s in allowed)


def test_megatron_splits_a_trained_weight_that_is_a_state_input():
    """In a training step a trained weight is a graph input the step updates (state), not
    an initializer: Megatron's pattern applies to its products all the same."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("Identity", ["w"], ["w.updated"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [16, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64]),
         helper.make_tensor_value_info("w.updated", TensorProto.FLOAT, [16, 64])])
    built = build_graph(infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                       ir_version=8)))
    node = built.nodes[0]
    everything = node_strategies(node, built, MESH)
    assert apply_policy("megatron", node, built, everything) == everything   # an input like any other
    built.state = {"w.updated": "w"}
    allowed = apply_policy("megatron", node, built, everything)
    assert allowed and all(str(s.inputs[1]) == "RS1" for s in allowed)


def test_unknown_policy_or_scheduler_is_a_plan_error(tmp_path):
    sample = SAMPLES["mlp"]
    for options, message in ((PlanOptions(policy="fsdp"), "unknown policy"),
                             (PlanOptions(reshard_scheduler="fifo"), "unknown resharding scheduler")):
        with pytest.raises(PlanError, match=message):
            make_plan(sample.path, make_cluster((1, 2), "cpu"), dict(sample.dims), tmp_path / "plan", options)
        assert not (tmp_path / "plan").exists()
