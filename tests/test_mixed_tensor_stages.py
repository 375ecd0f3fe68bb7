"""Pipelined training plans whose stages shard their operators over different numbers of
devices (``meshplan plan --train --stages S --tensor-parallel T0,T1,...``): each stage's
parts cut from the step planned on its own [1, T] mesh, each crossing between stages of
different layouts moved device to device (``meshplan.crossing_layouts``); run in process
and under ``mpiexec``, equal to torch; checkpoints, resume onto another plan, export; the
plans it refuses."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import run_cli, run_mpi
from meshplan.crossing_layouts import Relayout, base_name, spec_of_name
from meshplan.emit.pipeline_parts import read_pipeline
from meshplan.plan_format import read_plan
from meshplan.runtime.pipeline_inprocess import PipelineRunner
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.stage_ranks import per_stage
from sample_models.training import TRAINING_DIR, load_case
from test_cli_errors import _one_error_line
from test_pipeline_plans import _train_options
from tests.training_cases import assert_final_like_torch, assert_resumes, train_in_process, trained_under_mpiexec


def _plan(tmp_path, name: str, mesh: str, tensors: str, *more, microbatches: int = 4, out: str = "plan",
          devices: str | None = None):
    case = load_case(name)
    settings = case["settings"]
    stages = len((devices or tensors).split(","))
    done = run_cli("plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer",
                   settings["optimizer"], "--mesh", mesh, "--stages", stages, "--tensor-parallel",
                   tensors, "--microbatches", microbatches, "--dim", f"batch={settings['batch']}", "--device", "cpu",
                   *(("--stage-devices", devices) if devices else ()), *more, "-o", tmp_path / out)
    assert done.returncode == 0, done.stdout + done.stderr
    return case, tmp_path / out, done.stdout


def _pieces(value: np.ndarray, spec: str, devices: int) -> list[np.ndarray]:
    """Each device's piece of ``value`` in ``spec`` on [1, devices] (a partial sum: device 0
    holds the value plus noise, the others the noise's opposite shares)."""
    layout = ShardingSpec.parse(spec)
    mesh = LogicalMesh((1, devices), tuple(range(devices)))
    whole = ShardingSpec(layout.dims)
    cut = [np.array(value[whole.local_slices(value.shape, mesh, (0, j))]) for j in range(devices)]
    if layout.partial and devices > 1:
        rng = np.random.default_rng(1)
        noise = [rng.standard_normal(cut[0].shape).astype(value.dtype) for _ in range(devices - 1)]
        cut = [cut[0] - sum(noise)] + noise
    return cut


@pytest.mark.parametrize("shape,source,senders,target,receivers", [
    ((4, 6), "S1R", 2, "RR", 1),           # split → whole
    ((4, 6), "RR", 1, "RS1", 2),           # whole → split
    ((4, 8), "S1R", 2, "RS1", 4),          # split one way → split the other way, 2 → 4
    ((8, 4), "RS1", 4, "S1R", 2),
    ((4, 6), "RR+P1", 2, "S1R", 2),    # addends → split: the receivers add them up
    ((4, 6), "RR", 2, "S1R", 2),           # whole on both senders: each receiver's from its own
    ((4, 6), "RR", 2, "RR+P1", 4),         # → addends: the first receiver holds it, the others zeros
    ((4, 6), "RR+P1", 4, "RR+P1", 2),
    ((), "()", 2, "()", 1),                # a scalar
])
def test_a_relayout_gives_each_receiver_its_piece(shape, source, senders, target, receivers):
    """Every receiver puts together exactly its piece of the tensor in the target layout
    (for a target of addends: their sum is the tensor) from what the senders send it; where
    the senders hold the same piece, they share the sending."""
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 0.5
    move = Relayout(tuple(shape), source, target, senders, receivers)
    held = _pieces(value, source, senders)
    inbox = {j: {} for j in range(receivers)}
    for i in range(senders):
        for j, cut in move.sends(i):
            inbox[j][i] = np.ascontiguousarray(np.asarray(held[i])[cut])
    got = []
    for j in range(receivers):
        assert sorted(inbox[j]) == move.sources(j)
        got.append(move.joined(j, [inbox[j][i] for i in move.sources(j)]))
    layout = ShardingSpec.parse(target)
    if layout.partial:
        np.testing.assert_allclose(sum(got), value, rtol=1e-6)
        assert all(not g.any() for g in got[1:])
    else:
        for j, piece in enumerate(got):
            np.testing.assert_array_equal(piece, _pieces(value, target, receivers)[j])
    if source == "RR" and senders > 1 and not layout.partial:     # replicated senders share the sending
        assert len({i for j in range(receivers) for i in move.sources(j)}) == min(senders, receivers)


def test_crossing_names_carry_their_layouts():
    assert spec_of_name("add_1@S1RR", {}) == "S1RR" and base_name("add_1@S1RR", {}) == "add_1"
    assert spec_of_name("add_1", {}) is None and base_name("add_1", {}) == "add_1"
    assert spec_of_name("w", {"w": "RS1"}) == "RS1" and base_name("w", {"w": "RS1"}) == "w"
    assert spec_of_name("w@whole", {}) is None and base_name("w@whole", {}) == "w@whole"


@pytest.mark.parametrize("name,mesh,tensors,devices,more", [
    ("gpt_adamw", "1x3", "2,1", None, ("--policy", "data")),                   # split batch → one device
    ("gpt_adamw", "1x3", "1,2", None, ("--policy", "megatron", "--schedule", "gpipe")),
    ("gpt2_tied", "1x3", "1,2", None, ("--policy", "data")),                   # the tie spans stages of 1 and 2
    ("gpt_adamw", "1x4", "1,2,1", None, ("--policy", "megatron")),
    ("gpt_adamw", "1x6", "2,1", None, ("--policy", "megatron")),               # 2 replicas of each stage
    # replica counts that differ too: 2 replicas of 1 device, then 1 of 2 (Alpa's [2, 1] and [1, 2])
    ("gpt_adamw", "1x4", "1,2", "2,2", ("--policy", "megatron")),
    ("gpt2_tied", "1x4", "1,2", "2,2", ("--policy", "data")),
    ("gpt_adamw", "1x5", "1,1,2", "1,2,2", ("--policy", "megatron")),          # and rows between two of 1
    ("gpt_adamw", "1x6", "2", "4,2", ("--policy", "megatron")),                 # one T, 2 and 1 replicas of it
])
def test_stages_of_different_tensor_parallelism_train_as_torch_in_process(tmp_path, name, mesh, tensors, devices,
                                                                          more):
    """Each device of each stage in a thread: each step's loss within 1e-3 of torch's and the
    final weights, put together from each stage's pieces in its own layouts, as torch's."""
    stages = len(devices.split(",")) if devices else len(tensors.split(","))
    case, plan_dir, said = _plan(tmp_path, name, mesh, tensors, *more, devices=devices)
    assert "crossing(s) laid out again between stages" in said
    plan = read_plan(plan_dir)
    pipeline = read_pipeline(plan_dir, plan.training)
    each = [int(t) for t in tensors.split(",")]
    assert pipeline.tensors == (each if len(each) == stages else each * stages)
    assert pipeline.relayouts, "no crossing changes its layout"
    replicas = per_stage(plan.training["pipeline"]["replicas"], stages)
    assert [s.logical_mesh for s in plan.stages] == [[r, t] if t > 1 else [1, r]
                                                     for r, t in zip(replicas, pipeline.tensors)]
    # the replicas of a stage of one device share its optimizer's state (ZeRO-1); a sharded stage's do not
    whole = {s for s in range(stages) if pipeline.tensors[s] == 1 and replicas[s] > 1}
    ours = {n for (s, phase), part in pipeline.parts.items() if s in whole and phase in ("norm", "update")
            for n in list(part.inputs) + list(part.outputs)}
    assert pipeline.sharded <= ours and bool(pipeline.sharded) == bool(whole)
    runner = PipelineRunner(pipeline, plan.microbatches, case["initial"], plan.training["pipeline"]["schedule"],
                            replicas=replicas)
    losses = train_in_process(case, runner)
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-3)
    assert_final_like_torch(case, plan.training["tied"], runner.state_values())


def test_stages_of_different_tensor_parallelism_train_under_mpiexec(tmp_path):
    """``mpiexec -n 3 meshplan train`` on a stage of 2 devices that shard its operators and a
    stage of one: each step's loss as torch's, the checkpoint's pieces put together as
    torch's final weights; resumed after 6 steps on its plan and on a plan of the other
    order (1,2) the same steps as one job; ``meshplan export`` writes the trained model;
    and on 1x4 as two replicas of one device then one of two; ``show --schedule`` names the
    relayouts."""
    case, plan_dir, _ = _plan(tmp_path, "gpt_adamw", "1x3", "2,1", "--policy", "megatron")
    settings = case["settings"]
    options = [*_train_options(settings), "--data", TRAINING_DIR / "gpt_adamw.data.npz", "--total-steps",
               settings["steps"]]
    losses, checkpoint = trained_under_mpiexec(3, plan_dir, case, options, tmp_path)
    layouts = checkpoint.manifest["layouts"]
    assert any(entry.get("logical_mesh") == [1, 2] and entry["holders"] == [0, 1] for entry in layouts.values())
    assert_final_like_torch(case, read_plan(plan_dir).training["tied"], dict(checkpoint.tensors()))
    _, other, _ = _plan(tmp_path, "gpt_adamw", "1x3", "1,2", "--policy", "data", out="other")
    assert_resumes(3, plan_dir, other, options, losses, tmp_path)
    exported = run_cli("export", plan_dir, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "trained.onnx")
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "trained.onnx").is_file()
    # replica counts that differ as well (two of one device, then one of two), from the checkpoint
    _, rows, _ = _plan(tmp_path, "gpt_adamw", "1x4", "1,2", "--policy", "megatron", out="rows", devices="2,2")
    half = len(losses) // 2      # (where assert_resumes's checkpoint stands)
    fourth = run_mpi(4, "train", rows, "--steps", settings["steps"] - half, "--resume", tmp_path / "half",
                     "--log", tmp_path / "rows.json", "-q", *options)
    assert fourth.returncode == 0, fourth.stderr
    np.testing.assert_allclose(json.loads((tmp_path / "rows.json").read_text())["losses"], losses[half:],
                               rtol=1e-5)
    shown = run_cli("show", plan_dir, "--schedule")
    assert shown.returncode == 0, shown.stderr
    assert "on 2 device(s) ->" in shown.stdout and "on 1" in shown.stdout


def test_what_a_plan_of_stages_of_different_tensor_parallelism_refuses(tmp_path):
    """A list of another length than the stages (a usage error), a mesh that is not a
    multiple of their sum, a stage's devices across two hosts, --stage-devices that are not
    multiples of each stage's T, a stage that reads what the other's programs compute again
    where it is read (the tied GPT-2's attention mask, made from its inputs alone), a T that
    is not a number: one line each, nothing written."""
    case = load_case("mlp_sgd")
    settings = case["settings"]
    base = ["plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer", "sgd", "--dim",
            f"batch={settings['batch']}", "--device", "cpu", "--microbatches", 2]
    usage = run_cli(*base, "--mesh", "1x3", "--stages", 3, "--tensor-parallel", "2,1", "-o", tmp_path / "a")
    assert usage.returncode == 2 and "goes with --stages 2" in usage.stderr
    _one_error_line(run_cli(*base, "--mesh", "1x4", "--stages", 2, "--tensor-parallel", "2,1", "-o", tmp_path / "a"),
                    "multiple of 3")
    _one_error_line(run_cli(*base, "--mesh", "3x1", "--stages", 2, "--tensor-parallel", "1,2", "-o", tmp_path / "a"),
                    "two hosts")
    _one_error_line(run_cli(*base, "--mesh", "1x6", "--stages", 2, "--tensor-parallel", "2,4", "--stage-devices",
                            "3,3", "-o", tmp_path / "a"), "a multiple of its T")
    tied = load_case("gpt2_tied")
    given = tied["settings"]
    _one_error_line(run_cli("plan", tied["model_path"], "--train", "--loss", given["loss"], "--optimizer", "adamw",
                            "--dim", f"batch={given['batch']}", "--device", "cpu", "--microbatches", 4, "--mesh",
                            "1x4", "--stages", 2, "--stage-devices", "2,2", "--tensor-parallel", "2,1", "--policy",
                            "megatron", "-o", tmp_path / "a"), "stage 1 reads 'where' from stage 0", "do not hand it on")
    bad = run_cli(*base, "--mesh", "1x3", "--stages", 2, "--tensor-parallel", "2,x", "-o", tmp_path / "a")
    assert bad.returncode == 2 and "positive numbers" in bad.stderr
    assert not (tmp_path / "a").exists()


def test_auto_weighs_the_cuts_own_tensor_parallelism_of_each_stage(tmp_path):
    """``--tensor-parallel auto`` with ``--stages 2`` on 1x3 (and with ``--max-stages 2``):
    beside the replicas, the cut's own T for each stage (one replica a stage, 1 and 2), each
    estimated as its plan would be; the plan written is the fastest, as the report says."""
    for more in (("--stages", 2), ("--max-stages", 2)):
        case = load_case("gpt_adamw")
        settings = case["settings"]
        out = tmp_path / more[0].strip("-")
        done = run_cli("plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer", "adamw",
                       "--mesh", "1x3", *more, "--tensor-parallel", "auto", "--microbatches", 4, "--dim",
                       f"batch={settings['batch']}", "--device", "cpu", "-o", out)
        assert done.returncode == 0, done.stderr
        line = next(line for line in done.stdout.splitlines() if "weighed" in line)
        steps = {what.strip(): float(ms) for what, ms in re.findall(r"(?:^|; |: )([^:;]+): step ([\d.]+) ms", line)}
        mixed = next(what for what in steps if "1,2" in what)
        plan = read_plan(out)
        written = plan.estimate["step_seconds"] * 1e3
        assert written == pytest.approx(min(steps.values()), rel=1e-3), (line, written)
        tensors = plan.training.get("pipeline", {}).get("tensors")
        assert (tensors == [1, 2]) == (steps[mixed] == min(steps.values()))


def test_a_crossing_split_by_heads_in_segments_is_refused():
    """A relayout's boxes are contiguous: a tensor whose split dim holds heads in segments (a
    fused query/key/value projection of 3 × 4 heads, split over 2 devices: each holds two
    heads of every segment) cannot go between stages of different layouts; whole heads in one
    segment can."""
    from meshplan.errors import PlanError
    from meshplan.make_stage_programs import _check_segments

    fused = {2: ((64, 4), (64, 4), (64, 4))}
    with pytest.raises(PlanError, match="split by heads held in segments"):
        _check_segments("qkv", ("RRS1", 2), ("RRR", 1), fused, 0, 1)
    _check_segments("qkv", ("RRR", 2), ("RRR", 1), fused, 0, 1)            # not split: nothing to refuse
    _check_segments("qkv", ("RRS1", 2), ("RRR", 1), {2: ((192, 12),)}, 0, 1)   # one segment: a plain split
