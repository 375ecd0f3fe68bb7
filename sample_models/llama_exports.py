"""A tiny Hugging Face Llama with grouped-query attention and a key/value cache, exported
two ways, as people get LLMs in ONNX.

``transformers.LlamaForCausalLM`` with 2 layers, hidden 64, 8 query heads and 2 key/value
heads (head size 8), intermediate 128, vocab 256, random weights (seeded):

- ``llama_optimum.onnx``: optimum's ONNX exporter, task ``text-generation-with-past``
  (inputs ``input_ids``, ``attention_mask``, ``position_ids``,
  ``past_key_values.N.key/value``; outputs ``logits``, ``present.N.key/value``; dims
  ``batch_size``, ``sequence_length``, ``past_sequence_length`` and the attention mask's
  ``past_sequence_length + sequence_length``);
- ``llama_dynamo.onnx``: torch's dynamo exporter on the same model wrapped to take and
  return the cache as flat tensors (the same names), every dim left to torch to name
  (``Dim.AUTO``): the attention mask's length comes out as a symbol of its own.

Regenerating them needs torch (CPU is enough), transformers, onnxscript and optimum-onnx,
none of them dependencies of meshplan: ``python -m sample_models.llama_exports`` rewrites
the committed files. The tests use the committed files and never import torch. torch
2.13.0 (CPU) wrote both; the dynamo export with transformers 5.23.0, the optimum one with
optimum-onnx 0.1.0 and transformers 4.57.6 (optimum-onnx 0.1.0 needs transformers < 4.58,
and onnxruntime for its dynamic-axes check); other versions may export different graphs.
``--large PATH`` writes a 130M-parameter dynamo export for ``benchmarks/resident.py``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPTIMUM_PATH = HERE / "llama_optimum.onnx"
DYNAMO_PATH = HERE / "llama_dynamo.onnx"
VOCAB = 256
LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 8


SIZES = {   # name → (hidden, intermediate, layers, vocab): "tiny" is the committed one
    "tiny": (64, 128, LAYERS, VOCAB),
    "large": (1024, 2816, 8, 16384),   # ~130M parameters, for benchmarks/resident.py (not committed)
}


def build_model(size: str = "tiny"):
    """The transformers model, seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, vocab = SIZES[size]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                         tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():   # larger weights than the initialiser's, so that outputs differ clearly per token
        for parameter in model.parameters():
            parameter.mul_(4.0 if parameter.dim() > 1 else 1.0)
    return model


def export_optimum(path: Path = OPTIMUM_PATH, size: str = "tiny") -> Path:
    """optimum's exporter on a saved copy of the model (it loads models by folder)."""
    from optimum.exporters.onnx import main_export

    model = build_model(size)
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "model", Path(tmp) / "onnx"
        model.save_pretrained(source)
        main_export(str(source), output=str(out), task="text-generation-with-past", opset=17, no_post_process=True,
                    do_validation=False, legacy=False, device="cpu")
        shutil.copyfile(out / "model.onnx", path)
        data = out / "model.onnx_data"
        if data.exists():
            raise RuntimeError("the export wrote external data; the sample should fit in one file")
    return path


def export_dynamo(path: Path = DYNAMO_PATH, size: str = "tiny") -> Path:
    import torch
    from transformers import DynamicCache

    model = build_model(size)

    class WithCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=model.config)
            for layer in range(model.config.num_hidden_layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            present = []
            for layer in range(model.config.num_hidden_layers):
                present.extend([out.past_key_values.layers[layer].keys, out.past_key_values.layers[layer].values])
            return (out.logits, *present)

    batch, seq, past_len = 2, 3, 5
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    mask = torch.ones(batch, past_len + seq, dtype=torch.int64)
    positions = torch.arange(past_len, past_len + seq).unsqueeze(0).expand(batch, -1)
    layers = model.config.num_hidden_layers
    head = model.config.hidden_size // model.config.num_attention_heads
    past = [torch.randn(batch, KV_HEADS, past_len, head) for _ in range(2 * layers)]
    names = [f"past_key_values.{layer}.{kind}" for layer in range(layers) for kind in ("key", "value")]
    outputs = ["logits"] + [f"present.{layer}.{kind}" for layer in range(layers) for kind in ("key", "value")]
    auto = torch.export.Dim.AUTO
    dynamic = ({0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto, 1: auto}, tuple({0: auto, 2: auto} for _ in names))
    program = torch.onnx.export(WithCache().eval(), (ids, mask, positions, *past), dynamo=True,
                                input_names=["input_ids", "attention_mask", "position_ids", *names],
                                output_names=outputs, dynamic_shapes=dynamic, external_data=False)
    program.save(str(path), external_data=False)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["optimum", "dynamo"])
    parser.add_argument("--large", type=Path, metavar="PATH",
                        help="write the large dynamo export here instead (benchmarks/resident.py)")
    args = parser.parse_args()
    if args.large:
        print(f"wrote {export_dynamo(args.large, 'large')}")
        raise SystemExit(0)
    if args.only in (None, "optimum"):
        print(f"wrote {export_optimum()}")
    if args.only in (None, "dynamo"):
        print(f"wrote {export_dynamo()}")
