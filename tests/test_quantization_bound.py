"""The numerics rule for activation-quantizing kernels (``runtime.quantization_bound``).

onnxruntime's MatMulNBits at accuracy_level 4 rounds its input to int8 per block on the CPU;
a plan that sums a row-parallel product in another order (or fuses an op the reference does
not) hands the next such kernel an input that differs in its last bits, and an element on a
rounding boundary goes to the neighbouring int8 step, on one CPU and not another. The rule
``meshplan verify`` applies, and these tests with it: the dtype's tolerance plus twice the
change onnxruntime's own activation quantization makes in each output. A property test runs
plans that split K (megatron: the narrowing product row-parallel, all-reduced before the next
quantizing product) and plans that do not, on random inputs and on inputs placed on the
quantization grid's midpoints, and checks every output by the rule; the rule still fails a
plan that computes something else.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.providers import cuda_usable
from meshplan.runtime.inprocess import InProcessPlan, compare_outputs, reference_with_bounds
from meshplan.runtime.quantization_bound import (BOUND_FACTOR, QuantizationBound, activation_quantizing,
                                                 bounds_between, use_float_activations)
from tests.conftest import run_cli, save_npz
from tests.test_quantized import nbits_node

ROWS, WIDTH, HIDDEN, CLASSES, BLOCK = 64, 128, 256, 64, 32


def three_products(path: Path, accuracy_level: int = 4, seed: int = 0) -> Path:
    """x [batch, 128] → MatMulNBits (widening) → Relu → MatMulNBits (narrowing) →
    MatMulNBits → y [batch, 64], int4 weights in blocks of 32, every product at
    ``accuracy_level``; megatron splits the second along K."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], {}
    widths = [(WIDTH, HIDDEN), (HIDDEN, WIDTH), (WIDTH, CLASSES)]
    source = "x"
    for index, (k, n) in enumerate(widths):
        out = "y" if index == 2 else f"h{index}"
        node, weights = nbits_node(source, rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k), out,
                                   f"p{index}", BLOCK, zero_points=False)
        node.attribute.append(helper.make_attribute("accuracy_level", accuracy_level))
        nodes.append(node)
        inits.update(weights)
        source = out
        if index == 0:
            nodes.append(helper.make_node("Relu", [out], ["r0"], name="relu0"))
            source = "r0"
    graph = helper.make_graph(
        nodes, "three_products",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", CLASSES])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10   # onnxruntime's newest
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The model planned three ways: one device (nothing split), 1x2 and 1x4 under megatron
    (the narrowing product split along K)."""
    root = tmp_path_factory.mktemp("qbound")
    path = three_products(root / "model.onnx")
    found = {}
    for label, mesh, options in [("1x1", (1, 1), PlanOptions()),
                                 ("1x2 K split", (1, 2), PlanOptions(policy="megatron", max_stages=1)),
                                 ("1x4 K split", (1, 4), PlanOptions(policy="megatron", max_stages=1))]:
        plan = make_plan(path, make_cluster(mesh, "cpu"), {"batch": ROWS}, root / label.replace(" ", "_"), options)
        found[label] = (plan, InProcessPlan(plan, root / label.replace(" ", "_")))
    return path, found


def k_split(plan) -> bool:
    """Some product of the plan is row-parallel (its output partial)."""
    return any("+P" in s.split("->")[1] for stage in plan.stages for s in stage.strategies.values())


def midpoint_inputs(rng: np.random.Generator, scale: float) -> np.ndarray:
    """Rows whose every 32-block lies on int8 midpoints of its own quantization grid: one
    element at 127 steps fixes the block's scale, the others at (q + ½) steps."""
    steps = rng.integers(-126, 126, size=(ROWS, WIDTH)) + 0.5
    steps[:, ::BLOCK] = 127.0
    return (steps * scale / 127.0).astype(np.float32)


def test_plans_split_along_k_and_not(plans):
    _, found = plans
    assert not k_split(found["1x1"][0])
    assert k_split(found["1x2 K split"][0]) and k_split(found["1x4 K split"][0])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), magnitude=st.sampled_from([1e-3, 1.0, 30.0]), midpoints=st.booleans())
def test_every_plan_within_the_rule(plans, seed, magnitude, midpoints):
    path, found = plans
    rng = np.random.default_rng(seed)
    x = midpoint_inputs(rng, magnitude) if midpoints else (rng.standard_normal((ROWS, WIDTH)) * magnitude).astype(np.float32)
    feeds = {"x": x}
    any_plan = next(iter(found.values()))[0]
    expected, bounds = reference_with_bounds(any_plan, feeds)
    assert set(bounds) == {"y"} and bounds["y"] > 0
    for label, (_, runner) in found.items():
        got = runner.run(feeds)
        (result,) = compare_outputs(got, expected, bounds=bounds)
        assert result.ok, (label, result)
        # the rule is not so wide that a plan computing something else passes: one of two
        # partial sums lost (the output halved)
        (wrong,) = compare_outputs({"y": got["y"] * 0.5}, expected, bounds=bounds)
        assert not wrong.ok


def test_bound_is_the_quantization_change(tmp_path):
    """The bound is BOUND_FACTOR × (onnxruntime at accuracy_level 4 − the same at 0); a model
    without activation quantization has none and loads no second session."""
    import onnxruntime as ort

    quantized = three_products(tmp_path / "q.onnx")
    floats = three_products(tmp_path / "f.onnx", accuracy_level=0)
    x = np.random.default_rng(1).standard_normal((ROWS, WIDTH)).astype(np.float32)
    runs = {p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            for p in (quantized, floats)}
    assert np.abs(runs[quantized] - runs[floats]).max() > 0       # the kernel does quantize here
    bound = QuantizationBound(quantized, ["CPUExecutionProvider"])
    assert bound.active
    got = bound.bounds({"x": x}, {"y": runs[quantized]})
    assert got["y"] == pytest.approx(BOUND_FACTOR * float(np.abs(runs[quantized] - runs[floats]).max()), rel=1e-6)
    assert not QuantizationBound(floats, ["CPUExecutionProvider"]).active
    assert QuantizationBound(floats, ["CPUExecutionProvider"]).bounds({"x": x}, {"y": runs[floats]}) == {}


def test_only_quantizing_nodes_switch(tmp_path):
    model = onnx.load(str(three_products(tmp_path / "q.onnx")))
    model.graph.node[0].attribute[-1].i = 1          # accuracy_level 1: float activations already
    assert [n.name for n in activation_quantizing(model.graph.node)] == ["p1", "p2"]
    assert use_float_activations(model.graph.node) == 2
    assert activation_quantizing(model.graph.node) == []
    assert bounds_between({"y": np.ones(3, np.float32), "ids": np.ones(3, np.int64)},
                          {"y": np.array([1, 1.5, 0.75], np.float32), "ids": np.zeros(3, np.int64)}) == {"y": 1.0}


def test_verify_states_the_bound(plans, tmp_path):
    path, found = plans
    plan_dir = path.parent / "1x2_K_split"
    inputs = save_npz(tmp_path / "in.npz", {"x": np.random.default_rng(2).standard_normal((ROWS, WIDTH)).astype(np.float32)})
    done = run_cli("verify", plan_dir, "--inputs", inputs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "+ quantization bound" in done.stdout and "PASSED" in done.stdout
    done = run_cli("verify", plan_dir, "--inputs", inputs, "--stages")
    assert done.returncode == 0 and "+ quantization bound" in done.stdout, done.stdout + done.stderr
    done = run_cli("verify", plan_dir, "--inputs", inputs, "--provider", "cuda")
    if cuda_usable():   # the plan and the reference on the GPU: CUDA's kernel keeps float activations
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        assert done.returncode == 1 and done.stderr.strip().count("\n") == 0 and "CUDA" in done.stderr, done.stderr
