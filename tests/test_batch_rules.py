"""Sharding rules the exports need: Resize (dims of scale 1, nearest upsampling by an
integer factor), and Gather / GatherND with constant indices whose batch column is the
batch position. Every strategy is run piece by piece and compared with the whole node."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from meshplan.intra.strategies import node_strategies
from meshplan.model.graph import build_graph
from meshplan.model.load import infer_shapes
from tests.test_strategies import check_node_model, mesh_of, one_node, rand, strings

FLOAT = TensorProto.FLOAT


def _strategies(model, mesh=(1, 2)):
    graph = build_graph(infer_shapes(model))
    from onnx import numpy_helper
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return strings(node_strategies(graph.nodes[0], graph, mesh_of(mesh), constants, 17))


def test_resize_nearest_upsampling_splits_every_dim():
    """Torch's nearest upsampling (asymmetric, floor) by 2 on [N, C, H, W]: batch and
    channels keep their size, H and W upsample by an integer: all four split."""
    model = one_node("Resize", [("X", FLOAT, [4, 4, 4, 6])], ["Y"],
                     initializers=[("scales", np.array([1, 1, 2, 2], np.float32))], node_inputs=["X", "", "scales"],
                     mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    seen = strings(check_node_model(model, {"X": rand([4, 4, 4, 6])}))
    for d in range(4):
        assert any(s.startswith("".join("S0" if k == d else "R" for k in range(4))) for s in seen), (d, seen)


def test_resize_with_sizes_and_half_pixel_nearest():
    model = one_node("Resize", [("X", FLOAT, [2, 4, 4, 4])], ["Y"],
                     initializers=[("sizes", np.array([2, 4, 12, 8], np.int64))], node_inputs=["X", "", "", "sizes"],
                     mode="nearest")
    seen = check_node_model(model, {"X": rand([2, 4, 4, 4])})
    assert any(s.rewrites for s in seen)   # the sizes input took local sizes
    assert any(str(s).startswith("RRS0R") for s in seen)


def test_resize_linear_splits_only_dims_of_scale_one():
    model = one_node("Resize", [("X", FLOAT, [2, 4, 4, 4])], ["Y"],
                     initializers=[("scales", np.array([1, 1, 2, 2], np.float32))], node_inputs=["X", "", "scales"],
                     mode="linear")
    seen = strings(check_node_model(model, {"X": rand([2, 4, 4, 4])}))
    assert any(s.startswith("S0RRR") for s in seen) and any(s.startswith("RS0RR") for s in seen)
    assert not any(s.startswith("RRS0R") or s.startswith("RRRS0") for s in seen)


def test_gather_nd_with_the_batch_position_as_first_column():
    """``x[arange(B), i]``: indices [[0, 3], [1, 3], [2, 3], [3, 3]] keep each sample apart."""
    indices = np.array([[b, 3] for b in range(4)], np.int64)
    model = one_node("GatherND", [("X", FLOAT, [4, 6, 8])], ["Y"], initializers=[("indices", indices)])
    seen = check_node_model(model, {"X": rand([4, 6, 8])})
    split = [s for s in seen if str(s).startswith("S0RR")]
    assert split and all(s.rewrites for s in split)


def test_gather_nd_batch_rule_needs_the_batch_position():
    """Another first column (or other columns that differ between the pieces) is not
    batch-separable: no strategy splits the data's first dim."""
    for indices in (np.array([[1, 3], [0, 3], [2, 3], [3, 3]], np.int64),
                    np.array([[0, 1], [1, 1], [2, 5], [3, 5]], np.int64)):
        model = one_node("GatherND", [("X", FLOAT, [4, 6, 8])], ["Y"], initializers=[("indices", indices)])
        assert not any(s.startswith("S0RR") for s in _strategies(model)), indices
        check_node_model(model, {"X": rand([4, 6, 8])})


def test_gather_of_the_batch_positions():
    indices = np.arange(4, dtype=np.int64).reshape(4, 1)
    model = one_node("Gather", [("X", FLOAT, [4, 6])], ["Y"], initializers=[("indices", indices)], axis=0)
    seen = check_node_model(model, {"X": rand([4, 6])})
    assert any(str(s).startswith("S0R") and s.rewrites for s in seen)
