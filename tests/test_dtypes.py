"""Number formats: the dtype an operator computes in, its cost at that dtype's peak, the
report's header, and dtype-aware tolerances in ``compare_outputs`` / ``meshplan verify``
/ the tests' ``assert_close``."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from meshplan.cost.analytic import CostModel, compute_dtype, compute_dtypes, node_bytes, node_flops
from meshplan.cost.cluster import DEVICE_PRESETS, make_cluster
from meshplan.emit.report import text_report
from meshplan.model.graph import build_graph
from meshplan.model.load import infer_shapes
from meshplan.runtime.inprocess import compare_outputs, default_tolerance, tolerance_for
from tests.conftest import assert_close, run_cli, save_npz
from tests.test_report import _plan

BF16 = np.dtype(ml_dtypes.bfloat16)


def _matmul_graph(elem: int, m: int = 512, k: int = 1024, n: int = 2048):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("a", elem, [m, k]), helper.make_tensor_value_info("b", elem, [k, n])],
        [helper.make_tensor_value_info("y", elem, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return build_graph(infer_shapes(model))


def _integer_graph():
    """y = MatMulInteger(a int8, w int8) -> int32; then DequantizeLinear of an int8 weight."""
    w = helper.make_tensor("w", TensorProto.INT8, [64, 32], np.ones(64 * 32, dtype=np.int8))
    s = helper.make_tensor("s", TensorProto.FLOAT, [32], np.ones(32, dtype=np.float32))
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"], name="mmi"),
         helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], name="dq", axis=1)], "g",
        [helper.make_tensor_value_info("a", TensorProto.INT8, [16, 64])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None),
         helper.make_tensor_value_info("wf", TensorProto.FLOAT, None)],
        initializer=[w, s],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return build_graph(infer_shapes(model))


# --- the compute dtype and its cost -----------------------------------------------------

@pytest.mark.parametrize("elem, dtype, key", [
    (TensorProto.FLOAT, "float32", "fp32"),
    (TensorProto.FLOAT16, "float16", "fp16"),
    (TensorProto.BFLOAT16, "bfloat16", "bf16"),
])
def test_matmul_costs_at_its_dtypes_peak_with_real_element_sizes(elem, dtype, key):
    graph = _matmul_graph(elem)
    node = graph.nodes[0]
    assert compute_dtype(node, graph) == dtype and compute_dtypes(graph) == [dtype]
    device = DEVICE_PRESETS["h100-80g"]
    size = 4 if dtype == "float32" else 2
    assert node_bytes(node, graph) == size * (512 * 1024 + 1024 * 2048 + 512 * 2048)
    seconds = CostModel(make_cluster((1, 1), "h100-80g")).node_seconds(node, graph)
    compute = node_flops(node, graph) / device.peak(key)
    memory = node_bytes(node, graph) / device.memory_bandwidth
    assert seconds == pytest.approx(max(compute, memory) + device.kernel_overhead)


def test_float32_costs_at_the_fp32_peak():
    """float32 runs at ``peak_flops``, the FP32 rate (sessions keep TF32 off)."""
    graph = _matmul_graph(TensorProto.FLOAT, 4096, 4096, 4096)
    node = graph.nodes[0]
    device = DEVICE_PRESETS["h100-80g"]
    assert device.peak_flops == pytest.approx(67e12)
    expected = max(node_flops(node, graph) / 67e12, node_bytes(node, graph) / device.memory_bandwidth)
    assert CostModel(make_cluster((1, 1), "h100-80g")).node_seconds(node, graph) == pytest.approx(
        expected + device.kernel_overhead)


def test_float16_matmul_is_faster_than_float32_when_compute_bound():
    cost = CostModel(make_cluster((1, 1), "h100-80g"))
    g32, g16 = _matmul_graph(TensorProto.FLOAT, 4096, 4096, 4096), _matmul_graph(TensorProto.FLOAT16, 4096, 4096, 4096)
    assert cost.node_seconds(g16.nodes[0], g16) < 0.6 * cost.node_seconds(g32.nodes[0], g32)


def test_integer_products_compute_in_int8_and_dequantize_in_float32():
    graph = _integer_graph()
    by_name = {n.name: n for n in graph.nodes}
    assert compute_dtype(by_name["mmi"], graph) == "int8"
    assert compute_dtype(by_name["dq"], graph) == "float32"
    assert "int8" in compute_dtypes(graph)


# --- the report's header ----------------------------------------------------------------

def test_report_header_shows_compute_dtypes():
    plan = _plan([1e-3], 1)
    assert "computing in float32," in text_report(plan).splitlines()[0]
    plan.model["compute_dtypes"] = ["float16", "float32"]
    assert "computing in float16+float32," in text_report(plan).splitlines()[0]


# --- tolerances -------------------------------------------------------------------------

def test_default_tolerances_by_dtype():
    assert default_tolerance(np.float32) == (1e-3, 1e-4)
    assert default_tolerance(np.float64) == (1e-3, 1e-4)
    assert default_tolerance(np.float16) == (8 * 2.0**-10, 8 * 2.0**-10)
    assert default_tolerance(BF16) == (8 * 2.0**-7, 8 * 2.0**-7)
    for dtype in (np.int64, np.int32, np.int8, np.uint8, np.bool_):
        assert default_tolerance(dtype) == (0.0, 0.0)
    assert tolerance_for(np.float16, rtol=0.5) == (0.5, 8 * 2.0**-10)
    assert tolerance_for(np.int64, atol=2.0) == (0.0, 2.0)


def _ulps_up(x: np.ndarray, n: int) -> np.ndarray:
    for _ in range(n):
        x = np.nextafter(x, np.array(np.inf, dtype=x.dtype))
    return x


def test_two_ulps_of_float16_pass_by_default_and_fail_with_float32_tolerance():
    """Two float16 ulps just above a power of two are 2**-9 relative: over float32's rtol 1e-3."""
    want = np.array([1.0, 2.0, 4.0, -3.0, 0.0], dtype=np.float16)
    got = _ulps_up(want, 2)
    (c,) = compare_outputs({"y": got}, {"y": want})
    assert c.ok and c.rtol == c.atol == 8 * 2.0**-10
    (c,) = compare_outputs({"y": got}, {"y": want}, rtol=1e-3, atol=1e-4)
    assert not c.ok and (c.rtol, c.atol) == (1e-3, 1e-4)
    assert_close({"y": got}, {"y": want})
    with pytest.raises(AssertionError):
        assert_close({"y": got}, {"y": want}, rtol=0, atol=0)


def test_bfloat16_outputs_compare():
    want = np.linspace(-4, 4, 33).astype(BF16)
    (c,) = compare_outputs({"y": want.copy()}, {"y": want})
    assert c.ok and c.max_abs == 0
    assert_close({"y": want.copy()}, {"y": want})
    (c,) = compare_outputs({"y": (want.astype(np.float32) + 1).astype(BF16)}, {"y": want})
    assert not c.ok


@pytest.mark.parametrize("want", [np.arange(10, dtype=np.int64), np.array([True, False, True])])
def test_integer_and_bool_outputs_compare_exactly(want):
    (c,) = compare_outputs({"y": want.copy()}, {"y": want})
    assert c.ok and (c.rtol, c.atol) == (0.0, 0.0)
    off = want.copy()
    off[0] = not off[0] if want.dtype == bool else off[0] + 1
    (c,) = compare_outputs({"y": off}, {"y": want})
    assert not c.ok
    with pytest.raises(AssertionError):
        assert_close({"y": off}, {"y": want})


def test_float32_tolerance_unchanged():
    want = np.ones(4, dtype=np.float32)
    assert compare_outputs({"y": want * (1 + 5e-4)}, {"y": want})[0].ok
    assert not compare_outputs({"y": want * (1 + 5e-3)}, {"y": want})[0].ok


# --- meshplan verify on a float16 model that shards nothing -----------------------------

def test_verify_float16_plan_uses_float16_tolerance(tmp_path):
    """A float16 chain of MatMuls on one device: verify passes with the float16 tolerance and
    says which tolerance each verdict used; --rtol/--atol override it for every output."""
    from sample_models.llama import make_llama

    model_path = tmp_path / "llama16.onnx"
    onnx.save(make_llama(layers=1, hidden=32, heads=2, ffn=64, vocab=64, max_seq=16, dtype="float16"), model_path)
    plan_dir = tmp_path / "plan"
    done = run_cli("plan", model_path, "--mesh", "1x1", "--dim", "batch=1", "--dim", "seq=8", "-o", plan_dir)
    assert done.returncode == 0, done.stderr
    inputs = save_npz(tmp_path / "in.npz", {"input_ids": np.arange(8, dtype=np.int64).reshape(1, 8)})
    done = run_cli("verify", plan_dir, "--inputs", inputs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "logits: " in done.stdout and "(rtol 0.0078125, atol 0.0078125) ok" in done.stdout
    done = run_cli("verify", plan_dir, "--inputs", inputs, "--rtol", "0.5", "--atol", "0.25")
    assert done.returncode == 0 and "(rtol 0.5, atol 0.25) ok" in done.stdout
