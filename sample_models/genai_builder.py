"""Tiny LLMs as onnxruntime-genai's model builder writes them.

Random-init Hugging Face configs (a Llama with grouped-query attention, 8 query and 2
key/value heads; a Qwen2 with 8 query and 4 key/value heads, biased QKV and tied
embeddings; a Phi3 with 8 heads), each saved to a folder with a byte-level BPE tokenizer
trained offline on a few sentences, then built by ``python -m
onnxruntime_genai.models.builder`` for the CPU in float32 and int4. The builder writes
what it ships for real models: com.microsoft GroupQueryAttention with the rotary step
fused in and past/present buffers shared at a fixed capacity, SkipSimplifiedLayerNormalization,
SimplifiedLayerNormalization in the default domain, a packed QKV projection (MatMul, or
MatMulNBits in int4, with its bias Add for Qwen2), GatherBlockQuantized for Qwen2's tied
int4 embedding, ``genai_config.json`` and the tokenizer files beside ``model.onnx`` (with a chat template
added to ``tokenizer_config.json``).

Each model lands in ``sample_models/genai/NAME_PRECISION/``. Hidden size 128 (head size
16: onnxruntime's CPU GroupQueryAttention with rotary needs a multiple of 16), 2 layers,
vocabulary 320: every file is about a megabyte or less.

Regenerating them needs torch (CPU), transformers, tokenizers and onnxruntime-genai, not
dependencies of meshplan (install them in a separate environment: onnxruntime-genai pulls
the CPU onnxruntime): ``python -m sample_models.genai_builder``. The tests use the
committed files. torch 2.13.0 (CPU), transformers 5.23.0, tokenizers 0.23.3 and
onnxruntime-genai 0.18.0 wrote them; other versions may write other graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "genai"
VOCAB = 320
PRECISIONS = ("fp32", "int4")
TEXT = [
    "the quick brown fox jumps over the lazy dog.",
    "a small model speaks in short sentences, one token at a time.",
    "each device holds the heads of attention it computes, and their cache.",
    "grouped query attention shares one key and value head among several query heads.",
    "the plan splits the weights so that every device reads a part of them per token.",
]

# A chat template (Hugging Face's convention: Jinja2 in tokenizer_config.json), so that the
# samples serve /v1/chat/completions: each message as <|role|>content</s>, then <|assistant|>.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] "
                 "+ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")

# name → (transformers config class, its arguments)
CONFIGS = {
    "llama": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
                                pad_token_id=0, original_max_position_embeddings=1024)),
}
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=1024, bos_token_id=0, eos_token_id=1)


def model_dir(name: str, precision: str) -> Path:
    return ROOT / f"{name}_{precision}"


def train_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer of ``VOCAB`` entries trained on ``TEXT``, saved as
    ``tokenizer.json`` (+ its config) in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEXT * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))


def save_hf_model(name: str, folder: Path) -> None:
    """The random-init (seeded) transformers model ``name`` and its tokenizer in ``folder``."""
    import torch
    import transformers

    class_name, extra = CONFIGS[name]
    config = getattr(transformers, class_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():   # transformers initialises biases to zero, and the builder drops zero biases
        for key, value in model.named_parameters():
            if key.endswith("_proj.bias"):
                value.normal_(0.0, 0.02)
    model.save_pretrained(str(folder))
    train_tokenizer(folder)


def build(name: str, precision: str, out: Path, work: Path) -> None:
    """Run the genai builder on the saved model (offline) and keep what it writes."""
    source = work / f"{name}_hf"
    if not source.exists():
        save_hf_model(name, source)
    target = work / f"{name}_{precision}"
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(source), "-i", str(source),
               "-o", str(target), "-p", precision, "-e", "cpu", "-c", str(work / "cache")]
    if name == "qwen2" and precision == "int4":
        command += ["--extra_options", "shared_embeddings=true"]   # the tied table as GatherBlockQuantized
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for file in sorted(target.iterdir()):
        shutil.copy2(file, out / file.name)
    add_chat_template(out / "tokenizer_config.json")


def add_chat_template(path: Path) -> None:
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(CONFIGS), help=f"models to build (default: {', '.join(CONFIGS)})")
    parser.add_argument("-o", "--output", type=Path, default=ROOT, help="folder of the model folders")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        for name in args.names:
            for precision in PRECISIONS:
                out = args.output / f"{name}_{precision}"
                build(name, precision, out, Path(work))
                print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
