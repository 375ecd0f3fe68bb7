"""The committed sample models: where they live, how to rebuild them, how to feed them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .gpt import make_gpt
from meshplan.model.inputs import random_inputs
from .mlp import make_mlp
from .moe import make_moe
from .resnet import make_resnet

SAMPLE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class SampleModel:
    """One committed sample model.

    ``path`` is absolute; ``dims`` fixes every symbolic dimension for a default run;
    ``make`` rebuilds the committed model in memory with its default arguments.
    """

    name: str
    path: Path
    dims: Mapping[str, int] = field(hash=False)
    make: Callable[[], onnx.ModelProto] = field(compare=False)
    description: str = ""

    def build(self) -> onnx.ModelProto:
        """Rebuild the model in memory (identical to the committed file)."""
        return self.make()

    def load(self) -> onnx.ModelProto:
        """Read the committed file."""
        return onnx.load(str(self.path))

    def serialized(self) -> bytes:
        """The exact bytes the committed file should hold."""
        return self.build().SerializeToString()


def _sample(name: str, make: Callable[[], onnx.ModelProto], dims: dict[str, int],
            description: str) -> SampleModel:
    return SampleModel(name=name, path=SAMPLE_DIR / f"{name}.onnx", dims=dims, make=make,
                       description=description)


SAMPLES: dict[str, SampleModel] = {
    s.name: s
    for s in (
        _sample("mlp", make_mlp, {"batch": 8}, "6-layer MLP, 64 -> 256 -> 10"),
        _sample("gpt", make_gpt, {"batch": 4, "seq": 32},
                "4-layer GPT decoder, hidden 128, 4 heads, vocab 512, max_seq 64"),
        _sample("resnet", make_resnet, {"batch": 4},
                "ResNet with basic blocks (2, 2, 2), widths (16, 32, 64), 32x32 images"),
        _sample("moe", make_moe, {"batch": 2, "seq": 8},
                "2-layer Mixtral-style sparse MoE decoder, hidden 32, 4 experts of ffn 64, top-2 routing "
                "(NonZero per expert), vocab 128"),
    )
}


def get_sample(name: str) -> SampleModel:
    """Look a sample up by name; KeyError lists the known names."""
    try:
        return SAMPLES[name]
    except KeyError:
        raise KeyError(f"unknown sample model {name!r}; known: {', '.join(SAMPLES)}") from None


def make_inputs(name_or_model: str | SampleModel | onnx.ModelProto,
                dims: Mapping[str, int] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Valid random inputs for a sample (by name or entry) or any model.

    For a sample, ``dims`` defaults to its registry dims and the committed file is
    read; for a ModelProto, ``dims`` must cover its symbolic dimensions.  Integer
    inputs stay inside the embedding table they index (token ids < vocab for gpt).
    """
    if isinstance(name_or_model, onnx.ModelProto):
        return random_inputs(name_or_model, dims or {}, seed=seed)
    sample = name_or_model if isinstance(name_or_model, SampleModel) else get_sample(name_or_model)
    model = sample.load() if sample.path.exists() else sample.build()
    return random_inputs(model, sample.dims if dims is None else dims, seed=seed)


def write_samples(names: list[str] | None = None) -> list[tuple[Path, int]]:
    """(Re)write the committed model files; return each path with its size in bytes.

    A file whose bytes already match is left untouched.
    """
    written = []
    for name in names or list(SAMPLES):
        sample = get_sample(name)
        data = sample.serialized()
        if not sample.path.exists() or sample.path.read_bytes() != data:
            sample.path.write_bytes(data)
        written.append((sample.path, len(data)))
    return written


def stale_samples() -> list[str]:
    """Names of samples whose committed file is missing or differs from the generator."""
    return [name for name, s in SAMPLES.items()
            if not s.path.exists() or s.path.read_bytes() != s.serialized()]
