"""Pipelined training plans end to end: ``meshplan plan --train --stages S`` writes the cut,
the parts and the 1F1B/GPipe lists; the parts run in process and under ``mpiexec -n S
meshplan train`` equal to torch (the references of sample_models/training); checkpoints,
resume and export; what such a plan refuses, in one line."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO, run_cli, run_mpi, run_mpi_script
from meshplan.emit.pipeline_parts import read_pipeline
from meshplan.emit.report import training_timeline
from meshplan.emit.schedule import read_lists
from meshplan.emit.train_schedule import read_training_schedule, training_schedule
from meshplan.errors import PlanError
from meshplan.plan_format import read_plan
from meshplan.providers import cuda_usable
from meshplan.runtime.pipeline_inprocess import PipelineRunner
from meshplan.trainer.checkpoint import Checkpoint
from sample_models.training import load_case
from test_cli_errors import _one_error_line
from tests.training_cases import assert_final_like_torch, train_in_process

SAMPLES = REPO / "sample_models" / "training"


def _plan(tmp_path, name: str, mesh: str, stages: int, *more, out: str = "plan"):
    case = load_case(name)
    settings = case["settings"]
    done = run_cli("plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer",
                   settings["optimizer"], "--mesh", mesh, "--stages", stages, "--microbatches", 4, "--dim",
                   f"batch={settings['batch']}", "--device", "cpu", *more, "-o", tmp_path / out)
    assert done.returncode == 0, done.stdout + done.stderr
    return case, tmp_path / out, done.stdout


def _train_options(settings: dict) -> list:
    options = ["--lr", settings["lr"], "--schedule", settings["schedule"], "--warmup", settings["warmup"],
               "--weight-decay", settings.get("weight_decay") or 0.0]
    if settings.get("clip_norm"):
        options += ["--clip-norm", settings["clip_norm"]]
    if settings["optimizer"] == "adamw":
        options += ["--betas", ",".join(str(b) for b in settings["betas"]), "--eps", settings["eps"]]
    else:
        options += ["--momentum", settings.get("momentum") or 0.0]
    return options


def test_plan_writes_the_cut_parts_and_lists(tmp_path):
    case, plan_dir, out = _plan(tmp_path, "gpt_adamw", "1x2", 2)
    plan = read_plan(plan_dir)
    record = plan.training["pipeline"]
    assert record["schedule"] == "1f1b" and record["stages"] == 2 and plan.microbatches == 4
    assert [s.devices for s in plan.stages] == [[0], [1]]
    assert plan.stages[0].layers[1] == plan.stages[1].layers[0]
    assert {(p["stage"], p["phase"]) for p in record["parts"]} == {
        (0, "forward"), (0, "backward"), (0, "norm"), (0, "update"),
        (1, "forward"), (1, "backward"), (1, "norm"), (1, "clip"), (1, "update")}
    assert all((plan_dir / p["file"]).is_file() for p in record["parts"])
    pipeline = read_pipeline(plan_dir, plan.training)
    lists = read_training_schedule(plan.to_dict()["checksum"], plan_dir, pipeline, 4, "1f1b")
    assert lists == training_schedule(pipeline, 4, "1f1b")
    assert "pipelined training, 2 stages" in out and "in flight" in out
    svg = (plan_dir / "timeline.svg").read_text()
    assert svg.count("<title>stage 1, backward of microbatch") == 4 and svg.count("norm, clip and update") == 2
    shown = run_cli("show", plan_dir, "--schedule", "--stage", 1)
    assert shown.returncode == 0, shown.stderr
    assert "run backward mb 3" in shown.stdout and "run clip" in shown.stdout


def test_replicas_of_a_stage_hold_the_optimizer_state_in_row_blocks(tmp_path):
    """1x4 in 2 stages: each stage's two replicas update in row blocks (ZeRO-1): every weight's
    slots are among the plan's sharded tensors, the norm and update parts take any number of
    rows, a replica's optimizer memory is half the slots' (AdamW's two slots: the weights'
    bytes), and the report and ``show --schedule`` say so. On 1x2 (one device a stage) nothing
    is sharded."""
    case, plan_dir, said = _plan(tmp_path, "gpt_adamw", "1x4", 2)
    plan = read_plan(plan_dir)
    sharded = set(plan.training["pipeline"]["sharded"])
    for weight in plan.training["weights"]:
        assert {weight, f"{weight}.exp_avg", f"{weight}.exp_avg_sq", f"{weight}.updated"} <= sharded
    for held in plan.training["memory"]:
        assert held["optimizer"] == held["weights"] > 0
    pipeline = read_pipeline(plan_dir, plan.training)
    for (stage, phase), part in pipeline.parts.items():
        model = onnx.load(part.model, load_external_data=False)
        for value in model.graph.input:
            dims = value.type.tensor_type.shape.dim
            if phase in ("norm", "update") and value.name in sharded:
                assert dims and all(d.dim_param and not d.dim_value for d in dims)
            elif phase == "forward" and value.name in plan.training["weights"]:
                assert all(d.dim_value for d in dims)
    assert "ZeRO-1" in said
    shown = run_cli("show", plan_dir, "--schedule", "--stage", 0)
    assert shown.returncode == 0, shown.stderr
    assert "ranks 0-1 (stage 0)" in shown.stdout and "reduce-scatter the accumulated gradients" in shown.stdout
    damaged = json.loads((plan_dir / "plan.json").read_text())   # a group of the update that is not its own
    damaged["training"]["pipeline"]["update_chunks"]["0"][0].append("no.such.updated")
    with pytest.raises(PlanError, match="update groups of stage 0"):
        read_pipeline(plan_dir, damaged["training"])
    damaged["training"]["pipeline"]["update_chunks"] = [["a"]]
    with pytest.raises(PlanError, match="malformed"):
        read_pipeline(plan_dir, damaged["training"])
    shown = run_cli("show", plan_dir)    # the report, then each stage's ranks, state and parts
    assert shown.returncode == 0, shown.stderr
    assert "reduce-scatter and weight all-gather" in shown.stdout and "no annotated.onnx" not in shown.stdout
    assert "stage 1: layers" in shown.stdout and "rank(s) 2,3 (2 data-parallel replicas)" in shown.stdout
    assert "row blocks of their optimizer slots" in shown.stdout and "groups of weights" in shown.stdout
    assert shown.stdout.count("training/stage") == 9
    _, one_dir, said = _plan(tmp_path, "gpt_adamw", "1x2", 2, out="one")
    one = read_plan(one_dir)
    assert one.training["pipeline"]["sharded"] == [] and "ZeRO-1" not in said
    chunks = read_pipeline(one_dir, one.training).chunks
    for stage, held in enumerate(one.training["memory"]):
        assert held["optimizer"] == 2 * held["weights"]
        # a backward makes new accumulated gradients while the old are held; the update, run
        # group by group, holds one group's new weights and slots at a time, not all 3 W
        assert len(chunks[stage]) > 1
        assert held["weights"] <= held["working"] < 3 * held["weights"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_timeline_plays_the_schedule(tmp_path, schedule):
    """The drawn step: a stage runs one part at a time, a forward after the stage before has
    made its input, a backward after the stage after has sent its gradient; it ends near
    Alpa's T (equal at equal stages)."""
    _, plan_dir, _ = _plan(tmp_path, "gpt_adamw", "1x4", 4, "--schedule", schedule)
    plan = read_plan(plan_dir)
    rows, total = training_timeline(plan)
    when = {(phase, s, mb): (start, end) for s, row in enumerate(rows) for phase, mb, start, end in row}
    assert len(when) == 2 * 4 * 4
    for s, row in enumerate(rows):
        assert all(a[3] <= b[2] + 1e-12 for a, b in zip(row, row[1:]))
        for phase, mb, start, _ in row:
            before = ("forward", s - 1, mb) if phase == "forward" else ("backward", s + 1, mb)
            if before in when:
                assert start >= when[before][1] - 1e-12
    assert total == pytest.approx(plan.estimate["step_seconds"], rel=0.25)


@pytest.mark.parametrize("name,mesh", [("gpt_adamw", "1x2"), ("gpt_adamw", "1x4"), ("gpt2_tied", "1x4")])
def test_plan_parts_in_process_equal_torch(tmp_path, name, mesh):
    """The written parts (files), run stage by stage in this process, train as torch; on 1x4
    each stage's two replicas (threads) take half of every microbatch and update their row
    blocks of the weights."""
    case, plan_dir, _ = _plan(tmp_path, name, mesh, 2)
    plan = read_plan(plan_dir)
    pipeline = read_pipeline(plan_dir, plan.training)
    replicas = plan.training["pipeline"]["replicas"]
    assert replicas == int(mesh[2]) // 2 and bool(pipeline.sharded) is (replicas > 1)
    runner = PipelineRunner(pipeline, 4, case["initial"], plan.training["pipeline"]["schedule"], replicas=replicas)
    losses = train_in_process(case, runner)
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-3)
    assert_final_like_torch(case, plan.training["tied"], runner.state_values())


@pytest.mark.parametrize("name,mesh,stages,schedule,recompute", [("gpt_adamw", "1x2", 2, "1f1b", False),
                                                                 ("gpt2_tied", "2x2", 4, "gpipe", False),
                                                                 ("gpt_adamw", "1x4", 2, "1f1b", False),
                                                                 ("gpt2_tied", "1x2", 2, "1f1b", True),
                                                                 ("gpt2_tied", "1x4", 2, "gpipe", False)])
def test_mpi_training_equals_torch(tmp_path, name, mesh, stages, schedule, recompute):
    """One rank a device under mpiexec (1x4 in 2 stages: each stage two data-parallel
    replicas, which update in row blocks — for the tied GPT-2 the head's gradient of the
    embedding crosses back whole and each replica takes its rows; with ``--recompute``, each
    stage's backward running its forward again): each
    step's loss as torch's, the final weights (read back from the checkpoint) as torch's,
    and ``meshplan export`` writes them."""
    case, plan_dir, said = _plan(tmp_path, name, mesh, stages, "--schedule", schedule,
                                 *(["--recompute"] if recompute else []))
    assert read_plan(plan_dir).training["recompute"] is recompute
    assert ("activations recomputed" in said) is recompute
    settings = case["settings"]
    ranks = int(mesh[0]) * int(mesh[2])
    done = run_mpi(ranks, "train", plan_dir, "--data", SAMPLES / f"{name}.data.npz", "--steps", settings["steps"],
                   *_train_options(settings), "--checkpoint", tmp_path / "ck", "--log", tmp_path / "log.json",
                   "--trace", tmp_path / "trace.json", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    log = json.loads((tmp_path / "log.json").read_text())
    # the last step's trace: every rank runs each microbatch's forward and backward, then its update
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    microbatches = read_plan(plan_dir).microbatches
    for rank in range(ranks):
        runs = [(e["name"], e["args"]["microbatch"]) for e in events if e["pid"] == rank]
        assert sorted(mb for name, mb in runs if name == "forward") == list(range(microbatches))
        assert sorted(mb for name, mb in runs if name == "backward") == list(range(microbatches))
        assert runs[-1][0] == "update"
    np.testing.assert_allclose(log["losses"], case["losses"], rtol=1e-3)
    assert len(log["busy_fractions"]) == ranks and all(0 < b <= 1 for b in log["busy_fractions"])
    assert log["bubble"] == pytest.approx((stages - 1) / (4 + stages - 1))
    assert "pipeline: ranks busy" in done.stdout
    state = dict(Checkpoint(tmp_path / "ck").tensors())
    plan = read_plan(plan_dir)
    assert_final_like_torch(case, plan.training["tied"], state)
    exported = run_cli("export", plan_dir, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "trained.onnx")
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "trained.onnx").is_file()


@pytest.mark.parametrize("mesh", ["1x2", "1x4"])
def test_stages_keeping_their_tensors_on_the_device_train_the_same_under_mpiexec(tmp_path, mesh):
    """``train_pipeline_rank(on_device=True)``: each stage's state as OrtValues where its
    sessions compute (a CUDA job's path, on host memory here), the same steps and checkpoint;
    on 1x4 with each stage's replicas updating in row blocks."""
    _, plan_dir, _ = _plan(tmp_path, "gpt_adamw", mesh, 2)
    lines = run_mpi_script("pipeline_device_case.py", int(mesh[2]),
                           args=(plan_dir, SAMPLES / "gpt_adamw.data.npz", tmp_path))
    assert lines == ["ok pipeline_device"]


@pytest.mark.parametrize("mesh", ["1x2", "1x4"])
def test_resume_continues_the_same_steps(tmp_path, mesh):
    """A checkpoint taken after 3 steps and resumed gives the steps of one job of 6. On 1x4
    (two replicas a stage) each replica writes its own row blocks of the momentum buffers, and
    the checkpoint reads back whole what the replicas held in part."""
    case, plan_dir, _ = _plan(tmp_path, "mlp_sgd", mesh, 2)
    ranks = int(mesh[2])
    settings = case["settings"]
    common = ["--data", SAMPLES / "mlp_sgd.data.npz", *_train_options(settings), "--total-steps", 6]
    first = run_mpi(ranks, "train", plan_dir, "--steps", 3, "--checkpoint", tmp_path / "ck", "-q", *common)
    assert first.returncode == 0, first.stdout + first.stderr
    checkpoint = Checkpoint(tmp_path / "ck")
    layouts = checkpoint.manifest["layouts"]
    shared = sorted(n for n, entry in layouts.items() if len(entry["holders"]) > 1)
    if ranks == 4:
        assert shared and all(n.endswith(".momentum_buffer") for n in shared)
        assert sorted(p.name for p in checkpoint.path.glob("rank*.npz")) == [f"rank{r}.npz" for r in range(4)]
        shapes = {n: tuple(info["shape"]) for n, info in read_plan(plan_dir).training["weights"].items()}
        for name in shared:
            assert checkpoint.tensor(name).shape == shapes[name.rpartition(".")[0]]
    else:
        assert not shared
    second = run_mpi(ranks, "train", plan_dir, "--steps", 3, "--resume", tmp_path / "ck", "--log",
                     tmp_path / "log.json", "-q", *common)
    assert second.returncode == 0, second.stdout + second.stderr
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["first_step"] == 3
    whole = run_mpi(ranks, "train", plan_dir, "--steps", 6, "--log", tmp_path / "whole.json", "-q", *common)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    np.testing.assert_allclose(log["losses"], json.loads((tmp_path / "whole.json").read_text())["losses"][3:],
                               rtol=1e-6)


def test_pipelined_plans_refuse_in_one_line(tmp_path):
    case = load_case("mlp_sgd")
    settings = case["settings"]
    base = ["plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer", "sgd", "--dim",
            f"batch={settings['batch']}", "--device", "cpu", "--microbatches", 2]
    _one_error_line(run_cli(*base, "--mesh", "1x2", "--stages", 3, "-o", tmp_path / "a"),
                    "--stages 3 needs at least 3 devices, the mesh has 2")
    _one_error_line(run_cli(*base[:-1], 8, "--mesh", "1x4", "--stages", 2, "-o", tmp_path / "a"),
                    "a microbatch of 1 sample(s) does not split over the 2 replicas")
    c = 3   # batch normalization in training mode: its running statistics would differ between replicas
    graph = helper.make_graph(
        [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "rm", "rv"],
                          training_mode=1, momentum=0.9)],
        "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", c, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", c, 4, 4])],
        [numpy_helper.from_array(v, k) for k, v in {"scale": np.ones(c, np.float32), "bias": np.zeros(c, np.float32),
                                                    "mean": np.zeros(c, np.float32),
                                                    "var": np.ones(c, np.float32)}.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8),
              str(tmp_path / "bn.onnx"))
    _one_error_line(run_cli("plan", tmp_path / "bn.onnx", "--train", "--loss", "mse:y:t", "--optimizer", "sgd",
                            "--dim", "batch=8", "--device", "cpu", "--microbatches", 2, "--mesh", "1x4", "--stages", 2,
                            "-o", tmp_path / "a"), "running statistics")
    wrong = run_cli(*base, "--mesh", "1x2", "--schedule", "gpipe", "-o", tmp_path / "d")
    assert wrong.returncode == 2 and "--schedule goes with --train and --stages" in wrong.stderr, wrong.stderr
    for name in "ad":
        assert not (tmp_path / name).exists()
    _, plan_dir, _ = _plan(tmp_path, "mlp_sgd", "1x2", 2)
    data = SAMPLES / "mlp_sgd.data.npz"
    _one_error_line(run_mpi(1, "train", plan_dir, "--data", data, "--steps", 1), "mpiexec -n 2")
    _one_error_line(run_mpi(3, "train", plan_dir, "--data", data, "--steps", 1), "mpiexec -n 2",
                    "this job has 3 rank(s)")
    _one_error_line(run_cli("run", plan_dir, "--inputs", data), "pipelined training plan", "meshplan train")
    if not cuda_usable():
        _one_error_line(run_mpi(2, "train", plan_dir, "--data", data, "--steps", 1, "--provider", "cuda"),
                        "CUDA execution provider is not usable here")
    _one_error_line(run_mpi(2, "train", plan_dir, "--data", data, "--steps", 1, "--transfer", "device"),
                    "host memory")
    schedule = json.loads((plan_dir / "schedule.json").read_text())
    first = schedule["ranks"][0]
    run_at = next(i for i, item in enumerate(first) if item["op"] == "run")
    receive_at = next((i for i, item in enumerate(first) if item["op"] == "receive"), None)
    assert receive_at is not None and receive_at > run_at
    first.insert(0, first.pop(receive_at))           # stage 0 waits for a gradient before its first forward
    (plan_dir / "schedule.json").write_text(json.dumps(schedule))
    _one_error_line(run_mpi(2, "train", plan_dir, "--data", data, "--steps", 1), "schedule")


def test_max_stages_weighs_one_stage_and_pipelines(tmp_path):
    """``--max-stages 4`` on 1x4 weighs the one-stage plan and 2, 3 (stages of different
    device counts) and 4 pipeline stages, and writes the fastest estimate; on 1x1 only the
    one-stage plan is there to weigh."""
    case = load_case("gpt_adamw")
    common = ["plan", case["model_path"], "--train", "--loss", case["settings"]["loss"], "--optimizer", "adamw",
              "--microbatches", 4, "--dim", "batch=8", "--device", "cpu", "--max-stages", 4]
    done = run_cli(*common, "--mesh", "1x4", "-o", tmp_path / "four")
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(l for l in done.stdout.splitlines() if l.startswith("stages weighed"))
    steps = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"(\d) stages?: step ([\d.]+) ms", line)}
    assert sorted(steps) == [1, 2, 3, 4]
    best = min(steps, key=steps.get)
    plan = read_plan(tmp_path / "four")
    assert len(plan.stages) == best and f"chosen: {best} pipeline stages" in line
    assert plan.estimate["step_seconds"] * 1e3 == pytest.approx(steps[best], rel=1e-3)
    assert "stages weighed" in (tmp_path / "four" / "report.txt").read_text()
    done = run_cli(*common, "--mesh", "1x1", "-o", tmp_path / "one")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "chosen: one stage over the mesh" in done.stdout
    assert not read_plan(tmp_path / "one").training.get("pipeline")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["four", "one"]     # no trial left behind


def test_a_stage_that_does_not_fit_is_refused(tmp_path):
    case = load_case("gpt_adamw")
    settings = case["settings"]
    cluster = tmp_path / "tiny.toml"
    cluster.write_text('hosts = 1\ndevices_per_host = 2\n[device]\npreset = "cpu"\nmemory_gb = 0.05\n')
    done = run_cli("plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer", "adamw",
                   "--cluster", cluster, "--stages", 2, "--microbatches", 4, "--dim", "batch=8", "-o", tmp_path / "p")
    _one_error_line(done, "stage 0 needs", "GiB", "more than its device's")
    assert not (tmp_path / "p").exists()


def test_a_rank_that_dies_mid_step_ends_the_job_and_leaves_the_last_checkpoint(tmp_path):
    """Stage 1's rank killed in the middle of step 3 (a checkpoint after every step): the job
    ends, no process of it is left, and the checkpoint folder holds steps 1 and 2, whole: the
    job resumes from step 2 and its next step is the uninterrupted job's third."""
    from tests.jobs import run_marked

    case, plan_dir, _ = _plan(tmp_path, "gpt_adamw", "1x2", 2)
    settings = case["settings"]
    common = ["--data", SAMPLES / "gpt_adamw.data.npz", *_train_options(settings)]
    plan = read_plan(plan_dir)
    lists = read_lists(plan_dir / "schedule.json", plan.to_dict()["checksum"], (plan.training["pipeline"]["schedule"],),
                       plan.microbatches).ranks
    runs = sum(1 for i in lists[1] if i.op == "run")       # stage 1's runs a step
    ended = run_marked(2, "train", plan_dir, "--steps", 5, "--checkpoint", tmp_path / "ck", "--checkpoint-every", 1,
                       "-q", *common, failure=f"rank-1-dies-at-part-{2 * runs + 3}", timeout=120)
    assert ended.returncode not in (None, 0) and not ended.left, ended.stderr
    assert Checkpoint(tmp_path / "ck").step == 2
    resumed = run_mpi(2, "train", plan_dir, "--steps", 1, "--resume", tmp_path / "ck", "--log", tmp_path / "r.json",
                      "-q", *common, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    whole = run_mpi(2, "train", plan_dir, "--steps", 3, "--log", tmp_path / "w.json", "-q", *common, timeout=300)
    assert whole.returncode == 0, whole.stderr
    third = json.loads((tmp_path / "w.json").read_text())["losses"][2]
    assert json.loads((tmp_path / "r.json").read_text())["losses"] == [third]

