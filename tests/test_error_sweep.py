"""Every command's error paths, swept: a bad file, bad dims, bad inputs, inputs that make
onnxruntime fail while running, a rank failing, a missing solver. Each must end with a
non-zero exit and no traceback anywhere in its output; user errors with exactly one
``meshplan: error:`` line (malformed options are click's usage errors, exit 2).

The table must cover every command of ``meshplan``: a new command without error cases
fails ``test_every_command_is_swept``.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest

from cli.main import main as cli_group
from sample_models import SAMPLES, make_inputs
from tests.backend_cases import all_cases
from tests.conftest import run_cli, run_mpi, save_npz

GPT = SAMPLES["gpt"]
DIMS = ("--dim", "batch=4", "--dim", "seq=16")
NO_HIGHS = {"PMIP_HIGHS_LIBRARY": "/nonexistent/libhighs.so"}
NO_CBC = {"PMIP_CBC_LIBRARY": "/nonexistent/libCbc.so"}


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple                   # CLI arguments; "{name}" placeholders name files of the fixture
    fragment: str | tuple = ""    # must appear in the error line (each of a tuple)
    ranks: int = 0                # > 0: under mpiexec -n ranks
    env: dict = field(default_factory=dict)
    code: int = 1                 # 2: a click usage error


CASES = [
    # plan
    Case("plan-not-onnx", ("plan", "{garbage}", "--mesh", "1x2", "-o", "{out}"), "not an ONNX model"),
    Case("plan-missing-file", ("plan", "{missing}", "--mesh", "1x2", "-o", "{out}"), "not found"),
    Case("plan-dim-not-int", ("plan", GPT.path, "--mesh", "1x2", "--dim", "batch=four", "-o", "{out}"), code=2),
    Case("plan-unknown-dim", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--dim", "heads=2", "-o", "{out}"),
         "unknown dimension 'heads'"),
    Case("plan-dim-left-open", ("plan", GPT.path, "--mesh", "1x2", "--dim", "batch=4", "-o", "{out}"), "'seq'"),
    Case("plan-bad-mesh", ("plan", GPT.path, "--mesh", "2by2", *DIMS, "-o", "{out}"), code=2),
    Case("plan-missing-highs", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--solver", "highs", "-o", "{out}"),
         "the HiGHS solver does not load", env=NO_HIGHS),
    Case("plan-missing-cbc", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "-o", "{out}"),
         "the CBC solver does not load", env=NO_CBC),
    Case("plan-bad-cluster-file", ("plan", GPT.path, "--cluster", "{garbage}", *DIMS, "-o", "{out}"), "cluster"),
    # plan --hints
    Case("plan-hints-missing", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--hints", "{missing}", "-o", "{out}"),
         "hints file not found"),
    Case("plan-hints-not-onnx", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--hints", "{garbage}", "-o", "{out}"),
         "not an ONNX model"),
    Case("plan-hints-without-annotations", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--hints", GPT.path,
                                            "-o", "{out}"), "no multi-device annotations"),
    Case("plan-hints-other-mesh", ("plan", GPT.path, "--mesh", "1x4", *DIMS, "--hints", "{plan}", "-o", "{out}"),
         "the mesh has 4 devices"),
    Case("plan-hints-stage-goes-back", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--hints", "{backwards}",
                                        "-o", "{out}"), ("hint for node 'layer0/ln2'", "comes after stage 1")),
    Case("plan-hints-split-does-not-divide", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--hints", "{indivisible}",
                                              "-o", "{out}"), ("hint for node 'layer0/attn/scores'", "does not split into 3 pieces")),
    Case("plan-hints-and-no-hints", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--hints", "{plan}", "--no-hints",
                                     "-o", "{out}"), code=2),
    # show
    Case("show-missing-plan", ("show", "{missing}"), "plan directory not found"),
    Case("show-not-a-plan", ("show", "{not_a_plan}"), "not valid JSON"),
    Case("show-no-such-stage", ("show", "{plan}", "--stage", "7"), "the plan has no stage 7"),
    Case("show-damaged-annotations", ("show", "{damaged}"), "annotated.onnx is not an ONNX model"),
    # verify
    Case("plan-generate-without-cache", ("plan", GPT.path, "--mesh", "1x2", "--generate", "--max-length", "16", "-o",
                                          "{out}"), "no key/value cache"),
    Case("verify-generate-without-cache", ("verify", "--generate", "{plan}", "--prompt", "hi"), "no key/value cache"),
    Case("verify-missing-plan", ("verify", "{missing}", "--inputs", "{inputs}"), "plan directory not found"),
    Case("verify-garbage-inputs", ("verify", "{plan}", "--inputs", "{garbage}"), "not a valid .npz"),
    Case("verify-wrong-shape", ("verify", "{plan}", "--inputs", "{short}"), "shape"),
    Case("verify-index-out-of-range", ("verify", "{plan}", "--inputs", "{out_of_range}"),
         "onnxruntime failed running"),
    Case("verify-garbage-outputs", ("verify", "{plan}", "--inputs", "{inputs}", "--outputs", "{garbage}"),
         "not a valid .npz"),
    # run (under mpiexec)
    Case("generate-garbage-prompt-ids", ("generate", "{plan}", "--prompt-ids", "{garbage}"), "not JSON", ranks=2),
    Case("generate-without-cache", ("generate", "{plan}", "--prompt", "hi"), "no key/value cache", ranks=2),
    Case("generate-missing-plan", ("generate", "{missing}", "--prompt", "hi"), "plan directory not found", ranks=2),
    Case("serve-without-cache", ("serve", "{plan}", "--port", "0"), "no key/value cache", ranks=2),
    Case("serve-missing-plan", ("serve", "{missing}", "--port", "0"), "plan directory not found", ranks=2),
    Case("serve-bad-port", ("serve", "{plan}", "--port", "70000"), code=2),
    # plan --train, train, export
    Case("plan-train-without-loss", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--train", "-o", "{out}"), code=2),
    Case("plan-train-bad-loss", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--train", "--loss", "hinge:logits",
                                 "-o", "{out}"), "expected cross_entropy"),
    Case("plan-train-loss-no-output", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--train", "--loss",
                                       "cross_entropy:nope:target", "-o", "{out}"), "names no output"),
    Case("plan-train-all-frozen", ("plan", GPT.path, "--mesh", "1x2", *DIMS, "--train", "--loss",
                                   "cross_entropy:logits:target", "--frozen", "*", "-o", "{out}"), "nothing to train"),
    Case("profile-train-bad-loss", ("profile", GPT.path, "--mesh", "1x2", *DIMS, "--train", "--loss", "hinge:logits",
                                    "--cache", "{cache}", "-o", "{out}"), "expected cross_entropy"),
    Case("profile-train-microbatches", ("profile", GPT.path, "--mesh", "1x2", *DIMS, "--train", "--loss",
                                        "cross_entropy:logits:target", "--microbatches", "3", "--cache", "{cache}",
                                        "-o", "{out}"), "does not divide the batch"),
    Case("train-inference-plan", ("train", "{plan}", "--data", "{inputs}", "--steps", "1"), "not a training plan",
         ranks=2),
    Case("train-zero-steps", ("train", "{plan}", "--data", "{inputs}", "--steps", "0"), code=2),
    Case("train-bad-betas", ("train", "{plan}", "--data", "{inputs}", "--steps", "1", "--betas", "0.9"), code=2),
    Case("export-inference-plan", ("export", "{plan}", "--checkpoint", "{missing}", "-o", "{out}.onnx"),
         "not a training plan"),
    Case("export-missing-plan", ("export", "{missing}", "--checkpoint", "{missing}", "-o", "{out}.onnx"),
         "plan directory not found"),
    Case("run-missing-plan", ("run", "{missing}", "--inputs", "{inputs}"), "plan directory not found", ranks=2),
    Case("run-garbage-inputs", ("run", "{plan}", "--inputs", "{garbage}"), "not a valid .npz", ranks=2),
    Case("run-wrong-rank-count", ("run", "{plan}", "--inputs", "{inputs}"), "the plan needs 2 ranks", ranks=3),
    Case("run-index-out-of-range", ("run", "{plan}", "--inputs", "{out_of_range}", "--output", "{out}.npz"),
         "onnxruntime failed running", ranks=2),
    # inputs
    Case("inputs-not-onnx", ("inputs", "{garbage}", "-o", "{out}.npz"), "not an ONNX model"),
    Case("inputs-unknown-dim", ("inputs", GPT.path, *DIMS, "--dim", "heads=2", "-o", "{out}.npz"),
         "unknown dimension 'heads'"),
    Case("inputs-dim-not-int", ("inputs", GPT.path, "--dim", "seq=x", "-o", "{out}.npz"), code=2),
    # profile
    Case("profile-not-onnx", ("profile", "{garbage}", "--mesh", "1x2", "--cache", "{cache}", "-o", "{out}"),
         "not an ONNX model"),
    Case("profile-unknown-dim", ("profile", GPT.path, "--mesh", "1x2", *DIMS, "--dim", "heads=2", "--cache",
                                 "{cache}", "-o", "{out}"), "unknown dimension 'heads'"),
    Case("profile-unknown-provider", ("profile", GPT.path, "--mesh", "1x2", *DIMS, "--provider", "tpu",
                                      "--cache", "{cache}", "-o", "{out}"), "unknown provider"),
    Case("profile-garbage-cluster", ("profile", GPT.path, "--cluster", "{garbage}", *DIMS, "--cache", "{cache}",
                                     "-o", "{out}"), "cluster"),
    # doctor
    Case("doctor-missing-plan", ("doctor", "--plan", "{missing}"), "plan directory not found"),
    Case("doctor-missing-cbc", ("doctor",), "the CBC solver does not load", env=NO_CBC),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    plan = root / "plan"
    done = run_cli("plan", GPT.path, "--mesh", "1x2", "--device", "cpu", *DIMS, "-o", plan)
    assert done.returncode == 0, done.stderr
    good = make_inputs("gpt", {"batch": 4, "seq": 16}, seed=0)
    bad = {k: v.copy() for k, v in good.items()}
    bad["input_ids"][0, 0] = 10**6
    (root / "garbage").write_bytes(b"PK\x03\x04 neither a zip nor a protobuf \x00\xff" * 4)
    backwards = _edited_hints(plan, root / "backwards.onnx", {"layer0/ln1": 1, "layer0/ln2": 0})
    indivisible = _edited_hints(plan, root / "indivisible.onnx", {"layer0/attn/scores": (1, 3)})
    damaged = root / "damaged"
    shutil.copytree(plan, damaged)
    (damaged / "annotated.onnx").write_bytes((root / "garbage").read_bytes())
    not_a_plan = root / "not_a_plan"
    not_a_plan.mkdir()
    (not_a_plan / "plan.json").write_text("{ not json")
    return {
        "plan": plan, "garbage": root / "garbage", "missing": root / "missing", "backwards": backwards,
        "indivisible": indivisible, "damaged": damaged, "not_a_plan": not_a_plan,
        "inputs": save_npz(root / "in.npz", good), "out_of_range": save_npz(root / "bad.npz", bad),
        "short": save_npz(root / "short.npz", {"input_ids": good["input_ids"][:, :8]}),
    }


def _edited_hints(plan: Path, out: Path, edits: dict) -> Path:
    """The plan's annotations with only the nodes ``edits`` names kept: an int moves the node
    to that stage; (axis, pieces) splits the node's output along axis in that many pieces
    (on devices it does not name)."""
    model = onnx.load(str(plan / "annotated.onnx"), load_external_data=False)
    for node in model.graph.node:
        edit = edits.get(node.name)
        if edit is None:
            del node.device_configurations[:]
            continue
        (config,) = node.device_configurations
        if isinstance(edit, int):
            config.pipeline_stage = edit
            del config.sharding_spec[:]
            continue
        spec = next(s for s in config.sharding_spec if s.tensor_name == node.output[0])
        del spec.device[:], spec.index_to_device_group_map[:], spec.sharded_dim[:]
        dim = spec.sharded_dim.add()
        dim.axis = edit[0]
        dim.simple_sharding.add().num_shards = edit[1]
    onnx.save(model, str(out))
    return out


def _arguments(case: Case, files: dict, tmp_path) -> list[str]:
    names = {**{k: str(v) for k, v in files.items()}, "out": str(tmp_path / "out"),
             "cache": str(tmp_path / "cache.sqlite")}
    return [str(a).format(**names) if isinstance(a, str) else str(a) for a in case.args]


def _check(case: Case, done: subprocess.CompletedProcess, tmp_path) -> None:
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    assert done.returncode == case.code, (done.returncode, output)
    if case.code == 2:
        assert "Error:" in done.stderr, output
        return
    ours = [line for line in done.stderr.splitlines() if line.startswith("meshplan: error:")]
    fragments = case.fragment if isinstance(case.fragment, tuple) else (case.fragment,)
    if case.ranks:   # every failing rank may say its line; all must be the same kind
        assert ours and all(f in line for line in ours for f in fragments), output
    else:
        assert len(ours) == 1 and all(f in ours[0] for f in fragments), output
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("out")]
    assert leftovers == [], leftovers   # nothing half-written


@pytest.mark.parametrize("case", [c for c in CASES if not c.ranks], ids=lambda c: c.id)
def test_error_path(case, files, tmp_path, monkeypatch):
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    _check(case, run_cli(*_arguments(case, files, tmp_path), timeout=180), tmp_path)


@pytest.mark.mpi
@pytest.mark.parametrize("case", [c for c in CASES if c.ranks], ids=lambda c: c.id)
def test_error_path_under_mpiexec(case, files, tmp_path):
    _check(case, run_mpi(case.ranks, *_arguments(case, files, tmp_path), timeout=180), tmp_path)


def test_every_command_is_swept():
    swept = {c.args[0] for c in CASES}
    assert set(cli_group.commands) <= swept, set(cli_group.commands) - swept


STRING_CASES = ("test_string_concat_zero_dimensional", "test_string_split_maxsplit")


@pytest.mark.parametrize("name", STRING_CASES)
def test_string_outputs_verify_exactly(name, tmp_path):
    """String outputs are compared for equality (onnx backend cases with string tensors),
    in process and from a run's outputs file."""
    (case,) = [c for c in all_cases() if c.name == name]
    import onnx

    model = tmp_path / "model.onnx"
    onnx.save(case.model, model)
    inputs = save_npz(tmp_path / "in.npz", {k: np.asarray(v, dtype=str) if v.dtype == object else v
                                            for k, v in case.inputs.items()})
    done = run_cli("plan", model, "--mesh", "1x2", "--device", "cpu", "-o", tmp_path / "plan")
    assert done.returncode == 0, done.stderr
    done = run_cli("verify", tmp_path / "plan", "--inputs", inputs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compared exactly) ok" in done.stdout and "PASSED" in done.stdout
    wrong = {name: np.asarray(value, dtype=str) if value.dtype == object else value
             for name, value in case.outputs.items()}
    strings = next(n for n, v in wrong.items() if v.dtype.kind == "U")
    wrong[strings] = np.full_like(wrong[strings], "not it")
    done = run_cli("verify", tmp_path / "plan", "--inputs", inputs, "--outputs", save_npz(tmp_path / "o.npz", wrong))
    assert done.returncode == 1 and "MISMATCH" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.mpi
def test_string_outputs_of_a_run_are_readable_by_verify(tmp_path):
    (case,) = [c for c in all_cases() if c.name == "test_string_split_maxsplit"]
    import onnx

    model = tmp_path / "model.onnx"
    onnx.save(case.model, model)
    inputs = save_npz(tmp_path / "in.npz", {k: np.asarray(v, dtype=str) for k, v in case.inputs.items()})
    assert run_cli("plan", model, "--mesh", "1x2", "--device", "cpu", "-o", tmp_path / "plan").returncode == 0
    done = run_mpi(2, "run", tmp_path / "plan", "--inputs", inputs, "--output", tmp_path / "out.npz")
    assert done.returncode == 0, done.stderr
    done = run_cli("verify", tmp_path / "plan", "--inputs", inputs, "--outputs", tmp_path / "out.npz")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("compared exactly) ok") == 2


def test_both_solvers_plan_the_sample_alike_and_print_nothing_of_their_own(tmp_path):
    import json

    latency = {}
    for solver in ("cbc", "highs"):
        done = run_cli("plan", GPT.path, "--mesh", "1x2", "--device", "cpu", *DIMS, "--solver", solver,
                       "-o", tmp_path / solver)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        assert done.stdout.splitlines()[-1].startswith("PASSED |")
        plan = json.loads((tmp_path / solver / "plan.json").read_text())
        assert plan["solver"]["ilp"]["solver"] == solver and plan["solver"]["ilp"]["solved"] > 0
        latency[solver] = plan["estimate"]["latency_seconds"]
    assert latency["highs"] == pytest.approx(latency["cbc"], rel=1e-6)   # both optimal
