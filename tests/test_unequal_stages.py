"""Pipeline stages with different numbers of devices: ``meshplan plan --train --stages S``
where S does not divide the mesh (the cut chooses each stage's replicas with its layers), or
``--stage-devices D0,D1,...``. Each crossing between stages of R_src and R_dst replicas is
split by its rows of samples (``meshplan.stage_ranks``); the gradients the last stage sends
go as sums. Trained in process and under mpiexec, equal to torch; checkpoints move to plans
of equal stages; what such plans refuse, in one line."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO, run_cli, run_mpi, run_mpi_script
from meshplan.emit.pipeline_parts import read_pipeline
from meshplan.inter.training_stages import _cut_over_devices
from meshplan.plan_format import read_plan
from meshplan.runtime.pipeline_inprocess import PipelineRunner
from meshplan.stage_ranks import ONE, ROWS, SAME, SUM, StageRanks, joined, piece_for, sources
from meshplan.trainer.checkpoint import Checkpoint
from sample_models.training import load_case
from test_cli_errors import _one_error_line
from test_pipeline_plans import _train_options as train_options
from tests.training_cases import assert_final_like_torch, train_in_process

SAMPLES = REPO / "sample_models" / "training"


def _plan(tmp_path, name: str, mesh: str, stages: int, *more, out: str = "plan", microbatches: int = 4):
    case = load_case(name)
    settings = case["settings"]
    done = run_cli("plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer",
                   settings["optimizer"], "--mesh", mesh, "--stages", stages, "--microbatches", microbatches,
                   "--dim", f"batch={settings['batch']}", "--device", "cpu", *more, "-o", tmp_path / out)
    assert done.returncode == 0, done.stdout + done.stderr
    return case, tmp_path / out, done.stdout


def _train_options(settings: dict) -> list:
    """The reference's hyperparameters, its learning-rate schedule over all its steps."""
    return [*train_options(settings), "--total-steps", settings["steps"]]


def test_ranks_follow_the_stages_before():
    ranks = StageRanks.of([1, 3, 2], 3)
    assert ranks.size == 6 and not ranks.uniform
    assert [ranks.first(s) for s in range(3)] == [0, 1, 4]
    assert [ranks.where(r) for r in range(6)] == [(0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 2, 0), (2, 0, 0), (2, 1, 0)]
    assert all(ranks.rank(*ranks.where(r)) == r for r in range(6))
    sharded = StageRanks.of(2, 2, tensor=2)
    assert sharded.uniform and sharded.size == 8 and sharded.where(5) == (1, 0, 1)
    with pytest.raises(ValueError):
        StageRanks.of([1, 2], 3)


@pytest.mark.parametrize("r_src,r_dst", [(1, 2), (2, 1), (2, 3), (3, 2), (4, 6), (2, 2)])
def test_a_crossing_between_replica_counts_gives_each_its_rows_and_keeps_sums(r_src, r_dst):
    """Each destination replica gets exactly its row block of the whole (on any axis), the
    partial sums add up to the same total, a shared value reaches every destination."""
    rng = np.random.default_rng(r_src * 10 + r_dst)
    whole = rng.standard_normal((3, 12, 5)).astype(np.float32)     # 12 samples on axis 1
    held = np.split(whole, r_src, axis=1)
    for dst in range(r_dst):
        pieces = [piece_for(ROWS, held[s], 1, s, r_src, dst, r_dst) for s in sources(ROWS, dst, r_src, r_dst)]
        np.testing.assert_array_equal(joined(ROWS, pieces, 1), np.split(whole, r_dst, axis=1)[dst])
    partial = [rng.standard_normal(4) for _ in range(r_src)]
    got = [joined(SUM, [piece_for(SUM, partial[s], None, s, r_src, d, r_dst) for s in sources(SUM, d, r_src, r_dst)],
                  None) for d in range(r_dst)]
    np.testing.assert_allclose(sum(got), sum(partial), rtol=1e-12)
    same = [np.full(2, s) for s in range(r_src)]
    for d in range(r_dst):
        (s,) = sources(SAME, d, r_src, r_dst)
        assert piece_for(SAME, same[s], None, s, r_src, d, r_dst) is same[s]
        np.testing.assert_array_equal(piece_for(ONE, np.float32(7.0), None, s, r_src, d, r_dst), 1.0)


def test_the_cut_gives_more_replicas_to_more_work():
    """Of 3 devices in 2 stages, the heavy layers' stage gets two replicas; the cut's slowest
    stage is the least of every cut and count (tried one by one), and among those within 1 %
    its stages' times add up to the least."""
    seconds = [3.0, 3.0, 3.0, 3.0, 1.0, 1.0]
    for given in (seconds, seconds[::-1]):
        edges, replicas = _cut_over_devices(given, [0] * 7, [[1, 2], [1, 2]], 3)
        times = [sum(given[a:b]) / r for a, b, r in zip(edges[:-1], edges[1:], replicas)]
        tried = [(max(sum(given[:k]) / r, sum(given[k:]) / (3 - r)), sum(given[:k]) / r + sum(given[k:]) / (3 - r))
                 for k in range(1, 6) for r in (1, 2)]
        assert max(times) == min(t for t, _ in tried)
        assert sum(times) == min(total for t, total in tried if t <= min(t for t, _ in tried) * 1.01)
        assert replicas == ([2, 1] if given is seconds else [1, 2])
    with pytest.raises(Exception, match="no way to give"):
        _cut_over_devices(seconds, [0] * 7, [[1], [1]], 3)


@pytest.mark.parametrize("name,mesh,microbatches,more", [
    ("gpt_adamw", "1x3", 4, ()),
    ("gpt2_tied", "1x3", 4, ("--stage-devices", "2,1", "--schedule", "gpipe")),
    ("mlp_sgd", "1x5", 2, ("--stage-devices", "1,4")),
    ("mlp_sgd", "1x6", 2, ())])
def test_stages_of_different_sizes_train_as_torch_in_process(tmp_path, name, mesh, microbatches, more):
    """gpt_adamw (targets of -100 in different numbers in each replica's rows) on 1x3, the
    cut choosing the stages' devices; the tied GPT-2 on 2 + 1 devices (the head's gradient
    of the embedding crosses back to the stage of two); the MLP on 1 + 4, and on 1x6 where a
    microbatch of 4 does not split over 3 replicas a stage (the cut gives 2 and 4): each
    step's loss as torch's, the final weights as torch's."""
    case, plan_dir, said = _plan(tmp_path, name, mesh, 2, *more, microbatches=microbatches)
    plan = read_plan(plan_dir)
    replicas = plan.training["pipeline"]["replicas"]
    assert isinstance(replicas, list) and sum(replicas) == int(mesh[2]) and len(set(replicas)) == 2
    assert "the stages' devices: " + ", ".join(map(str, replicas)) in said
    assert [s.devices for s in plan.stages] == [list(range(replicas[0])), list(range(replicas[0], sum(replicas)))]
    pipeline = read_pipeline(plan_dir, plan.training)
    assert pipeline.rows     # the activations and their gradients are split by their rows
    runner = PipelineRunner(pipeline, plan.microbatches, case["initial"], plan.training["pipeline"]["schedule"],
                            replicas=replicas)
    losses = train_in_process(case, runner)
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-3)
    assert_final_like_torch(case, plan.training["tied"], runner.state_values())


@pytest.mark.parametrize("name", ["gpt_adamw", "gpt2_tied"])
def test_where_equal_stages_are_possible_the_cuts_own_choice_is_weighed_beside_them(tmp_path, name):
    """1x6, 2 stages, microbatches of 12: the cut would give the stages 2 and 4 devices; both
    that and 3 + 3 are planned as estimates and the faster written, the report saying so."""
    case = load_case(name)
    done = run_cli("plan", case["model_path"], "--train", "--loss", case["settings"]["loss"], "--optimizer", "sgd",
                   "--mesh", "1x6", "--stages", 2, "--microbatches", 4, "--dim", "batch=48", "--device", "cpu",
                   "-o", tmp_path / "plan")
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(l for l in done.stdout.splitlines() if l.startswith("the stages' devices weighed"))
    steps = {tuple(int(d) for d in m.group(1).split(", ")): float(m.group(2))
             for m in re.finditer(r"(\d+, \d+): step ([\d.]+) ms", line)}
    assert (3, 3) in steps and len(steps) == 2
    best = min(steps, key=steps.get)
    plan = read_plan(tmp_path / "plan")
    assert [len(s.devices) for s in plan.stages] == list(best) and line.endswith(f"chosen: {best[0]}, {best[1]}")
    assert plan.estimate["step_seconds"] * 1e3 == pytest.approx(steps[best], rel=1e-3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]     # no trial left behind


def test_stages_of_different_sizes_train_as_torch_under_mpiexec_and_resume_on_equal_stages(tmp_path):
    """Three ranks, stage 0 on one and stage 1 on two: the losses as torch's; its checkpoint
    after 6 steps resumed on a plan of one device a stage (1x2) gives torch's last 6 losses
    and final weights; ``show --schedule`` and ``export`` read the plan."""
    case, plan_dir, _ = _plan(tmp_path, "gpt_adamw", "1x3", 2, "--stage-devices", "1,2")
    settings = case["settings"]
    data = SAMPLES / "gpt_adamw.data.npz"
    first = run_mpi(3, "train", plan_dir, "--data", data, "--steps", 6, *_train_options(settings),
                    "--checkpoint", tmp_path / "ck", "--log", tmp_path / "first.json", "-q", timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    np.testing.assert_allclose(json.loads((tmp_path / "first.json").read_text())["losses"], case["losses"][:6],
                               rtol=1e-3)
    layouts = Checkpoint(tmp_path / "ck").manifest["layouts"]
    assert any(entry["holders"] == [1, 2] for entry in layouts.values())   # stage 1's replicas' row blocks
    _, equal_dir, _ = _plan(tmp_path, "gpt_adamw", "1x2", 2, out="equal")
    second = run_mpi(2, "train", equal_dir, "--data", data, "--steps", 6, "--resume", tmp_path / "ck",
                     *_train_options(settings), "--checkpoint", tmp_path / "ck2", "--log", tmp_path / "second.json",
                     "-q", timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    np.testing.assert_allclose(json.loads((tmp_path / "second.json").read_text())["losses"], case["losses"][6:],
                               rtol=1e-3)
    assert_final_like_torch(case, read_plan(equal_dir).training["tied"], dict(Checkpoint(tmp_path / "ck2").tensors()))
    shown = run_cli("show", plan_dir, "--schedule")
    assert shown.returncode == 0 and "rank 0 (stage 0)" in shown.stdout and "ranks 1-2 (stage 1)" in shown.stdout
    exported = run_cli("export", plan_dir, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "trained.onnx")
    assert exported.returncode == 0, exported.stderr
    wrong = run_mpi(2, "train", plan_dir, "--data", data, "--steps", 1)
    _one_error_line(wrong, "2 pipeline stages of 1, 2 device(s)", "mpiexec -n 3")


def test_stages_of_different_sizes_keeping_their_tensors_on_the_device_train_the_same(tmp_path):
    """``on_device=True`` (a CUDA job's path, OrtValues in host memory here) on 2 + 1 devices:
    the same losses, norms and checkpoint as on numpy arrays, to the bit."""
    _, plan_dir, _ = _plan(tmp_path, "gpt_adamw", "1x3", 2, "--stage-devices", "2,1")
    lines = run_mpi_script("pipeline_device_case.py", 3, args=(plan_dir, SAMPLES / "gpt_adamw.data.npz", tmp_path))
    assert lines == ["ok pipeline_device"]


def _flattened_model(path):
    """x [batch, 4, 8] flattened to [batch·4, 8] before two products: every tensor between
    its layers mixes the samples into its first dim."""
    rng = np.random.default_rng(0)
    weights = {f"w{i}": rng.standard_normal((8, 8)).astype(np.float32) * 0.3 for i in range(4)}
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["h0"])]
    for i in range(4):
        nodes.append(helper.make_node("MatMul", [f"h{2 * i}", f"w{i}"], [f"h{2 * i + 1}"]))
        nodes.append(helper.make_node("Tanh", [f"h{2 * i + 1}"], [f"h{2 * i + 2}"]))
    nodes.append(helper.make_node("Reshape", ["h8", "back"], ["y"]))
    initializers = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    initializers += [numpy_helper.from_array(np.array([-1, 8], np.int64), "flat"),
                     numpy_helper.from_array(np.array([-1, 4, 8], np.int64), "back")]
    graph = helper.make_graph(nodes, "flat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))


def test_stages_of_different_sizes_refuse_in_one_line(tmp_path):
    case = load_case("mlp_sgd")
    settings = case["settings"]
    base = ["plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer", "sgd", "--dim",
            f"batch={settings['batch']}", "--device", "cpu", "--microbatches", 2]
    _one_error_line(run_cli(*base, "--mesh", "1x3", "--stages", 2, "--stage-devices", "2,2", "-o", tmp_path / "a"),
                    "--stage-devices 2,2 does not give each of the 2 stages devices adding up to the mesh's 3")
    _one_error_line(run_cli(*base, "--mesh", "1x4", "--stages", 2, "--stage-devices", "3,1", "-o", tmp_path / "a"),
                    "a microbatch of 4 sample(s) does not split over the 3 replicas of stage 0")
    _one_error_line(run_cli(*base, "--mesh", "1x6", "--stages", 2, "--stage-devices", "4,2", "--tensor-parallel", 4,
                            "-o", tmp_path / "a"), "does not give each of the 2 stages a multiple of its T")
    _one_error_line(run_cli(*base, "--mesh", "1x2", "--stages", 3, "-o", tmp_path / "a"),
                    "--stages 3 needs at least 3 devices")
    usage = run_cli(*base, "--mesh", "1x3", "--stage-devices", "2,1", "-o", tmp_path / "a")
    assert usage.returncode == 2 and "--stage-devices goes with --train and --stages" in usage.stderr, usage.stderr
    bad = run_cli(*base, "--mesh", "1x3", "--stages", 2, "--stage-devices", "2,x", "-o", tmp_path / "a")
    assert bad.returncode == 2 and "is not a list of positive device counts" in bad.stderr, bad.stderr
    _flattened_model(tmp_path / "flat.onnx")
    _one_error_line(run_cli("plan", tmp_path / "flat.onnx", "--train", "--loss", "mse:y:t", "--optimizer", "sgd",
                            "--dim", "batch=8", "--device", "cpu", "--microbatches", 2, "--mesh", "1x3",
                            "--stages", 2, "--stage-devices", "2,1", "-o", tmp_path / "a"),
                    "mixed into other dims", "cannot split it")
    assert not (tmp_path / "a").exists()
