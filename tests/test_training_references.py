"""The committed torch training references (sample_models/training) hang together, without torch.

Each case's files agree with each other and with the ONNX model: the trainable initializers
are the model's and their initial values are its own, the first loss is the loss spec
applied to onnxruntime's output, the learning rates follow the schedule's formula, and the
first step's gradients are the loss's derivative (a central difference along them, through
onnxruntime, tied initializers moved together).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from sample_models.training import CASES, load_case


def _loss(spec: str, outputs: dict, data: dict) -> float:
    kind, output, target = spec.split(":")
    out, labels = outputs[output].astype(np.float64), data[target]
    if kind == "mse":
        return float(np.mean((out - labels) ** 2))
    assert kind == "cross_entropy"
    logits, labels = out.reshape(-1, out.shape[-1]), labels.reshape(-1)
    keep = labels != -100
    logits, labels = logits[keep], labels[keep]
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(labels)), labels].mean())


def _first_batch(case: dict) -> dict:
    settings = case["settings"]
    index = np.arange(settings["batch"]) % settings["samples"]
    return {name: array[index] for name, array in case["data"].items()}


class _Model:
    """The case's ONNX model with some initializers replaced, run by onnxruntime."""

    def __init__(self, case: dict):
        self.proto = onnx.load(str(case["model_path"]))
        self.case = case

    def loss(self, values: dict) -> float:
        proto = onnx.ModelProto()
        proto.CopyFrom(self.proto)
        for init in proto.graph.initializer:
            if init.name in values:
                init.CopyFrom(numpy_helper.from_array(values[init.name].astype(np.float32), init.name))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        batch = _first_batch(self.case)
        names = [o.name for o in session.get_outputs()]
        outputs = dict(zip(names, session.run(None, {i.name: batch[i.name] for i in session.get_inputs()})))
        return _loss(self.case["settings"]["loss"], outputs, batch)


@pytest.mark.parametrize("name", CASES)
def test_files_agree(name):
    case = load_case(name)
    settings = case["settings"]
    proto = onnx.load(str(case["model_path"]))
    kind = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(settings.get("dtype", "float32")))
    floats = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer if i.data_type == kind}
    assert sorted(settings["trainable"]) == sorted(case["initial"]) == sorted(case["final"]) == sorted(case["grads"])
    assert sorted(settings["trainable"] + settings["frozen"]) == sorted(floats)
    for init in settings["trainable"]:
        np.testing.assert_array_equal(case["initial"][init], floats[init])
        assert case["final"][init].shape == case["grads"][init].shape == floats[init].shape
        assert not np.array_equal(case["final"][init], case["initial"][init]), init
    assert [i.name for i in proto.graph.input] == settings["inputs"]
    assert [o.name for o in proto.graph.output] == [settings["output"]]
    assert settings["loss"].split(":")[1:] == [settings["output"], settings["target"]]
    for array in case["data"].values():
        assert len(array) == settings["samples"]
    assert case["losses"].dtype == np.float64 and case["losses"].shape == (settings["steps"],)
    assert np.all(np.isfinite(case["losses"]))
    assert "torch" not in sys.modules


@pytest.mark.parametrize("name", CASES)
def test_schedule(name):
    settings = load_case(name)["settings"]
    lr, warmup, steps = settings["lr"], settings["warmup"], settings["steps"]
    if settings["schedule"] == "constant":
        want = [lr] * steps
    else:
        want = [lr * (k + 1) / warmup if k < warmup else lr * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (steps - warmup)))
                for k in range(steps)]
    np.testing.assert_allclose(load_case(name)["lrs"], want, rtol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_first_loss(name):
    case = load_case(name)
    assert math.isclose(_Model(case).loss({}), case["losses"][0], rel_tol=1e-4)


FLOAT32_CASES = [name for name in CASES if load_case(name)["settings"].get("dtype", "float32") == "float32"]


@pytest.mark.parametrize("name", FLOAT32_CASES)
def test_first_gradients(name):
    """d/dh loss(w + h*u) at h=0, u the gradient's direction, is |grad|: checks the stored
    gradients' layouts. A tied group is one parameter: every initializer in it moves by the
    same (laid out) step, and its gradient counts once."""
    case = load_case(name)
    grads = case["grads"]
    counted = [names[0] for names in case["settings"]["tied"]]
    once = [n for n in grads if not any(n in group for group in case["settings"]["tied"])] + counted
    norm = math.sqrt(sum(float(np.sum(grads[n].astype(np.float64) ** 2)) for n in once))
    model = _Model(case)
    step = 1e-3

    def moved(sign: float) -> dict:
        return {n: case["initial"][n] + sign * step * grads[n] / norm for n in grads}

    slope = (model.loss(moved(1)) - model.loss(moved(-1))) / (2 * step)
    assert math.isclose(slope, norm, rel_tol=1e-3), (slope, norm)


def test_float16_gradients_are_the_float32_models():
    """gpt_fp16_master is gpt_adamw's GPT in float16 (its weights gpt_adamw's, rounded): its
    first gradients, the float32 masters' after unscaling, are gpt_adamw's within float16's
    rounding, tensor by tensor in the same layouts (a central difference through a float16
    model could not tell them). The key biases' gradients are zero but for rounding in both."""
    half, full = load_case("gpt_fp16_master"), load_case("gpt_adamw")
    assert half["settings"]["dtype"] == "float16" and half["settings"]["master_weights"] == "float32"
    assert sorted(half["grads"]) == sorted(full["grads"])
    for name, grad in half["grads"].items():
        assert grad.dtype == np.float32 and half["final"][name].dtype == np.float32
        np.testing.assert_array_equal(half["initial"][name], full["initial"][name].astype(np.float16))
        want = full["grads"][name]
        if ".k.bias" in name:
            assert float(np.abs(grad).max()) < 1e-5 and float(np.abs(want).max()) < 1e-5, name
            continue
        off = float(np.linalg.norm(grad - want)) / float(np.linalg.norm(want))
        assert off < 1e-2, (name, off)
