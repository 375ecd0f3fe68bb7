"""A small GPT decoder exported by torch's dynamo exporter with a static batch of 8.

``torch.onnx.export(..., dynamo=True)`` writes every dimension as exported unless it is
told otherwise, so the committed ``gpt_dynamo.onnx`` has ``input_ids int64 [8, 16]`` and
its Reshape targets, the causal mask and the position ids carry the batch size 8 as
constants: the model `meshplan plan --microbatches` rewrites to the microbatch size.

Regenerating it needs torch (not a dependency of meshplan; CPU torch is enough) and
onnxscript: ``python -m sample_models.gpt_dynamo`` rewrites the committed file. The tests
use the committed file and never import torch. torch 2.13.0 (CPU) rewrites the file byte
for byte; other torch versions may export a different graph.
"""

from __future__ import annotations

import argparse
from pathlib import Path

BATCH = 8
SEQ = 16
VOCAB = 256
HIDDEN = 64
HEADS = 4
LAYERS = 2
PATH = Path(__file__).resolve().parent / "gpt_dynamo.onnx"


def build_module():
    """The torch module (seeded weights): token and position embeddings, pre-LayerNorm
    blocks of causal self-attention and a GELU MLP, a final LayerNorm and an LM head."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(HIDDEN)
            self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
            self.proj = nn.Linear(HIDDEN, HIDDEN)
            self.ln2 = nn.LayerNorm(HIDDEN)
            self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
            self.out = nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(HIDDEN, dim=2)
            q = q.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            k = k.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            v = v.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            scores = (q @ k.transpose(-2, -1)) * (1.0 / (c // HEADS) ** 0.5)
            mask = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t).expand(b, 1, t, t)
            scores = scores.masked_fill(~mask, float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v
            y = y.transpose(1, 2).contiguous().view(b, t, c)
            x = x + self.proj(y)
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, HIDDEN)
            self.pos = nn.Embedding(SEQ, HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln = nn.LayerNorm(HIDDEN)
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

        def forward(self, input_ids):
            b, t = input_ids.shape
            positions = torch.arange(t).unsqueeze(0).expand(b, t)
            x = self.tok(input_ids) + self.pos(positions)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x).view(b * t, HIDDEN)).view(b, t, VOCAB)

    torch.manual_seed(0)
    return GPT().eval()


def export(path: Path = PATH) -> Path:
    import torch

    module = build_module()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    program = torch.onnx.export(module, (ids,), dynamo=True, input_names=["input_ids"], output_names=["logits"],
                                external_data=False)
    program.save(str(path), external_data=False)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=PATH)
    print(f"wrote {export(parser.parse_args().output)}")
