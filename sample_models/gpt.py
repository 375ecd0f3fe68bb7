"""A small GPT-style decoder written the way exporters write it.

The graph keeps its symbolic-shape sub-computations: positions come from
Shape -> Gather -> Range, every attention Reshape target is built from
Shape -> Gather -> Unsqueeze -> Concat of the layer's input, and the causal mask
is a ``[max_seq, max_seq]`` constant cut to ``[seq, seq]`` by a Slice whose ends
come from the same shape values.  Small constants (axes, scalars, the mask) are
shared initializers used by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from ._builder import FLOAT, INT64, GraphBuilder, linear, normal

MASK_VALUE = -1.0e4  # exp underflows to exactly 0 in float32; still finite in float16
LN_EPSILON = 1e-5
INIT_STD = 0.02


@dataclass(frozen=True)
class _Config:
    hidden: int
    heads: int
    ffn: int
    max_seq: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def make_gpt(layers: int = 4, hidden: int = 128, heads: int = 4, vocab: int = 512,
             max_seq: int = 64, ffn_mult: int = 4, seed: int = 0) -> onnx.ModelProto:
    """Build a GPT decoder ``input_ids int64 ['batch', 'seq'] -> logits ['batch', 'seq', vocab]``.

    Pre-LayerNorm blocks (attention, then a GELU MLP of width ``ffn_mult * hidden``),
    learned position embeddings for up to ``max_seq`` positions, a final LayerNorm and
    an untied LM head.  Valid for any batch and any ``seq <= max_seq``.
    """
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
    cfg = _Config(hidden=hidden, heads=heads, ffn=ffn_mult * hidden, max_seq=max_seq)
    rng = np.random.RandomState(seed)
    g = GraphBuilder("gpt")
    ids = g.input("input_ids", INT64, ["batch", "seq"])
    x = _embeddings(g, rng, ids, vocab, cfg)
    for i in range(layers):
        x = _decoder_layer(g, rng, x, i, cfg)
    x = _layer_norm(g, rng, x, "final_ln", "final_ln", hidden)
    head = normal(rng, (hidden, vocab), INIT_STD)
    linear(g, x, head, None, "lm_head", "lm_head", out="logits")
    g.output("logits", FLOAT, ["batch", "seq", vocab])
    return g.build(doc=f"meshplan sample GPT: {layers} layers, hidden {hidden}, "
                       f"{heads} heads, vocab {vocab}, max_seq {max_seq}")


def _embeddings(g: GraphBuilder, rng: np.random.RandomState, ids: str, vocab: int,
                cfg: _Config) -> str:
    """Token embedding plus learned position embedding for positions ``0 .. seq-1``."""
    wte = g.weight("embed.tok.weight", normal(rng, (vocab, cfg.hidden), INIT_STD))
    wpe = g.weight("embed.pos.weight", normal(rng, (cfg.max_seq, cfg.hidden), INIT_STD))
    tok = g.op("Gather", [wte, ids], "embed/tok", axis=0)
    shape = g.op("Shape", [ids], "embed/shape")
    seq = g.op("Gather", [shape, g.i64(1, scalar=True)], "embed/seq_len", axis=0)
    positions = g.op("Range", [g.i64(0, scalar=True), seq, g.i64(1, scalar=True)],
                     "embed/positions")
    pos = g.op("Gather", [wpe, positions], "embed/pos", axis=0)
    return g.op("Add", [tok, pos], "embed/add")


def _layer_norm(g: GraphBuilder, rng: np.random.RandomState, x: str, name: str, param: str,
                width: int) -> str:
    """LayerNormalization over the last axis with scale ``1 + noise`` and a small bias."""
    scale = g.weight(f"{param}.weight", normal(rng, (width,), INIT_STD, mean=1.0))
    bias = g.weight(f"{param}.bias", normal(rng, (width,), INIT_STD))
    return g.op("LayerNormalization", [x, scale, bias], name, axis=-1, epsilon=LN_EPSILON)


def _decoder_layer(g: GraphBuilder, rng: np.random.RandomState, x: str, i: int,
                   cfg: _Config) -> str:
    """One pre-LN block: ``x + attn(ln1(x))`` then ``h + mlp(ln2(h))``."""
    p = f"layer{i}"
    h = _layer_norm(g, rng, x, f"{p}/ln1", f"{p}.ln1", cfg.hidden)
    x = g.op("Add", [x, _attention(g, rng, h, p, cfg)], f"{p}/attn_residual")
    h = _layer_norm(g, rng, x, f"{p}/ln2", f"{p}.ln2", cfg.hidden)
    return g.op("Add", [x, _mlp(g, rng, h, p, cfg)], f"{p}/mlp_residual")


def _proj(rng: np.random.RandomState, fan_in: int, fan_out: int) -> tuple[np.ndarray, np.ndarray]:
    """A weight with std 0.02 and a small bias."""
    return normal(rng, (fan_in, fan_out), INIT_STD), normal(rng, (fan_out,), INIT_STD)


def _attention(g: GraphBuilder, rng: np.random.RandomState, x: str, p: str,
               cfg: _Config) -> str:
    """Causal multi-head self-attention on ``x [batch, seq, hidden]``."""
    a = f"{p}/attn"
    batch, seq = _batch_and_seq(g, x, a)
    heads_shape = g.op("Concat", [batch, seq, g.i64(cfg.heads, cfg.head_dim)],
                       f"{a}/heads_shape", axis=0)

    def heads(role: str, perm: list[int]) -> str:
        proj = linear(g, x, *_proj(rng, cfg.hidden, cfg.hidden), f"{a}/{role}_proj",
                      f"{p}.attn.{role}_proj")
        split = g.op("Reshape", [proj, heads_shape], f"{a}/{role}_reshape")
        return g.op("Transpose", [split], f"{a}/{role}_transpose", perm=perm)

    q = heads("q", [0, 2, 1, 3])  # [b, h, s, d]
    k = heads("k", [0, 2, 3, 1])  # [b, h, d, s]
    v = heads("v", [0, 2, 1, 3])  # [b, h, s, d]
    scores = g.op("MatMul", [q, k], f"{a}/scores")
    scale = g.f32(1.0 / np.sqrt(cfg.head_dim), f"attn_scale_{cfg.head_dim}")
    scores = g.op("Mul", [scores, scale], f"{a}/scale")
    scores = g.op("Add", [scores, _causal_mask(g, seq, a, cfg.max_seq)], f"{a}/mask_add")
    probs = g.op("Softmax", [scores], f"{a}/softmax", axis=-1)
    ctx = g.op("MatMul", [probs, v], f"{a}/context")
    ctx = g.op("Transpose", [ctx], f"{a}/context_transpose", perm=[0, 2, 1, 3])
    merge_shape = g.op("Concat", [batch, seq, g.i64(cfg.hidden)], f"{a}/merge_shape", axis=0)
    ctx = g.op("Reshape", [ctx, merge_shape], f"{a}/context_reshape")
    return linear(g, ctx, *_proj(rng, cfg.hidden, cfg.hidden), f"{a}/o_proj", f"{p}.attn.o_proj")


def _batch_and_seq(g: GraphBuilder, x: str, a: str) -> tuple[str, str]:
    """The batch and seq sizes of ``x`` as 1-element int64 tensors, read from its shape."""
    shape = g.op("Shape", [x], f"{a}/shape")
    axes0 = g.i64(0)
    sizes = []
    for index, label in ((0, "batch"), (1, "seq")):
        size = g.op("Gather", [shape, g.i64(index, scalar=True)], f"{a}/{label}", axis=0)
        sizes.append(g.op("Unsqueeze", [size, axes0], f"{a}/{label}_1d"))
    return sizes[0], sizes[1]


def _causal_mask(g: GraphBuilder, seq: str, a: str, max_seq: int) -> str:
    """The shared ``[max_seq, max_seq]`` additive mask sliced to ``[seq, seq]``."""
    future = np.triu(np.ones((max_seq, max_seq), dtype=bool), k=1)
    table = g.const(f"const.causal_mask_{max_seq}",
                    np.where(future, MASK_VALUE, 0.0).astype(np.float32))
    ends = g.op("Concat", [seq, seq], f"{a}/mask_ends", axis=0)
    return g.op("Slice", [table, g.i64(0, 0), ends, g.i64(0, 1)], f"{a}/mask_slice")


def _mlp(g: GraphBuilder, rng: np.random.RandomState, x: str, p: str, cfg: _Config) -> str:
    """``fc2(gelu(fc1(x)))`` with the exact (erf) GELU written in primitive ops."""
    m = f"{p}/mlp"
    h = linear(g, x, *_proj(rng, cfg.hidden, cfg.ffn), f"{m}/fc1", f"{p}.mlp.fc1")
    h = _gelu(g, h, f"{m}/gelu")
    return linear(g, h, *_proj(rng, cfg.ffn, cfg.hidden), f"{m}/fc2", f"{p}.mlp.fc2")


def _gelu(g: GraphBuilder, x: str, n: str) -> str:
    """``0.5 * x * (1 + erf(x / sqrt(2)))`` as Div, Erf, Add, Mul, Mul."""
    scaled = g.op("Div", [x, g.f32(np.sqrt(2.0), "sqrt2")], f"{n}/div")
    erf = g.op("Erf", [scaled], f"{n}/erf")
    one_plus = g.op("Add", [erf, g.f32(1.0, "one")], f"{n}/add")
    prod = g.op("Mul", [x, one_plus], f"{n}/mul")
    return g.op("Mul", [prod, g.f32(0.5, "half")], f"{n}/half")
