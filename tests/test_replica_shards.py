"""The row blocks a pipeline stage's replicas hold of the update's tensors (ZeRO-1): the
pieces cover each tensor once, a checkpoint's layout puts them back together, and only an
update that computes element by element is cut so."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from meshplan import replica_shards
from meshplan.runtime.state_layout import assemble
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.training.sharded_update import _row_wise, relaxed


@pytest.mark.parametrize("shape,replicas", [((8, 3), 2), ((12,), 4), ((5, 2), 2), ((1,), 2), ((6, 4), 1)])
def test_pieces_cover_the_tensor_once(shape, replicas):
    whole = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    pieces = [replica_shards.piece(whole, replicas, r) for r in range(replicas)]
    assert [p.shape for p in pieces] == [replica_shards.piece_shape(shape, replicas, r) for r in range(replicas)]
    assert [p.size for p in pieces] == (replica_shards.counts(shape, replicas) if replicas > 1 else [whole.size])
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    even = replicas > 1 and shape[0] % replicas == 0
    assert replica_shards.splits(shape, replicas) is even
    if not even and replicas > 1:     # held whole by the first replica
        assert pieces[0].shape == shape and all(p.size == 0 for p in pieces[1:])
    ranks = list(range(10, 10 + replicas))
    entry = replica_shards.layout(shape, ranks)
    assert entry["holders"] == (ranks if even else ranks[:1])
    mesh = LogicalMesh(tuple(entry["logical_mesh"]), tuple(entry["devices"]))
    held = {rank: pieces[ranks.index(rank)] for rank in entry["holders"]}
    np.testing.assert_array_equal(assemble(held, ShardingSpec.parse(entry["spec"]), mesh), whole)
    assert replica_shards.held_bytes(shape, 4, replicas) == pieces[0].nbytes


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "update",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_only_an_update_computed_element_by_element_is_cut_into_row_blocks():
    update = _model([helper.make_node("Mul", ["g", "lr"], ["step"]), helper.make_node("Sub", ["w", "step"], ["w2"]),
                     helper.make_node("Mul", ["g", "g"], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["part"]),
                     helper.make_node("Sum", ["part"], ["partial"])],
                    [("g", [4, 3]), ("w", [4, 3]), ("lr", [])], [("w2", [4, 3]), ("partial", [])])
    assert _row_wise(update, {"partial"})
    assert not _row_wise(update, set())     # a sum over the whole tensor handed on as if per row
    product = _model([helper.make_node("MatMul", ["g", "w"], ["w2"])], [("g", [4, 3]), ("w", [3, 3])],
                     [("w2", [4, 3])])
    assert not _row_wise(product, set())
    by_axis = _model([helper.make_node("ReduceSum", ["g"], ["part"], axes=[0])], [("g", [4, 3])],
                     [("part", [3])])
    assert not _row_wise(by_axis, {"part"})
    loose = relaxed(update, {"g", "w", "w2"})
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(loose.graph.input) + list(loose.graph.output)}
    assert dims == {"g": ["g.d0", "g.d1"], "w": ["w.d0", "w.d1"], "lr": [], "w2": ["w2.d0", "w2.d1"],
                    "partial": []}


def test_no_row_blocks_for_one_replica_or_a_weight_without_dims():
    """One replica a stage, or a trained weight of no dims (its square would be counted by
    every replica in the norm), or an update that is not element by element: every replica
    updates whole."""
    from meshplan.testing.train_reference import even_stages
    from meshplan.training.pipeline_step import split_step
    from meshplan.training.sharded_update import update_shards
    from meshplan.training.step_model import TrainSpec, build_step_model
    from sample_models.training import load_case

    case = load_case("mlp_sgd")
    settings = case["settings"]
    step = build_step_model(case["model_path"], TrainSpec(settings["loss"], settings["optimizer"], microbatches=4,
                                                          stages=2))
    pipeline = split_step(step, even_stages(step, case["model_path"], 2), 2)
    assert update_shards(pipeline, 2) and not update_shards(pipeline, 1)
    weights = step.manifest["weights"]
    name = next(iter(weights))
    step.manifest["weights"] = {**weights, name: {**weights[name], "shape": []}}
    assert update_shards(pipeline, 2) == set()
    step.manifest["weights"] = weights
    update = next(part for (_, phase), part in pipeline.parts.items() if phase == "update")
    update.model.graph.node.append(helper.make_node("MatMul", [update.inputs[0], update.inputs[0]], ["extra"]))
    assert update_shards(pipeline, 2) == set()
