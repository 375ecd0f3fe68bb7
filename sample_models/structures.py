"""Models shaped like fresh torch exports, written with ``onnx.helper`` and numpy only.

torch's dynamo exporter writes the batch as a number and leaves small operators at the
ends of a graph (a timestep's Unsqueeze, a last LayerNorm, an output MatMul, a
classifier Gemm). These builders write the same structures at a static batch, so that
the planner's treatment of them is tested without torch (``sample_models.torch_exports``
writes the real exports, for the benchmarks):

- ``make_unet_like``: a timestep embedding from an Unsqueeze, convolutions, a strided
  down block, cross attention over the spatial positions, nearest upsampling by
  ``Resize`` (torch's ``asymmetric`` / ``floor``), a skip concatenation;
- ``make_encoder``: a Whisper-like encoder (input projection, pre-LayerNorm attention
  and MLP blocks, a last LayerNorm);
- ``make_encoder_decoder``: a T5-like encoder and decoder (self and cross attention),
  whose decoder's last position is picked by a ``GatherND`` with the constant indices
  ``[[b, T - 1], …]`` exporters write, then the output MatMul;
- ``make_vit_like``: a ViT classifier over patch vectors (hidden 768, 12 heads by
  default: 28 MB of weights per layer), ending in a classifier Gemm.

Every model has a static batch (``batch``), random seeded weights and float32 data.
"""

from __future__ import annotations

import numpy as np
import onnx

from ._builder import FLOAT, INT64, GraphBuilder, linear, normal

STD = 0.05


def _layer_norm(g: GraphBuilder, rng, x: str, name: str, width: int) -> str:
    scale = g.weight(f"{name}.weight", normal(rng, (width,), STD, mean=1.0))
    bias = g.weight(f"{name}.bias", normal(rng, (width,), STD))
    return g.op("LayerNormalization", [x, scale, bias], name, axis=-1, epsilon=1e-5)


def _heads(g: GraphBuilder, x: str, batch: int, length: int, heads: int, size: int, name: str) -> str:
    """[batch, length, heads·size] → [batch, heads, length, size]."""
    split = g.op("Reshape", [x, g.i64(batch, length, heads, size)], f"{name}/split")
    return g.op("Transpose", [split], f"{name}/heads", perm=[0, 2, 1, 3])


def _attention(g: GraphBuilder, rng, x: str, memory: str, batch: int, length: int, memory_length: int,
               hidden: int, heads: int, name: str, mask: np.ndarray | None = None) -> str:
    """Multi-head attention of ``x`` [batch, length, hidden] over ``memory`` (itself for
    self attention), by heads, with an additive ``mask`` [length, memory_length]."""
    size = hidden // heads
    q = linear(g, x, normal(rng, (hidden, hidden), STD), normal(rng, (hidden,), STD), f"{name}/q", f"{name}.q")
    k = linear(g, memory, normal(rng, (hidden, hidden), STD), normal(rng, (hidden,), STD), f"{name}/k", f"{name}.k")
    v = linear(g, memory, normal(rng, (hidden, hidden), STD), normal(rng, (hidden,), STD), f"{name}/v", f"{name}.v")
    q = _heads(g, q, batch, length, heads, size, f"{name}/q")
    kt = g.op("Transpose", [g.op("Reshape", [k, g.i64(batch, memory_length, heads, size)], f"{name}/k/split")],
              f"{name}/k/heads", perm=[0, 2, 3, 1])
    v = _heads(g, v, batch, memory_length, heads, size, f"{name}/v")
    scores = g.op("MatMul", [q, kt], f"{name}/scores")
    scores = g.op("Mul", [scores, g.f32(1.0 / np.sqrt(size), f"scale{size}")], f"{name}/scaled")
    if mask is not None:
        scores = g.op("Add", [scores, g.const(f"{name}.mask", mask.astype(np.float32))], f"{name}/masked")
    probs = g.op("Softmax", [scores], f"{name}/softmax", axis=-1)
    context = g.op("MatMul", [probs, v], f"{name}/context")
    merged = g.op("Reshape", [g.op("Transpose", [context], f"{name}/merge", perm=[0, 2, 1, 3]),
                              g.i64(batch, length, hidden)], f"{name}/merged")
    return linear(g, merged, normal(rng, (hidden, hidden), STD), normal(rng, (hidden,), STD), f"{name}/o", f"{name}.o")


def _mlp(g: GraphBuilder, rng, x: str, hidden: int, ffn: int, name: str) -> str:
    up = linear(g, x, normal(rng, (hidden, ffn), STD), normal(rng, (ffn,), STD), f"{name}/up", f"{name}.up")
    act = g.op("Relu", [up], f"{name}/act")
    return linear(g, act, normal(rng, (ffn, hidden), STD), normal(rng, (hidden,), STD), f"{name}/down", f"{name}.down")


def _block(g: GraphBuilder, rng, x: str, batch: int, length: int, hidden: int, heads: int, ffn: int, name: str,
           memory: str | None = None, memory_length: int = 0, mask: np.ndarray | None = None) -> str:
    """Pre-LayerNorm block: self attention, cross attention over ``memory`` where given, MLP."""
    h = _layer_norm(g, rng, x, f"{name}/ln1", hidden)
    x = g.op("Add", [x, _attention(g, rng, h, h, batch, length, length, hidden, heads, f"{name}/self", mask)],
             f"{name}/res1")
    if memory is not None:
        h = _layer_norm(g, rng, x, f"{name}/ln_cross", hidden)
        x = g.op("Add", [x, _attention(g, rng, h, memory, batch, length, memory_length, hidden, heads, f"{name}/cross")],
                 f"{name}/res_cross")
    h = _layer_norm(g, rng, x, f"{name}/ln2", hidden)
    return g.op("Add", [x, _mlp(g, rng, h, hidden, ffn, f"{name}/mlp")], f"{name}/res2")


def _encoder(g: GraphBuilder, rng, x: str, batch: int, length: int, hidden: int, heads: int, layers: int,
             prefix: str) -> str:
    for i in range(layers):
        x = _block(g, rng, x, batch, length, hidden, heads, 4 * hidden, f"{prefix}{i}")
    return _layer_norm(g, rng, x, f"{prefix}final_ln", hidden)


def make_encoder(batch: int = 2, length: int = 16, features: int = 32, hidden: int = 64, heads: int = 4,
                 layers: int = 2, seed: int = 0) -> onnx.ModelProto:
    """``input_features [batch, length, features] → last_hidden_state [batch, length, hidden]``."""
    rng = np.random.RandomState(seed)
    g = GraphBuilder("encoder")
    x = g.input("input_features", FLOAT, [batch, length, features])
    x = linear(g, x, normal(rng, (features, hidden), STD), normal(rng, (hidden,), STD), "proj", "proj")
    x = _encoder(g, rng, x, batch, length, hidden, heads, layers, "layer")
    g.op("Identity", [x], "output", out="last_hidden_state")
    g.output("last_hidden_state", FLOAT, [batch, length, hidden])
    return g.build(doc=f"Whisper-like encoder: {layers} layers, hidden {hidden}, static batch {batch}")


def make_encoder_decoder(batch: int = 2, source: int = 12, target: int = 6, vocab: int = 256, hidden: int = 64,
                         heads: int = 4, layers: int = 2, seed: int = 0) -> onnx.ModelProto:
    """``input_ids [batch, source], decoder_input_ids [batch, target] → logits [batch, vocab]``
    of the decoder's last position (picked by GatherND with indices ``[[b, target - 1], …]``)."""
    rng = np.random.RandomState(seed)
    g = GraphBuilder("encoder_decoder")
    ids = g.input("input_ids", INT64, [batch, source])
    dec_ids = g.input("decoder_input_ids", INT64, [batch, target])
    table = g.weight("shared.weight", normal(rng, (vocab, hidden), STD))
    memory = _encoder(g, rng, g.op("Gather", [table, ids], "encoder/embed", axis=0), batch, source, hidden, heads,
                      layers, "encoder/layer")
    causal = np.triu(np.full((target, target), -1e4, np.float32), 1)
    x = g.op("Gather", [table, dec_ids], "decoder/embed", axis=0)
    for i in range(layers):
        x = _block(g, rng, x, batch, target, hidden, heads, 4 * hidden, f"decoder/layer{i}", memory, source, causal)
    x = _layer_norm(g, rng, x, "decoder/final_ln", hidden)
    last = g.const("decoder.last_position", np.array([[b, target - 1] for b in range(batch)], np.int64))
    x = g.op("GatherND", [x, last], "decoder/last")
    linear(g, x, normal(rng, (hidden, vocab), STD), None, "lm_head", "lm_head", out="logits")
    g.output("logits", FLOAT, [batch, vocab])
    return g.build(doc=f"T5-like encoder-decoder: {layers}+{layers} layers, hidden {hidden}, static batch {batch}")


def make_vit_like(batch: int = 2, patches: int = 196, patch: int = 768, hidden: int = 768, heads: int = 12,
                  layers: int = 3, classes: int = 1000, seed: int = 0) -> onnx.ModelProto:
    """``pixel_patches [batch, patches, patch] → logits [batch, classes]``: a patch
    projection, a class token, pre-LayerNorm blocks, a last LayerNorm, the class token's
    row and a classifier Gemm."""
    rng = np.random.RandomState(seed)
    g = GraphBuilder("vit")
    x = g.input("pixel_patches", FLOAT, [batch, patches, patch])
    x = linear(g, x, normal(rng, (patch, hidden), STD), normal(rng, (hidden,), STD), "embed/patch", "embed.patch")
    cls = g.weight("embed.cls", normal(rng, (1, 1, hidden), STD))
    cls = g.op("Expand", [cls, g.i64(batch, 1, hidden)], "embed/cls")
    x = g.op("Concat", [cls, x], "embed/tokens", axis=1)
    x = g.op("Add", [x, g.weight("embed.position", normal(rng, (1, patches + 1, hidden), STD))], "embed/position")
    x = _encoder(g, rng, x, batch, patches + 1, hidden, heads, layers, "layer")
    first = g.op("Gather", [x, g.i64(0, scalar=True)], "head/cls", axis=1)
    weight = g.weight("classifier.weight", normal(rng, (classes, hidden), STD))
    bias = g.weight("classifier.bias", normal(rng, (classes,), STD))
    g.op("Gemm", [first, weight, bias], "classifier", out="logits", transB=1)
    g.output("logits", FLOAT, [batch, classes])
    return g.build(doc=f"ViT-like classifier: {layers} layers, hidden {hidden}, static batch {batch}")


def make_unet_like(batch: int = 2, channels: int = 32, size: int = 16, context: int = 8, context_dim: int = 32,
                   seed: int = 0) -> onnx.ModelProto:
    """``sample [batch, 4, size, size], timestep [batch], encoder_hidden_states [batch,
    context, context_dim] → out_sample [batch, 4, size, size]``."""
    rng = np.random.RandomState(seed)
    g = GraphBuilder("unet")
    sample = g.input("sample", FLOAT, [batch, 4, size, size])
    timestep = g.input("timestep", FLOAT, [batch])
    states = g.input("encoder_hidden_states", FLOAT, [batch, context, context_dim])

    def conv(x, cin, cout, name, stride=1):
        w = g.weight(f"{name}.weight", normal(rng, (cout, cin, 3, 3), 1.0 / np.sqrt(9 * cin)))
        b = g.weight(f"{name}.bias", normal(rng, (cout,), STD))
        return g.op("Conv", [x, w, b], name, pads=[1, 1, 1, 1], strides=[stride, stride])

    t = g.op("Unsqueeze", [timestep, g.i64(1)], "time/unsqueeze")
    t = g.op("Sin", [linear(g, t, normal(rng, (1, channels), 1.0), None, "time/freq", "time.freq")], "time/sin")
    t = linear(g, t, normal(rng, (channels, channels), STD), normal(rng, (channels,), STD), "time/proj", "time.proj")
    t = g.op("Unsqueeze", [t, g.i64(2, 3)], "time/spatial")
    x = g.op("Relu", [g.op("Add", [conv(sample, 4, channels, "conv_in"), t], "conv_in/time")], "conv_in/act")
    skip = x
    wide, half = 2 * channels, size // 2
    x = g.op("Relu", [conv(x, channels, wide, "down", stride=2)], "down/act")
    tokens = g.op("Transpose", [g.op("Reshape", [x, g.i64(batch, wide, half * half)], "mid/flatten")], "mid/tokens",
                  perm=[0, 2, 1])
    proj = linear(g, states, normal(rng, (context_dim, wide), STD), None, "mid/context", "mid.context")
    h = _layer_norm(g, rng, tokens, "mid/ln", wide)
    tokens = g.op("Add", [tokens, _attention(g, rng, h, proj, batch, half * half, context, wide, 4, "mid/cross")],
                  "mid/res")
    x = g.op("Reshape", [g.op("Transpose", [tokens], "mid/channels", perm=[0, 2, 1]), g.i64(batch, wide, half, half)],
             "mid/unflatten")
    scales = g.const("up.scales", np.array([1, 1, 2, 2], np.float32))
    x = g.op("Resize", [x, "", scales], "up/resize", mode="nearest", coordinate_transformation_mode="asymmetric",
             nearest_mode="floor")
    x = g.op("Relu", [conv(x, wide, channels, "up/conv")], "up/act")
    x = g.op("Concat", [x, skip], "up/skip", axis=1)
    conv(x, wide, 4, "conv_out")
    g.nodes[-1].output[0] = "out_sample"
    g.output("out_sample", FLOAT, [batch, 4, size, size])
    return g.build(doc=f"UNet-like: {channels} channels, {size}x{size}, static batch {batch}")


STRUCTURES = {"unet_like": make_unet_like, "encoder": make_encoder, "encoder_decoder": make_encoder_decoder,
              "vit_like": make_vit_like}
