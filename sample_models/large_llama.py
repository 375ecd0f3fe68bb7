"""A Llama-style decoder of a chosen size, written straight to external data.

``write_large_llama(path, gigabytes)`` picks the layer count for about that many bytes
of float16 weights (hidden 4096, ffn 11008, vocab 32000: 0.4 GB a layer, as a 7B model
has) and streams every weight into ``path + '.data'`` a chunk at a time, so a model far
larger than memory is written with a few hundred MB of it. Each weight is recorded as
an external tensor (``onnx.external_data_helper.set_external_data``); the graph is
onnx's own (RMSNorm from Pow/ReduceMean/Sqrt/Div, attention with Reshape/Transpose/
Softmax, a SiLU-gated MLP, tied nothing). Inputs ``input_ids[batch, seq]`` int64;
output ``logits[batch, seq, vocab]`` float16.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

CHUNK_ELEMENTS = 16 * 1024 * 1024          # 32 MiB of float16 per write


def layer_bytes(hidden: int, ffn: int) -> int:
    return 2 * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden)


def layers_for(gigabytes: float, hidden: int = 4096, ffn: int = 11008, vocab: int = 32000) -> int:
    fixed = 2 * (2 * vocab * hidden + hidden)
    return max(1, round((gigabytes * 1e9 - fixed) / layer_bytes(hidden, ffn)))


class _WeightFile:
    """Appends float16 weights to one external data file, never holding one whole; a
    sparse file (``sparse``) gets no bytes at all: its length is set at the end, so it
    reads as zeros and takes no disk space."""

    def __init__(self, path: Path, seed: int, sparse: bool = False):
        self.path = path
        self.file = open(path, "wb")
        self.offset = 0
        self.rng = np.random.default_rng(seed)
        self.largest = 0
        self.sparse = sparse

    def add(self, name: str, shape: tuple[int, ...], scale: float, constant: float | None = None) -> TensorProto:
        count = math.prod(shape)
        left = 0 if self.sparse else count
        while left:
            n = min(left, CHUNK_ELEMENTS)
            if constant is None:
                chunk = (self.rng.standard_normal(n, dtype=np.float32) * scale).astype(np.float16)
            else:
                chunk = np.full(n, constant, dtype=np.float16)
            self.file.write(chunk.tobytes())
            left -= n
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT16, dims=list(shape))
        tensor.raw_data = b""          # set_external_data moves raw data out; there is none here
        set_external_data(tensor, location=self.path.name, offset=self.offset, length=2 * count)
        tensor.ClearField("raw_data")
        self.offset += 2 * count
        self.largest = max(self.largest, 2 * count)
        return tensor

    def close(self) -> None:
        if self.sparse:
            self.file.truncate(self.offset)
        self.file.close()


class _ModelWriter:
    """A decoder's graph as it is written: its nodes, its initializers (weights streamed into
    a ``_WeightFile`` beside ``path``), the attention they share, and the atomic save."""

    def __init__(self, path: Path, seed: int, sparse: bool):
        self.path = path
        self.weights = _WeightFile(path.with_name(path.name + ".data"), seed, sparse)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, shape: tuple[int, ...], constant: float | None = None) -> str:
        self.inits.append(self.weights.add(name, shape, 1.0 / math.sqrt(shape[0]), constant))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def attention(self, p: str, q: str, k: str, v: str, scale: str, merge_heads: str) -> str:
        """Heads [batch, heads, seq, head] (``k`` transposed) → the merged context [batch, seq, hidden]."""
        node = self.node
        scores = node("Mul", [node("MatMul", [q, k], f"{p}/attn/qk"), scale], f"{p}/attn/scores")
        probs = node("Softmax", [scores], f"{p}/attn/probs", axis=-1)
        context = node("Transpose", [node("MatMul", [probs, v], f"{p}/attn/context")], f"{p}/attn/context_t",
                       perm=[0, 2, 1, 3])
        return node("Reshape", [context, merge_heads], f"{p}/attn/merged")

    def save(self, name: str, logits: str, vocab: int) -> None:
        """Close the weights and write the model (``input_ids`` in, float16 ``logits`` out)."""
        self.weights.close()
        graph = helper.make_graph(
            self.nodes, name,
            [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
            [helper.make_tensor_value_info(logits, TensorProto.FLOAT16, ["batch", "seq", vocab])], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9,
                                  producer_name="meshplan-sample")
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(model.SerializeToString())
        os.replace(tmp, self.path)


def write_large_llama(path: str | os.PathLike, gigabytes: float = 2.0, *, layers: int | None = None,
                      hidden: int = 4096, heads: int = 32, ffn: int = 11008, vocab: int = 32000,
                      kv_heads: int | None = None, sparse: bool = False, seed: int = 0) -> dict:
    """Write the model to ``path`` (weights in ``path.data``); returns its facts:
    {"path", "data", "layers", "weight_bytes", "largest_initializer_bytes"}.

    ``kv_heads`` (a divisor of ``heads``) gives grouped-query attention: the key and value
    projections have ``kv_heads`` heads, each repeated for ``heads / kv_heads`` query heads
    (Reshape, Expand, Reshape, as exporters write it). ``sparse`` writes no weight bytes:
    the data file is a sparse file of the right length (zeros), for planning without
    programs (``meshplan plan --no-programs``); a 70B-shaped model is written in a moment."""
    path = Path(path)
    layers = layers or layers_for(gigabytes, hidden, ffn, vocab)
    head = hidden // heads
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise ValueError(f"kv_heads {kv_heads} must divide heads {heads}")
    kv = kv_heads * head
    writer = _ModelWriter(path, seed, sparse)
    const, weight, node, weights = writer.const, writer.weight, writer.node, writer.weights
    two, eps = const("two", np.float16(2)), const("eps", np.float16(1e-5))
    scale = const("attn_scale", np.float16(1.0 / math.sqrt(head)))
    split_heads = const("split_heads", np.array([0, 0, heads, head], dtype=np.int64))
    merge_heads = const("merge_heads", np.array([0, 0, hidden], dtype=np.int64))
    if kv_heads != heads:
        split_groups = const("split_groups", np.array([0, 0, kv_heads, 1, head], dtype=np.int64))
        repeat_heads = const("repeat_heads", np.array([1, 1, 1, heads // kv_heads, 1], dtype=np.int64))
    last = const("last_axis", np.array([-1], dtype=np.int64))

    def rms_norm(x: str, p: str) -> str:
        mean = node("ReduceMean", [node("Pow", [x, two], f"{p}/sq"), last], f"{p}/mean", keepdims=1)
        root = node("Sqrt", [node("Add", [mean, eps], f"{p}/var")], f"{p}/rms")
        return node("Mul", [node("Div", [x, root], f"{p}/normed"), weight(f"{p}.weight", (hidden,), 1.0)], f"{p}/out")

    x = node("Gather", [weight("embed_tokens", (vocab, hidden)), "input_ids"], "embedded", axis=0)
    for i in range(layers):
        p = f"layers.{i}"
        n = rms_norm(x, f"{p}.input_norm")

        def heads_of(role: str, perm: list[int]) -> str:
            width = hidden if role == "q" else kv
            proj = node("MatMul", [n, weight(f"{p}.attn.{role}_proj", (hidden, width))], f"{p}/attn/{role}")
            if width == hidden:
                split = node("Reshape", [proj, split_heads], f"{p}/attn/{role}_heads")
            else:   # each key/value head repeated for its group of query heads
                grouped = node("Reshape", [proj, split_groups], f"{p}/attn/{role}_groups")
                shape = node("Shape", [grouped], f"{p}/attn/{role}_groups_shape")
                target = node("Mul", [shape, repeat_heads], f"{p}/attn/{role}_repeat_shape")
                split = node("Reshape", [node("Expand", [grouped, target], f"{p}/attn/{role}_repeated"), split_heads],
                             f"{p}/attn/{role}_heads")
            return node("Transpose", [split], f"{p}/attn/{role}_t", perm=perm)

        q, k, v = heads_of("q", [0, 2, 1, 3]), heads_of("k", [0, 2, 3, 1]), heads_of("v", [0, 2, 1, 3])
        merged = writer.attention(p, q, k, v, scale, merge_heads)
        out = node("MatMul", [merged, weight(f"{p}.attn.o_proj", (hidden, hidden))], f"{p}/attn/out")
        x = node("Add", [x, out], f"{p}/attn_residual")
        n = rms_norm(x, f"{p}.post_norm")
        gate = node("MatMul", [n, weight(f"{p}.mlp.gate_proj", (hidden, ffn))], f"{p}/mlp/gate")
        silu = node("Mul", [gate, node("Sigmoid", [gate], f"{p}/mlp/sigmoid")], f"{p}/mlp/silu")
        up = node("MatMul", [n, weight(f"{p}.mlp.up_proj", (hidden, ffn))], f"{p}/mlp/up")
        down = node("MatMul", [node("Mul", [silu, up], f"{p}/mlp/gated"), weight(f"{p}.mlp.down_proj", (ffn, hidden))],
                    f"{p}/mlp/down")
        x = node("Add", [x, down], f"{p}/mlp_residual")
    logits = node("MatMul", [rms_norm(x, "final_norm"), weight("lm_head", (hidden, vocab))], "logits")
    writer.save("large_llama", logits, vocab)
    return {"path": str(path), "data": str(weights.path), "layers": layers, "weight_bytes": weights.offset,
            "largest_initializer_bytes": weights.largest}
