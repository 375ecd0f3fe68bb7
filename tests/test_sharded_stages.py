"""Pipelined training plans whose stages shard their operators (``meshplan plan --train
--stages S --tensor-parallel T``): the step planned by the sharding ILP on a [1, T] mesh,
each device's program cut into its stages' parts (``emit.rank_parts``), run in process
(a thread a device, collectives in memory) and under ``mpiexec`` (collectives on MPI),
equal to torch and to the whole step on one device; checkpoints, resume, export and what
such a plan refuses."""

from __future__ import annotations


import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import run_cli, run_mpi
from meshplan.emit.pipeline_parts import read_pipeline
from meshplan.emit.rank_parts import _placed, _rename
from meshplan.plan_format import COLLECTIVE_DOMAIN, read_plan
from meshplan.runtime.pipeline_inprocess import PipelineRunner
from meshplan.sharding import ShardingSpec
from meshplan.testing.train_reference import run_step_model
from meshplan.trainer.checkpoint import Checkpoint
from meshplan.training.optimizers import DEFAULTS
from meshplan.training.step_model import StepModel, TrainSpec, build_step_model
from sample_models.training import TRAINING_DIR, load_case
from test_cli_errors import _one_error_line
from test_pipeline_plans import _train_options
from tests.training_cases import (assert_final_like_torch, assert_resumes, batches, hyper, train_in_process,
                                  trained_under_mpiexec)


def _plan(tmp_path, name: str, mesh: str, stages: int, tensor: int, *more, microbatches: int = 4):
    case = load_case(name)
    settings = case["settings"]
    done = run_cli("plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer",
                   settings["optimizer"], "--mesh", mesh, "--stages", stages, "--tensor-parallel", tensor,
                   "--microbatches", microbatches, "--dim", f"batch={settings['batch']}", "--device", "cpu", *more,
                   "-o", tmp_path / "plan")
    assert done.returncode == 0, done.stdout + done.stderr
    return case, tmp_path / "plan", done.stdout


def _collectives(plan_dir) -> set[str]:
    found = set()
    for path in (plan_dir / "training").glob("*.d0.onnx"):
        found.update(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node
                     if n.domain == COLLECTIVE_DOMAIN)
    return found


@pytest.mark.parametrize("name,mesh,tensor,more,microbatches", [
    ("gpt_adamw", "1x4", 2, ("--schedule", "1f1b"), 4),
    ("gpt2_tied", "1x4", 2, ("--schedule", "gpipe"), 4),
    ("gpt_adamw", "2x4", 2, (), 4),                         # 2 replicas of 2 devices a stage
    ("gpt_adamw", "1x4", 2, ("--policy", "data"), 1),       # other collectives: all-reduces
    ("gpt_adamw", "1x4", 2, ("--recompute",), 4),           # each backward runs its forward's parts again
    ("gpt_adamw", "1x4", 2, ("--policy", "megatron"), 4),   # the products split Megatron's way
])
def test_stages_that_shard_their_operators_train_as_torch_in_process(tmp_path, name, mesh, tensor, more,
                                                                     microbatches):
    """Each device of each stage in a thread, its collectives with its replica's devices in
    memory: each step's loss within 1e-3 of torch's and 1e-5 of the whole step on one
    device; the final weights, put together from the devices' pieces, as torch's."""
    case, plan_dir, said = _plan(tmp_path, name, mesh, 2, tensor, *more, microbatches=microbatches)
    assert f"{tensor} that shard its operators" in said
    plan = read_plan(plan_dir)
    pipeline = read_pipeline(plan_dir, plan.training)
    assert pipeline.tensor == tensor and len(pipeline.device_parts) == tensor
    assert _collectives(plan_dir), "the parts shard nothing"
    replicas = int(plan.training["pipeline"]["replicas"])
    assert replicas * tensor * 2 == int(mesh[0]) * int(mesh[2])
    runner = PipelineRunner(pipeline, plan.microbatches, case["initial"], plan.training["pipeline"]["schedule"],
                            replicas=replicas)
    settings = case["settings"]
    losses = train_in_process(case, runner)
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-3)
    whole = build_step_model(case["model_path"], TrainSpec(settings["loss"], settings["optimizer"],
                                                           microbatches=plan.microbatches))
    one_device, _ = run_step_model(whole, case["initial"], batches(case), hyper(settings), list(case["lrs"]))
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)
    assert_final_like_torch(case, plan.training["tied"], runner.state_values())


def test_stages_that_shard_their_operators_train_under_mpiexec(tmp_path):
    """``mpiexec -n 4 meshplan train`` on 2 stages of 2 devices that shard their operators:
    each step's loss as torch's; the checkpoint holds each device's pieces in the layouts
    the ILP chose and gives torch's final weights; resumed after 6 steps it gives the same
    steps as one job, on its plan and on a plan of replicas; ``meshplan export`` writes the
    trained model."""
    case, plan_dir, _ = _plan(tmp_path, "gpt_adamw", "1x4", 2, 2)
    settings = case["settings"]
    options = [*_train_options(settings), "--data", TRAINING_DIR / "gpt_adamw.data.npz", "--total-steps",
               settings["steps"]]
    losses, checkpoint = trained_under_mpiexec(4, plan_dir, case, options, tmp_path)
    layouts = checkpoint.manifest["layouts"]
    pieces = [n for n, entry in layouts.items() if entry["holders"] == [0, 1]]
    assert pieces and all(layouts[n]["logical_mesh"] == [1, 2] for n in pieces)
    assert_final_like_torch(case, read_plan(plan_dir).training["tied"], dict(checkpoint.tensors()))
    # and on a plan of the same model whose stages' devices are replicas (each tensor put together)
    replicas = run_cli("plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer",
                       settings["optimizer"], "--mesh", "1x4", "--stages", 2, "--microbatches", 4, "--dim",
                       f"batch={settings['batch']}", "--device", "cpu", "-o", tmp_path / "replicas")
    assert replicas.returncode == 0, replicas.stderr
    assert_resumes(4, plan_dir, tmp_path / "replicas", options, losses, tmp_path)
    exported = run_cli("export", plan_dir, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "trained.onnx")
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "trained.onnx").is_file()


def test_a_device_that_fails_ends_the_step_and_its_partner_stops_waiting(tmp_path, monkeypatch):
    """In process: stage 0's device 1 fails in its backward, where device 0 waits for it in
    a collective; the step ends with that failure (no thread left waiting)."""
    case, plan_dir, _ = _plan(tmp_path, "gpt_adamw", "1x4", 2, 2)
    plan = read_plan(plan_dir)
    runner = PipelineRunner(read_pipeline(plan_dir, plan.training), plan.microbatches, case["initial"])
    failing = runner.runners[1].sessions["backward"]     # rank 1: device 1 of stage 0

    def fail(outputs, feeds, collective):
        raise ValueError("device 1 fails here")

    monkeypatch.setattr(failing, "run", fail)
    controls = {**DEFAULTS, **hyper(case["settings"]), "train.lr": 1e-3, "train.step": 1}
    with pytest.raises(ValueError, match="device 1 fails here"):
        runner.step(batches(case)[0], controls)


def test_a_rank_that_dies_mid_step_ends_the_sharded_job_and_leaves_the_last_checkpoint(tmp_path):
    """Under mpiexec: device 1 of stage 0 killed in the middle of step 3 (a checkpoint after
    every step): the job ends, no process of it is left, and the last checkpoint (step 2) is
    whole: a job resumes from it."""
    from meshplan.emit.schedule import read_lists
    from tests.jobs import run_marked

    case, plan_dir, _ = _plan(tmp_path, "gpt_adamw", "1x4", 2, 2)
    plan = read_plan(plan_dir)
    lists = read_lists(plan_dir / "schedule.json", plan.to_dict()["checksum"], (plan.training["pipeline"]["schedule"],),
                       plan.microbatches).ranks
    runs = sum(1 for i in lists[0] if i.op == "run")       # stage 0's runs a step
    common = ["--data", TRAINING_DIR / "gpt_adamw.data.npz", "--lr", 1e-3]
    ended = run_marked(4, "train", plan_dir, "--steps", 5, "--checkpoint", tmp_path / "ck", "--checkpoint-every", 1,
                       "-q", *common, failure=f"rank-1-dies-at-part-{2 * runs + 3}", timeout=120)
    assert ended.returncode not in (None, 0) and not ended.left, ended.stderr
    assert Checkpoint(tmp_path / "ck").step == 2
    resumed = run_mpi(4, "train", plan_dir, "--steps", 1, "--resume", tmp_path / "ck", "-q", *common)
    assert resumed.returncode == 0, resumed.stderr


def test_what_a_plan_of_stages_that_shard_their_operators_refuses(tmp_path):
    """A tensor parallelism that does not divide a stage's devices, or one wider than a
    host; a job of the wrong size: one line each. The option without stages: a usage error."""
    case = load_case("mlp_sgd")
    settings = case["settings"]
    base = ["plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer", "sgd", "--dim",
            f"batch={settings['batch']}", "--device", "cpu", "--microbatches", 2]
    _one_error_line(run_cli(*base, "--mesh", "1x4", "--stages", 2, "--tensor-parallel", 4, "-o", tmp_path / "a"),
                    "--tensor-parallel 4", "stage's 2")
    _one_error_line(run_cli(*base, "--mesh", "4x1", "--stages", 2, "--tensor-parallel", 2, "-o", tmp_path / "a"),
                    "one host")
    usage = run_cli(*base, "--mesh", "1x4", "--tensor-parallel", 2, "-o", tmp_path / "a")
    assert usage.returncode == 2 and "--tensor-parallel goes with --train and --stages" in usage.stderr
    assert not (tmp_path / "a").exists()
    done = run_cli(*base, "--mesh", "1x4", "--stages", 2, "--tensor-parallel", 2, "-o", tmp_path / "p")
    assert done.returncode == 0, done.stderr
    wrong = run_mpi(2, "train", tmp_path / "p", "--data", TRAINING_DIR / "mlp_sgd.data.npz", "--steps", 1)
    _one_error_line(wrong, "mpiexec -n 4")
    _one_error_line(run_cli("run", tmp_path / "p", "--inputs", TRAINING_DIR / "mlp_sgd.data.npz"), "mpiexec -n 4")


def test_the_memory_of_a_stage_that_shards_its_operators(tmp_path):
    """Each device holds its pieces of its stage's weights, gradients and slots (the layouts
    the plan records), less than the stage's whole weights; its working memory counts the
    weights its parts gather whole while they run."""
    case, plan_dir, _ = _plan(tmp_path, "gpt_adamw", "1x4", 2, 2)
    plan = read_plan(plan_dir)
    training = plan.training
    specs, home = training["pipeline"]["specs"], training["pipeline"]["home"]
    for stage, held in enumerate(training["memory"]):
        mine = {w: info for w, info in training["weights"].items() if home[w] == stage}
        whole = sum(int(np.prod(info["shape"])) * np.dtype(info["dtype"]).itemsize for info in mine.values())
        assert held["weights"] < whole
        assert held["gradients"] < whole
        sharded = [w for w in mine if not ShardingSpec.parse(specs[w]).is_replicated]
        largest = max(int(np.prod(mine[w]["shape"])) * np.dtype(mine[w]["dtype"]).itemsize for w in sharded)
        assert held["working"] >= largest
        assert plan.stages[stage].memory_bytes == pytest.approx(sum(held.values()))


def test_auto_weighs_each_tensor_parallelism_and_takes_the_fastest_that_fits(tmp_path):
    """``--tensor-parallel auto``: each T that divides a stage's devices estimated as its plan
    would be (``pipeline_estimate``: the programs' runs counted); with room for both, the
    faster estimate is planned; with room for only one (a device's memory between their
    needs), that one, and the report says the other does not fit; where microbatches of one
    sample leave the replicas nothing to split, the sharded stages."""
    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_pipeline_plan import pipeline_estimate

    case = load_case("gpt_adamw")
    settings = case["settings"]
    spec = TrainSpec(settings["loss"], settings["optimizer"], microbatches=4)
    cluster = make_cluster((1, 4), "cpu")
    needs = {}
    for tensor in (1, 2):
        options = PlanOptions(stages=2, tensor_parallel=tensor, microbatches=1)
        needs[tensor] = pipeline_estimate(case["model_path"], cluster, {"batch": 2}, options, spec, 4, None,
                                          tmp_path / f"w{tensor}")
    assert needs[1][1] != needs[2][1]
    common = ["plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer", settings["optimizer"],
              "--stages", 2, "--tensor-parallel", "auto", "--microbatches", 4, "--dim", f"batch={settings['batch']}"]
    done = run_cli(*common, "--mesh", "1x4", "--device", "cpu", "-o", tmp_path / "roomy")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tensor parallelism weighed" in done.stdout
    faster = min((1, 2), key=lambda t: needs[t][0])
    assert int(read_plan(tmp_path / "roomy").training["pipeline"].get("tensor", 1)) == faster
    room = (needs[1][1] + needs[2][1]) / 2 / 2 ** 30
    (tmp_path / "small.toml").write_text(f"hosts = 1\ndevices_per_host = 4\n[device]\npreset = \"cpu\"\n"
                                         f"memory_gb = {room!r}\n")
    done = run_cli(*common, "--cluster", tmp_path / "small.toml", "-o", tmp_path / "small")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(does not fit)" in done.stdout
    smaller = min((1, 2), key=lambda t: needs[t][1])
    assert int(read_plan(tmp_path / "small").training["pipeline"].get("tensor", 1)) == smaller
    # microbatches of one sample: no replicas can split them, so the devices shard instead
    ones = [str(c) if not str(c).startswith("batch=") else "batch=4" for c in common]
    done = run_cli(*ones, "--mesh", "1x4", "--device", "cpu", "-o", tmp_path / "ones")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "replicas: no plan" in done.stdout and "chosen: T = 2" in done.stdout
    assert read_plan(tmp_path / "ones").training["pipeline"]["tensor"] == 2
    # --max-stages weighs each stage count with each T
    capped = [c if c != "--stages" else "--max-stages" for c in ones]
    done = run_cli(*capped, "--mesh", "1x4", "--device", "cpu", "-o", tmp_path / "capped")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 stages of 2 that shard: step" in done.stdout and "stages weighed" in done.stdout
    bad = run_cli(*common, "--mesh", "1x4", "--device", "cpu", "--tensor-parallel", "two", "-o", tmp_path / "bad")
    assert bad.returncode == 2 and "--tensor-parallel" in bad.stderr


def _model(nodes, inputs, outputs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in outputs])
    return helper.make_model(graph)


def test_an_input_gathered_for_two_phases_is_gathered_in_each_and_names_do_not_collide():
    """A weight's shard gathered whole (under the weight's own name) and read by the forward
    and the backward: the gather is made again in each, under names of its own; the shard
    takes the weight's name and the gathered tensor becomes ``w@whole``."""
    nodes = [helper.make_node("AllGather", ["w@S1"], ["w"], name="w/all_gather", domain=COLLECTIVE_DOMAIN),
             helper.make_node("Mul", ["x", "w"], ["y"], name="fwd"),
             helper.make_node("Mul", ["y", "w"], ["g"], name="bwd")]
    step_nodes = [helper.make_node("Mul", ["x", "w"], ["y"], name="fwd"),
                  helper.make_node("Mul", ["y", "w"], ["g"], name="bwd")]
    model = _model(nodes, ["w@S1", "x"], ["g"])
    _rename(model, {"w@S1": "w"})
    assert [list(n.input) for n in model.graph.node][0] == ["w"] and model.graph.node[0].output[0] == "w@whole"
    step = StepModel(_model(step_nodes, ["w", "x"], ["g"]), {})
    out, places, copies = _placed(list(model.graph.node), {"fwd": (0, "forward"), "bwd": (0, "backward")}, step)
    gathers = [n for n in out if n.op_type == "AllGather"]
    assert sorted(places[n.name] for n in gathers) == [(0, "backward"), (0, "forward")]
    assert len({n.output[0] for n in gathers}) == 2
    by_name = {n.name: n for n in out}
    assert by_name["fwd"].input[1] == copies[("w@whole", (0, "forward"))]
    assert by_name["bwd"].input[1] == copies[("w@whole", (0, "backward"))]
    # each gather right before the node that reads it (gathered when about to be used)
    order = [n.name for n in out]
    for reader in ("fwd", "bwd"):
        gather = next(n.name for n in gathers if n.output[0] == by_name[reader].input[1])
        assert order.index(gather) == order.index(reader) - 1


def test_a_sharded_part_lets_a_gathered_tensor_go_after_its_last_reader(tmp_path):
    """``ProgramRunner.run(release=True)``: what no later segment reads is dropped as the run
    goes, so the result holds the program's outputs (and nothing gathered on the way)."""
    from meshplan.runtime.program import ProgramRunner

    nodes = [helper.make_node("AllGather", ["w@S1"], ["w"], name="gather", domain=COLLECTIVE_DOMAIN,
                              axis=1, dim=0),
             helper.make_node("Mul", ["x", "w"], ["y"], name="use"),
             helper.make_node("AllReduce", ["y"], ["z"], name="sum", domain=COLLECTIVE_DOMAIN, axis=1),
             helper.make_node("Neg", ["z"], ["out"], name="neg")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("w@S1", TensorProto.FLOAT, [1]),
                                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])],
                              value_info=[helper.make_tensor_value_info(n, TensorProto.FLOAT, [2])
                                          for n in ("w", "y", "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(COLLECTIVE_DOMAIN, 1)], ir_version=8)
    onnx.save(model, str(tmp_path / "part.onnx"))
    runner = ProgramRunner(tmp_path / "part.onnx", ["CPUExecutionProvider"], 1)
    feeds = {"w@S1": np.array([2.0], np.float32), "x": np.array([1.0, 3.0], np.float32)}

    def collective(step, x, spare=False):    # one device's view of a [1, 2] mesh whose other device holds the same
        return np.concatenate([x, x]) if step.kind.name == "all_gather" else 2 * x

    kept = runner.run(dict(feeds), collective)
    released = runner.run(dict(feeds), collective, release=True)
    np.testing.assert_array_equal(released["out"], kept["out"])
    np.testing.assert_array_equal(released["out"], -2 * feeds["x"] * 2.0)
    assert {"w", "y"} <= set(kept) and not {"w", "y"} & set(released)
