"""Unit tests for meshplan.cost.analytic on tiny graphs built with onnx.helper."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from meshplan.cost.cluster import Cluster, DeviceSpec, LinkSpec, make_cluster
from meshplan.cost.analytic import CostModel, node_bytes, node_flops
from meshplan.model.graph import build_graph
from meshplan.model.load import infer_shapes

F32 = TensorProto.FLOAT


def _graph(nodes, inputs, outputs, initializers=()):
    """inputs/outputs: [(name, shape)] (outputs may have shape None); initializers: [(name, shape)]."""
    inits = [
        helper.make_tensor(name, F32, shape, np.zeros(int(np.prod(shape)), dtype=np.float32))
        for name, shape in initializers
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, F32, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, F32, s) for n, s in outputs],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return build_graph(infer_shapes(model))


def _one(graph):
    assert len(graph.nodes) == 1
    return graph.nodes[0]


# --- FLOPs ------------------------------------------------------------------------------

@pytest.mark.parametrize("b, m, k, n", [(1, 1, 1, 1), (3, 5, 7, 11), (2, 16, 64, 8), (4, 1, 9, 2)])
def test_matmul_batched_flops(b, m, k, n):
    g = _graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"], name="mm")],
        [("a", [b, m, k])], [("y", None)], [("w", [k, n])],
    )
    assert g.tensors["y"].shape == (b, m, n)
    node = _one(g)
    assert node_flops(node, g) == 2 * b * m * n * k
    # bytes: a, w and y, 4 bytes each
    assert node_bytes(node, g) == 4 * (b * m * k + k * n + b * m * n)


def test_matmul_two_activations_flops():
    g = _graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])],
        [("a", [2, 3, 4, 5]), ("b", [2, 3, 5, 6])], [("y", None)],
    )
    assert node_flops(_one(g), g) == 2 * (2 * 3) * 4 * 6 * 5


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_flops(trans_a, trans_b, bias):
    m, k, n = 6, 10, 4
    a_shape = [k, m] if trans_a else [m, k]
    b_shape = [n, k] if trans_b else [k, n]
    inputs = ["a", "b"] + (["c"] if bias else [])
    inits = [("b", b_shape)] + ([("c", [n])] if bias else [])
    g = _graph(
        [helper.make_node("Gemm", inputs, ["y"], transA=trans_a, transB=trans_b)],
        [("a", a_shape)], [("y", None)], inits,
    )
    assert g.tensors["y"].shape == (m, n)
    node = _one(g)
    expected = 2 * m * n * k + (m * n if bias else 0)
    assert node_flops(node, g) == expected
    assert node_bytes(node, g) == 4 * (m * k + k * n + (n if bias else 0) + m * n)


def _conv_out(size, kernel, stride, pad):
    return (size + 2 * pad - kernel) // stride + 1


@pytest.mark.parametrize(
    "n, c_in, c_out, h, w, kh, kw, stride, pad, group",
    [
        (1, 3, 8, 9, 9, 3, 3, 1, 0, 1),
        (2, 4, 6, 10, 7, 3, 2, 2, 1, 1),
        (1, 8, 8, 12, 12, 3, 3, 1, 1, 8),      # depthwise
        (3, 6, 9, 11, 13, 5, 3, 3, 2, 3),      # grouped, strided
        (1, 4, 2, 5, 5, 1, 1, 1, 0, 2),
    ],
)
def test_conv_flops(n, c_in, c_out, h, w, kh, kw, stride, pad, group):
    node = helper.make_node(
        "Conv", ["x", "wt"], ["y"], group=group, strides=[stride, stride], pads=[pad, pad, pad, pad],
        kernel_shape=[kh, kw],
    )
    g = _graph([node], [("x", [n, c_in, h, w])], [("y", None)], [("wt", [c_out, c_in // group, kh, kw])])
    oh, ow = _conv_out(h, kh, stride, pad), _conv_out(w, kw, stride, pad)
    assert g.tensors["y"].shape == (n, c_out, oh, ow)
    # each output element: (c_in / group) * kh * kw multiply-adds
    expected = 2 * n * c_out * oh * ow * (c_in // group) * kh * kw
    assert node_flops(_one(g), g) == expected
    assert node_bytes(_one(g), g) == 4 * (n * c_in * h * w + c_out * (c_in // group) * kh * kw + n * c_out * oh * ow)


def test_conv_transpose_flops():
    n, c_in, c_out, h, w, k, group = 2, 4, 6, 5, 7, 3, 2
    g = _graph(
        [helper.make_node("ConvTranspose", ["x", "wt"], ["y"], group=group, strides=[2, 2])],
        [("x", [n, c_in, h, w])], [("y", None)], [("wt", [c_in, c_out // group, k, k])],
    )
    # each input element is multiplied into (c_out / group) * k * k outputs
    assert node_flops(_one(g), g) == 2 * n * c_in * h * w * (c_out // group) * k * k


def test_add_flops_and_bytes():
    g = _graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [("a", [4, 5, 6]), ("b", [6])], [("y", None)],
    )
    node = _one(g)
    assert node_flops(node, g) == 4 * 5 * 6
    assert node_bytes(node, g) == 4 * (120 + 6 + 120)


def test_same_input_twice_counted_once():
    g = _graph([helper.make_node("Add", ["a", "a"], ["y"])], [("a", [3, 7])], [("y", None)])
    assert node_bytes(_one(g), g) == 4 * (21 + 21)


def test_a_lookup_reads_only_the_rows_it_gathers():
    """An embedding lookup of 3 tokens in a 1000 x 64 table reads 3 rows, not the table."""
    indices = helper.make_tensor("ids", TensorProto.INT64, [1, 3], [1, 5, 9])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])], "g", [],
        [helper.make_tensor_value_info("y", F32, None)],
        initializer=[helper.make_tensor("table", F32, [1000, 64], np.zeros(64000, np.float32)), indices])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    g = build_graph(infer_shapes(model))
    out = 3 * 64 * 4
    assert node_bytes(_one(g), g) == out + 3 * 8 + out     # rows read, the indices, the rows written
    # a lookup's table is never counted above what the node writes, however small the table
    small = _graph([helper.make_node("GatherElements", ["t", "i"], ["y"])], [("t", [2, 2]), ("i", [2, 2])],
                   [("y", None)])
    assert node_bytes(_one(small), small) == 4 * (4 + 4 + 4)


def _reshape_graph():
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [6, 4])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
        [helper.make_tensor_value_info("x", F32, [2, 3, 4])],
        [helper.make_tensor_value_info("y", F32, None)], initializer=[shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return build_graph(infer_shapes(model))


def test_reshape_is_free_but_moves_bytes():
    g = _reshape_graph()
    assert g.tensors["y"].shape == (6, 4)
    node = _one(g)
    assert node_flops(node, g) == 0
    # x, the int64 shape tensor (a parameter) and y
    assert node_bytes(node, g) == 4 * 24 + 8 * 2 + 4 * 24


@pytest.mark.parametrize("op, per_element", [("Relu", 1), ("Sigmoid", 4), ("Tanh", 6), ("Exp", 4)])
def test_unary_per_element(op, per_element):
    g = _graph([helper.make_node(op, ["x"], ["y"])], [("x", [3, 11])], [("y", None)])
    assert node_flops(_one(g), g) == 33 * per_element


# --- node_seconds ------------------------------------------------------------------------

def _cluster(peak, bandwidth, overhead, hosts=1, per_host=4):
    return Cluster(
        hosts, per_host, DeviceSpec("test", 1e12, peak, bandwidth, overhead),
        LinkSpec(100e9, 2e-6), LinkSpec(10e9, 20e-6),
    )


def test_node_seconds_compute_bound():
    b, m, k, n = 2, 64, 128, 32
    g = _graph([helper.make_node("MatMul", ["a", "w"], ["y"])], [("a", [b, m, k])], [("y", None)], [("w", [k, n])])
    node = _one(g)
    flops, nbytes = 2 * b * m * n * k, 4 * (b * m * k + k * n + b * m * n)
    cm = CostModel(_cluster(peak=1e9, bandwidth=1e15, overhead=3e-6))
    assert flops / 1e9 > nbytes / 1e15
    assert cm.node_seconds(node, g) == pytest.approx(flops / 1e9 + 3e-6)


def test_node_seconds_memory_bound():
    g = _graph([helper.make_node("Add", ["a", "b"], ["y"])], [("a", [100, 10]), ("b", [100, 10])], [("y", None)])
    node = _one(g)
    cm = CostModel(_cluster(peak=1e15, bandwidth=1e6, overhead=1e-5))
    assert cm.node_seconds(node, g) == pytest.approx(4 * 3000 / 1e6 + 1e-5)


def test_node_seconds_is_max_plus_overhead_on_presets():
    g = _graph(
        [helper.make_node("MatMul", ["a", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [("a", [8, 256])], [("y", None)], [("w", [256, 512])],
    )
    for device in ("h100-80g", "cpu"):
        cluster = make_cluster((1, 1), device)
        cm = CostModel(cluster)
        d = cluster.device
        seconds = cm.graph_seconds(g)
        assert len(seconds) == 2
        for node, got in zip(g.nodes, seconds):
            expected = max(node_flops(node, g) / d.peak_flops, node_bytes(node, g) / d.memory_bandwidth) + d.kernel_overhead
            assert got == pytest.approx(expected)
            assert got > d.kernel_overhead


def test_node_seconds_scales_with_device():
    g = _graph([helper.make_node("MatMul", ["a", "w"], ["y"])], [("a", [64, 512])], [("y", None)], [("w", [512, 512])])
    node = _one(g)
    slow = CostModel(_cluster(peak=1e11, bandwidth=1e11, overhead=0)).node_seconds(node, g)
    fast = CostModel(_cluster(peak=1e13, bandwidth=1e13, overhead=0)).node_seconds(node, g)
    assert slow == pytest.approx(100 * fast)


def test_shape_op_costs_only_overhead():
    g = _graph([helper.make_node("Shape", ["x"], ["s"])], [("x", [1000, 1000])], [])
    cm = CostModel(_cluster(peak=1, bandwidth=1, overhead=4e-6))
    assert cm.node_seconds(_one(g), g) == pytest.approx(4e-6)


# --- transfers ---------------------------------------------------------------------------

def test_transfer_same_rank_and_empty_are_free():
    cm = CostModel(_cluster(1e12, 1e12, 0, hosts=2, per_host=2))
    assert cm.transfer_seconds(1e9, 3, 3) == 0.0
    assert cm.transfer_seconds(0, 0, 3) == 0.0
    assert cm.transfer_seconds(-5, 0, 1) == 0.0


def test_transfer_intra_vs_inter_host():
    cm = CostModel(_cluster(1e12, 1e12, 0, hosts=2, per_host=4))
    nbytes = 8e6
    intra = nbytes / 100e9 + 2e-6
    inter = nbytes / 10e9 + 20e-6
    assert cm.transfer_seconds(nbytes, 0, 3) == pytest.approx(intra)
    assert cm.transfer_seconds(nbytes, 5, 6) == pytest.approx(intra)
    assert cm.transfer_seconds(nbytes, 3, 4) == pytest.approx(inter)
    assert cm.transfer_seconds(nbytes, 7, 0) == pytest.approx(inter)
    assert cm.transfer_seconds(nbytes, 3, 4) > cm.transfer_seconds(nbytes, 0, 3)


def test_worst_transfer_seconds():
    multi = CostModel(_cluster(1e12, 1e12, 0, hosts=2, per_host=4))
    single = CostModel(_cluster(1e12, 1e12, 0, hosts=1, per_host=8))
    nbytes = 1e6
    assert multi.worst_transfer_seconds(nbytes) == pytest.approx(nbytes / 10e9 + 20e-6)
    assert single.worst_transfer_seconds(nbytes) == pytest.approx(nbytes / 100e9 + 2e-6)
    assert multi.worst_transfer_seconds(0) == 0.0
    # the worst case is never cheaper than an actual transfer
    for src in range(8):
        for dst in range(8):
            assert multi.transfer_seconds(nbytes, src, dst) <= multi.worst_transfer_seconds(nbytes) + 1e-15
