"""A 24-layer GPT-2 from transformers exported by torch's dynamo exporter (not committed).

``transformers.GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=256, n_head=8,
vocab_size=1000))`` with symbolic ``batch`` and ``seq`` (``--dim batch=… --dim seq=…``):
about 900 operators and 75 MB of float32 weights, too big to commit. It is the model the
planning-time benchmark plans on large meshes (``benchmarks/plan_time.py --gpt2``).

``export(path)`` needs torch (CPU is enough), onnxscript and transformers, which are not
dependencies of meshplan; without them it raises ``MissingExporter`` with the line to
install them. ``python -m sample_models.gpt2_dynamo -o gpt2.onnx`` writes the file.
torch 2.13.0 (CPU) with transformers 5 wrote the one measured in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

LAYERS = 24
HIDDEN = 256
HEADS = 8
VOCAB = 1000
POSITIONS = 1024


class MissingExporter(RuntimeError):
    """torch, onnxscript or transformers is not installed."""


def build_module(layers: int = LAYERS):
    """The transformers model (seeded weights) wrapped to take ``input_ids`` and return the logits."""
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as error:
        raise MissingExporter(
            f"exporting GPT-2 needs torch and transformers ({error}); install them in a separate environment: "
            "pip install torch onnxscript transformers") from error

    config = GPT2Config(n_layer=layers, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    return Logits().eval()


def export(path: str | Path, layers: int = LAYERS) -> Path:
    """Write the export to ``path`` (weights inline; 75 MB at 24 layers)."""
    module = build_module(layers)
    import torch

    ids = torch.randint(0, VOCAB, (2, 16))
    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("seq", min=2, max=POSITIONS)
    program = torch.onnx.export(module, (ids,), dynamo=True, input_names=["input_ids"], output_names=["logits"],
                                dynamic_shapes=({0: batch, 1: seq},), external_data=False)
    path = Path(path)
    program.save(str(path), external_data=False)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    print(f"wrote {export(args.output, args.layers)}")
