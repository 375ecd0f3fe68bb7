"""Float32 master weights for float16 models (``plan --train --master-weights``, ``train
--loss-scale``): the step's structure, the loss scale keeping float16's small gradients, every
kind of plan equal to the whole step, checkpoints exported in the model's dtype, and the bad
input. (Torch's mixed-precision reference, ``gpt_fp16_master``, is compared in
test_training_vs_torch.py.)"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshplan.testing.train_reference import run_step_model, run_whole
from meshplan.training.master_weights import LOSS_SCALE, master_name
from meshplan.training.step_model import UPDATE, TrainSpec, build_step_model
from tests.conftest import run_cli, run_mpi

ADAMW = {"train.weight_decay": 0.0, "train.beta1": 0.9, "train.beta2": 0.999, "train.eps": 1e-8,
         "train.clip_norm": 0.0}


def _mlp(path, dtype=np.float16, shrink: float | None = None):
    """x [batch, 16] → MatMul, Add, Tanh, MatMul → y [batch, 4] in ``dtype`` (``shrink``: y
    multiplied by it, so that the loss's gradients are that much smaller)."""
    rng = np.random.default_rng(0)
    kind = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    weights = [numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.3).astype(dtype), "w1"),
               numpy_helper.from_array((rng.standard_normal(32) * 0.1).astype(dtype), "b1"),
               numpy_helper.from_array((rng.standard_normal((32, 4)) * 0.3).astype(dtype), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
             helper.make_node("Add", ["a", "b1"], ["ab"], name="add1"),
             helper.make_node("Tanh", ["ab"], ["h"], name="tanh"),
             helper.make_node("MatMul", ["h", "w2"], ["y" if shrink is None else "y0"], name="mm2")]
    if shrink is not None:
        weights.append(numpy_helper.from_array(np.array(shrink, dtype=dtype), "shrink"))
        nodes.append(helper.make_node("Mul", ["y0", "shrink"], ["y"], name="small"))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", kind, ["batch", 16])],
                              [helper.make_tensor_value_info("y", kind, ["batch", 4])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), str(path))
    return path


def _data(path, dtype=np.float16, scale: float = 1.0):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    t = (np.tanh(x @ (rng.standard_normal((16, 4)) / 4)) * scale).astype(np.float32)
    np.savez(path, x=x.astype(dtype), t=t)
    return path


def _batches(data, steps: int, batch: int = 8) -> list[dict]:
    with np.load(data) as found:
        arrays = {k: found[k] for k in found.files}
    return [{n: a[(k * batch + np.arange(batch)) % 32] for n, a in arrays.items()} for k in range(steps)]


def _weights(path, dtype=np.float32) -> dict:
    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t).astype(dtype) for t in model.graph.initializer if t.name != "shrink"}


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_the_step_holds_the_weights_in_float32(tmp_path, dtype):
    """Each float16 (or bfloat16) weight a float32 state input read through a Cast; its
    slots float32; its gradient divided by the loss scale; the scale an input of the step."""
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    step = build_step_model(_mlp(tmp_path / "mlp.onnx", dtype), TrainSpec("mse:y:t", "adamw", master_weights=True))
    weights = step.manifest["weights"]
    assert set(weights) == {"w1", "b1", "w2"}
    assert all(w["dtype"] == "float32" and w["model_dtype"] == np.dtype(dtype).name for w in weights.values())
    assert LOSS_SCALE in step.manifest["hyperparameters"]
    graph = step.model.graph
    inputs = {v.name: v.type.tensor_type.elem_type for v in graph.input}
    for name in ("w1", "b1", "w2", "w1.exp_avg", "w2.exp_avg_sq"):
        assert inputs[name] == TensorProto.FLOAT, name
    outputs = {v.name: v.type.tensor_type.elem_type for v in graph.output}
    assert outputs["w1.updated"] == TensorProto.FLOAT and outputs["w1.exp_avg.updated"] == TensorProto.FLOAT
    casts = {n.input[0]: n for n in graph.node if n.op_type == "Cast" and n.output[0] == master_name(n.input[0])}
    assert set(casts) == {"w1", "b1", "w2"}
    readers = [n for n in graph.node if "w1" in n.input and step.roles[n.name] != UPDATE]
    assert readers == [casts["w1"]]      # the forward and backward read the cast, the update the master
    for weight, grad in step.gradients.items():
        divide = next(n for n in graph.node if grad in n.output)
        assert divide.op_type == "Div" and divide.input[1] == LOSS_SCALE, weight
    onnx.checker.check_model(step.model)


def test_the_loss_scale_keeps_float16s_small_gradients(tmp_path):
    """A model whose loss's gradients are at float16's smallest (its output shrunk by 1e-3):
    unscaled, they lose their digits or flush to zero and the training drifts from the same
    model's in float32; with a loss scale of 2^16 it trains as that one does."""
    half = build_step_model(_mlp(tmp_path / "half.onnx", np.float16, 1e-3), TrainSpec("mse:y:t", "adamw",
                                                                                    master_weights=True))
    full = build_step_model(_mlp(tmp_path / "full.onnx", np.float32, 1e-3), TrainSpec("mse:y:t", "adamw"))
    batches = _batches(_data(tmp_path / "d.npz", np.float16, 1e-3), 6)
    start, lrs = _weights(tmp_path / "half.onnx"), [0.01] * 6
    full_batches = [{"x": b["x"].astype(np.float32), "t": b["t"]} for b in batches]
    want, want_state = run_step_model(full, start, full_batches, ADAMW, lrs)
    assert want[-1] < 0.5 * want[0]                                   # the float32 model learns
    drift = {}
    for scale in (1.0, 65536.0):
        got, state = run_step_model(half, start, batches, {**ADAMW, LOSS_SCALE: scale}, lrs)
        assert all(state[name].dtype == np.float32 for name in start)
        drift[scale] = max(float(np.abs(state[n] - want_state[n]).max()) for n in start)
        if scale > 1:
            np.testing.assert_allclose(got, want, rtol=2e-3)
    assert drift[65536.0] <= 1e-4 and drift[1.0] > 1e-3, drift


def test_a_power_of_two_scale_changes_nothing_else(tmp_path):
    """Where no gradient is near float16's limits, scaling the loss by 2^10 and the gradients
    back is exact: the same steps to the bit."""
    step = build_step_model(_mlp(tmp_path / "mlp.onnx"), TrainSpec("mse:y:t", "adamw", master_weights=True))
    batches, start = _batches(_data(tmp_path / "d.npz"), 4), _weights(tmp_path / "mlp.onnx")
    one = run_step_model(step, start, batches, {**ADAMW, LOSS_SCALE: 1.0}, [0.01] * 4)
    scaled = run_step_model(step, start, batches, {**ADAMW, LOSS_SCALE: 1024.0}, [0.01] * 4)
    assert one[0] == scaled[0]
    for name in start:
        np.testing.assert_array_equal(one[1][name], scaled[1][name])


@pytest.mark.mpi
def test_plans_train_as_the_whole_step_and_export_in_float16(tmp_path):
    """1x2 data parallel in process and a 2-stage pipeline of 2 microbatches under mpiexec
    train as the whole step does; the checkpoint's masters are float32 and `export` writes
    them back as float16, rounded to nearest."""
    model, data = _mlp(tmp_path / "mlp.onnx"), _data(tmp_path / "d.npz")
    common = ("--train", "--loss", "mse:y:t", "--optimizer", "adamw", "--master-weights", "--device", "cpu",
              "--dim", "batch=8")
    one, two, piped = tmp_path / "p1", tmp_path / "p2", tmp_path / "p3"
    for out, extra in ((one, ("--mesh", "1x1")), (two, ("--mesh", "1x2")),
                       (piped, ("--mesh", "1x2", "--stages", "2", "--microbatches", "2"))):
        done = run_cli("plan", model, *common, *extra, "-o", out)
        assert done.returncode == 0, done.stderr
    hyper = {"loss_scale": 1024.0}
    want, want_state = run_whole(one, data, 5, 0.01, hyper)
    got, state = run_whole(two, data, 5, 0.01, hyper, in_process=True)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for name in ("w1", "b1", "w2"):
        assert state[name].dtype == np.float32
        np.testing.assert_allclose(state[name], want_state[name], rtol=1e-5, atol=1e-6)
    done = run_mpi(2, "train", piped, "--data", data, "--steps", 5, "--lr", 0.01, "--loss-scale", 1024,
                   "--log", tmp_path / "log.json", "--checkpoint", tmp_path / "ck", "-q")
    assert done.returncode == 0, done.stderr
    losses = json.loads((tmp_path / "log.json").read_text())["losses"]
    # two microbatches' float16 backwards, summed in float32, against one of the whole batch
    np.testing.assert_allclose(losses, want, rtol=2e-3)
    done = run_cli("export", piped, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "out.onnx")
    assert done.returncode == 0, done.stderr
    exported = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "out.onnx")).graph.initializer}
    from meshplan.trainer.checkpoint import Checkpoint

    checkpoint = Checkpoint(tmp_path / "ck")
    for name in ("w1", "b1", "w2"):
        master = checkpoint.tensor(name)
        assert master.dtype == np.float32 and exported[name].dtype == np.float16
        np.testing.assert_array_equal(exported[name], master.astype(np.float16))
        np.testing.assert_allclose(master, want_state[name], atol=5e-3)


@pytest.mark.mpi
def test_bad_input(tmp_path):
    """One line and exit 1 (2 for usage): master weights of a float32 model, without --train;
    a loss scale for a plan without masters, or not positive."""
    full = _mlp(tmp_path / "full.onnx", np.float32)
    done = run_cli("plan", full, "--train", "--loss", "mse:y:t", "--master-weights", "--mesh", "1x1", "--device",
                   "cpu", "--dim", "batch=8", "-o", tmp_path / "p")
    assert done.returncode == 1 and "no trained weight is float16 or bfloat16" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "p").exists()
    done = run_cli("plan", full, "--master-weights", "--mesh", "1x1", "-o", tmp_path / "p")
    assert done.returncode == 2 and "--master-weights go with --train" in done.stderr
    done = run_cli("plan", full, "--train", "--loss", "mse:y:t", "--mesh", "1x1", "--device", "cpu", "--dim",
                   "batch=8", "-o", tmp_path / "plain")
    assert done.returncode == 0, done.stderr
    data = _data(tmp_path / "d.npz", np.float32)
    done = run_mpi(1, "train", tmp_path / "plain", "--data", data, "--steps", 1, "--loss-scale", 8)
    assert done.returncode == 1 and "the plan's step has no loss scale" in done.stderr
    assert "Traceback" not in done.stderr
    half = _mlp(tmp_path / "half.onnx")
    done = run_cli("plan", half, "--train", "--loss", "mse:y:t", "--master-weights", "--mesh", "1x1", "--device",
                   "cpu", "--dim", "batch=8", "-o", tmp_path / "m")
    assert done.returncode == 0, done.stderr
    done = run_mpi(1, "train", tmp_path / "m", "--data", _data(tmp_path / "h.npz"), "--steps", 1,
                   "--loss-scale", -1)
    assert done.returncode == 1 and "--loss-scale must be a positive number" in done.stderr
    for bad in (("--loss-scale", "dynamic:x"), ("--loss-scale", "dynamic", "--growth-factor", "0.5")):
        done = run_mpi(1, "train", tmp_path / "m", "--data", tmp_path / "h.npz", "--steps", 1, *bad)
        assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = run_cli("train", tmp_path / "m", "--data", tmp_path / "h.npz", "--steps", 1, "--loss-scale", "8",
                   "--growth-interval", "10")
    assert done.returncode == 2 and "--growth-interval goes with --loss-scale dynamic" in done.stderr


@pytest.mark.parametrize("how", ["pipeline", "megatron", "sharded stages"])
def test_the_float16_gpt_trains_as_torch_in_process(tmp_path, how):
    """Torch's mixed-precision reference (gpt_fp16_master: the GPT in float16, float32
    masters, a loss scale of 1024) against two stages of four microbatches, a 1x2 Megatron
    plan, and two stages of two devices that shard their operators Megatron's way, every
    rank in this process: each step's loss within 1e-3 of torch's, the final masters by the
    float16 rule (tests/training_cases.py)."""
    from meshplan.emit.pipeline_parts import read_pipeline
    from meshplan.plan_format import read_plan
    from meshplan.runtime.pipeline_inprocess import PipelineRunner
    from meshplan.training.master_weights import as_held
    from sample_models.training import load_case
    from tests.training_cases import assert_final_like_torch, train_in_process

    case = load_case("gpt_fp16_master")
    settings = case["settings"]
    extra = {"pipeline": ("--mesh", "1x2", "--stages", 2, "--microbatches", 4),
             "megatron": ("--mesh", "1x2", "--policy", "megatron"),
             "sharded stages": ("--mesh", "1x4", "--stages", 2, "--microbatches", 4, "--tensor-parallel", 2,
                                "--policy", "megatron")}[how]
    done = run_cli("plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer", "adamw",
                   "--master-weights", "--device", "cpu", "--dim", f"batch={settings['batch']}", *extra,
                   "-o", tmp_path / "plan")
    assert done.returncode == 0, done.stderr
    assert "held and updated in float32 (master weights)" in done.stdout
    plan = read_plan(tmp_path / "plan")
    initial = dict(as_held(plan.training["weights"], case["initial"].items()))
    if how != "megatron":
        pipeline = read_pipeline(tmp_path / "plan", plan.training)
        assert pipeline.tensor == (2 if how == "sharded stages" else 1)
        runner = PipelineRunner(pipeline, plan.microbatches, initial, plan.training["pipeline"]["schedule"])
        losses, state = train_in_process(case, runner), runner.state_values()
    else:
        data = tmp_path / "data.npz"
        np.savez(data, **case["data"])
        losses, state = run_whole(tmp_path / "plan", data, settings["steps"], settings["lr"],
                                  {"weight_decay": settings["weight_decay"], "beta1": settings["betas"][0],
                                   "beta2": settings["betas"][1], "eps": settings["eps"],
                                   "clip_norm": settings["clip_norm"], "loss_scale": settings["loss_scale"]},
                                  settings["schedule"], settings["warmup"], in_process=True)
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-3)
    assert_final_like_torch(case, plan.training["tied"], state)


def test_estimates_count_the_masters_float32_state(tmp_path):
    """A plan without programs weighs a float16 weight held as a float32 master as 16 bytes a
    parameter under AdamW (master, gradient, two slots), twice its own dtype's 4 copies."""
    from meshplan.inter.training_costs import TrainingCosting

    half = _mlp(tmp_path / "half.onnx")
    plain = TrainingCosting.of(build_step_model(half, TrainSpec("mse:y:t", "adamw")))
    masters = TrainingCosting.of(build_step_model(half, TrainSpec("mse:y:t", "adamw", master_weights=True)))
    assert (plain.widening, plain.held_per_weight) == (1, 4)
    assert (masters.widening, masters.held_per_weight) == (2, 8)
    assert masters.trained == plain.trained == {"w1", "b1", "w2"}
    done = run_cli("plan", half, "--train", "--loss", "mse:y:t", "--master-weights", "--mesh", "1x2", "--stages", 2,
                   "--device", "cpu", "--dim", "batch=8", "--no-programs", "-o", tmp_path / "estimate")
    assert done.returncode == 0, done.stderr
    assert "held 8x with gradients and optimizer slots, in float32 masters" in done.stdout


def test_the_loss_scale_follows_grad_scalers_rule():
    """Halved at an overflow (the step skipped), doubled after the growth interval's finite
    steps, kept as given where static; its state carried by a checkpoint."""
    from meshplan.errors import TrainError
    from meshplan.trainer.loss_scale import LossScale

    scale = LossScale.parse("dynamic:1024", growth_interval=2)
    seen = [(scale.after(norm), scale.scale) for norm in (np.inf, 1.0, np.nan, 1.0, 1.0, 1.0, 1.0)]
    assert seen == [(False, 512), (True, 512), (False, 256), (True, 256), (True, 512), (True, 512), (True, 1024)]
    again = LossScale.parse("dynamic", growth_interval=2)
    assert again.scale == 65536.0
    again.resume(scale.state())
    assert (again.scale, again.good_steps) == (1024, 0)
    static = LossScale.parse("8")
    assert [static.after(n) for n in (np.inf, 1.0)] == [False, True] and static.scale == 8 and static.given
    assert not LossScale.parse("1").given
    for bad in ("abc", "0", "-2", "dynamic:x", "inf"):
        with pytest.raises(TrainError):
            LossScale.parse(bad)
    with pytest.raises(TrainError):
        LossScale.parse("dynamic", growth_interval=0)


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["1x1", "pipeline"])
def test_a_dynamic_loss_scale_skips_and_scales_as_torchs_grad_scaler(tmp_path, how):
    """Torch's reference with GradScaler's rule (gpt_fp16_dynamic: from 2^22, which
    overflows, backed off to 2^19, grown again after three finite steps, and so on: steps 0,
    4 and 8 skipped): under mpiexec on 1x1 and on two pipeline stages, the same steps skipped
    at the same scales, each step's loss within 1e-3 of torch's, AdamW counting only the
    steps it took (the final masters by the float16 rule)."""
    from meshplan.plan_format import read_plan
    from meshplan.trainer.checkpoint import Checkpoint
    from sample_models.training import load_case
    from test_pipeline_plans import _train_options
    from tests.training_cases import assert_final_like_torch

    case = load_case("gpt_fp16_dynamic")
    settings = case["settings"]
    shape = ("--mesh", "1x1") if how == "1x1" else ("--mesh", "1x2", "--stages", 2, "--microbatches", 1)
    done = run_cli("plan", case["model_path"], "--train", "--loss", settings["loss"], "--optimizer", "adamw",
                   "--master-weights", "--device", "cpu", "--dim", f"batch={settings['batch']}", *shape,
                   "-o", tmp_path / "plan")
    assert done.returncode == 0, done.stderr
    data = tmp_path / "data.npz"
    np.savez(data, **case["data"])
    done = run_mpi(1 if how == "1x1" else 2, "train", tmp_path / "plan", "--data", data, "--steps", settings["steps"],
                   *_train_options(settings), "--total-steps", settings["steps"],
                   "--loss-scale", f"dynamic:{settings['init_scale']!r}", "--growth-interval",
                   settings["growth_interval"], "--growth-factor", settings["growth_factor"], "--backoff-factor",
                   settings["backoff_factor"], "--log", tmp_path / "log.json", "--checkpoint", tmp_path / "ck")
    assert done.returncode == 0, done.stderr
    assert "skipped (overflow)" in done.stdout
    assert f"{int(np.sum(case['skipped']))} of {settings['steps']} step(s) skipped" in done.stdout
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["skipped"] == [bool(s) for s in case["skipped"]]
    assert log["loss_scale"] == [float(s) for s in case["scales"]]
    assert all((norm is None) == skipped for norm, skipped in zip(log["grad_norm"], log["skipped"]))
    np.testing.assert_allclose(log["losses"], case["losses"], rtol=1e-3)
    checkpoint = Checkpoint(tmp_path / "ck")
    assert checkpoint.manifest["optimizer_steps"] == int(np.sum(~case["skipped"]))
    state = {name: checkpoint.tensor(name) for name in case["final"]}
    assert_final_like_torch(case, read_plan(tmp_path / "plan").training["tied"], state)


@pytest.mark.mpi
def test_a_sharded_plan_skips_the_steps_the_whole_step_skips(tmp_path):
    """A 1x2 plan whose update the ILP shards, under mpiexec with a dynamic scale that starts
    far too high: the same steps skipped, at the same scales, with the same losses, as on
    1x1; a skipped step leaves the weights as they were (its batch's loss comes back the
    same when the data wraps around)."""
    model, data = _mlp(tmp_path / "mlp.onnx"), _data(tmp_path / "d.npz")
    logs = {}
    for mesh, ranks in (("1x1", 1), ("1x2", 2)):
        out = tmp_path / mesh
        done = run_cli("plan", model, "--train", "--loss", "mse:y:t", "--optimizer", "adamw", "--master-weights",
                       "--mesh", mesh, "--device", "cpu", "--dim", "batch=8", "--policy", "megatron", "-o", out)
        assert done.returncode == 0, done.stderr
        done = run_mpi(ranks, "train", out, "--data", data, "--steps", 10, "--lr", 0.01, "--loss-scale",
                       "dynamic:1.6e7", "--growth-interval", 2, "--log", tmp_path / f"{mesh}.json", "-q")
        assert done.returncode == 0, done.stderr
        logs[mesh] = json.loads((tmp_path / f"{mesh}.json").read_text())
    one, two = logs["1x1"], logs["1x2"]
    assert one["skipped"][:4] == [True] * 4 and not all(one["skipped"])
    assert two["skipped"] == one["skipped"] and two["loss_scale"] == one["loss_scale"]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    for log in (one, two):      # four batches of 8 in 32 samples: step 4 is step 0's, nothing applied between
        assert log["losses"][4] == log["losses"][0]


@pytest.mark.parametrize("op", ["Gather0", "Gather1", "GatherElements", "GatherND"])
def test_float16_scatter_add_gradients_run_on_the_cpu_and_add_in_float32(op):
    """The gradients of Gather (an embedding's and another axis'), GatherElements and
    GatherND are scatter-adds, which onnxruntime's CPU provider has no float16 kernel for:
    the step adds them in float32 and casts back, so a float16 weight's gradient runs and is
    the float32 one's rounded to float16 (indices repeat, so addends meet)."""
    import onnxruntime as ort

    from meshplan.training.autodiff import gradients

    rng = np.random.default_rng(3)
    table = rng.standard_normal((6, 5)).astype(np.float32)
    if op == "Gather0":
        node, index = helper.make_node("Gather", ["w", "i"], ["y"], axis=0), np.array([[0, 2, 2], [5, 0, 2]])
    elif op == "Gather1":
        node, index = helper.make_node("Gather", ["w", "i"], ["y"], axis=1), np.array([1, 1, 4, 0])
    elif op == "GatherElements":
        node, index = helper.make_node("GatherElements", ["w", "i"], ["y"], axis=1), rng.integers(0, 5, (6, 7))
    else:
        node, index = helper.make_node("GatherND", ["w", "i"], ["y"]), np.array([[0, 1], [3, 4], [0, 1], [5, 0]])
    found = {}
    for dtype in (np.float32, np.float16):
        kind = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        nodes = [node, helper.make_node("Mul", ["y", "y"], ["sq"]),
                 helper.make_node("ReduceSum", ["sq"], ["total"], keepdims=0),
                 helper.make_node("Cast", ["total"], ["loss"], to=TensorProto.FLOAT)]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("w", kind, list(table.shape))],
                                  [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                                  [numpy_helper.from_array(index.astype(np.int64), "i")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
        model = onnx.shape_inference.infer_shapes(model)
        grads = gradients(model, "loss", ["w"])
        model.graph.node.extend(grads.nodes)
        model.graph.initializer.extend(grads.constants)
        model.graph.output.append(helper.make_tensor_value_info(grads.of["w"], kind, list(table.shape)))
        if dtype == np.float16:
            assert any(n.op_type.startswith("Scatter") for n in grads.nodes)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        found[dtype] = session.run([grads.of["w"]], {"w": table.astype(dtype)})[0]
    assert found[np.float16].dtype == np.float16 and np.abs(found[np.float32]).max() > 0
    want = found[np.float32]
    np.testing.assert_allclose(found[np.float16].astype(np.float32), want, rtol=4e-3, atol=4e-3 * np.abs(want).max())
