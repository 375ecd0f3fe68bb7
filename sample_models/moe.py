"""A Mixtral-style sparse mixture-of-experts decoder, written the way torch's exporter writes
Hugging Face's ``MixtralSparseMoeBlock``: the routing is data-dependent.

Each layer is Llama's (``llama.py``: RMSNorm, causal attention with rotary embeddings)
with the MLP replaced by a sparse MoE block over the ``tokens = batch * seq`` rows::

    logits  = x @ router                       # [tokens, experts]
    weights, chosen = TopK(Softmax(logits), top_k)
    weights = weights / sum(weights)           # [tokens, top_k]
    mask    = Transpose(OneHot(chosen, experts), (2, 1, 0))   # [experts, top_k, tokens]
    out     = zeros [tokens, hidden]
    for e in experts:                          # unrolled, one expert's MLP each
        slot, token = NonZero(mask[e])         # which tokens chose e: a data-dependent count
        h = SwiGLU_e(x[token]) * weights[token, slot]
        out = ScatterND(out, token, h, reduction="add")   # index_add_

Every expert has its own gate, up and down weights (``layers.i.block_sparse_moe.experts.e.w1/w3/w2``),
as the Hugging Face module stores them; the rows an expert sees are NonZero's count, known
only at run time.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from ._builder import INT64, GraphBuilder, normal
from .llama import INIT_STD, _attention, _Config, _linear, _rms_norm


def make_moe(layers: int = 2, hidden: int = 32, heads: int = 4, ffn: int = 64, experts: int = 4, top_k: int = 2,
             vocab: int = 128, max_seq: int = 32, seed: int = 0) -> onnx.ModelProto:
    """Build ``input_ids int64 ['batch', 'seq'] -> logits float32 ['batch', 'seq', vocab]``."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts}; got {top_k}")
    cfg = _Config("float32", None, True, hidden, heads, hidden // heads, ffn, max_seq)
    rng = np.random.RandomState(seed)
    g = GraphBuilder("moe")
    ids = g.input("input_ids", INT64, ["batch", "seq"])
    embed = g.weight("embed_tokens.weight", normal(rng, (vocab, hidden), INIT_STD))
    x = g.op("Gather", [embed, ids], "embed/tok", axis=0)
    for i in range(layers):
        p = f"layer{i}"
        h = _rms_norm(g, rng, x, f"{p}/input_norm", f"layers.{i}.input_layernorm", cfg)
        x = g.op("Add", [x, _attention(g, rng, h, p, f"layers.{i}.self_attn", cfg)], f"{p}/attn_residual")
        h = _rms_norm(g, rng, x, f"{p}/post_attention_norm", f"layers.{i}.post_attention_layernorm", cfg)
        moe = _sparse_moe(g, rng, h, p, f"layers.{i}.block_sparse_moe", cfg, experts, top_k)
        x = g.op("Add", [x, moe], f"{p}/moe_residual")
    x = _rms_norm(g, rng, x, "final_norm", "norm", cfg)
    _linear(g, x, normal(rng, (hidden, vocab), INIT_STD), "lm_head", "lm_head", cfg, out="logits")
    g.output("logits", TensorProto.FLOAT, ["batch", "seq", vocab])
    return g.build(doc=f"meshplan sample Mixtral-style MoE: {layers} layers, hidden {hidden}, {heads} heads, "
                       f"{experts} experts of ffn {ffn}, top-{top_k} routing, vocab {vocab}, max_seq {max_seq}")


def _sparse_moe(g: GraphBuilder, rng: np.random.RandomState, x: str, p: str, param: str, cfg: _Config,
                experts: int, top_k: int) -> str:
    """The MoE block on ``x [batch, seq, hidden]``; returns ``[batch, seq, hidden]``."""
    m = f"{p}/moe"
    rows = g.op("Reshape", [x, g.i64(-1, cfg.hidden)], f"{m}/flatten")                 # [tokens, hidden]
    logits = _linear(g, rows, normal(rng, (cfg.hidden, experts), INIT_STD), f"{m}/gate", f"{param}.gate", cfg)
    probs = g.op("Softmax", [logits], f"{m}/softmax", axis=1)
    weights, chosen = g.node("TopK", [probs, g.i64(top_k)], f"{m}/topk", ["values", "indices"], axis=-1)
    total = g.op("ReduceSum", [weights, g.i64(-1)], f"{m}/weights_sum", keepdims=1)
    weights = g.op("Div", [weights, total], f"{m}/weights_normalize")                 # [tokens, top_k]
    one_hot = g.op("OneHot", [chosen, g.i64(experts, scalar=True), g.i64(0, 1)], f"{m}/one_hot", axis=-1)
    mask = g.op("Transpose", [one_hot], f"{m}/expert_mask", perm=[2, 1, 0])         # [experts, top_k, tokens]
    out = g.op("ConstantOfShape", [g.op("Shape", [rows], f"{m}/rows_shape")], f"{m}/zeros",
               value=onnx.helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0]))
    for e in range(experts):
        n = f"{m}/expert{e}"
        hit = g.op("NonZero", [g.op("Gather", [mask, g.i64(e, scalar=True)], f"{n}/mask", axis=0)], f"{n}/nonzero")
        slot = g.op("Gather", [hit, g.i64(0, scalar=True)], f"{n}/slot", axis=0)         # [count]
        token = g.op("Gather", [hit, g.i64(1, scalar=True)], f"{n}/token", axis=0)       # [count]
        picked = g.op("Reshape", [g.op("Gather", [rows, token], f"{n}/gather_rows", axis=0), g.i64(-1, cfg.hidden)],
                      f"{n}/rows")
        w = f"{param}.experts.{e}"
        gate = _linear(g, picked, normal(rng, (cfg.hidden, cfg.ffn), INIT_STD), f"{n}/w1", f"{w}.w1", cfg)
        up = _linear(g, picked, normal(rng, (cfg.hidden, cfg.ffn), INIT_STD), f"{n}/w3", f"{w}.w3", cfg)
        silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{n}/sigmoid")], f"{n}/silu")
        h = _linear(g, g.op("Mul", [silu, up], f"{n}/swiglu"), normal(rng, (cfg.ffn, cfg.hidden), INIT_STD),
                    f"{n}/w2", f"{w}.w2", cfg)
        where = g.op("Concat", [g.op("Unsqueeze", [token, g.i64(-1)], f"{n}/token_column"),
                                g.op("Unsqueeze", [slot, g.i64(-1)], f"{n}/slot_column")], f"{n}/token_slot", axis=-1)
        scale = g.op("Unsqueeze", [g.op("GatherND", [weights, where], f"{n}/routing_weight"), g.i64(-1)],
                     f"{n}/routing_column")
        h = g.op("Mul", [h, scale], f"{n}/weighted")
        out = g.op("ScatterND", [out, g.op("Unsqueeze", [token, g.i64(-1)], f"{n}/scatter_index"), h],
                   f"{n}/index_add", reduction="add")
    return g.op("Reshape", [out, g.op("Shape", [x], f"{m}/input_shape")], f"{m}/unflatten")
