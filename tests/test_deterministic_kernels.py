"""``--deterministic`` (run, generate, verify): every onnxruntime session of the process asks
for deterministic kernels (``use_deterministic_compute``: on CUDA no atomic adds in
reductions), and the job says so. Two runs of one plan then give the same bits; on the CPU
they did before too, so these tests check that the setting reaches every session and that
runs with it are bit-identical and still correct."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.providers import CPU
from meshplan.runtime import sessions
from meshplan.runtime.inprocess import reference_outputs
from sample_models import SAMPLE_DIR, make_inputs
from tests.conftest import assert_close, load_npz, run_cli, run_mpi, save_npz


def test_the_setting_reaches_every_session():
    model = str(SAMPLE_DIR / "mlp.onnx")
    try:
        sessions.set_deterministic(True)
        assert sessions.StageSession(model, [CPU]).session.get_session_options().use_deterministic_compute
    finally:
        sessions.set_deterministic(False)
    assert not sessions.StageSession(model, [CPU]).session.get_session_options().use_deterministic_compute


@pytest.mark.mpi
def test_two_runs_are_bit_identical(tmp_path):
    model = SAMPLE_DIR / "mlp.onnx"
    dims = {"batch": 8}
    plan = make_plan(model, make_cluster((1, 2), "cpu"), dims, tmp_path / "plan", PlanOptions(all_devices=True))
    feeds = make_inputs(onnx.load(str(model)), dims, seed=1)
    inputs = save_npz(tmp_path / "in.npz", feeds)
    outputs = []
    for attempt in range(2):
        out = tmp_path / f"out{attempt}.npz"
        done = run_mpi(2, "run", tmp_path / "plan", "--inputs", inputs, "--output", out, "--deterministic")
        assert done.returncode == 0, done.stderr
        assert "deterministic kernels (use_deterministic_compute)" in done.stdout
        outputs.append(load_npz(out))
    assert all(np.array_equal(outputs[0][k], outputs[1][k]) for k in outputs[0])
    assert_close(outputs[0], reference_outputs(plan, feeds))
    done = run_cli("verify", tmp_path / "plan", "--inputs", inputs, "--deterministic")
    assert done.returncode == 0 and "PASSED" in done.stdout, done.stdout + done.stderr


@pytest.mark.mpi
def test_generate_says_so(tmp_path):
    plan_dir = tmp_path / "plan"
    done = run_cli("plan", SAMPLE_DIR / "genai" / "llama_fp32" / "model.onnx", "--mesh", "1x2", "--device", "cpu",
                   "--generate", "--max-length", "64", "--all-devices", "-o", plan_dir)
    assert done.returncode == 0, done.stderr
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4]]))
    ids = []
    for attempt in range(2):
        out = tmp_path / f"out{attempt}.json"
        done = run_mpi(2, "generate", plan_dir, "--prompt-ids", prompts, "--max-new-tokens", 6, "--eos", 999,
                       "--deterministic", "--output", out)
        assert done.returncode == 0, done.stderr
        assert "deterministic kernels" in done.stdout
        ids.append(json.loads(out.read_text())["sequences"][0]["ids"])
    assert ids[0] == ids[1] and len(ids[0]) == 6
