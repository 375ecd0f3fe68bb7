"""Bad input: one clear line on stderr, exit 1 (2 for malformed options), no traceback,
no partial output, no hang — for plan, run (under mpiexec) and verify."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from sample_models import SAMPLES, make_inputs
from tests.conftest import run_cli, run_mpi, save_npz

GPT = SAMPLES["gpt"]
DIMS = ["--dim", "batch=4", "--dim", "seq=16"]


def _one_error_line(result, *fragments):
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("meshplan: error:")]
    assert len(ours) == 1, result.stderr
    for fragment in fragments:
        assert fragment in ours[0], ours[0]
    return ours[0]


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory):
    """A 1x2 plan of the GPT sample with matching inputs, planned once for this module."""
    root = tmp_path_factory.mktemp("gpt_plan")
    result = run_cli("plan", GPT.path, "--mesh", "1x2", "--device", "cpu", *DIMS, "--microbatches", "2",
                     "-o", root / "plan")
    assert result.returncode == 0, result.stderr
    save_npz(root / "in.npz", make_inputs("gpt", {"batch": 4, "seq": 16}, seed=0))
    return root


def _copy_plan(gpt_plan, tmp_path):
    target = tmp_path / "plan"
    shutil.copytree(gpt_plan / "plan", target)
    return target


# --- plan ---------------------------------------------------------------------------

def test_plan_not_onnx(tmp_path):
    bogus = tmp_path / "bogus.onnx"
    bogus.write_bytes(b"this is not a protobuf \x00\xff" * 10)
    result = run_cli("plan", bogus, "--mesh", "1x2", "-o", tmp_path / "out")
    _one_error_line(result, "not an ONNX model")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bogus.onnx"]  # no staging directory left behind


def test_plan_missing_file(tmp_path):
    result = run_cli("plan", tmp_path / "nope.onnx", "--mesh", "1x2", "-o", tmp_path / "out")
    _one_error_line(result, "not found")
    assert not (tmp_path / "out").exists()


def test_plan_unknown_dim_name(tmp_path):
    result = run_cli("plan", GPT.path, "--mesh", "1x2", *DIMS, "--dim", "heads=4", "-o", tmp_path / "out")
    _one_error_line(result, "unknown dimension 'heads'")
    assert not (tmp_path / "out").exists()


def test_plan_dim_left_unknown(tmp_path):
    result = run_cli("plan", GPT.path, "--mesh", "1x2", "--dim", "batch=4", "-o", tmp_path / "out")
    _one_error_line(result, "'seq'", "--dim seq=INT")


def test_plan_model_that_fits_nowhere(tmp_path):
    cluster = tmp_path / "tiny.toml"
    cluster.write_text("hosts = 1\ndevices_per_host = 2\n[device]\npreset = 'cpu'\nmemory_gb = 0.0001\n")
    result = run_cli("plan", GPT.path, "--cluster", cluster, *DIMS, "--layers", "4", "-o", tmp_path / "out")
    _one_error_line(result)
    assert not (tmp_path / "out").exists()


def test_plan_microbatches_not_dividing_batch(tmp_path):
    result = run_cli("plan", GPT.path, "--mesh", "1x2", *DIMS, "--microbatches", "3", "-o", tmp_path / "out")
    _one_error_line(result, "not divisible")


def test_plan_bad_cluster_file(tmp_path):
    cluster = tmp_path / "c.toml"
    cluster.write_text("hosts = 1\ndevices_per_host = 2\ndevice = 'tpu-v9'\n")
    result = run_cli("plan", GPT.path, "--cluster", cluster, *DIMS, "-o", tmp_path / "out")
    _one_error_line(result, "unknown device preset")


@pytest.mark.parametrize("args, fragment", [
    (["--mesh", "2y2"], "HxD"),
    (["--mesh", "1x2", "--dim", "batch=four"], "not an integer"),
    (["--mesh", "1x2", "--dim", "batch"], "NAME=INT"),
    (["--mesh", "1x2", "--microbatches", "0"], "microbatches"),
    (["--cluster", "cluster.toml", "--device", "cpu"], "--device goes with --mesh"),
])
def test_plan_malformed_options_are_usage_errors(args, fragment, tmp_path):
    result = run_cli("plan", GPT.path, *args, "-o", tmp_path / "out")
    assert result.returncode == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_plan_cluster_file_matches_mesh_option(tmp_path):
    cluster = tmp_path / "c.toml"
    cluster.write_text('hosts = 1\ndevices_per_host = 2\ndevice = "cpu"\n[inter_host]\nbandwidth_gbps = 5\n')
    result = run_cli("plan", GPT.path, "--cluster", cluster, *DIMS, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["cluster"]["mesh"] == [1, 2] and plan["cluster"]["inter_host"]["bandwidth"] == 5e9


# --- run under mpiexec --------------------------------------------------------------

@pytest.mark.mpi
def test_run_wrong_rank_count(gpt_plan, tmp_path):
    out = tmp_path / "out.npz"
    result = run_mpi(4, "run", gpt_plan / "plan", "--inputs", gpt_plan / "in.npz", "--output", out, timeout=120)
    _one_error_line(result, "needs 2 ranks", "job has 4")
    assert not out.exists()


@pytest.mark.mpi
def test_run_edited_program(gpt_plan, tmp_path):
    plan_dir = _copy_plan(gpt_plan, tmp_path)
    program = plan_dir / "rank1.onnx"
    program.write_bytes(program.read_bytes() + b"\x00")
    out = tmp_path / "out.npz"
    result = run_mpi(2, "run", plan_dir, "--inputs", gpt_plan / "in.npz", "--output", out, timeout=120)
    _one_error_line(result, "rank1.onnx", "changed after planning")
    assert not out.exists()


@pytest.mark.mpi
def test_run_edited_plan(gpt_plan, tmp_path):
    plan_dir = _copy_plan(gpt_plan, tmp_path)
    data = json.loads((plan_dir / "plan.json").read_text())
    data["microbatches"] = 1
    (plan_dir / "plan.json").write_text(json.dumps(data))
    result = run_mpi(2, "run", plan_dir, "--inputs", gpt_plan / "in.npz", timeout=120)
    _one_error_line(result, "plan.json was changed")


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["garbage", "missing-array", "wrong-shape", "wrong-dtype", "no-file"])
def test_run_bad_inputs(case, gpt_plan, tmp_path):
    path = tmp_path / "in.npz"
    good = make_inputs("gpt", {"batch": 4, "seq": 16})
    if case == "garbage":
        path.write_bytes(b"PK\x03\x04 not really a zip")
    elif case == "missing-array":
        save_npz(path, {"tokens": good["input_ids"]})
    elif case == "wrong-shape":
        save_npz(path, {"input_ids": good["input_ids"][:, :8]})
    elif case == "wrong-dtype":
        save_npz(path, {"input_ids": good["input_ids"].astype(np.int32)})
    out = tmp_path / "out.npz"
    result = run_mpi(2, "run", gpt_plan / "plan", "--inputs", path, "--output", out, timeout=120)
    _one_error_line(result, "input")
    assert not out.exists()


@pytest.mark.mpi
def test_rank_failing_mid_run_ends_the_job(gpt_plan, tmp_path):
    """Token ids outside the embedding table pass the start-up checks but make rank 0's
    Gather fail while rank 1 waits for it: the whole job must end, with an error."""
    bad = make_inputs("gpt", {"batch": 4, "seq": 16})
    bad["input_ids"][0, 0] = 10**6
    path = save_npz(tmp_path / "in.npz", bad)
    out = tmp_path / "out.npz"
    result = run_mpi(2, "run", gpt_plan / "plan", "--inputs", path, "--output", out, timeout=120)
    assert result.returncode != 0
    assert "meshplan: error: rank 0 failed" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


# --- verify -------------------------------------------------------------------------

def test_verify_passes_and_detects_wrong_outputs(gpt_plan, tmp_path):
    result = run_cli("verify", gpt_plan / "plan", "--inputs", gpt_plan / "in.npz")
    assert result.returncode == 0, result.stderr
    assert "PASSED" in result.stdout and "max abs err" in result.stdout
    wrong = save_npz(tmp_path / "wrong.npz", {"logits": np.zeros((4, 16, 512), np.float32)})
    result = run_cli("verify", gpt_plan / "plan", "--inputs", gpt_plan / "in.npz", "--outputs", wrong)
    assert result.returncode == 1
    assert "MISMATCH" in result.stdout and "FAILED" in result.stdout


def test_verify_edited_model(gpt_plan, tmp_path):
    model = tmp_path / "gpt.onnx"
    model.write_bytes(GPT.path.read_bytes() + b"\x00")
    result = run_cli("verify", gpt_plan / "plan", "--inputs", gpt_plan / "in.npz", "--model", model)
    _one_error_line(result, "changed after planning")


def test_verify_missing_plan(tmp_path):
    result = run_cli("verify", tmp_path / "nowhere", "--inputs", tmp_path / "in.npz")
    _one_error_line(result, "plan directory not found")


def test_inputs_command_writes_valid_inputs(tmp_path):
    out = tmp_path / "in.npz"
    result = run_cli("inputs", GPT.path, *DIMS, "-o", out)
    assert result.returncode == 0, result.stderr
    with np.load(out) as archive:
        ids = archive["input_ids"]
    assert ids.shape == (4, 16) and ids.dtype == np.int64 and 0 <= ids.min() and ids.max() < 512


def test_profile_unknown_provider(tmp_path):
    out = tmp_path / "profile.json"
    result = run_cli("profile", GPT.path, "--mesh", "1x2", *DIMS, "--provider", "tpu",
                     "--cache", tmp_path / "cache.sqlite", "-o", out)
    _one_error_line(result, "unknown provider 'tpu'")
    assert not out.exists()


def test_plan_with_profile_of_another_model(tmp_path):
    profile = tmp_path / "mlp.json"
    made = run_cli("profile", SAMPLES["mlp"].path, "--mesh", "1x2", "--device", "cpu", "--dim", "batch=8",
                   "--cache", tmp_path / "cache.sqlite", "-o", profile)
    assert made.returncode == 0, made.stderr
    result = run_cli("plan", GPT.path, "--mesh", "1x2", "--device", "cpu", *DIMS, "--profile", profile,
                     "-o", tmp_path / "plan")
    _one_error_line(result, "another model")
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize("args", [
    ["export", "PLAN", "--checkpoint", "CK", "-o", "DIR"],
    ["inputs", "MODEL", "-o", "DIR"],
    ["profile", "MODEL", "--mesh", "1x2", "-o", "DIR"],
    ["run", "PLAN", "--inputs", "IN", "--output", "DIR"],
    ["run", "PLAN", "--inputs", "IN", "--trace", "DIR"],
    ["train", "PLAN", "--data", "IN", "--steps", "1", "--log", "DIR"],
    ["train", "PLAN", "--data", "IN", "--steps", "1", "--trace", "DIR"],
    ["generate", "PLAN", "--output", "DIR"],
], ids=lambda a: f"{a[0]} {a[-2]}")
def test_an_output_file_that_is_a_directory_is_one_usage_error(args, tmp_path):
    """(``train --log`` and ``--trace`` given a directory ran the whole job, then ended in a
    traceback when the file was to be written.)"""
    (tmp_path / "DIR").mkdir()
    named = {"DIR": tmp_path / "DIR", "MODEL": SAMPLES["mlp"].path, "PLAN": tmp_path, "IN": tmp_path / "in.npz",
             "CK": tmp_path}
    done = run_cli(*[named.get(a, a) for a in args])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is a directory" in done.stderr and "Traceback" not in done.stderr
