"""Part of an output asked for (``Job.run(outputs={name: box})``): where the output comes
out of a collective the box commutes with (an all-gather the box leaves whole along its dim,
an all-reduce), the box is taken before the collective, so only it crosses the ranks (a
prompt's last logits, not all of them); the values are the box of the whole either way. On the
path a GPU runs, an output kept on the device is copied to the host as its box alone, and the
state's device buffers stay where they were from one request to the next."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.reshard.kinds import kind_of_op
from meshplan.reshard.steps import Step
from meshplan.runtime.program import narrowed_box
from sample_models import SAMPLE_DIR
from tests.conftest import run_cli, run_mpi_script


def _step(op: str, dim=None) -> Step:
    return Step(kind_of_op(op), 0, dim, None)


def test_which_boxes_commute_with_which_collectives():
    last = np.s_[:, -1:]
    assert narrowed_box(_step("AllGather", 2), last, 3) == last            # the vocabulary stays whole
    assert narrowed_box(_step("AllGather", 1), last, 3) is None            # it cuts the gathered dim
    assert narrowed_box(_step("AllGather", 2), np.s_[:, :, :10], 3) is None
    assert narrowed_box(_step("AllGather", 2), np.s_[:, :, 0:], 3) == np.s_[:, :, 0:]
    assert narrowed_box(_step("AllReduce"), np.s_[:, 3:5, 1:2], 3) == np.s_[:, 3:5, 1:2]
    assert narrowed_box(_step("ReduceScatter", 2), last, 3) is None
    assert narrowed_box(_step("AllReduce"), (slice(None),) * 3, 3) is None   # the whole: nothing to narrow
    assert narrowed_box(_step("AllReduce"), (), 3) is None


@pytest.fixture(scope="module")
def llama_1x2(tmp_path_factory):
    out = tmp_path_factory.mktemp("narrow")
    done = run_cli("plan", SAMPLE_DIR / "genai" / "llama_fp32" / "model.onnx", "--mesh", "1x2", "--generate",
                   "--max-length", "64", "--policy", "megatron", "--max-stages", "1", "-o", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["host", "on-device"])
def test_a_box_of_the_logits_crosses_alone(llama_1x2, where):
    lines = run_mpi_script("narrow_outputs_case.py", ranks=2, args=[llama_1x2] + ([where] if where != "host" else []))
    assert len(lines) == 6


def test_box_runs_find_the_runs_a_box_lies_in():
    from meshplan.runtime.buffers import box_runs

    # (first byte, bytes per run, bytes between runs, runs, shape); float32, shape [2, 6, 10]
    assert box_runs((2, 6, 10), np.s_[:, -1:], 4) == (5 * 40, 40, 240, 2, (2, 1, 10))
    assert box_runs((2, 6, 10), np.s_[1:2], 4) == (240, 240, 480, 1, (1, 6, 10))
    assert box_runs((2, 6, 10), np.s_[:, :, 3:5], 4) == (12, 8, 40, 12, (2, 6, 2))
    assert box_runs((2, 6, 10), (), 4) == (0, 480, 480, 1, (2, 6, 10))
    assert box_runs((2, 6, 10), np.s_[:, 1:3, 2:4], 4) is None          # two dims cut
    assert box_runs((2, 6, 10), np.s_[:, ::2], 4) is None                # a step
    assert box_runs((2, 6, 10), np.s_[:, 1], 4) is None                  # an index, not a slice


@pytest.fixture(scope="module")
def llama_1x1(tmp_path_factory):
    out = tmp_path_factory.mktemp("narrow1")
    done = run_cli("plan", SAMPLE_DIR / "genai" / "llama_fp32" / "model.onnx", "--mesh", "1x1", "--generate",
                   "--max-length", "64", "-o", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_a_box_of_an_output_kept_on_the_device_is_copied_alone(llama_1x1, monkeypatch):
    """On the path a GPU runs (``Job(on_device=True)``, OrtValues in host memory here) a
    prompt's last logits are copied to the host alone, not the whole prompt's logits."""
    from meshplan.generation.loop import GenerationShape
    from meshplan.runtime.buffers import DeviceTensor
    from meshplan.runtime.job import Job

    copies = []   # (whole or box, the shape that reached the host)
    numpy, box_numpy = DeviceTensor.numpy, DeviceTensor.box_numpy

    def whole(self):
        copies.append(("whole", self.shape))
        return numpy(self)

    def boxed(self, box):
        found = box_numpy(self, box)
        if found is not None:
            copies.append(("box", found.shape))
        return found

    monkeypatch.setattr(DeviceTensor, "numpy", whole)
    monkeypatch.setattr(DeviceTensor, "box_numpy", boxed)
    job = Job(llama_1x1, provider="cpu", cache_in_place=True, on_device=True)
    try:
        shape = GenerationShape.of_plan(job.plan)
        prompt = np.array([[295, 277, 75, 312, 17, 42]], dtype=np.int64)
        feeds = {shape.input_ids: prompt, shape.attention_mask: np.ones(prompt.shape, np.int64)}

        def call(box):
            job.reset_state()
            copies.clear()
            logits = job.run(feeds, outputs={"logits": box} if box is not None else None)["logits"]
            return logits, list(copies)

        full, _ = call(None)
        for box in (np.s_[:, -1:], np.s_[:, 2:4], np.s_[:, :, :10], np.s_[-1:]):
            got, copied = call(box)
            assert got.shape == full[box].shape and np.array_equal(got, full[box]), box
            assert copied == [("box", full[box].shape)], (box, copied)   # the box alone reached the host
        got, copied = call(np.s_[:, 1:3, :10])         # two dims cut: the whole is copied, then cut
        assert np.array_equal(got, full[:, 1:3, :10]) and copied == [("whole", full.shape)], copied
    finally:
        job.close()


def test_each_state_takes_its_own_device_buffer_again_after_a_reset(llama_1x1):
    """A new request's cache on the device is the buffers the request before left, each state
    its own: a CUDA graph of the decode step reads their addresses (two layers' buffers
    swapped at every reset once, and every other request captured its graph again)."""
    from meshplan.generation.loop import GenerationShape
    from meshplan.runtime.job import Job

    job = Job(llama_1x1, provider="cpu", cache_in_place=True, on_device=True)
    try:
        shape = GenerationShape.of_plan(job.plan)
        prompt = np.array([[295, 277, 75, 312]], dtype=np.int64)
        feeds = {shape.input_ids: prompt, shape.attention_mask: np.ones(prompt.shape, np.int64)}
        addresses = []
        for _ in range(3):
            job.reset_state()
            job.run(feeds, outputs={"logits": np.s_[:, -1:]})
            addresses.append({name: tensor.address for name, tensor in job.state.items()})
        assert len(addresses[0]) >= 2 and len(set(addresses[0].values())) == len(addresses[0])
        assert addresses[1] == addresses[0] and addresses[2] == addresses[0]
    finally:
        job.close()
