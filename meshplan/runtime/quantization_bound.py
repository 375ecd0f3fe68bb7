"""How far a plan may differ from onnxruntime where a kernel quantizes its activations.

onnxruntime's ``MatMulNBits`` with ``accuracy_level`` 4 rounds its input to int8 on the
CPU, per block of K (the block's scale is its largest magnitude / 127), before the integer
product. A plan computes that input up to float rounding: the order of a split sum, a
fusion onnxruntime makes in one program and not in another (x·sigmoid(x) into QuickGelu).
Where an input element lies within a rounding of a quantization midpoint, the plan and
onnxruntime round it to neighbouring int8 steps, and the output moves by the block's scale
times the weight; later layers carry that on. Which elements flip depends on the CPU's
kernels, so no fixed tolerance holds on every CPU.

The rule (``meshplan verify`` and the tests apply the same one): each float output may
differ from onnxruntime's by its dtype's tolerance plus a **quantization bound** measured
on the same inputs: ``BOUND_FACTOR`` times the largest change that onnxruntime's own
activation quantization makes in that output, found by running the model once more with
every such operator at ``accuracy_level`` 0 (float activations, the computation the
quantization approximates). The plan and the reference each differ from that float
computation by roundings of the same kind and size, so their difference is taken to be at
most two such: a bound measured on the inputs at hand, not proven for every input (a flip
moves an output by one step, the whole quantization by many). A model without such
operators has no bound (0) and no second run. Where the provider does not quantize
activations (CUDA's MatMulNBits), both runs compute the same and the bound is 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import onnx

MICROSOFT = "com.microsoft"
# (domain, op type) -> (attribute, the value at which activations are quantized, the value
# that keeps them float)
QUANTIZING = {(MICROSOFT, "MatMulNBits"): ("accuracy_level", 4, 0)}
BOUND_FACTOR = 2.0


def _quantizing_attribute(node: onnx.NodeProto) -> onnx.AttributeProto | None:
    entry = QUANTIZING.get((node.domain, node.op_type))
    if entry is None:
        return None
    name, quantized, _ = entry
    found = next((a for a in node.attribute if a.name == name), None)
    return found if found is not None and found.i == quantized else None


def activation_quantizing(nodes: Iterable[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The nodes among ``nodes`` that quantize their activations."""
    return [n for n in nodes if _quantizing_attribute(n) is not None]


def use_float_activations(nodes: Iterable[onnx.NodeProto]) -> int:
    """Switch every activation-quantizing node among ``nodes`` (in place) to float
    activations; returns how many were switched."""
    count = 0
    for node in nodes:
        attribute = _quantizing_attribute(node)
        if attribute is not None:
            attribute.i = QUANTIZING[(node.domain, node.op_type)][2]
            count += 1
    return count


def bounds_between(reference: dict[str, np.ndarray], float_activations: dict[str, np.ndarray]) -> dict[str, float]:
    """Per float output: ``BOUND_FACTOR`` × the largest |reference − float-activation run|."""
    bounds = {}
    for name, want in reference.items():
        other = float_activations.get(name)
        floating = isinstance(want, np.ndarray) and (want.dtype.kind == "f" or want.dtype.type.__module__ == "ml_dtypes")
        if other is None or not floating:
            continue
        if want.size == 0 or other.shape != want.shape:
            continue
        diff = np.abs(want.astype(np.float64) - other.astype(np.float64))
        bounds[name] = BOUND_FACTOR * float(np.nanmax(diff)) if np.isfinite(diff).any() else 0.0
    return bounds


def float_activation_model(model_path: str | Path) -> onnx.ModelProto | None:
    """The model's graph (weights left on disk) with float activations, or None when no
    operator quantizes them."""
    model = onnx.load(str(model_path), load_external_data=False)
    return model if use_float_activations(model.graph.node) else None


class QuantizationBound:
    """onnxruntime on ``model_path`` with float activations, ready to give the bounds of any
    inputs (``bounds``); a model without activation-quantizing operators loads nothing."""

    def __init__(self, model_path: str | Path, providers: list, optimization: str = "basic"):
        from meshplan.runtime.sessions import StageSession

        model = float_activation_model(model_path)
        self.session = None
        if model is not None:
            self.session = StageSession(model.SerializeToString(), providers, weights_dir=Path(model_path).parent,
                                        optimization=optimization, label=f"{Path(model_path).name} (float activations)")

    @property
    def active(self) -> bool:
        return self.session is not None

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The float-activation model's outputs (only when ``active``)."""
        return self.session.run(dict(inputs))

    def bounds(self, inputs: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> dict[str, float]:
        """Per output of ``reference`` (onnxruntime's on ``inputs``): its quantization bound;
        empty where the model quantizes no activations."""
        if self.session is None:
            return {}
        return bounds_between(reference, self.run(inputs))
