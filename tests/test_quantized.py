"""Quantized operators sharded: every strategy of DequantizeLinear/QuantizeLinear (per-tensor,
per-axis, blocked), MatMulNBits (N and K splits, zero points, bias), MatMulInteger and
QLinearMatMul computes what the unsharded operator computes — through the test harness of
test_strategies and through the emitter (shard_program: sliced scales, zero points and
packed weights, local K/N attributes) — and a model whose linear layers are MatMulNBits
planned on 1x2 runs in-process as onnxruntime runs it."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from meshplan.cost.cluster import load_cluster_file
from meshplan.emit.shard import shard_program
from meshplan.inter.pipeline import PlanOptions
from meshplan.intra.strategies import node_strategies
from meshplan.make_plan import make_plan
from meshplan.model.graph import build_graph
from meshplan.model.load import infer_shapes
from meshplan.ops import entry, node_flops
from meshplan.plan_format import COLLECTIVE_DOMAIN
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from meshplan.testing.reshard import shard, unshard
from sample_models.mlp import make_mlp
from tests.conftest import assert_close, run_signature, sharded_signatures
from tests.test_strategies import SETTINGS, sharded_tolerance, check_node_model, mesh_of

MESHES = [(1, 2), (2, 2), (1, 4)]
INT4 = {TensorProto.INT4: ml_dtypes.int4, TensorProto.UINT4: ml_dtypes.uint4}
NP = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, **INT4}


def _model(node, inputs, initializers, opsets) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                      for n, v in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in node.output if o],
        [numpy_helper.from_array(v, n) for n, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 10
    return model


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def check_emitted(model: onnx.ModelProto, feeds: dict[str, np.ndarray], meshes=MESHES) -> list[str]:
    """Every strategy of the single node, emitted with ``shard_program`` for every rank
    (initializers sliced by the emitter, feeds sharded per the strategy), run on
    onnxruntime and compared with the unsharded run; returns the strategies seen."""
    graph = build_graph(infer_shapes(model))
    node = graph.nodes[0]
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    expected = _session(model).run(None, feeds)
    seen = []
    for shape in meshes:
        mesh = mesh_of(shape)
        for strategy in node_strategies(node, graph, mesh, constants, graph.opset):
            seen.append(str(strategy))
            in_specs = {n: s for n, s in zip(node.inputs, strategy.inputs) if n in feeds}
            out_specs = {n: s for n, s in zip(node.outputs, strategy.outputs) if n}
            local_feeds = {n: shard(feeds[n], s, mesh) for n, s in in_specs.items()}
            got: dict[int, dict] = {k: {} for k in range(len(out_specs))}
            for rank in mesh.ranks:
                program = shard_program(model, graph, {node.name: strategy}, mesh, rank, in_specs, out_specs)
                program.opset_import.pop(next(i for i, o in enumerate(program.opset_import) if o.domain == COLLECTIVE_DOMAIN))
                session = _session(program)
                coord = mesh.coord(rank)
                outs = session.run(None, {i.name: local_feeds[i.name.split("@")[0]][coord] for i in session.get_inputs()})
                for k, value in enumerate(outs):
                    got[k][coord] = value
            for k, (name, spec) in enumerate(out_specs.items()):
                np.testing.assert_allclose(unshard(got[k], spec, mesh), expected[k], err_msg=f"{strategy} on {shape}",
                                           **sharded_tolerance(expected[k], False))
    return seen


# --- DequantizeLinear / QuantizeLinear ---------------------------------------------------

@st.composite
def dq_case(draw):
    """(x shape, axis, block size or 0, scale shape) for per-tensor, per-axis or blocked."""
    rank = draw(st.integers(1, 3))
    shape = [draw(st.sampled_from([2, 4, 8])) for _ in range(rank)]
    kind = draw(st.sampled_from(["tensor", "axis", "blocked"]))
    axis = draw(st.integers(0, rank - 1))
    if kind == "tensor":
        return shape, axis, 0, []
    if kind == "axis":
        return shape, axis, 0, [shape[axis]]
    block = draw(st.sampled_from([1, 2, 4]))
    shape[axis] = block * draw(st.sampled_from([1, 2, 4] if rank > 1 else [2, 4]))   # more than one scale
    scale = list(shape)
    scale[axis] //= block
    return shape, axis, block, scale


def _dq_model(op, shape, axis, block, scale_shape, elem, zero_point, rng) -> tuple[onnx.ModelProto, dict]:
    dtype = NP[elem]
    info = np.iinfo(np.int8 if elem in (TensorProto.INT8, TensorProto.INT4) else np.uint8)
    lo, hi = (info.min, info.max) if elem not in INT4 else ((-8, 7) if elem == TensorProto.INT4 else (0, 15))
    scale = (rng.random(scale_shape) + 0.5).astype(np.float32)
    inits = {"scale": scale}
    if zero_point:
        inits["zp"] = rng.integers(lo, hi + 1, scale_shape).astype(dtype)
    attrs = dict(axis=axis, **({"block_size": block} if block else {}))
    if op == "DequantizeLinear":
        inits = {"x": rng.integers(lo, hi + 1, shape).astype(dtype), **inits}
        feeds = {}
        names = list(inits)
    else:
        feeds = {"x": (rng.standard_normal(shape) * 4).astype(np.float32)}
        names = ["x"] + list(inits)
    node = helper.make_node(op, names, ["y"], name="q", **attrs)
    return _model(node, feeds, inits, [("", 21)]), feeds


@SETTINGS
@given(dq_case(), st.sampled_from([TensorProto.INT8, TensorProto.UINT8]), st.booleans(), st.integers(0, 2**16))
def test_dequantize_linear(case, elem, zero_point, seed):
    model, _ = _dq_model("DequantizeLinear", *case, elem, zero_point, np.random.default_rng(seed))
    seen = check_node_model(model, {}, opset=21)
    _, axis, block, scale = case
    if scale:   # a split along the quantization axis takes the scale (and zero point) with it
        assert all((s.inputs[0].dims[axis] != "R") == (s.inputs[1].dims[-1 if not block else axis] != "R")
                   for s in seen), [str(s) for s in seen]
    else:
        assert all(s.inputs[1].is_replicated for s in seen)
    check_emitted(model, {}, meshes=[(1, 2), (2, 2)])


@SETTINGS
@given(dq_case(), st.sampled_from([TensorProto.INT4, TensorProto.UINT4]), st.booleans(), st.integers(0, 2**16))
def test_dequantize_linear_int4(case, elem, zero_point, seed):
    """int4 weights cannot be fed to onnxruntime from numpy: emitted programs only (the
    emitter slices the int4 initializers)."""
    model, _ = _dq_model("DequantizeLinear", *case, elem, zero_point, np.random.default_rng(seed))
    check_emitted(model, {}, meshes=[(1, 2), (2, 2)])


@SETTINGS
@given(dq_case(), st.sampled_from([TensorProto.INT8, TensorProto.UINT8]), st.integers(0, 2**16))
def test_quantize_linear(case, elem, seed):
    model, feeds = _dq_model("QuantizeLinear", *case, elem, True, np.random.default_rng(seed))
    check_node_model(model, feeds, opset=21)


def test_blocked_split_only_on_block_boundaries():
    """x [8, 4], blocks of 4 along dim 0 (2 blocks): 2 shards keep whole blocks, 4 would
    cut them — the scale's 2 rows cannot be split 4 ways."""
    model, _ = _dq_model("DequantizeLinear", [8, 4], 0, 4, [2, 4], TensorProto.INT8, True, np.random.default_rng(0))
    graph = build_graph(infer_shapes(model))
    found = {str(s) for s in node_strategies(graph.nodes[0], graph, mesh_of((1, 4)), opset=21)}
    assert "S1R,S1R,S1R->S1R" not in found and "RS1,RS1,RS1->RS1" in found
    found = {str(s) for s in node_strategies(graph.nodes[0], graph, mesh_of((1, 2)), opset=21)}
    assert "S1R,S1R,S1R->S1R" in found


def test_dynamic_quantize_linear_is_replicated():
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"], name="d")
    model = _model(node, {"x": np.zeros((4, 4), np.float32)}, {}, [("", 17)])
    graph = build_graph(infer_shapes(model))
    assert len(node_strategies(graph.nodes[0], graph, mesh_of((2, 2)))) == 1


# --- MatMulInteger / QLinearMatMul -----------------------------------------------------------

@pytest.mark.parametrize("per_column", [False, True])
def test_matmul_integer(per_column):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 255, (4, 8, 6)).astype(np.uint8)
    b = rng.integers(-128, 127, (6, 4)).astype(np.int8)
    bzp = rng.integers(-3, 3, (4,) if per_column else ()).astype(np.int8)
    node = helper.make_node("MatMulInteger", ["a", "b", "azp", "bzp"], ["y"], name="m")
    model = _model(node, {"a": a}, {"b": b, "azp": np.array(3, np.uint8), "bzp": bzp}, [("", 17)])
    seen = check_node_model(model, {"a": a}, opset=17)
    assert any(s.outputs[0].dims[-1] != "R" and (not per_column or s.inputs[3].dims[0] != "R") for s in seen)
    check_emitted(model, {"a": a}, meshes=[(2, 2)])


@pytest.mark.parametrize("per_column", [False, True])
def test_qlinear_matmul(per_column):
    rng = np.random.default_rng(2)
    a = rng.integers(0, 255, (8, 6)).astype(np.uint8)
    b = rng.integers(0, 255, (6, 4)).astype(np.uint8)
    b_shape = (4,) if per_column else ()
    inits = {"sa": np.array(0.02, np.float32), "za": np.array(128, np.uint8), "b": b,
             "sb": np.full(b_shape, 0.03, np.float32), "zb": rng.integers(110, 130, b_shape).astype(np.uint8),
             "sy": np.array(0.5, np.float32), "zy": np.array(100, np.uint8)}
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"], name="m")
    model = _model(node, {"a": a}, inits, [("", 17)])
    seen = {str(s) for s in check_node_model(model, {"a": a}, opset=17)}
    split, whole = ("S1", "R") if per_column else ("()", "()")
    assert {f"S0R,(),(),RR,{whole},{whole},(),()->S0R", f"RR,(),(),RS1,{split},{split},(),()->RS1"} <= seen, seen
    check_emitted(model, {"a": a}, meshes=[(2, 2)])


# --- MatMulNBits -----------------------------------------------------------------------------

def _pack4(q: np.ndarray) -> np.ndarray:
    """4-bit values (last dim even) two to a byte, the first in the low nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def quantize_4bits(w: np.ndarray, block: int, zero_points: bool):
    """MatMulNBits' B [N, K/block, block/2], scales [N, K/block] and packed zero points
    [N, ceil(K/block / 2)] (None when symmetric: zero point 8) of a [K, N] weight, per the
    contrib op spec (blocks along K per column, low nibble first). onnxruntime's own
    quantizer needs onnx_ir, which this environment lacks."""
    k, n = w.shape
    blocks = w.T.reshape(n, k // block, block)
    if zero_points:
        lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
        scale = np.where(hi > lo, (hi - lo) / 15, 1).astype(np.float32)
        zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    else:
        scale = np.where(np.abs(blocks).max(-1) > 0, np.abs(blocks).max(-1) / 7, 1).astype(np.float32)
        zp = np.full(scale.shape, 8, np.uint8)
    q = np.clip(np.round(blocks / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
    packed_zp = _pack4(np.pad(zp, ((0, 0), (0, zp.shape[1] % 2)))) if zero_points else None
    return _pack4(q), scale, packed_zp


def nbits_node(a: str, w: np.ndarray, out: str, name: str, block: int = 32, zero_points: bool = True):
    """(MatMulNBits node, its initializers) for ``a @ w`` with w quantized to 4 bits."""
    b, scale, zp = quantize_4bits(w, block, zero_points)
    inits = {f"{name}.q4": b, f"{name}.scales": scale, **({f"{name}.zp": zp} if zp is not None else {})}
    node = helper.make_node("MatMulNBits", [a, *inits], [out], name=name, domain="com.microsoft",
                            K=w.shape[0], N=w.shape[1], bits=4, block_size=block)
    return node, inits


def nbits_model(k: int, n: int, lead=(2, 3), block=32, zero_points=True, bias=False, flat=False, seed=0):
    """A one-node MatMulNBits model quantizing a random [k, n] weight (2-D scales and packed
    zero points); ``flat``: the 1-D scale and zero-point layouts; ``bias``: a bias input."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    a = rng.standard_normal((*lead, k)).astype(np.float32)
    node, inits = nbits_node("a", w, "y", "m", block, zero_points)
    model = _model(node, {"a": a}, inits, [("", 17), ("com.microsoft", 1)])
    node = model.graph.node[0]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    if flat:
        for t in model.graph.initializer:
            if t.name != node.input[1]:
                t.CopyFrom(numpy_helper.from_array(inits[t.name].reshape(-1), t.name))
    if bias:
        model.graph.initializer.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias"))
        inputs = list(node.input) + [""] * (5 - len(node.input)) + ["bias"]
        del node.input[:]
        node.input.extend(inputs)
    return model, {"a": a}


def _nbits_strategies(model, mesh):
    graph = build_graph(infer_shapes(model))
    return graph, [str(s) for s in node_strategies(graph.nodes[0], graph, mesh_of(mesh))]


@pytest.mark.parametrize("zero_points, bias", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_nbits(zero_points, bias):
    model, feeds = nbits_model(128, 64, zero_points=zero_points, bias=bias)
    seen = check_emitted(model, feeds)
    absent = ",_" if bias else ""   # omitted zero points (before the bias), omitted g_idx
    zp_n, zp_k = (",S1R", ",RS1") if zero_points else (absent, absent)
    bias_n, bias_k = (",_,S1", ",_,R+P1") if bias else ("", "")
    assert f"RRR,S1RR,S1R{zp_n}{bias_n}->RRS1" in seen, seen                 # column-parallel
    assert f"RRS1,RS1R,RS1{zp_k}{bias_k}->RRR+P1" in seen, seen              # row-parallel, bias on one device
    assert any(s.startswith("S0RR,") for s in seen), seen                                 # batch


def test_matmul_nbits_split_rules():
    """K splits keep whole bytes of packed zero points (4 blocks = 2 bytes: not 4 ways) and
    whole blocks (not 8 ways); 1-D scales: N splits only."""
    model, _ = nbits_model(128, 64)
    graph, found = _nbits_strategies(model, (1, 4))
    assert found == ["RRR,RRR,RR,RR->RRR", "RRR,S1RR,S1R,S1R->RRS1"]
    _, found = _nbits_strategies(nbits_model(128, 64, zero_points=False)[0], (1, 4))
    assert "RRS1,RS1R,RS1->RRR+P1" in found
    _, found = _nbits_strategies(nbits_model(128, 64, zero_points=False)[0], (2, 4))
    assert not any("RS01R" in s for s in found), found
    flat, feeds = nbits_model(128, 64, flat=True)
    _, found = _nbits_strategies(flat, (1, 2))
    assert "RRR,S1RR,S1,S1->RRS1" in found and not any("+P" in s for s in found), found
    check_emitted(flat, feeds, meshes=[(1, 2), (2, 2)])
    node = graph.nodes[0]
    assert node_flops(node, graph) == 2 * 2 * 3 * 64 * 128
    assert entry("MatMulNBits", "com.microsoft").heavy and not entry("MatMulNBits").heavy


def test_matmul_nbits_shapes_are_inferred():
    model, _ = nbits_model(64, 32, lead=(5,))
    graph = build_graph(infer_shapes(model))
    assert graph.tensors["y"].shape == (5, 32) and graph.tensors["y"].dtype == np.float32


def quantize_matmuls(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every MatMul with a 2-D weight initializer becomes a 4-bit MatMulNBits."""
    weights = {t.name: t for t in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        w = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is None or len(w.dims) != 2:
            nodes.append(node)
            continue
        quantized, inits = nbits_node(node.input[0], numpy_helper.to_array(w), node.output[0], node.name)
        nodes.append(quantized)
        model.graph.initializer.remove(w)
        model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in inits.items())
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


# --- end to end --------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["megatron", "auto"])
def test_quantized_mlp_on_1x2(policy, tmp_path):
    """An MLP whose MatMuls are MatMulNBits (4 bits, blocks of 32, zero points), planned on
    1x2 and run in-process, gives onnxruntime's outputs. (The automatic plan of so small an
    MLP may keep it whole on both devices.)"""
    model = quantize_matmuls(make_mlp(layers=3, in_features=64, hidden=128, classes=32))
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 3
    path = tmp_path / "mlp_q4.onnx"
    onnx.save(model, str(path))
    cluster_file = tmp_path / "cluster.toml"
    cluster_file.write_text("hosts = 1\ndevices_per_host = 2\n[device]\npreset = 'h100-80g'\nmemory_gb = 80\n")
    plan_dir = tmp_path / "plan"
    plan = make_plan(path, load_cluster_file(cluster_file), {"batch": 8}, plan_dir,
                     PlanOptions(max_stages=1, policy=policy, all_devices=True))
    strategies = plan.stages[0].strategies
    assert plan.stages[0].devices == [0, 1]
    if policy == "megatron":   # widening: column-parallel; narrowing (128 -> 32): row-parallel, partial
        assert strategies["layer0/matmul"] == "RR,S1RR,S1R,S1R->RS1", strategies
        assert strategies["layer2/matmul"] == "RS1,RS1R,RS1,RS1->RR+P1", strategies
    inputs = {"x": np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)}
    assert_close(run_in_process(plan, plan_dir, inputs), reference_outputs(plan, inputs))


def test_profiled_variants_run_with_local_k_and_n(tmp_path):
    """The profiler's sharded MatMulNBits signatures carry each device's K and N, so every
    one of them runs in onnxruntime (with the whole weight's K/N they would not)."""
    path = tmp_path / "mlp_q4.onnx"
    onnx.save(quantize_matmuls(make_mlp(layers=2, in_features=64, hidden=128, classes=32)), str(path))
    variants = sharded_signatures(path, {"batch": 8}, (1, 2), "MatMulNBits", tmp_path)
    assert variants
    for entry_ in variants:
        run_signature(entry_)
