"""A GPT-3-style decoder of a chosen shape, written straight to external data.

``write_large_gpt(path, layers=…, hidden=…, heads=…)`` writes the architecture of the GPT
models in Alpa's and Megatron-LM's weak-scaling benchmarks (learned position embeddings,
pre-LayerNorm blocks with biases, attention with ``heads`` heads, a 4×hidden GELU MLP, the
output head tied to the token embedding) in float16, streaming every weight into ``path +
'.data'`` a chunk at a time (``large_llama._ModelWriter``); ``sparse`` writes no bytes at
all, for planning without programs. The graph is onnx's own: ``LayerNormalization``,
GELU from ``Erf``, attention from MatMul/Softmax/Reshape/Transpose. It has no causal mask
(the work and memory a plan weighs are the same with one). Inputs ``input_ids[batch,
seq]`` int64; output ``logits[batch, seq, vocab]`` float16.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from sample_models.large_llama import _ModelWriter

# the GPT-3 models of Alpa's weak-scaling table (OSDI 2022, §8.1): sequence 1024, vocabulary 51,200
ALPA_GPT = {
    "350M": dict(layers=24, hidden=1024, heads=16, gpus=1),
    "1.3B": dict(layers=24, hidden=2048, heads=32, gpus=4),
    "2.6B": dict(layers=32, hidden=2560, heads=32, gpus=8),
    "6.7B": dict(layers=32, hidden=4096, heads=32, gpus=16),
    "15B": dict(layers=48, hidden=5120, heads=40, gpus=32),
    "39B": dict(layers=48, hidden=8192, heads=64, gpus=64),
}


def parameter_count(layers: int, hidden: int, vocab: int = 51200, positions: int = 1024) -> int:
    """Weights of the model ``write_large_gpt`` writes (the head is the embedding)."""
    block = 12 * hidden * hidden + 13 * hidden
    return layers * block + (vocab + positions) * hidden + 2 * hidden


def write_large_gpt(path: str | os.PathLike, *, layers: int, hidden: int, heads: int, vocab: int = 51200,
                    positions: int = 1024, sparse: bool = False, seed: int = 0) -> dict:
    """Write the model to ``path`` (weights in ``path.data``); returns its facts:
    {"path", "data", "layers", "parameters", "weight_bytes"}."""
    path = Path(path)
    if hidden % heads:
        raise ValueError(f"heads {heads} must divide hidden {hidden}")
    head = hidden // heads
    writer = _ModelWriter(path, seed, sparse)
    const, weight, node = writer.const, writer.weight, writer.node

    zero, one = const("zero", np.int64(0)), const("one", np.int64(1))
    half, one_h, root2 = const("half", np.float16(0.5)), const("one_h", np.float16(1.0)), \
        const("sqrt2", np.float16(math.sqrt(2.0)))
    scale = const("attn_scale", np.float16(1.0 / math.sqrt(head)))
    split_heads = const("split_heads", np.array([0, 0, heads, head], dtype=np.int64))
    merge_heads = const("merge_heads", np.array([0, 0, hidden], dtype=np.int64))
    seq_axis = const("seq_axis", np.array([1], dtype=np.int64))

    def layer_norm(x: str, p: str) -> str:
        return node("LayerNormalization", [x, weight(f"{p}.weight", (hidden,), 1.0), weight(f"{p}.bias", (hidden,), 0.0)],
                    f"{p}/out", axis=-1, epsilon=1e-5)

    def linear(x: str, p: str, fan_in: int, fan_out: int) -> str:
        product = node("MatMul", [x, weight(f"{p}.weight", (fan_in, fan_out))], f"{p}/mm")
        return node("Add", [product, weight(f"{p}.bias", (fan_out,), 0.0)], f"{p}/out")

    wte = weight("wte", (vocab, hidden))
    seq = node("Gather", [node("Shape", ["input_ids"], "ids_shape"), seq_axis], "seq_len")
    positions_of = node("Range", [zero, node("Squeeze", [seq], "seq_scalar"), one], "positions")
    x = node("Add", [node("Gather", [wte, "input_ids"], "tokens", axis=0),
                     node("Gather", [weight("wpe", (positions, hidden)), positions_of], "placed", axis=0)], "embedded")
    for i in range(layers):
        p = f"h.{i}"
        n = layer_norm(x, f"{p}.ln_1")

        def heads_of(role: str, perm: list[int]) -> str:
            split = node("Reshape", [linear(n, f"{p}.attn.{role}", hidden, hidden), split_heads], f"{p}/attn/{role}_heads")
            return node("Transpose", [split], f"{p}/attn/{role}_t", perm=perm)

        q, k, v = heads_of("q", [0, 2, 1, 3]), heads_of("k", [0, 2, 3, 1]), heads_of("v", [0, 2, 1, 3])
        merged = writer.attention(p, q, k, v, scale, merge_heads)
        x = node("Add", [x, linear(merged, f"{p}.attn.proj", hidden, hidden)], f"{p}/attn_residual")
        n = layer_norm(x, f"{p}.ln_2")
        fc = linear(n, f"{p}.mlp.fc", hidden, 4 * hidden)
        erf = node("Erf", [node("Div", [fc, root2], f"{p}/mlp/scaled")], f"{p}/mlp/erf")
        gelu = node("Mul", [node("Mul", [fc, half], f"{p}/mlp/half"), node("Add", [erf, one_h], f"{p}/mlp/erf1")],
                    f"{p}/mlp/gelu")
        x = node("Add", [x, linear(gelu, f"{p}.mlp.proj", 4 * hidden, hidden)], f"{p}/mlp_residual")
    head_weight = node("Transpose", [wte], "wte_t", perm=[1, 0])      # the head tied to the embedding
    logits = node("MatMul", [layer_norm(x, "ln_f"), head_weight], "logits")
    writer.save("large_gpt", logits, vocab)
    return {"path": str(path), "data": str(writer.weights.path), "layers": layers,
            "parameters": parameter_count(layers, hidden, vocab, positions), "weight_bytes": writer.weights.offset}
