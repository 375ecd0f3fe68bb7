"""A Llama decoder of any size in onnxruntime-genai's builder format, written with onnx and
numpy alone (no torch, no transformers): the graph the builder writes for its float32 CPU
models (GroupQueryAttention with the rotary step fused in and a past/present buffer of
fixed capacity, a packed QKV projection, SkipSimplifiedLayerNormalization,
SimplifiedLayerNormalization, a SwiGLU MLP) with random weights streamed straight to one
external data file, and a ``genai_config.json`` beside it.

``write_builder_llama(folder, gigabytes=1.1)`` picks the number of layers for the size
(hidden 1024, 8 query and 2 key/value heads of 128, MLP 2816, vocabulary 32000). Tests
and ``benchmarks/generate.py`` write such models into temporary folders; none is committed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

MICROSOFT = "com.microsoft"


def layers_for(gigabytes: float, hidden: int, ffn: int, vocab: int, kv_heads: int, head: int) -> int:
    per_layer = 4 * (hidden * (hidden + 2 * kv_heads * head) + hidden * hidden + 3 * hidden * ffn)
    fixed = 4 * 2 * vocab * hidden
    return max(1, round((gigabytes * 1e9 - fixed) / per_layer))


def write_builder_llama(folder: str | Path, gigabytes: float = 1.1, *, layers: int | None = None, hidden: int = 1024,
                        heads: int = 8, kv_heads: int = 2, ffn: int = 2816, vocab: int = 32000, context: int = 512,
                        seed: int = 0) -> Path:
    """Write ``folder/model.onnx`` (+ ``model.onnx.data``, ``genai_config.json``); return the model's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    head = hidden // heads
    layers = layers or layers_for(gigabytes, hidden, ffn, vocab, kv_heads, head)
    rng = np.random.default_rng(seed)
    data_path = folder / "model.onnx.data"
    initializers: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    offset = 0

    with open(data_path, "wb") as data:
        def weight(name: str, shape: tuple[int, ...], scale: float | None = None, values: np.ndarray | None = None) -> str:
            nonlocal offset
            if values is None:
                scale = scale if scale is not None else 1.0 / np.sqrt(shape[0])
                values = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
            raw = np.ascontiguousarray(values, dtype=np.float32).tobytes()
            data.write(raw)
            tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(len(raw)))):
                tensor.external_data.add(key=key, value=value)
            offset += len(raw)
            initializers.append(tensor)
            return name

        def node(op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> None:
            nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0] if outputs[0] else op, domain=domain,
                                          **attrs))

        one = "/model/constants/INT64/[1]"
        index = "/model/constants/INT64/1"
        initializers += [helper.make_tensor(one, TensorProto.INT64, [1], [1]),
                         helper.make_tensor(index, TensorProto.INT64, [], [1])]
        mask = "/model/attn_mask_reformat"
        node("ReduceSum", ["attention_mask", one], [f"{mask}/ReduceSum"], keepdims=0)
        node("Sub", [f"{mask}/ReduceSum", one], [f"{mask}/Sub"])
        node("Cast", [f"{mask}/Sub"], [f"{mask}/seqlens_k"], to=TensorProto.INT32)
        node("Shape", ["attention_mask"], [f"{mask}/Shape"])
        node("Gather", [f"{mask}/Shape", index], [f"{mask}/Gather"], axis=0)
        node("Cast", [f"{mask}/Gather"], [f"{mask}/total_sequence_length"], to=TensorProto.INT32)
        positions = np.arange(context, dtype=np.float64)[:, None]
        inv = 1.0 / (10000.0 ** (np.arange(0, head, 2, dtype=np.float64) / head))
        weight("cos_cache", (context, head // 2), values=np.cos(positions * inv[None, :]))
        weight("sin_cache", (context, head // 2), values=np.sin(positions * inv[None, :]))
        weight("model.embed_tokens.weight", (vocab, hidden), scale=1.0)
        node("Gather", ["model.embed_tokens.weight", "input_ids"], ["/model/embed_tokens/output_0"])
        residual = "/model/embed_tokens/output_0"
        weight("model.layers.0.input_layernorm.weight", (hidden,), values=np.ones(hidden))
        node("SimplifiedLayerNormalization", [residual, "model.layers.0.input_layernorm.weight"],
             ["/model/layers.0/input_layernorm/output_0"], epsilon=1e-6, axis=-1, stash_type=1)
        normed = "/model/layers.0/input_layernorm/output_0"
        for i in range(layers):
            p = f"/model/layers.{i}"
            w = f"model.layers.{i}"
            weight(f"{w}.attn.qkv_proj.MatMul.weight", (hidden, hidden + 2 * kv_heads * head))
            node("MatMul", [normed, f"{w}.attn.qkv_proj.MatMul.weight"], [f"{p}/attn/qkv_proj/MatMul/output_0"])
            node("GroupQueryAttention",
                 [f"{p}/attn/qkv_proj/MatMul/output_0", "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value",
                  f"{mask}/seqlens_k", f"{mask}/total_sequence_length", "cos_cache", "sin_cache"],
                 [f"{p}/attn/GroupQueryAttention/output_0", f"present.{i}.key", f"present.{i}.value"],
                 domain=MICROSOFT, num_heads=heads, kv_num_heads=kv_heads, scale=float(1 / np.sqrt(head)),
                 local_window_size=-1, do_rotary=1, rotary_interleaved=0)
            weight(f"{w}.attn.o_proj.MatMul.weight", (hidden, hidden))
            node("MatMul", [f"{p}/attn/GroupQueryAttention/output_0", f"{w}.attn.o_proj.MatMul.weight"],
                 [f"{p}/attn/o_proj/MatMul/output_0"])
            weight(f"{w}.post_attention_layernorm.weight", (hidden,), values=np.ones(hidden))
            node("SkipSimplifiedLayerNormalization",
                 [residual, f"{p}/attn/o_proj/MatMul/output_0", f"{w}.post_attention_layernorm.weight"],
                 [f"{p}/post_attention_layernorm/output_0", "", "", f"{p}/post_attention_layernorm/output_3"],
                 domain=MICROSOFT, epsilon=1e-6)
            mid = f"{p}/post_attention_layernorm/output_0"
            for role in ("gate", "up"):
                weight(f"{w}.mlp.{role}_proj.MatMul.weight", (hidden, ffn))
                node("MatMul", [mid, f"{w}.mlp.{role}_proj.MatMul.weight"], [f"{p}/mlp/{role}_proj/MatMul/output_0"])
            node("Sigmoid", [f"{p}/mlp/gate_proj/MatMul/output_0"], [f"{p}/mlp/act_fn/Sigmoid/output_0"])
            node("Mul", [f"{p}/mlp/gate_proj/MatMul/output_0", f"{p}/mlp/act_fn/Sigmoid/output_0"],
                 [f"{p}/mlp/act_fn/Mul/output_0"])
            node("Mul", [f"{p}/mlp/act_fn/Mul/output_0", f"{p}/mlp/up_proj/MatMul/output_0"], [f"{p}/mlp/Mul/output_0"])
            weight(f"{w}.mlp.down_proj.MatMul.weight", (ffn, hidden))
            node("MatMul", [f"{p}/mlp/Mul/output_0", f"{w}.mlp.down_proj.MatMul.weight"],
                 [f"{p}/mlp/down_proj/MatMul/output_0"])
            last = i == layers - 1
            norm = "model.layers.{}.final_norm_layernorm.weight".format(layers) if last else \
                f"model.layers.{i + 1}.input_layernorm.weight"
            weight(norm, (hidden,), values=np.ones(hidden))
            out = f"/model/layers.{layers}/final_norm_layernorm" if last else f"/model/layers.{i + 1}/input_layernorm"
            node("SkipSimplifiedLayerNormalization",
                 [f"{p}/post_attention_layernorm/output_3", f"{p}/mlp/down_proj/MatMul/output_0", norm],
                 [f"{out}/output_0", "", "", f"{out}/output_3"] if not last else [f"{out}/output_0"],
                 domain=MICROSOFT, epsilon=1e-6)
            residual, normed = f"{out}/output_3", f"{out}/output_0"
        weight("lm_head.MatMul.weight", (hidden, vocab))
        node("MatMul", [normed, "lm_head.MatMul.weight"], ["logits"])

    cache = ["batch_size", kv_heads, "past_sequence_length", head]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])]
    for i in range(layers):
        for kv in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", TensorProto.FLOAT, cache))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT,
                                                         ["batch_size", kv_heads, "total_sequence_length", head]))
    graph = helper.make_graph(nodes, "main_graph", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MICROSOFT, 1)],
                              producer_name="meshplan sample_models.genai_large")
    model.ir_version = 10
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))
    config = {
        "model": {"bos_token_id": 0, "context_length": context, "eos_token_id": 1, "pad_token_id": 1,
                  "type": "llama", "vocab_size": vocab,
                  "decoder": {"filename": "model.onnx", "head_size": head, "hidden_size": hidden,
                              "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
                              "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                              "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                         "past_key_names": "past_key_values.%d.key",
                                         "past_value_names": "past_key_values.%d.value"},
                              "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                          "present_value_names": "present.%d.value"}}},
        "search": {"do_sample": False, "max_length": context, "num_beams": 1, "past_present_share_buffer": True,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n")
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--gigabytes", type=float, default=1.1)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    print(write_builder_llama(args.folder, args.gigabytes, layers=args.layers))
