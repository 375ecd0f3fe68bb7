"""A plain multi-layer perceptron: a chain of MatMul + Add (+ Relu) layers."""

from __future__ import annotations

import numpy as np
import onnx

from ._builder import FLOAT, GraphBuilder, linear, normal


def make_mlp(layers: int = 6, in_features: int = 64, hidden: int = 256, classes: int = 10,
             seed: int = 0) -> onnx.ModelProto:
    """Build an MLP ``x ['batch', in_features] -> logits ['batch', classes]``.

    ``layers`` linear layers; all but the last are followed by Relu.  Weights are
    He-scaled (std ``sqrt(2 / fan_in)``, the last layer ``sqrt(1 / fan_in)``) so the
    logits are O(1) for standard-normal inputs.
    """
    if layers < 1:
        raise ValueError("an MLP needs at least one layer")
    rng = np.random.RandomState(seed)
    g = GraphBuilder("mlp")
    x = g.input("x", FLOAT, ["batch", in_features])
    widths = [in_features] + [hidden] * (layers - 1) + [classes]
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        last = i == layers - 1
        gain = 1.0 if last else 2.0
        weight = normal(rng, (fan_in, fan_out), np.sqrt(gain / fan_in))
        bias = normal(rng, (fan_out,), 0.01)
        x = linear(g, x, weight, bias, f"layer{i}", f"layer{i}", out="logits" if last else None)
        if not last:
            x = g.op("Relu", [x], f"layer{i}/relu")
    g.output("logits", FLOAT, ["batch", classes])
    return g.build(doc=f"meshplan sample MLP: {layers} layers, hidden {hidden}")
