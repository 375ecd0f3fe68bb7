"""Sample ONNX models for meshplan, generated with ``onnx.helper`` and numpy only.

``python -m sample_models`` rewrites the committed files ``mlp.onnx``, ``gpt.onnx``,
``resnet.onnx`` and ``moe.onnx`` (a sparse mixture of experts with data-dependent
routing) next to this module; generation is deterministic, so the files
are byte-identical to what :data:`SAMPLES` entries rebuild in memory.
``gpt_dynamo.onnx`` and ``mixtral_dynamo.onnx`` are not among them: torch's dynamo
exporter wrote them, and ``python -m sample_models.gpt_dynamo`` (which needs torch) and
``python -m sample_models.mixtral_dynamo`` (torch and transformers) rewrite them.
"""

from .gpt import make_gpt
from meshplan.model.inputs import gather_index_bound, random_inputs, resolve_shape
from .mlp import make_mlp
from .moe import make_moe
from .registry import (
    SAMPLE_DIR,
    SAMPLES,
    SampleModel,
    get_sample,
    make_inputs,
    stale_samples,
    write_samples,
)
from .resnet import make_resnet

__all__ = [
    "SAMPLE_DIR",
    "SAMPLES",
    "SampleModel",
    "gather_index_bound",
    "get_sample",
    "make_gpt",
    "make_inputs",
    "make_mlp",
    "make_moe",
    "make_resnet",
    "random_inputs",
    "resolve_shape",
    "stale_samples",
    "write_samples",
]
