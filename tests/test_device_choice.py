"""The next token chosen next to the logits: a job of one rank whose program also returns
``ArgMax`` of its logits (``Job(choose=True)``, on by default on CUDA) brings rank 0 token ids
instead of logits, and generation feeds them back. Here on the CPU, on the path a GPU runs
(``on_device=True``: OrtValues in host memory) and on the host path: the ids are the host's
greedy choice, and only the ids reach the host."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from meshplan.generation.driver import JobStepper
from meshplan.generation.loop import Generation, GenerationShape
from meshplan.generation.sampling import Sampler
from meshplan.runtime import greedy_choice
from meshplan.runtime.greedy_choice import METHODS, greedy_output, with_greedy_choice
from sample_models import SAMPLE_DIR
from tests.conftest import run_cli

PROMPTS = [[295, 277, 75, 312, 223], [17, 42, 7]]   # two lengths: right-padded in one prefill


@pytest.mark.parametrize("opset", [17, 21])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("vocab", [7, 96])     # 96: rows of 8 or 12 for the chunked choice; 7: none
def test_the_appended_choice_is_numpys_argmax_first_on_a_tie(method, vocab, opset):
    import onnxruntime as ort

    node = helper.make_node("Identity", ["x"], ["logits"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["b", "s", vocab])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["b", "s", vocab])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    chosen = with_greedy_choice(model, "logits", method)
    onnx.checker.check_model(chosen)
    assert [o.name for o in chosen.graph.output] == ["logits", greedy_output("logits")]
    assert len(model.graph.output) == 1                      # the model given is left as it was
    assert with_greedy_choice(model, "nothing") is None
    bfloat16 = onnx.ModelProto()
    bfloat16.CopyFrom(model)
    bfloat16.graph.output[0].type.tensor_type.elem_type = TensorProto.BFLOAT16
    assert with_greedy_choice(bfloat16, "logits") is None    # no ArgMax for it: chosen on the host
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, (2, 5, vocab)).astype(np.float16)    # small integers: many ties
    x[0, 0] = -np.inf
    x[1, 2, 4] = np.inf
    x[1, 3, vocab - 1] = 9           # the last index, in the last row of a chunked choice
    session = ort.InferenceSession(chosen.SerializeToString(), providers=["CPUExecutionProvider"])
    logits, ids = session.run(None, {"x": x})
    assert ids.dtype == np.int64 and ids.shape == (2, 5)
    assert np.array_equal(ids, x.argmax(axis=-1))
    assert np.array_equal(ids, Sampler()(x.reshape(10, vocab)).reshape(2, 5))
    if method == "chunked" and vocab == 96:
        assert any(n.op_type == "ReduceMax" for n in chosen.graph.node)   # rows, not one ArgMax


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    root = tmp_path_factory.mktemp("choice")
    found = {}
    for name, batch in (("llama_fp32", "2"), ("llama_int4", "1")):
        out = root / name
        done = run_cli("plan", SAMPLE_DIR / "genai" / name / "model.onnx", "--mesh", "1x1", "--generate",
                       "--max-length", "64", "--batch", batch, "-o", out)
        assert done.returncode == 0, done.stdout + done.stderr
        found[name] = out
    return found


def _generate(plan_dir, prompts, sampler, **job_options):
    from meshplan.runtime.job import Job

    job = Job(plan_dir, "cpu", cache_in_place=True, **job_options)
    try:
        shape = GenerationShape.of_plan(job.plan)
        sequences, _ = Generation(shape, JobStepper(job)).run(prompts, 12, sampler)
        return [s.ids for s in sequences], job.chosen
    finally:
        job.close()


@pytest.mark.parametrize("on_device, method", [(True, "argmax"), (False, "argmax"), (True, "topk"), (True, "chunked")])
@pytest.mark.parametrize("name", ["llama_fp32", "llama_int4"])
def test_ids_chosen_next_to_the_logits_are_the_hosts_greedy_ids(plans, name, on_device, method, monkeypatch):
    monkeypatch.setattr(greedy_choice, "METHOD", method)
    prompts = PROMPTS if name == "llama_fp32" else PROMPTS[:1]
    expected, none = _generate(plans[name], prompts, Sampler(), on_device=on_device, choose=False)
    got, chosen = _generate(plans[name], prompts, Sampler(), on_device=on_device, choose=True)
    assert none is None and chosen == greedy_output("logits")
    assert got == expected
    assert len({i for ids in got for i in ids}) > 3          # ids that change: a check that can fail
    # a sampled request on a job that chooses still gets logits and draws from them
    sampled, _ = _generate(plans[name], prompts, Sampler(temperature=0.8, seed=3), on_device=on_device, choose=True)
    again, _ = _generate(plans[name], prompts, Sampler(temperature=0.8, seed=3), on_device=on_device, choose=False)
    assert sampled == again


def test_only_the_ids_reach_the_host_and_the_logits_when_asked(plans, monkeypatch):
    from meshplan.runtime.buffers import DeviceTensor
    from meshplan.runtime.job import Job

    copies = []
    numpy, box_numpy = DeviceTensor.numpy, DeviceTensor.box_numpy

    def whole(self):
        copies.append(("whole", self.dtype, self.shape))
        return numpy(self)

    def boxed(self, box):
        found = box_numpy(self, box)
        copies.append(("box", self.dtype, None if found is None else found.shape))
        return found

    monkeypatch.setattr(DeviceTensor, "numpy", whole)
    monkeypatch.setattr(DeviceTensor, "box_numpy", boxed)
    job = Job(plans["llama_fp32"], "cpu", cache_in_place=True, on_device=True, choose=True)
    try:
        shape = GenerationShape.of_plan(job.plan)
        prompt = np.array([PROMPTS[0], PROMPTS[0][::-1]], dtype=np.int64)
        feeds = {shape.input_ids: prompt, shape.attention_mask: np.ones(prompt.shape, np.int64)}
        last = np.s_[:, -2:]
        copies.clear()
        ids = job.run(feeds, outputs={job.chosen: last})[job.chosen]
        assert copies == [("box", np.dtype(np.int64), (2, 2))]   # the ids' box alone: no logits
        job.reset_state()
        copies.clear()
        both = job.run(feeds, outputs={"logits": last, job.chosen: last})
        assert sorted(c[1].name for c in copies) == ["float32", "int64"]
        assert both["logits"].shape == (2, 2, shape.vocab or both["logits"].shape[-1])
        assert np.array_equal(both[job.chosen], ids) and np.array_equal(ids, both["logits"].argmax(axis=-1))
        job.reset_state()
        assert set(job.run(feeds)) == {"logits"}     # every output of the plan: the ids are asked for by name
    finally:
        job.close()


@pytest.mark.parametrize("choose", [False, None])
def test_a_job_chooses_on_the_host_unless_asked_or_on_cuda(plans, choose):
    """``choose=None`` (what ``generate`` and ``serve`` ask): on CUDA only; the default: never."""
    from meshplan.runtime.job import Job

    job = Job(plans["llama_int4"], "cpu", cache_in_place=True, on_device=True, choose=choose)
    try:
        assert job.chosen is None and all(t.name != greedy_output("logits") for t in job.outputs)
    finally:
        job.close()


def test_onnxruntimes_log_level_comes_from_the_environment(monkeypatch):
    from meshplan.runtime.sessions import ORT_LOG_LEVEL, ort_log_level

    monkeypatch.delenv(ORT_LOG_LEVEL, raising=False)
    assert ort_log_level() == 4
    monkeypatch.setenv(ORT_LOG_LEVEL, "2")
    assert ort_log_level() == 2
    monkeypatch.setenv(ORT_LOG_LEVEL, "loud")
    assert ort_log_level() == 4


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("where", ["host", "device", "device rows"])
def test_the_scorer_is_the_hosts_log_softmax_and_top_k_of_the_box(dtype, where):
    """``LogitScorer`` (the log-softmax and top k where the logits lie) against ``Scores``
    (the host's) on the box asked for: a numpy array, an OrtValue, a view of some of its rows."""
    from meshplan.generation.scoring import Scores
    from meshplan.runtime.buffers import DeviceBuffers
    from meshplan.runtime.logit_scores import TOP_COUNT, LogitScorer

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((4, 6, 50)) * 4).astype(dtype)
    logits[1, 4, 7] = logits[1, 4, 9] = logits[1, 4].max() + 1     # a tie: the lower id first
    scorer = LogitScorer("logits", ["CPUExecutionProvider"], 50)
    value, rows = logits, slice(None)
    if where != "host":
        value = DeviceBuffers("cpu", 0, ["CPUExecutionProvider"]).from_host(logits)
        if where == "device rows":
            value, rows = value[1:3], slice(1, 3)
            assert not value.whole
    box = (slice(None), slice(-2, None))
    top, ids = scorer(value, box)
    window = logits[rows][:, -2:]
    assert top.shape == ids.shape == window.shape[:-1] + (TOP_COUNT,) and top.dtype == np.float32
    expected = Scores(window, TOP_COUNT)
    assert np.allclose(top.reshape(-1, TOP_COUNT), expected.top, atol=1e-5)
    assert np.array_equal(ids.reshape(-1, TOP_COUNT), expected.ids)
    assert np.array_equal(ids[..., 0], window.argmax(axis=-1))
    if where == "host":
        assert ids[1, 0, 0] == 7 and ids[1, 0, 1] == 9
        few, _ = scorer(value, (slice(0, 1), slice(None), slice(0, 3)))   # a box over the alternatives too
        assert few.shape == (1, 6, 3)


def test_scored_calls_bring_k_values_per_position_not_the_logits(plans, monkeypatch):
    from meshplan.runtime.buffers import DeviceTensor
    from meshplan.runtime.job import Job
    from meshplan.runtime.logit_scores import TOP_COUNT

    copies = []
    numpy, box_numpy = DeviceTensor.numpy, DeviceTensor.box_numpy
    monkeypatch.setattr(DeviceTensor, "numpy", lambda self: copies.append(self.shape) or numpy(self))
    monkeypatch.setattr(DeviceTensor, "box_numpy", lambda self, box: copies.append(self.shape) or box_numpy(self, box))
    job = Job(plans["llama_fp32"], "cpu", cache_in_place=True, on_device=True, choose=True)
    try:
        top, ids = job.scorer.outputs
        assert {top, ids} <= {t.name for t in job.outputs} and set(job.run(
            {"input_ids": np.array([PROMPTS[0]] * 2), "attention_mask": np.ones((2, 5), np.int64)})) == {"logits"}
        job.reset_state()
        shape = GenerationShape.of_plan(job.plan)
        prompt = np.array([PROMPTS[0], PROMPTS[0][::-1]], dtype=np.int64)
        feeds = {shape.input_ids: prompt, shape.attention_mask: np.ones(prompt.shape, np.int64)}
        copies.clear()
        scored = job.run(feeds, outputs={top: np.s_[:, -2:], ids: np.s_[:, -2:]})
        assert copies and all(len(c) == 2 for c in copies)   # the program's greedy ids alone, not the logits
        assert scored[top].shape == scored[ids].shape == (2, 2, TOP_COUNT)
        job.reset_state()
        logits = job.run(feeds, outputs={"logits": np.s_[:, -2:]})["logits"]
        assert np.array_equal(scored[ids][..., 0], logits.argmax(axis=-1))
        shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
        expected = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        assert np.allclose(scored[top][..., 0], expected.max(axis=-1), atol=1e-5)
    finally:
        job.close()
