"""The committed sample models match their generators, are valid, and run."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import sample_models
from meshplan.errors import ModelError
from sample_models import SAMPLES, make_inputs, random_inputs, resolve_shape

NAMES = list(SAMPLES)


@functools.cache
def _model(name: str) -> onnx.ModelProto:
    return SAMPLES[name].load()


@functools.cache
def _session(name: str) -> ort.InferenceSession:
    return ort.InferenceSession(SAMPLES[name].path.read_bytes(),
                                providers=["CPUExecutionProvider"])


def _run(name: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return _session(name).run(None, feeds)[0]


@pytest.mark.parametrize("name", NAMES)
def test_committed_file_matches_generator(name):
    sample = SAMPLES[name]
    assert sample.path.is_absolute()
    assert sample.path.read_bytes() == sample.serialized(), (
        f"{sample.path.name} is stale: run `python -m sample_models`")


@pytest.mark.parametrize("name", NAMES)
def test_passes_full_checker(name):
    model = _model(name)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]


@pytest.mark.parametrize("name", NAMES)
def test_runs_at_default_dims(name):
    sample = SAMPLES[name]
    (output,) = _model(name).graph.output
    logits = _run(name, make_inputs(name))
    assert logits.shape == resolve_shape(output, sample.dims)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert 0.01 < logits.std() < 100


def test_symbolic_input_dims():
    dims = {name: [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
                   for i in _model(name).graph.input] for name in NAMES}
    assert dims == {"mlp": [["batch", 64]], "gpt": [["batch", "seq"]],
                    "resnet": [["batch", 3, 32, 32]], "moe": [["batch", "seq"]]}


@pytest.mark.parametrize("batch, seq", [(1, 5), (2, 64)])
def test_gpt_other_sizes(batch, seq):
    feeds = make_inputs("gpt", {"batch": batch, "seq": seq}, seed=seq)
    logits = _run("gpt", feeds)
    assert logits.shape == (batch, seq, 512)
    assert np.isfinite(logits).all()


def test_gpt_token_ids_within_vocab():
    ids = make_inputs("gpt", {"batch": 16, "seq": 64}, seed=3)["input_ids"]
    assert ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < 512


def test_gpt_is_causal():
    ids = make_inputs("gpt", {"batch": 2, "seq": 24}, seed=7)["input_ids"]
    changed = ids.copy()
    changed[:, 15:] = (changed[:, 15:] + 1) % 512
    before, after = _run("gpt", {"input_ids": ids}), _run("gpt", {"input_ids": changed})
    np.testing.assert_array_equal(before[:, :15], after[:, :15])
    assert not np.allclose(before[:, 15:], after[:, 15:])


def test_gpt_keeps_shape_subcomputations():
    ops = [n.op_type for n in _model("gpt").graph.node]
    for op in ("Shape", "Range", "Concat", "Slice", "LayerNormalization", "Erf"):
        assert op in ops
    assert "Gelu" not in ops
    names = {n.name for n in _model("gpt").graph.node}
    assert "layer3/attn/q_proj/matmul" in names


def test_random_inputs_needs_every_symbolic_dim():
    with pytest.raises(ModelError, match="seq"):
        random_inputs(_model("gpt"), {"batch": 2})


def test_random_inputs_is_seeded():
    a = random_inputs(_model("mlp"), {"batch": 3}, seed=5)["x"]
    b = random_inputs(_model("mlp"), {"batch": 3}, seed=5)["x"]
    np.testing.assert_array_equal(a, b)


def test_small_variants_build_and_run():
    model = sample_models.make_gpt(layers=1, hidden=32, heads=2, vocab=50, max_seq=8)
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = session.run(None, make_inputs(model, {"batch": 2, "seq": 8}))[0]
    assert logits.shape == (2, 8, 50)
