"""A small CIFAR-style ResNet built from basic residual blocks (inference-mode BN)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from ._builder import FLOAT, GraphBuilder, normal, uniform

BN_EPSILON = 1e-5


def make_resnet(blocks_per_stage: Sequence[int] = (2, 2, 2),
                widths: Sequence[int] = (16, 32, 64), classes: int = 10, image: int = 32,
                seed: int = 0) -> onnx.ModelProto:
    """Build ``image float32 ['batch', 3, image, image] -> logits ['batch', classes]``.

    A 3x3 Conv + BN + Relu stem of width ``widths[0]``, then one stage per entry of
    ``blocks_per_stage`` (every stage after the first halves the resolution in its
    first block, with a strided 1x1 Conv + BN shortcut), GlobalAveragePool, Flatten
    and a Gemm classifier.  Conv weights are He-scaled; BatchNormalization carries
    random running mean and (positive) variance.
    """
    if len(blocks_per_stage) != len(widths):
        raise ValueError("blocks_per_stage and widths need the same length")
    rng = np.random.RandomState(seed)
    g = GraphBuilder("resnet")
    x = g.input("image", FLOAT, ["batch", 3, image, image])
    x = _conv_bn(g, rng, x, "stem", "stem", 3, widths[0], 3, 1)
    x = g.op("Relu", [x], "stem/relu")
    channels = widths[0]
    for s, (blocks, width) in enumerate(zip(blocks_per_stage, widths)):
        for b in range(blocks):
            stride = 2 if s > 0 and b == 0 else 1
            x = _basic_block(g, rng, x, f"stage{s}/block{b}", channels, width, stride)
            channels = width
    x = g.op("GlobalAveragePool", [x], "head/pool")
    x = g.op("Flatten", [x], "head/flatten", axis=1)
    weight = g.weight("head.fc.weight", normal(rng, (classes, channels), np.sqrt(1.0 / channels)))
    bias = g.weight("head.fc.bias", normal(rng, (classes,), 0.01))
    g.op("Gemm", [x, weight, bias], "head/fc", out="logits", transB=1)
    g.output("logits", FLOAT, ["batch", classes])
    return g.build(doc=f"meshplan sample ResNet: blocks {tuple(blocks_per_stage)}, "
                       f"widths {tuple(widths)}, image {image}")


def _conv_bn(g: GraphBuilder, rng: np.random.RandomState, x: str, name: str, param: str,
             c_in: int, c_out: int, kernel: int, stride: int, bn_gain: float = 1.0) -> str:
    """Bias-free Conv (He init, 'same' padding) followed by BatchNormalization.

    ``bn_gain`` scales the BN weight; residual branches use a smaller one so the
    activations stay O(1) through the network.
    """
    std = np.sqrt(2.0 / (c_in * kernel * kernel))
    w = g.weight(f"{param}.conv.weight", normal(rng, (c_out, c_in, kernel, kernel), std))
    pad = kernel // 2
    y = g.op("Conv", [x, w], f"{name}/conv", kernel_shape=[kernel, kernel],
             strides=[stride, stride], pads=[pad] * 4)
    params = [
        g.weight(f"{param}.bn.weight", normal(rng, (c_out,), 0.1, mean=bn_gain)),
        g.weight(f"{param}.bn.bias", normal(rng, (c_out,), 0.1)),
        g.weight(f"{param}.bn.running_mean", normal(rng, (c_out,), 0.2)),
        g.weight(f"{param}.bn.running_var", uniform(rng, (c_out,), 0.5, 2.0)),
    ]
    return g.op("BatchNormalization", [y, *params], f"{name}/bn", epsilon=BN_EPSILON)


def _basic_block(g: GraphBuilder, rng: np.random.RandomState, x: str, n: str, c_in: int,
                 c_out: int, stride: int) -> str:
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
    p = n.replace("/", ".")
    h = _conv_bn(g, rng, x, f"{n}/conv1", f"{p}.conv1", c_in, c_out, 3, stride)
    h = g.op("Relu", [h], f"{n}/relu1")
    h = _conv_bn(g, rng, h, f"{n}/conv2", f"{p}.conv2", c_out, c_out, 3, 1, bn_gain=0.5)
    if stride != 1 or c_in != c_out:
        x = _conv_bn(g, rng, x, f"{n}/shortcut", f"{p}.shortcut", c_in, c_out, 1, stride)
    y = g.op("Add", [h, x], f"{n}/add")
    return g.op("Relu", [y], f"{n}/relu")
