"""A Llama-style decoder written the way torch exporters write it, in the number formats
large models ship in: float32, float16 or bfloat16 weights and arithmetic, int8 weights
(per-output-channel scales, DequantizeLinear before each MatMul), and int4 weights
(onnxruntime's own MatMulNBitsQuantizer, ``write_llama_int4``).

Standard ONNX ops only (opset 17), as in ``gpt.py``: RMSNorm is Pow, ReduceMean, Add,
Sqrt, Div, Mul (computed in float32 and cast back, as ``LlamaRMSNorm`` does); the MLP is
SwiGLU (``down(silu(gate(x)) * up(x))``, SiLU as Sigmoid then Mul); attention is causal
multi-head with rotary position embeddings (cos/sin tables of ``max_seq`` rows, sliced to
``seq``; ``rotary=False`` leaves them out) and its softmax runs in float32, as Hugging Face
computes it; the LM head is untied or, with ``tied=True``, the token embedding transposed.
Sequence sizes come from Shape -> Gather of the layer's input, so any batch and any
``seq <= max_seq`` run.

Weights are drawn in float32 from one seeded stream in the same order whatever the dtype,
so models with the same seed differ only by rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto

from ._builder import INT64, GraphBuilder, normal

DTYPES = {
    "float32": (np.dtype(np.float32), TensorProto.FLOAT),
    "float16": (np.dtype(np.float16), TensorProto.FLOAT16),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), TensorProto.BFLOAT16),
}
WEIGHT_FORMATS = (None, "int8")
RMS_EPSILON = 1e-6
ROPE_THETA = 10000.0
MASK_VALUE = -1.0e4  # finite in float16 and bfloat16; exp of it underflows to 0 in float32
INIT_STD = 0.02
INT4_BLOCK_SIZE = 32


@dataclass(frozen=True)
class _Config:
    dtype: str                  # a key of DTYPES
    weights: str | None         # one of WEIGHT_FORMATS
    rotary: bool
    hidden: int
    heads: int
    head_dim: int
    ffn: int
    max_seq: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype][0]

    @property
    def elem_type(self) -> int:
        return DTYPES[self.dtype][1]


def make_llama(layers: int = 2, hidden: int = 64, heads: int = 4, ffn: int = 176, vocab: int = 256,
               max_seq: int = 64, seed: int = 0, dtype: str = "float32", weights: str | None = None,
               tied: bool = False, rotary: bool = True) -> onnx.ModelProto:
    """Build a Llama decoder ``input_ids int64 ['batch', 'seq'] -> logits dtype ['batch', 'seq', vocab]``.

    ``dtype`` (float32, float16, bfloat16) is what the weights are stored in and the
    arithmetic runs in. ``weights="int8"`` stores every linear weight (q, k, v, o, gate,
    up, down and an untied head) as int8 ``[in, out]`` with a float32 scale and an int8
    zero point per output channel, dequantized by DequantizeLinear (axis 1) and, for
    float16/bfloat16, cast to ``dtype`` (opset 17's DequantizeLinear yields float32). The
    embedding table (and so a tied head) and the norm weights stay in ``dtype``.
    """
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"hidden {hidden} must split into {heads} heads of an even size")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be None or 'int8'; got {weights!r} (int4: write_llama_int4)")
    cfg = _Config(dtype, weights, rotary, hidden, heads, hidden // heads, ffn, max_seq)
    rng = np.random.RandomState(seed)
    g = GraphBuilder("llama")
    ids = g.input("input_ids", INT64, ["batch", "seq"])
    table = normal(rng, (vocab, hidden), INIT_STD)
    embed = g.weight("embed_tokens.weight", table.astype(cfg.np_dtype))
    x = g.op("Gather", [embed, ids], "embed/tok", axis=0)
    for i in range(layers):
        x = _decoder_layer(g, rng, x, i, cfg)
    x = _rms_norm(g, rng, x, "final_norm", "norm", cfg)
    if tied:
        head_t = g.op("Transpose", [embed], "lm_head/transpose", perm=[1, 0])
        g.op("MatMul", [x, head_t], "lm_head/matmul", out="logits")
    else:
        _linear(g, x, normal(rng, (hidden, vocab), INIT_STD), "lm_head", "lm_head", cfg, out="logits")
    g.output("logits", cfg.elem_type, ["batch", "seq", vocab])
    label = f"{dtype}" + (f", {weights} weights" if weights else "")
    return g.build(doc=f"meshplan sample Llama ({label}): {layers} layers, hidden {hidden}, {heads} heads, "
                       f"ffn {ffn}, vocab {vocab}, max_seq {max_seq}, "
                       f"{'tied' if tied else 'untied'} head, {'rotary' if rotary else 'no'} position embeddings")


def save_llama(path: str | os.PathLike, model: onnx.ModelProto | None = None, **options) -> Path:
    """Write ``model`` (or ``make_llama(**options)``) to ``path`` with every weight over
    1 KiB in one external data file ``<name>.data`` beside it: a model past protobuf's 2 GB
    is never serialised whole."""
    path = Path(path)
    model = model if model is not None else make_llama(**options)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    return path


def write_llama_int4(path: str | os.PathLike, external_data: bool = False, **options) -> Path:
    """The float32 ``make_llama(**options)`` with every MatMul on a constant weight replaced
    by onnxruntime's MatMulNBits (com.microsoft): 4-bit symmetric blocks of
    ``INT4_BLOCK_SIZE`` along the input dim, quantized by onnxruntime's own
    ``MatMulNBitsQuantizer``; written to ``path`` (weights in ``<name>.data`` with
    ``external_data``). A tied head reads a transposed embedding, not a constant, and
    stays a float32 MatMul."""
    if options.get("dtype", "float32") != "float32" or options.get("weights"):
        raise ValueError("write_llama_int4 quantizes the float32 model: leave dtype and weights out")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # needs onnx-ir

    quantizer = MatMulNBitsQuantizer(make_llama(**options), bits=4, block_size=INT4_BLOCK_SIZE, is_symmetric=True)
    quantizer.process()
    path = Path(path)
    if external_data:
        return save_llama(path, quantizer.model.model)
    onnx.save_model(quantizer.model.model, str(path))
    return path


def _scalar(g: GraphBuilder, value: float, label: str, dtype: np.dtype) -> str:
    """A shared scalar constant of ``dtype`` named ``const.<dtype>.<label>``."""
    return g.const(f"const.{dtype.name}.{label}", np.array(value, dtype=dtype))


def _linear(g: GraphBuilder, x: str, weight: np.ndarray, prefix: str, param: str, cfg: _Config,
            out: str | None = None) -> str:
    """``x @ weight`` (no bias, as in Llama): the weight stored in ``cfg.dtype``, or as int8
    with per-output-channel scales dequantized before the MatMul."""
    if cfg.weights != "int8":
        w = g.weight(f"{param}.weight", weight.astype(cfg.np_dtype))
        return g.op("MatMul", [x, w], f"{prefix}/matmul", out=out)
    scale = np.maximum(np.abs(weight).max(axis=0), 1e-8) / 127.0
    quantized = np.clip(np.rint(weight / scale), -127, 127).astype(np.int8)
    q = g.weight(f"{param}.weight_quantized", quantized)
    s = g.weight(f"{param}.weight_scale", scale.astype(np.float32))
    z = g.weight(f"{param}.weight_zero_point", np.zeros(weight.shape[1], dtype=np.int8))
    w = g.op("DequantizeLinear", [q, s, z], f"{prefix}/dequantize", axis=1)
    if cfg.dtype != "float32":
        w = g.op("Cast", [w], f"{prefix}/weight_cast", to=cfg.elem_type)
    return g.op("MatMul", [x, w], f"{prefix}/matmul", out=out)


def _cast(g: GraphBuilder, x: str, name: str, to: int, cfg: _Config) -> str:
    """``x`` cast to ``to`` where the model's dtype is not float32 (exporters write no
    float32 -> float32 casts)."""
    return x if cfg.dtype == "float32" else g.op("Cast", [x], name, to=to)


def _rms_norm(g: GraphBuilder, rng: np.random.RandomState, x: str, name: str, param: str, cfg: _Config) -> str:
    """``weight * (x / sqrt(mean(x^2) + eps))``, the statistics in float32."""
    weight = g.weight(f"{param}.weight", normal(rng, (cfg.hidden,), INIT_STD, mean=1.0).astype(cfg.np_dtype))
    f32 = np.dtype(np.float32)
    xf = _cast(g, x, f"{name}/to_float", TensorProto.FLOAT, cfg)
    sq = g.op("Pow", [xf, _scalar(g, 2.0, "two", f32)], f"{name}/pow")
    mean = g.op("ReduceMean", [sq], f"{name}/mean", axes=[-1], keepdims=1)
    var = g.op("Add", [mean, _scalar(g, RMS_EPSILON, "rms_eps", f32)], f"{name}/add_eps")
    root = g.op("Sqrt", [var], f"{name}/sqrt")
    inv = g.op("Div", [_scalar(g, 1.0, "one", f32), root], f"{name}/reciprocal")
    normed = g.op("Mul", [xf, inv], f"{name}/normalize")
    normed = _cast(g, normed, f"{name}/to_dtype", cfg.elem_type, cfg)
    return g.op("Mul", [weight, normed], f"{name}/scale")


def _decoder_layer(g: GraphBuilder, rng: np.random.RandomState, x: str, i: int, cfg: _Config) -> str:
    """``h = x + attn(norm1(x))``, then ``h + mlp(norm2(h))``."""
    p = f"layer{i}"
    h = _rms_norm(g, rng, x, f"{p}/input_norm", f"layers.{i}.input_layernorm", cfg)
    x = g.op("Add", [x, _attention(g, rng, h, p, f"layers.{i}.self_attn", cfg)], f"{p}/attn_residual")
    h = _rms_norm(g, rng, x, f"{p}/post_attention_norm", f"layers.{i}.post_attention_layernorm", cfg)
    return g.op("Add", [x, _mlp(g, rng, h, p, f"layers.{i}.mlp", cfg)], f"{p}/mlp_residual")


def _attention(g: GraphBuilder, rng: np.random.RandomState, x: str, p: str, param: str, cfg: _Config) -> str:
    """Causal multi-head self-attention on ``x [batch, seq, hidden]``."""
    a = f"{p}/attn"
    shape = g.op("Shape", [x], f"{a}/shape")
    batch, seq = (g.op("Unsqueeze", [g.op("Gather", [shape, g.i64(index, scalar=True)], f"{a}/{label}", axis=0),
                                     g.i64(0)], f"{a}/{label}_1d")
                  for index, label in ((0, "batch"), (1, "seq")))
    heads_shape = g.op("Concat", [batch, seq, g.i64(cfg.heads, cfg.head_dim)], f"{a}/heads_shape", axis=0)
    cos_sin = _rotary_tables(g, seq, a, cfg) if cfg.rotary else None

    def heads(role: str) -> str:
        proj = _linear(g, x, normal(rng, (cfg.hidden, cfg.hidden), INIT_STD), f"{a}/{role}_proj",
                       f"{param}.{role}_proj", cfg)
        split = g.op("Reshape", [proj, heads_shape], f"{a}/{role}_reshape")
        out = g.op("Transpose", [split], f"{a}/{role}_transpose", perm=[0, 2, 1, 3])  # [b, h, s, d]
        return _rotate(g, out, cos_sin, f"{a}/{role}_rope", cfg) if cos_sin and role in "qk" else out

    q, k, v = heads("q"), heads("k"), heads("v")
    k_t = g.op("Transpose", [k], f"{a}/k_transpose_for_scores", perm=[0, 1, 3, 2])
    scores = g.op("MatMul", [q, k_t], f"{a}/scores")
    scores = g.op("Mul", [scores, _scalar(g, 1.0 / np.sqrt(cfg.head_dim), f"attn_scale_{cfg.head_dim}", cfg.np_dtype)],
                  f"{a}/scale")
    scores = g.op("Add", [scores, _causal_mask(g, seq, a, cfg)], f"{a}/mask_add")
    scores = _cast(g, scores, f"{a}/scores_to_float", TensorProto.FLOAT, cfg)
    probs = g.op("Softmax", [scores], f"{a}/softmax", axis=-1)
    probs = _cast(g, probs, f"{a}/probs_to_dtype", cfg.elem_type, cfg)
    ctx = g.op("MatMul", [probs, v], f"{a}/context")
    ctx = g.op("Transpose", [ctx], f"{a}/context_transpose", perm=[0, 2, 1, 3])
    merge_shape = g.op("Concat", [batch, seq, g.i64(cfg.hidden)], f"{a}/merge_shape", axis=0)
    ctx = g.op("Reshape", [ctx, merge_shape], f"{a}/context_reshape")
    return _linear(g, ctx, normal(rng, (cfg.hidden, cfg.hidden), INIT_STD), f"{a}/o_proj", f"{param}.o_proj", cfg)


def _rotary_tables(g: GraphBuilder, seq: str, a: str, cfg: _Config) -> tuple[str, str]:
    """The shared cos and sin tables ``[max_seq, head_dim]`` (Hugging Face's layout: the
    half-width frequencies repeated), in ``cfg.dtype``, sliced to ``[seq, head_dim]``."""
    inv_freq = 1.0 / ROPE_THETA ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
    angles = np.outer(np.arange(cfg.max_seq, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    tables = []
    for fn in ("cos", "sin"):
        table = g.const(f"const.rope_{fn}_{cfg.max_seq}_{cfg.head_dim}.{cfg.dtype}",
                        getattr(np, fn)(angles).astype(cfg.np_dtype))
        tables.append(g.op("Slice", [table, g.i64(0), seq, g.i64(0)], f"{a}/rope_{fn}"))
    return tables[0], tables[1]


def _rotate(g: GraphBuilder, x: str, cos_sin: tuple[str, str], n: str, cfg: _Config) -> str:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = concat(-x2, x1)``."""
    half = cfg.head_dim // 2
    x1 = g.op("Slice", [x, g.i64(0), g.i64(half), g.i64(-1)], f"{n}/first_half")
    x2 = g.op("Slice", [x, g.i64(half), g.i64(cfg.head_dim), g.i64(-1)], f"{n}/second_half")
    rotated = g.op("Concat", [g.op("Neg", [x2], f"{n}/neg"), x1], f"{n}/rotate_half", axis=-1)
    cos, sin = cos_sin
    return g.op("Add", [g.op("Mul", [x, cos], f"{n}/mul_cos"), g.op("Mul", [rotated, sin], f"{n}/mul_sin")],
                f"{n}/add")


def _causal_mask(g: GraphBuilder, seq: str, a: str, cfg: _Config) -> str:
    """The shared ``[max_seq, max_seq]`` additive mask (in ``cfg.dtype``) sliced to ``[seq, seq]``."""
    future = np.triu(np.ones((cfg.max_seq, cfg.max_seq), dtype=bool), k=1)
    table = g.const(f"const.causal_mask_{cfg.max_seq}.{cfg.dtype}",
                    np.where(future, MASK_VALUE, 0.0).astype(cfg.np_dtype))
    ends = g.op("Concat", [seq, seq], f"{a}/mask_ends", axis=0)
    return g.op("Slice", [table, g.i64(0, 0), ends, g.i64(0, 1)], f"{a}/mask_slice")


def _mlp(g: GraphBuilder, rng: np.random.RandomState, x: str, p: str, param: str, cfg: _Config) -> str:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, SiLU as ``gate * sigmoid(gate)``."""
    m = f"{p}/mlp"
    gate = _linear(g, x, normal(rng, (cfg.hidden, cfg.ffn), INIT_STD), f"{m}/gate_proj", f"{param}.gate_proj", cfg)
    up = _linear(g, x, normal(rng, (cfg.hidden, cfg.ffn), INIT_STD), f"{m}/up_proj", f"{param}.up_proj", cfg)
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{m}/sigmoid")], f"{m}/silu")
    h = g.op("Mul", [silu, up], f"{m}/swiglu")
    return _linear(g, h, normal(rng, (cfg.ffn, cfg.hidden), INIT_STD), f"{m}/down_proj", f"{param}.down_proj", cfg)
