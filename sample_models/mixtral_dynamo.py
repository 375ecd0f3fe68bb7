"""A tiny Hugging Face Mixtral (sparse mixture of experts) exported by torch's dynamo exporter.

``transformers.MixtralForCausalLM`` with 2 layers, hidden 32, 4 heads (2 key/value heads),
8 experts of intermediate size 64, top-2 routing, vocab 128; exported with symbolic
``batch`` and ``seq`` (``--dim batch=… --dim seq=…``). transformers 5 stores the experts
stacked (``gate_up_proj [experts, 2 * intermediate, hidden]``, ``down_proj [experts,
hidden, intermediate]``). Its default ("eager") experts loop over the experts a batch
hits, which torch.export refuses (a Python loop over a tensor's values); the
``batched_mm`` experts export: each token's two experts' weights are gathered from the
stacks (GatherND on the expert ids from TopK) and applied by batched MatMuls, then
weighted by the routing probabilities and summed. (The loop form as older exporters
unrolled it, one NonZero per expert, is ``moe.py``.)

Regenerating it needs torch (CPU is enough), onnxscript and transformers, not
dependencies of meshplan: ``python -m sample_models.mixtral_dynamo`` rewrites the
committed file. The tests use the committed file and never import torch. torch 2.13.0
(CPU) with transformers 5.23.0 wrote it; other versions may export a different graph.
"""

from __future__ import annotations

import argparse
from pathlib import Path

VOCAB = 128
PATH = Path(__file__).resolve().parent / "mixtral_dynamo.onnx"


def build_module():
    """The transformers model (seeded weights) wrapped to take ``input_ids`` and return
    the logits."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=64)
    config._experts_implementation = "batched_mm"
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    return Logits().eval()


def export(path: Path = PATH) -> Path:
    import torch

    module = build_module()
    ids = torch.randint(0, VOCAB, (2, 8))
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=64)
    program = torch.onnx.export(module, (ids,), dynamo=True, input_names=["input_ids"], output_names=["logits"],
                                dynamic_shapes=({0: batch, 1: seq},), external_data=False)
    program.save(str(path), external_data=False)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=PATH)
    print(f"wrote {export(parser.parse_args().output)}")
