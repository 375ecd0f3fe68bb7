"""Every sharding strategy computes what the unsharded operator computes.

For a one-node model and each strategy on a mesh: shard the inputs per the strategy's
input specs (partial inputs as unequal addends), run the node with onnxruntime on each
device's local inputs (rewritten shape constants included), check each local output has
its spec's local shape and matches the unsharded result (non-partial: each device's
slice; partial: the sum of the addends).
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from meshplan.model.graph import build_graph
from meshplan.model.load import infer_shapes
from meshplan.testing.reshard import shard, unshard
from meshplan.sharding import LogicalMesh
from meshplan.intra.strategies import Strategy, node_strategies, ops_with_rules

OPSET = 17
MESHES = [(1, 2), (2, 2), (1, 4)]
FLOAT = TensorProto.FLOAT
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def mesh_of(shape) -> LogicalMesh:
    return LogicalMesh(tuple(shape), tuple(range(shape[0] * shape[1])))


# --- harness --------------------------------------------------------------------------

def _session(node: onnx.NodeProto, graph, opsets) -> ort.InferenceSession:
    """One session for every local run: the node with untyped-shape inputs and outputs."""
    def value(name):
        t = graph.tensors[name]
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(t.dtype), None)

    model = helper.make_model(
        helper.make_graph([node], "local", [value(n) for n in dict.fromkeys(node.input) if n],
                          [value(n) for n in node.output if n]),
        opset_imports=opsets)
    model.ir_version = 8
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def sharded_tolerance(expected: np.ndarray, half: bool) -> dict:
    """rtol 1e-4 (1e-2 when float16 is involved: addends of a float16 value round), exact for integers."""
    if not np.issubdtype(expected.dtype, np.floating):
        return dict(rtol=0, atol=0)
    scale = 1 + float(np.abs(expected[np.isfinite(expected)]).max(initial=0))
    return dict(rtol=1e-2, atol=1e-2 * scale) if half or expected.dtype == np.float16 else dict(rtol=1e-4, atol=1e-5 * scale)


def check_node_model(model: onnx.ModelProto, feeds: dict[str, np.ndarray], meshes=MESHES, opset: int | None = OPSET,
                     session=None, expected=None) -> list[Strategy]:
    """Check every strategy of the model's single node on each mesh; return the strategies seen."""
    inferred = infer_shapes(model)
    graph = build_graph(inferred)
    node = graph.nodes[0]
    proto = model.graph.node[0]
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    values = {**constants, **{k: np.asarray(v) for k, v in feeds.items()}}
    session = session or _session(proto, graph, model.opset_import)
    names = [n for n in dict.fromkeys(proto.input) if n]
    if expected is None:
        expected = session.run(None, {n: values[n] for n in names})
    seen = []
    for mesh_shape in meshes:
        mesh = mesh_of(mesh_shape)
        strategies = node_strategies(node, graph, mesh, constants, opset)
        assert strategies[0].is_replicated, strategies[0]
        assert len(set(strategies)) == len(strategies)
        for strategy in strategies:
            seen.append(strategy)
            _check_strategy(strategy, node, graph, session, values, expected, mesh)
    return seen


def _check_strategy(strategy, node, graph, session, values, expected, mesh):
    assert len(strategy.inputs) == len(node.inputs) and len(strategy.outputs) == len(node.outputs)
    rewrites = dict(strategy.rewrites)
    local_inputs: dict[str, dict] = {}
    for k, (name, spec) in enumerate(zip(node.inputs, strategy.inputs)):
        if not name:
            assert spec is None
            continue
        if k in rewrites:
            assert spec.is_replicated
            value = np.array(rewrites[k], dtype=np.int64)
            local_inputs[name] = {c: value for c in _coords(mesh)}
        else:
            if name in local_inputs:   # the same tensor twice: one layout per tensor in this harness
                if spec != strategy.inputs[node.inputs.index(name)]:
                    return
            local_inputs[name] = shard(values[name], spec, mesh)
    runs = {c: session.run(None, {n: local_inputs[n][c] for n in local_inputs}) for c in _coords(mesh)}
    half = any(values[n].dtype == np.float16 for n in local_inputs if n in values)
    present = [k for k, name in enumerate(node.outputs) if name]
    for slot, k in enumerate(present):
        spec, want = strategy.outputs[k], expected[slot]
        got = {c: runs[c][slot] for c in runs}
        label = f"{node.op_type} {strategy} on {mesh.shape}, output {k}"
        for c, local in got.items():
            assert local.shape == spec.local_shape(want.shape, mesh), f"{label}: device {c} has shape {local.shape}"
        np.testing.assert_allclose(unshard(got, spec, mesh), want, err_msg=label, **sharded_tolerance(want, half))
        if not spec.partial:
            for c, local in got.items():
                np.testing.assert_allclose(local, want[spec.local_slices(want.shape, mesh, c)],
                                           err_msg=f"{label}, device {c}", **sharded_tolerance(want, half))


def _coords(mesh):
    n, m = mesh.shape
    return [(i, j) for i in range(n) for j in range(m)]


def one_node(op_type, inputs, outputs, initializers=(), **attrs) -> onnx.ModelProto:
    """A one-node opset-17 model. ``inputs``: (name, elem type, shape) graph inputs;
    ``initializers``: numpy values by name; ``outputs``: names (types inferred)."""
    names = [i[0] for i in inputs] + [name for name, _ in initializers]
    node_inputs = attrs.pop("node_inputs", names)
    node = helper.make_node(op_type, node_inputs, outputs, **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), name) for name, v in initializers],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    # outputs typed by inference, so the harness sees the output shapes
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    types = {v.name: v for v in inferred.graph.value_info}
    for o in model.graph.output:
        if not o.type.HasField("tensor_type") and o.name in types:
            o.CopyFrom(types[o.name])
    return model


RNG = np.random.default_rng(0)


def rand(shape, dtype=np.float32):
    return np.asarray(RNG.standard_normal(shape), dtype=dtype)


def strings(strategies):
    return {str(s) for s in strategies}


dims = st.sampled_from([1, 2, 3, 4, 8])
even = st.sampled_from([2, 4, 8])


# --- contractions -----------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_matmul(data):
    ra, rb = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    batch = [data.draw(dims) for _ in range(max(ra, rb) - 2)]

    def batch_of(rank):
        return [b if data.draw(st.booleans()) else 1 for b in batch[len(batch) - (rank - 2):]] if rank > 2 else []

    m, k, n = data.draw(dims), data.draw(even), data.draw(dims)
    a = batch_of(ra) + ([m, k] if ra > 1 else [k])
    b = batch_of(rb) + ([k, n] if rb > 1 else [k])
    model = one_node("MatMul", [("A", FLOAT, a), ("B", FLOAT, b)], ["Y"])
    check_node_model(model, {"A": rand(a), "B": rand(b)})


def test_matmul_offers_megatron_splits():
    model = one_node("MatMul", [("A", FLOAT, [4, 8])], ["Y"], initializers=[("W", rand([8, 6]))])
    seen = strings(check_node_model(model, {"A": rand([4, 8])}, meshes=[(1, 2)]))
    assert "RR,RS1->RS1" in seen        # column parallel: N split
    assert "RS1,S1R->RR+P1" in seen     # row parallel: K split → partial
    assert "S1R,RR->S1R" in seen        # rows
    assert "RR+P1,RR->RR+P1" in seen    # linear in the activation
    assert not any("+P" in s.split("->")[0].split(",")[1] for s in seen)   # weights are never partial
    seen = strings(check_node_model(model, {"A": rand([4, 8])}, meshes=[(2, 2)]))
    assert "S0S1,S1R->S0R+P1" in seen and "RS01,S01R->RR+P01" in seen


EINSUMS = ["ij,jk->ik", "bij,bjk->bik", "bhqd,bhkd->bhqk", "bij,jk->bik", "ij,j->i", "i,i->", "ij->ji", "ij->i", "ik,jk"]


@pytest.mark.parametrize("equation", EINSUMS)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_einsum(equation, data):
    """Batch and free labels split, contracted labels give a partial result, each operand
    may be partial alone: every strategy matches the unsharded einsum."""
    terms = equation.split("->")[0].split(",")
    size = {label: data.draw(st.sampled_from([1, 2, 4, 8])) for label in sorted(set("".join(terms)))}
    shapes = [[size[label] for label in term] for term in terms]
    names = [f"X{k}" for k in range(len(terms))]
    model = one_node("Einsum", [(n, FLOAT, shape) for n, shape in zip(names, shapes)], ["Y"], equation=equation)
    check_node_model(model, {n: rand(shape) for n, shape in zip(names, shapes)})


def test_einsum_contraction_is_partial():
    model = one_node("Einsum", [("A", FLOAT, [4, 8]), ("B", FLOAT, [8, 6])], ["Y"], equation="ik,kj->ij")
    seen = strings(check_node_model(model, {"A": rand([4, 8]), "B": rand([8, 6])}, meshes=[(1, 2)]))
    assert {"S1R,RR->S1R", "RR,RS1->RS1", "RS1,S1R->RR+P1", "RR+P1,RR->RR+P1"} <= set(seen)


@SETTINGS
@given(st.data())
def test_gemm(data):
    m, k, n = data.draw(dims), data.draw(even), data.draw(dims)
    ta, tb = data.draw(st.booleans()), data.draw(st.booleans())
    a, b = ([k, m] if ta else [m, k]), ([n, k] if tb else [k, n])
    c = data.draw(st.sampled_from([None, [n], [m, n], [1, n], [m, 1], []]))
    beta = data.draw(st.sampled_from([1.0, 0.5, 0.0]))
    inputs = [("A", FLOAT, a), ("B", FLOAT, b)] + ([("C", FLOAT, c)] if c is not None else [])
    model = one_node("Gemm", inputs, ["Y"], transA=int(ta), transB=int(tb), alpha=0.7, beta=beta)
    feeds = {"A": rand(a), "B": rand(b)} | ({"C": rand(c)} if c is not None else {})
    seen = check_node_model(model, feeds)
    has_k_split = any(s.outputs[0].partial for s in seen)
    assert has_k_split or k < 2   # with a bias, C is partial too (row-parallel linear)
    if c is not None and beta != 0.0:
        assert all(s.inputs[2].partial == s.outputs[0].partial for s in seen if s.outputs[0].partial)


@SETTINGS
@given(st.data())
def test_conv(data):
    spatial = data.draw(st.sampled_from([1, 2]))
    group = data.draw(st.sampled_from([1, 1, 2]))
    n, cin, cout = data.draw(dims), 2 * data.draw(st.sampled_from([1, 2, 4])), 2 * data.draw(st.sampled_from([1, 2]))
    kernel = [data.draw(st.integers(1, 3)) for _ in range(spatial)]
    size = [data.draw(st.integers(3, 6)) for _ in range(spatial)]
    bias = data.draw(st.booleans())
    x, w = [n, cin] + size, [cout, cin // group] + kernel
    inputs = [("X", FLOAT, x), ("W", FLOAT, w)] + ([("B", FLOAT, [cout])] if bias else [])
    model = one_node("Conv", inputs, ["Y"], group=group, pads=[1] * 2 * spatial, strides=[1] * spatial)
    feeds = {"X": rand(x), "W": rand(w)} | ({"B": rand([cout])} if bias else {})
    seen = check_node_model(model, feeds)
    if group == 1 and not bias:
        assert any(str(s).startswith("RS1") and s.outputs[0].partial == (1,) for s in seen)


def test_conv_output_channels_with_param_weights():
    model = one_node("Conv", [("X", FLOAT, [2, 4, 5, 5])], ["Y"],
                     initializers=[("W", rand([8, 4, 3, 3])), ("B", rand([8]))], pads=[1, 1, 1, 1])
    seen = strings(check_node_model(model, {"X": rand([2, 4, 5, 5])}, meshes=[(1, 2)]))
    assert "RRRR,S1RRR,S1->RS1RR" in seen and "RS1RR,RS1RR,R->RR+P1" not in seen


# --- pointwise ---------------------------------------------------------------------------

UNARY = ["Abs", "Ceil", "Cos", "Elu", "Erf", "Exp", "Floor", "HardSigmoid", "HardSwish", "LeakyRelu", "Log",
         "Neg", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Softplus", "Softsign",
         "Sqrt", "Tan", "Tanh", "ThresholdedRelu", "Celu", "Identity", "IsNaN", "Shrink"]


@st.composite
def shape_of(draw, min_rank=0, max_rank=4):
    return [draw(dims) for _ in range(draw(st.integers(min_rank, max_rank)))]


@st.composite
def broadcast_shapes(draw, count):
    out = draw(shape_of(1, 4))
    shapes = []
    for _ in range(count):
        rank = draw(st.integers(0, len(out)))
        shapes.append([d if draw(st.integers(0, 3)) else 1 for d in out[len(out) - rank:]])
    shapes[draw(st.integers(0, count - 1))] = out   # one input has the full output shape
    return shapes


@pytest.mark.parametrize("op", UNARY)
@settings(max_examples=4, deadline=None)
@given(shape=shape_of(1, 4))
def test_unary(op, shape):
    model = one_node(op, [("X", FLOAT, shape)], ["Y"])
    seen = check_node_model(model, {"X": rand(shape) + 0.1})
    assert any(s.inputs[0].partial for s in seen) == (op in ("Neg", "Identity") and any(d > 0 for d in shape))


@SETTINGS
@given(st.sampled_from([TensorProto.DOUBLE, TensorProto.FLOAT, TensorProto.INT32, TensorProto.FLOAT16]), shape_of(1, 3))
def test_cast(to, shape):
    model = one_node("Cast", [("X", FLOAT, shape)], ["Y"], to=to)
    seen = check_node_model(model, {"X": rand(shape) * 10})
    if to == TensorProto.FLOAT16:
        assert not any(s.inputs[0].partial for s in seen)   # rounding addends is not rounding the sum


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Equal", "Greater", "Less", "PRelu"])
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_binary_broadcasting(op, data):
    a, b = data.draw(broadcast_shapes(2))
    if op == "PRelu":   # slope broadcasts to X only
        a = list(np.broadcast_shapes(tuple(a), tuple(b)))
    model = one_node(op, [("A", FLOAT, a), ("B", FLOAT, b)], ["Y"])
    feeds = {"A": rand(a), "B": rand(b)}
    if op in ("Div", "Pow"):
        feeds["B"] = np.asarray(np.abs(feeds["B"]) + 0.5)
        feeds["A"] = np.asarray(np.abs(feeds["A"]) + 0.5) if op == "Pow" else feeds["A"]
    check_node_model(model, feeds)


@SETTINGS
@given(st.sampled_from(["Sum", "Mean", "Max", "Min", "Where", "Clip"]), st.data())
def test_variadic(op, data):
    if op == "Clip":
        shape = data.draw(shape_of(1, 4))
        model = one_node(op, [("X", FLOAT, shape), ("lo", FLOAT, []), ("hi", FLOAT, [])], ["Y"])
        check_node_model(model, {"X": rand(shape), "lo": np.array(-0.5, np.float32), "hi": np.array(0.7, np.float32)})
        return
    shapes = data.draw(broadcast_shapes(3))
    types = [TensorProto.BOOL if op == "Where" and i == 0 else FLOAT for i in range(3)]
    model = one_node(op, [(f"X{i}", types[i], s) for i, s in enumerate(shapes)], ["Y"])
    feeds = {f"X{i}": rand(s) for i, s in enumerate(shapes)}
    if op == "Where":
        feeds["X0"] = feeds["X0"] > 0
    seen = check_node_model(model, feeds)
    if op in ("Sum", "Mean", "Where"):
        assert any(s.outputs[0].partial for s in seen)


def test_add_of_partial_and_bias_is_not_partial():
    model = one_node("Add", [("A", FLOAT, [4, 8])], ["Y"], initializers=[("bias", rand([8]))])
    seen = check_node_model(model, {"A": rand([4, 8])}, meshes=[(1, 2)])
    assert not any(s.outputs[0].partial for s in seen)
    assert "RS1,S1->RS1" in strings(seen)


# --- normalisations and reductions ---------------------------------------------------------

@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@SETTINGS
@given(shape=shape_of(1, 4), data=st.data())
def test_softmax(op, shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    check_node_model(one_node(op, [("X", FLOAT, shape)], ["Y"], axis=axis), {"X": rand(shape)})


def test_softmax_opset_semantics():
    model = one_node("Softmax", [("X", FLOAT, [2, 4, 8])], ["Y"], axis=1)
    graph = build_graph(infer_shapes(model))
    mesh = mesh_of((1, 2))
    assert "RRS1->RRS1" in strings(node_strategies(graph.nodes[0], graph, mesh, opset=17))
    # before opset 13 (or unknown), axis 1 normalises over dims 1 and 2 together
    assert strings(node_strategies(graph.nodes[0], graph, mesh)) == {"RRR->RRR", "S1RR->S1RR"}
    assert strings(node_strategies(graph.nodes[0], graph, mesh, opset=11)) == {"RRR->RRR", "S1RR->S1RR"}


@SETTINGS
@given(shape_of(1, 4), st.data())
def test_layer_norm(shape, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    outputs = data.draw(st.sampled_from([["Y"], ["Y", "M", "V"], ["Y", "", "V"]]))
    norm = shape[axis:] if axis >= 0 else shape[len(shape) + axis:]
    scale_shape = data.draw(st.sampled_from([norm, norm[-1:]]))
    with_bias = data.draw(st.booleans())
    inputs = [("X", FLOAT, shape), ("S", FLOAT, scale_shape)] + ([("B", FLOAT, scale_shape)] if with_bias else [])
    model = one_node("LayerNormalization", inputs, outputs, axis=axis, epsilon=1e-5)
    feeds = {"X": rand(shape), "S": rand(scale_shape)} | ({"B": rand(scale_shape)} if with_bias else {})
    check_node_model(model, feeds)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2",
                                "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"])
@settings(max_examples=8, deadline=None)
@given(shape=shape_of(1, 4), data=st.data())
def test_reduce(op, shape, data):
    rank = len(shape)
    keepdims = data.draw(st.sampled_from([0, 1]))
    if op.startswith("Arg"):
        model = one_node(op, [("X", FLOAT, shape)], ["Y"], axis=data.draw(st.integers(-rank, rank - 1)),
                         keepdims=keepdims)
    else:
        axes = sorted(data.draw(st.sets(st.integers(0, rank - 1), max_size=rank)))
        axes = [a - rank if data.draw(st.booleans()) else a for a in axes]
        noop = data.draw(st.sampled_from([0, 1])) if not axes else 0
        if op == "ReduceSum":   # axes as an input since opset 13
            inits = [("axes", np.array(axes, np.int64))] if axes or data.draw(st.booleans()) else []
            model = one_node(op, [("X", FLOAT, shape)], ["Y"], initializers=inits, keepdims=keepdims,
                             noop_with_empty_axes=noop)
        else:
            extra = {"axes": axes} if axes else {}   # an attribute before opset 18
            model = one_node(op, [("X", FLOAT, shape)], ["Y"], keepdims=keepdims, **extra)
    seen = check_node_model(model, {"X": rand(shape)})
    if op == "ReduceSum" and any(d % 2 == 0 and d > 1 for d in shape):
        assert any(s.outputs[0].partial for s in seen)


# --- shape ops --------------------------------------------------------------------------

@st.composite
def reshape_pair(draw):
    """A shape and a target made by splitting and merging its dims."""
    factors = [draw(st.sampled_from([[2], [3], [2, 2], [2, 4], [4, 2], [1], [2, 3]])) for _ in range(draw(st.integers(1, 3)))]
    src = [int(np.prod(f)) for f in factors]
    dst = []
    for f in factors:
        dst += f if draw(st.booleans()) else [int(np.prod(f))]
    if len(dst) > 1 and draw(st.booleans()):
        i = draw(st.integers(0, len(dst) - 2))
        dst[i:i + 2] = [dst[i] * dst[i + 1]]
    if draw(st.booleans()):
        dst.insert(draw(st.integers(0, len(dst))), 1)
    return src, dst


@SETTINGS
@given(reshape_pair(), st.booleans())
def test_reshape(pair, minus_one):
    src, dst = pair
    target = list(dst)
    if minus_one:
        target[0] = -1
    model = one_node("Reshape", [("X", FLOAT, src)], ["Y"], initializers=[("shape", np.array(target, np.int64))])
    seen = check_node_model(model, {"X": rand(src)})
    for s in seen:
        if s.rewrites:
            assert s.rewrites[0][0] == 1 and len(s.rewrites[0][1]) == len(dst)


def test_reshape_maps_hidden_to_heads():
    shape = [2, 4, 8]   # → [2, 4, 4, 2]: hidden 8 = 4 heads × 2
    model = one_node("Reshape", [("X", FLOAT, shape)], ["Y"], initializers=[("shape", np.array([0, 0, 4, 2], np.int64))])
    seen = check_node_model(model, {"X": rand(shape)}, meshes=[(1, 2), (2, 2)])
    by_str = {str(s): s for s in seen}
    assert "RRS1,R->RRS1R" in by_str
    assert by_str["RRS1,R->RRS1R"].rewrites == ((1, (2, 4, 2, 2)),)
    assert "S0RS1,R->S0RS1R" in by_str and "RRS01,R->RRS01R" in by_str
    assert "RS1R,R->RS1RR" in by_str and "S1RR,R->S1RRR" in by_str


def test_reshape_with_computed_target_offers_only_unchanged_shapes():
    shape = [2, 4, 8]
    model = one_node("Reshape", [("X", FLOAT, shape), ("shape", TensorProto.INT64, [4])], ["Y"])
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("Y", FLOAT, [2, 4, 4, 2]))   # known, computed at run time
    graph = build_graph(infer_shapes(model))
    assert [str(s) for s in node_strategies(graph.nodes[0], graph, mesh_of((1, 2)))] == ["RRR,R->RRRR", "RRR+P1,R->RRRR+P1"]


@SETTINGS
@given(shape_of(1, 4), st.data())
def test_transpose(shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    attrs = {"perm": list(perm)} if data.draw(st.booleans()) else {}
    check_node_model(one_node("Transpose", [("X", FLOAT, shape)], ["Y"], **attrs), {"X": rand(shape)})


@SETTINGS
@given(shape_of(0, 3), st.data())
def test_squeeze_unsqueeze_flatten(shape, data):
    op = data.draw(st.sampled_from(["Squeeze", "Unsqueeze", "Flatten"]))
    if op == "Unsqueeze":
        axes = sorted(data.draw(st.sets(st.integers(0, len(shape)), min_size=1, max_size=2)))
        model = one_node(op, [("X", FLOAT, shape)], ["Y"], initializers=[("axes", np.array(axes, np.int64))])
    elif op == "Squeeze":
        shape = shape + [1]
        ones = [d for d, s in enumerate(shape) if s == 1]
        inits = [("axes", np.array(ones[:data.draw(st.integers(1, len(ones)))], np.int64))] if data.draw(st.booleans()) else []
        model = one_node(op, [("X", FLOAT, shape)], ["Y"], initializers=inits)
    else:
        model = one_node(op, [("X", FLOAT, shape)], ["Y"], axis=data.draw(st.integers(0, len(shape))))
    check_node_model(model, {"X": rand(shape)})


@SETTINGS
@given(shape_of(1, 3), st.data())
def test_concat_split(shape, data):
    rank = len(shape)
    axis = data.draw(st.integers(-rank, rank - 1))
    if data.draw(st.booleans()):
        shapes = [list(shape) for _ in range(data.draw(st.integers(1, 3)))]
        for s in shapes:
            s[axis] = data.draw(dims)
        model = one_node("Concat", [(f"X{i}", FLOAT, s) for i, s in enumerate(shapes)], ["Y"], axis=axis)
        check_node_model(model, {f"X{i}": rand(s) for i, s in enumerate(shapes)})
        return
    size = shape[axis]
    cut = data.draw(st.integers(0, size))
    sizes = [cut, size - cut] if data.draw(st.booleans()) else None
    inits = [("split", np.array(sizes, np.int64))] if sizes else []
    outputs = ["Y0", "Y1"] if sizes else ["Y0"]
    check_node_model(one_node("Split", [("X", FLOAT, shape)], outputs, initializers=inits, axis=axis),
                     {"X": rand(shape)})


@SETTINGS
@given(shape_of(1, 3), st.data())
def test_slice(shape, data):
    rank = len(shape)
    axes = data.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    starts, ends, steps = [], [], []
    for a in axes:
        kind = data.draw(st.sampled_from(["whole", "whole_big", "part", "reverse"]))
        size = shape[a]
        if kind == "whole":
            starts.append(data.draw(st.sampled_from([0, -size]))); ends.append(size); steps.append(1)
        elif kind == "whole_big":
            starts.append(0); ends.append(2**62); steps.append(1)
        elif kind == "part":
            starts.append(data.draw(st.integers(0, size))); ends.append(data.draw(st.integers(-size, size))); steps.append(data.draw(st.sampled_from([1, 2])))
        else:
            starts.append(-1); ends.append(-(2**62)); steps.append(-1)
    inits = [("starts", np.array(starts, np.int64)), ("ends", np.array(ends, np.int64)),
             ("axes", np.array(axes, np.int64)), ("steps", np.array(steps, np.int64))]
    seen = check_node_model(one_node("Slice", [("X", FLOAT, shape)], ["Y"], initializers=inits), {"X": rand(shape)})
    for s in seen:
        for d, p in enumerate(s.inputs[0].dims):
            if p != "R":
                assert d not in axes or (starts[axes.index(d)] in (0, -shape[d]) and steps[axes.index(d)] == 1)


@SETTINGS
@given(st.data())
def test_gather(data):
    if data.draw(st.booleans()):   # an embedding: parameter table, token ids
        vocab, width = data.draw(dims), data.draw(even)
        idx = data.draw(shape_of(1, 2))
        model = one_node("Gather", [("ids", TensorProto.INT64, idx)], ["Y"], initializers=[("table", rand([vocab, width]))],
                         node_inputs=["table", "ids"])
        feeds = {"ids": RNG.integers(-vocab, vocab, idx).astype(np.int64)}
    else:
        shape = data.draw(shape_of(1, 3))
        axis = data.draw(st.integers(-len(shape), len(shape) - 1))
        idx = data.draw(shape_of(0, 2))
        model = one_node("Gather", [("X", FLOAT, shape), ("i", TensorProto.INT64, idx)], ["Y"], axis=axis)
        feeds = {"X": rand(shape), "i": RNG.integers(0, shape[axis], idx).astype(np.int64)}
    check_node_model(model, feeds)


def test_embedding_strategies():
    model = one_node("Gather", [("ids", TensorProto.INT64, [2, 4])], ["Y"], initializers=[("table", rand([10, 8]))],
                     node_inputs=["table", "ids"])
    seen = strings(check_node_model(model, {"ids": RNG.integers(0, 10, [2, 4]).astype(np.int64)}, meshes=[(1, 2)]))
    assert {"RR,RS1->RS1R", "RS1,RR->RRS1", "RR,S1R->S1RR"} <= seen


def test_gather_nd_strategies():
    # stacked expert weights [experts, out, in] gathered per token-expert pair (the
    # batched-experts export of a sparse MoE): split on out or in, or on the lookups
    model = one_node("GatherND", [("idx", TensorProto.INT64, [6, 1])], ["Y"], initializers=[("stack", rand([4, 8, 6]))],
                     node_inputs=["stack", "idx"])
    seen = strings(check_node_model(model, {"idx": RNG.integers(0, 4, [6, 1]).astype(np.int64)}, meshes=[(1, 2), (2, 2)]))
    assert {"RS1R,RR->RS1R", "RRS1,RR->RRS1", "RRR,S1R->S1RR"} <= seen
    assert not any(s.startswith("S") for s in seen)   # the addressed (expert) dim stays whole
    # several addressed dims and a multi-dim lookup
    model = one_node("GatherND", [("X", FLOAT, [3, 4, 6]), ("i", TensorProto.INT64, [2, 2, 2])], ["Y"])
    feeds = {"X": rand([3, 4, 6]), "i": np.stack([RNG.integers(0, 3, [2, 2]), RNG.integers(0, 4, [2, 2])], -1)}
    seen = strings(check_node_model(model, feeds, meshes=[(1, 2), (2, 2)]))
    assert "RRS1,RRR->RRS1" in seen and "RRR,S1RR->S1RR" in seen


# --- pooling, batch norm, pad, expand ----------------------------------------------------

@SETTINGS
@given(st.sampled_from(["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool", "GlobalLpPool"]), st.data())
def test_pool(op, data):
    spatial = data.draw(st.sampled_from([1, 2]))
    shape = [data.draw(dims), data.draw(dims)] + [data.draw(st.integers(3, 6)) for _ in range(spatial)]
    attrs = {} if op.startswith("Global") else {"kernel_shape": [2] * spatial, "strides": [data.draw(st.integers(1, 2))] * spatial}
    outputs = ["Y", "I"] if op == "MaxPool" and data.draw(st.booleans()) else ["Y"]
    seen = check_node_model(one_node(op, [("X", FLOAT, shape)], outputs, **attrs), {"X": rand(shape)})
    if len(outputs) == 2:
        assert len(seen) == len(MESHES)   # Indices count over the whole tensor: replicated only


@SETTINGS
@given(st.sampled_from(["BatchNormalization", "InstanceNormalization", "LRN"]), st.data())
def test_norms(op, data):
    n, c = data.draw(dims), data.draw(dims)
    spatial = {"BatchNormalization": [0, 1, 2], "InstanceNormalization": [1, 2], "LRN": [2]}[op]   # onnxruntime's LRN: 4-D
    shape = [n, c] + [data.draw(st.integers(1, 4)) for _ in range(data.draw(st.sampled_from(spatial)))]
    if op == "LRN":
        check_node_model(one_node(op, [("X", FLOAT, shape)], ["Y"], size=3), {"X": rand(shape)})
        return
    names = ["scale", "B", "mean", "var"][:4 if op == "BatchNormalization" else 2]
    params = [(name, np.abs(rand([c])) + 0.5) for name in names]
    seen = check_node_model(one_node(op, [("X", FLOAT, shape)], ["Y"], initializers=params), {"X": rand(shape)})
    if c % 2 == 0 and c > 1:
        assert any(s.outputs[0].dims[1] != "R" for s in seen)


@SETTINGS
@given(shape_of(1, 3), st.sampled_from(["constant", "reflect", "edge"]), st.data())
def test_pad(shape, mode, data):
    rank = len(shape)
    pads = [data.draw(st.integers(0, 1)) if shape[d % rank] > 1 else 0 for d in range(2 * rank)]
    inits = [("pads", np.array(pads, np.int64))]
    if mode == "constant" and data.draw(st.booleans()):
        inits.append(("value", np.array(data.draw(st.sampled_from([0.0, 1.5])), np.float32)))
    check_node_model(one_node("Pad", [("X", FLOAT, shape)], ["Y"], initializers=inits, mode=mode), {"X": rand(shape)})


@SETTINGS
@given(st.data())
def test_expand_tile(data):
    a, b = data.draw(broadcast_shapes(2))
    if data.draw(st.booleans()):
        model = one_node("Expand", [("X", FLOAT, a)], ["Y"], initializers=[("shape", np.array(b, np.int64))])
        check_node_model(model, {"X": rand(a)})
    else:
        repeats = [data.draw(st.sampled_from([1, 1, 2])) for _ in a]
        model = one_node("Tile", [("X", FLOAT, a)], ["Y"], initializers=[("repeats", np.array(repeats, np.int64))])
        check_node_model(model, {"X": rand(a)})


def test_unknown_ops_and_missing_constants_are_replicated_only():
    model = one_node("CumSum", [("X", FLOAT, [4, 4])], ["Y"], initializers=[("axis", np.array(0, np.int64))])
    graph = build_graph(infer_shapes(model))
    assert [str(s) for s in node_strategies(graph.nodes[0], graph, mesh_of((2, 2)))] == ["RR,()->RR"]
    model = one_node("ReduceSum", [("X", FLOAT, [4, 4])], ["Y"], initializers=[("axes", np.array([1], np.int64))])
    graph = build_graph(infer_shapes(model))
    assert len(node_strategies(graph.nodes[0], graph, mesh_of((1, 2)))) == 1            # axes value unknown
    assert len(node_strategies(graph.nodes[0], graph, mesh_of((1, 2)), {"axes": np.array([1])})) > 1


# --- onnx's backend node test cases ------------------------------------------------------

FLOATS = (np.float16, np.float32, np.float64)


def _backend_cases():
    """(name, model, inputs) of onnx's node test cases: files if shipped, else generated."""
    root = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
    if root.is_dir() and any(root.glob("test_*/model.onnx")):
        for case_dir in sorted(root.glob("test_*")):
            model = onnx.load(str(case_dir / "model.onnx"))
            files = sorted((case_dir / "test_data_set_0").glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
            inputs = []
            for f in files:
                t = TensorProto()
                t.ParseFromString(f.read_bytes())
                inputs.append(numpy_helper.to_array(t))
            yield case_dir.name, model, inputs
        return
    import warnings

    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    for case in cases:
        inputs = [numpy_helper.to_array(x) if isinstance(x, TensorProto) else x for x in case.data_sets[0][0]]
        yield case.name, case.model, inputs


def _prepare(model: onnx.ModelProto, inputs) -> tuple[onnx.ModelProto, dict] | str:
    """Non-float inputs become initializers (constants: shape inputs, indices, conditions);
    returns (model, float feeds) or why the case is skipped."""
    graph = model.graph
    if len(graph.node) != 1:
        return "not one node"
    if len(inputs) != len(graph.input) or not all(isinstance(x, (np.ndarray, np.generic)) for x in inputs):
        return "non-tensor inputs"
    inputs = [np.asarray(x) for x in inputs]
    node = graph.node[0]
    if node.domain not in ("", "ai.onnx") or node.op_type not in ops_with_rules():
        return "no rule"
    if not all(x.dtype.kind in "biuf" for x in inputs):
        return "non-numeric input"
    for value in graph.input:
        if not value.type.HasField("tensor_type") or any(not d.HasField("dim_value") for d in value.type.tensor_type.shape.dim):
            return "dynamic shapes"
    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    feeds = {}
    keep = []
    for value, x in zip(graph.input, inputs):
        if x.dtype.type in FLOATS:
            feeds[value.name] = x
            keep.append(value)
        else:
            prepared.graph.initializer.append(numpy_helper.from_array(x, value.name))
    del prepared.graph.input[:]
    prepared.graph.input.extend(keep)
    prepared.ir_version = min(prepared.ir_version, 10)
    for opset in prepared.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > _ort_max_opset():
            opset.version = _ort_max_opset()   # the same op as onnxruntime knows it
    return prepared, feeds


@functools.cache
def _ort_max_opset() -> int:
    """The newest default-domain opset this onnxruntime accepts."""
    for version in range(onnx.defs.onnx_opset_version(), 12, -1):
        x = helper.make_tensor_value_info("x", FLOAT, [1])
        model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                                                    [helper.make_tensor_value_info("y", FLOAT, [1])]),
                                  opset_imports=[helper.make_opsetid("", version)])
        model.ir_version = 8
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            return version
        except Exception:
            continue
    return 13


def test_onnx_backend_node_cases():
    counts = collections.Counter()
    per_op = collections.Counter()
    strategies = 0
    for name, model, inputs in _backend_cases():
        if name.endswith("_expanded") or "_expanded_" in name:
            counts["skipped: expanded function"] += 1
            continue
        prepared = _prepare(model, inputs)
        if isinstance(prepared, str):
            counts[f"skipped: {prepared}"] += 1
            continue
        model, feeds = prepared
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        try:
            graph = build_graph(infer_shapes(model))
            static = all(all(d > 0 for d in graph.tensors[o].shape) or graph.tensors[o].size == 0
                         for o in model.graph.node[0].output if o)
        except Exception:   # shape inference or typing fails: not a case the planner can see
            static = False
        if not static:
            counts["skipped: no static output shapes"] += 1
            continue
        try:
            session = _session(model.graph.node[0], graph, model.opset_import)
            names = [n for n in dict.fromkeys(model.graph.node[0].input) if n]
            values = {**{t.name: numpy_helper.to_array(t) for t in model.graph.initializer}, **feeds}
            quiet = ort.RunOptions()
            quiet.log_severity_level = 4
            expected = session.run(None, {n: values[n] for n in names}, quiet)
        except Exception:   # onnxruntime itself cannot run it unsharded
            counts["skipped: onnxruntime cannot run it"] += 1
            continue
        node = model.graph.node[0]
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2] and values[node.input[2]]:
            counts["skipped: random (training dropout)"] += 1
            continue
        seen = check_node_model(model, feeds, meshes=[(1, 2), (2, 2)], opset=opset, session=session, expected=expected)
        strategies += len(seen)
        counts["checked"] += 1
        per_op[model.graph.node[0].op_type] += 1
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    print(f"\nonnx backend node cases: {summary}; {strategies} strategies checked over {len(per_op)} op types")
    assert counts["checked"] >= 300, summary
    assert strategies >= 5 * counts["checked"], summary
    missing = sorted(set(ops_with_rules()) - set(per_op))
    print(f"ops with rules and no checked backend case: {', '.join(missing)}")


def test_strategy_printing_and_omitted_operands():
    model = one_node("Clip", [("X", FLOAT, [4, 2]), ("hi", FLOAT, [])], ["Y"], node_inputs=["X", "", "hi"])
    graph = build_graph(infer_shapes(model))
    found = [str(s) for s in node_strategies(graph.nodes[0], graph, mesh_of((2, 2)))]
    assert found[0] == "RR,_,()->RR"
    assert "S0S1,_,()->S0S1" in found and "S01R,_,()->S01R" in found
    assert all(s.inputs[1] is None for s in node_strategies(graph.nodes[0], graph, mesh_of((2, 2))))


def test_local_shapes_follow_the_segments_of_specs_that_compare_equal():
    """Specs differing in their segments alone are equal (the segments describe the tensor),
    yet hold different shares: the remembered local shapes keep them apart, in either order."""
    from meshplan.sharding import LogicalMesh, ShardingSpec

    mesh = LogicalMesh((1, 2), (0, 1))
    plain = ShardingSpec(("S1",))
    packed = ShardingSpec(("S1",), segments=((0, ((32, 4), (8, 1), (8, 1))),))   # 4 query heads, 1 key, 1 value
    assert plain == packed
    for first, second in ((plain, packed), (packed, plain)):
        assert [spec.local_shape((48,), mesh) for spec in (first, second)] == \
            [(32,) if spec.segments else (24,) for spec in (first, second)]
