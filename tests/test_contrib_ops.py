"""onnxruntime's own operators (the ones its GenAI model builder writes) shard correctly.

Each strategy of each operator runs sharded through onnxruntime and is compared with the
unsharded operator, as ``test_strategies`` does for ONNX's operators:
GroupQueryAttention (packed and separate query/key/value, with a cache shared at a fixed
capacity or growing, rotary, local window, softcap; key/value heads fewer than devices),
MultiHeadAttention, RotaryEmbedding, SkipSimplifiedLayerNormalization,
SkipLayerNormalization, SimplifiedLayerNormalization (default domain) and
GatherBlockQuantized.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from meshplan.intra.strategies import node_strategies
from meshplan.model.graph import build_graph
from meshplan.model.load import infer_shapes
from meshplan.model.ort_schemas import register_onnxruntime_schemas
from meshplan.sharding import ShardingSpec
from tests.test_quantized import check_emitted
from tests.test_strategies import mesh_of, strings

FLOAT = TensorProto.FLOAT
MS = "com.microsoft"
SETTINGS = settings(max_examples=10, deadline=None)
RNG = np.random.default_rng(7)


def rand(shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def contrib_node(op_type, inputs, outputs, initializers=(), domain=MS, **attrs) -> onnx.ModelProto:
    """A one-node model of an onnxruntime operator. ``inputs``: (name, elem type, shape) or
    "" for an omitted optional input; ``initializers``: (name, value) read as constants."""
    given = [i for i in inputs if i]
    names = [i[0] if i else "" for i in inputs]
    for name, _ in initializers:
        if name not in names:
            names.append(name)
    node = helper.make_node(op_type, names, outputs, domain=domain, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(*i) for i in given],
                              [helper.make_empty_tensor_value_info(o) for o in outputs if o],
                              [numpy_helper.from_array(np.asarray(v), n) for n, v in initializers])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def output_spec(strategy: str) -> ShardingSpec:
    return ShardingSpec.parse(strategy.split("->")[1].split(",")[0])


def heads_split(seen) -> bool:
    """Some strategy splits the output's last dim (heads × head size)."""
    return any(output_spec(s).dims[-1] != "R" for s in seen)


def batch_split(seen) -> bool:
    return any(output_spec(s).dims[0] != "R" for s in seen)


def check_node_model(model, feeds, meshes=((1, 2), (2, 2), (1, 4))):
    """Every strategy emitted for every rank (local attributes and sliced weights included)
    and run through onnxruntime against the unsharded node."""
    return check_emitted(model, feeds, meshes=list(meshes))


# --- GroupQueryAttention ------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_group_query_attention(data):
    heads, kv_heads = data.draw(st.sampled_from([(8, 2), (4, 4), (8, 4), (4, 1), (4, 2)]))
    size = 16
    batch, seq = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([1, 3]))
    shared = data.draw(st.booleans())            # past and present one buffer of fixed capacity
    past = data.draw(st.sampled_from([2, 5]))
    total = past + seq
    capacity = total + data.draw(st.sampled_from([0, 2])) if shared else past
    if shared:
        total = data.draw(st.sampled_from([seq, total]))
    if batch > 1 and seq > 1:   # onnxruntime's limit: a batch of prompts only without a past
        shared, total, capacity = True, seq, capacity + seq
    packed = data.draw(st.booleans())
    rotary = data.draw(st.booleans())
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=int(rotary),
                 rotary_interleaved=int(rotary and data.draw(st.booleans())),
                 local_window_size=data.draw(st.sampled_from([-1, 2])), softcap=data.draw(st.sampled_from([0.0, 4.0])))
    inputs = [("query", FLOAT, [batch, seq, (heads + 2 * kv_heads) * size if packed else heads * size])]
    inputs += ["", ""] if packed else [("key", FLOAT, [batch, seq, kv_heads * size]),
                                       ("value", FLOAT, [batch, seq, kv_heads * size])]
    inputs += [("past_key", FLOAT, [batch, kv_heads, capacity, size]), ("past_value", FLOAT, [batch, kv_heads, capacity, size]),
               ("seqlens_k", TensorProto.INT32, [batch])]
    initializers = [("total_sequence_length", np.array(total, np.int32))]
    if rotary:
        positions = np.arange(32)[:, None] / (10000.0 ** (np.arange(size // 2)[None, :] * 2 / size))
        initializers += [("cos_cache", np.cos(positions).astype(np.float32)), ("sin_cache", np.sin(positions).astype(np.float32))]
    model = contrib_node("GroupQueryAttention", inputs, ["output", "present_key", "present_value"], initializers, **attrs)
    feeds = {name: rand(shape) for name, _, shape in (i for i in inputs if i) if name != "seqlens_k"}
    feeds["seqlens_k"] = np.full([batch], total - 1, np.int32)
    seen = check_node_model(model, feeds)
    assert heads_split(seen)
    assert batch_split(seen) or batch == 1


def test_group_query_attention_splits_query_and_key_value_heads_together():
    """8 query / 2 key-value heads, packed: on 1x2 each device one key/value head and its 4
    query heads; on 1x4 each key/value head is held by the two devices whose query heads
    read it."""
    heads, kv_heads, size, batch, seq, capacity = 8, 2, 16, 1, 3, 8
    inputs = [("query", FLOAT, [batch, seq, (heads + 2 * kv_heads) * size]), "", "",
              ("past_key", FLOAT, [batch, kv_heads, capacity, size]), ("past_value", FLOAT, [batch, kv_heads, capacity, size]),
              ("seqlens_k", TensorProto.INT32, [batch])]
    model = contrib_node("GroupQueryAttention", inputs, ["output", "present_key", "present_value"],
                         [("total_sequence_length", np.array(seq, np.int32))], num_heads=heads, kv_num_heads=kv_heads)
    feeds = {"query": rand(inputs[0][2]), "past_key": rand(inputs[3][2]), "past_value": rand(inputs[4][2]),
             "seqlens_k": np.array([seq - 1], np.int32)}
    graph = build_graph(infer_shapes(model))
    for mesh in [(1, 2), (1, 4)]:
        assert heads_split(check_node_model(model, feeds, meshes=[mesh]))
        found = node_strategies(graph.nodes[0], graph, mesh_of(mesh))
        strategy = next(s for s in found if s.outputs[0].dims[-1] != "R")
        query, cache = strategy.inputs[0], strategy.inputs[3]
        assert query.segments_of(2) == ((128, 8), (32, 2), (32, 2))
        devices = mesh[1]
        assert query.local_shape((batch, seq, 192), mesh_of(mesh)) == (batch, seq, 192 // devices if devices == 2 else 64)
        assert cache.local_shape((batch, kv_heads, capacity, size), mesh_of(mesh)) == (batch, 1, capacity, size)
        held = [cache.local_indices(1, kv_heads, mesh_of(mesh), (0, j)).tolist() for j in range(devices)]
        assert held == ([[0], [1]] if devices == 2 else [[0], [0], [1], [1]])


# --- MultiHeadAttention -------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_multi_head_attention(data):
    heads, size = data.draw(st.sampled_from([2, 4])), 8
    batch, seq, kv_seq = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([1, 3])), data.draw(st.sampled_from([2, 3]))
    cached = data.draw(st.booleans())
    inputs = [("query", FLOAT, [batch, seq, heads * size]), ("key", FLOAT, [batch, kv_seq, heads * size]),
              ("value", FLOAT, [batch, kv_seq, heads * size])]
    outputs = ["output"]
    if cached:
        inputs += ["", "", "", ("past_key", FLOAT, [batch, heads, 2, size]), ("past_value", FLOAT, [batch, heads, 2, size])]
        outputs += ["present_key", "present_value"]
    model = contrib_node("MultiHeadAttention", inputs, outputs, num_heads=heads,
                         unidirectional=int(data.draw(st.booleans()) and cached))
    seen = check_node_model(model, {name: rand(shape) for name, _, shape in (i for i in inputs if i)})
    assert heads_split(seen)


# --- RotaryEmbedding ----------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_rotary_embedding(data):
    heads, size = data.draw(st.sampled_from([2, 4])), 8
    batch, seq = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([2, 4]))
    four_d = data.draw(st.booleans())
    shape = [batch, heads, seq, size] if four_d else [batch, seq, heads * size]
    per_token = data.draw(st.booleans())
    positions = (RNG.integers(0, 16, [batch, seq]) if per_token else np.array([3])).astype(np.int64)
    angles = np.arange(16)[:, None] / (10000.0 ** (np.arange(size // 2)[None, :] * 2 / size))
    attrs = dict(interleaved=int(data.draw(st.booleans())))
    if not four_d and data.draw(st.booleans()):
        attrs["num_heads"] = heads
    model = contrib_node("RotaryEmbedding", [("x", FLOAT, shape)], ["y"],
                         [("positions", positions), ("cos", np.cos(angles).astype(np.float32)),
                          ("sin", np.sin(angles).astype(np.float32))], **attrs)
    seen = check_node_model(model, {"x": rand(shape)})
    assert any(output_spec(s).dims[1 if four_d else 2] != "R" for s in seen)


# --- normalisations -----------------------------------------------------------------------

@pytest.mark.parametrize("op", ["SkipSimplifiedLayerNormalization", "SkipLayerNormalization"])
@SETTINGS
@given(data=st.data())
def test_skip_layer_norm(op, data):
    batch, seq, hidden = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([2, 4])), 8
    skip = data.draw(st.sampled_from([[batch, seq, hidden], [seq, hidden]]))
    inputs = [("x", FLOAT, [batch, seq, hidden]), ("skip", FLOAT, skip)]
    initializers = [("gamma", rand([hidden]))]
    if op == "SkipLayerNormalization":
        initializers.append(("beta", rand([hidden])))
    if data.draw(st.booleans()):
        initializers.append(("bias", rand([hidden])))
    outputs = data.draw(st.sampled_from([["y"], ["y", "", "", "sum"], ["y", "mean", "inv_std", "sum"]]))
    names = ["x", "skip"] + [n for n, _ in initializers]   # (input, skip, gamma, [beta], [bias])
    node = helper.make_node(op, names, outputs, domain=MS, epsilon=1e-5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_empty_tensor_value_info(o) for o in outputs if o],
                              [numpy_helper.from_array(v, n) for n, v in initializers])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    seen = check_node_model(model, {"x": rand([batch, seq, hidden]), "skip": rand(skip)})
    assert batch_split(seen) or batch == 1


@SETTINGS
@given(st.data())
def test_simplified_layer_norm(data):
    register_onnxruntime_schemas()
    shape = [data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([2, 4])), 8]
    axis = data.draw(st.sampled_from([-1, 2, 1]))
    outputs = data.draw(st.sampled_from([["y"], ["y", "inv_std"]]))
    model = contrib_node("SimplifiedLayerNormalization", [("x", FLOAT, shape)], outputs,
                         [("scale", rand(shape[axis:] if axis >= 0 else shape[axis:]))], domain="", axis=axis, epsilon=1e-5)
    onnx.checker.check_model(infer_shapes(model))   # checked against onnxruntime's schema
    seen = check_node_model(model, {"x": rand(shape)})
    assert batch_split(seen) or shape[0] == 1


# --- GatherBlockQuantized -------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_gather_block_quantized(data):
    vocab, hidden, block = 12, 64, data.draw(st.sampled_from([16, 32]))
    ids = data.draw(st.sampled_from([[4], [2, 3]]))
    table = RNG.integers(0, 256, [vocab, hidden // 2]).astype(np.uint8)   # two 4-bit values a byte
    initializers = [("table", table), ("scales", np.abs(rand([vocab, hidden // block])) + 0.1)]
    if data.draw(st.booleans()):
        initializers.append(("zero_points", RNG.integers(0, 256, [vocab, hidden // block // 2]).astype(np.uint8)))
    model = contrib_node("GatherBlockQuantized", [("ids", TensorProto.INT64, ids)], ["y"], initializers,
                         bits=4, block_size=block, gather_axis=0, quantize_axis=1)
    node = model.graph.node[0]
    node.input[:] = ["table", "ids"] + [n for n, _ in initializers[1:]]
    seen = check_node_model(model, {"ids": RNG.integers(0, vocab, ids).astype(np.int64)})
    hidden_split = [s for s in seen if output_spec(s).dims[-1] != "R"]
    assert hidden_split or len(initializers) == 3   # packed zero points keep the hidden dim whole


def test_contrib_shapes_are_inferred():
    model = contrib_node("GroupQueryAttention",
                         [("query", FLOAT, [2, 3, 192]), "", "", ("past_key", FLOAT, [2, 2, 8, 16]),
                          ("past_value", FLOAT, [2, 2, 8, 16]), ("seqlens_k", TensorProto.INT32, [2])],
                         ["output", "present_key", "present_value"], [("total_sequence_length", np.array(5, np.int32))],
                         num_heads=8, kv_num_heads=2)
    graph = build_graph(infer_shapes(model))
    assert graph.tensors["output"].shape == (2, 3, 128)
    assert graph.tensors["present_key"].shape == (2, 2, 8, 16)   # the shared buffer's capacity
    assert strings(node_strategies(graph.nodes[0], graph, mesh_of((1, 2))))


def test_segmented_specs():
    """A packed [Q | K | V] dim split by heads: each device one chunk of every segment; a
    segment of fewer heads than devices has each head on several devices; resharding it
    never reduce-scatters into it (a device's part is not one run), and round trips."""
    from meshplan.reshard.steps import reshard_steps
    from meshplan.testing.reshard import shard, unshard

    segments = {1: ((8, 4), (2, 1), (2, 1))}   # 4 query heads of 2, one key and one value head
    mesh = mesh_of((1, 2))
    split = ShardingSpec.parse("RS1").with_segments(segments)
    assert split.local_shape((3, 12), mesh) == (3, 8)   # 4 query columns + the shared K and V (2 each)
    assert split.local_indices(1, 12, mesh, (0, 0)).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert split.local_indices(1, 12, mesh, (0, 1)).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    full = np.arange(36.0).reshape(3, 12)
    assert np.array_equal(unshard(shard(full, split, mesh), split, mesh), full)
    partial = ShardingSpec.parse("RR+P1").with_segments(segments)
    steps = reshard_steps(partial, split)
    assert [s.kind.name for s in steps] == ["all_reduce", "slice"]
    plain = ShardingSpec.parse("RS1")
    assert [s.kind.name for s in reshard_steps(ShardingSpec.parse("RR+P1"), plain)] == ["reduce_scatter"]
    assert not ShardingSpec.parse("RS1").with_segments({1: ((9, 3), (3, 1))}).is_valid_for((3, 12), mesh_of((1, 4)))
