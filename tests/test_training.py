"""Training: the step model's losses and optimizers against numpy, training plans on 1x2 and
2x2 under mpiexec against the whole step model on onnxruntime, checkpoints, resume, export,
and the one-line errors of bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import REPO, run_cli, run_mpi, run_mpi_script
from meshplan.errors import TrainError
from meshplan.plan_format import read_plan
from meshplan.testing.train_reference import run_step_model, run_whole
from meshplan.trainer.checkpoint import Checkpoint
from meshplan.training.step_model import TrainSpec, build_step_model, is_additive_mask

MLP = REPO / "sample_models" / "mlp.onnx"


# --- the step model alone, against numpy ---------------------------------------------------

def _linear_model(path: Path, rng) -> dict:
    """y = x·W + b (x: [batch, 4], W: [4, 3]): a model whose gradients numpy writes by hand."""
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), str(path))
    return {"W": w, "b": b}


def _run_steps(step, weights: dict, batches: list[dict], hyper: dict) -> tuple[list[float], dict]:
    session = ort.InferenceSession(step.model.SerializeToString(), providers=["CPUExecutionProvider"])
    state = {}
    for name, value in weights.items():
        state[name] = value
        for kind in step.manifest["slots"]:
            state[f"{name}.{kind}"] = np.zeros_like(value)
    outputs = [o.name for o in session.get_outputs()]
    losses = []
    for k, batch in enumerate(batches):
        feeds = {**batch, **state, **{h: np.asarray(hyper.get(h, k + 1), np.float32)
                                      for h in step.manifest["hyperparameters"]}}
        result = dict(zip(outputs, session.run(outputs, feeds)))
        losses.append(float(result["train.loss"]))
        state = {i: result[o] for o, i in step.state.items()}
    return losses, state


def _numpy_train(weights: dict, batches: list[dict], hyper: dict, optimizer: str) -> tuple[list[float], dict]:
    """MSE of x·W + b against t, with torch.optim's SGD or AdamW written out in float64."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    slots = {k: [np.zeros_like(v), np.zeros_like(v)] for k, v in w.items()}
    lr, wd = hyper["train.lr"], hyper["train.weight_decay"]
    losses = []
    for t, batch in enumerate(batches, start=1):
        x, target = batch["x"].astype(np.float64), batch["t"].astype(np.float64)
        diff = x @ w["W"] + w["b"] - target
        losses.append(float(np.mean(diff ** 2)))
        dy = 2 * diff / diff.size
        grads = {"W": x.T @ dy, "b": dy.sum(0)}
        norm = np.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
        clip = hyper["train.clip_norm"]
        if clip > 0:
            grads = {k: g * min(1.0, clip / (norm + 1e-6)) for k, g in grads.items()}
        for k, g in grads.items():
            if optimizer == "sgd":
                g = g + wd * w[k]
                slots[k][0] = hyper["train.momentum"] * slots[k][0] + g
                w[k] = w[k] - lr * slots[k][0]
            else:
                b1, b2, eps = hyper["train.beta1"], hyper["train.beta2"], hyper["train.eps"]
                w[k] = w[k] * (1 - lr * wd)
                slots[k][0] = b1 * slots[k][0] + (1 - b1) * g
                slots[k][1] = b2 * slots[k][1] + (1 - b2) * g * g
                denom = np.sqrt(slots[k][1]) / np.sqrt(1 - b2 ** t) + eps
                w[k] = w[k] - lr / (1 - b1 ** t) * slots[k][0] / denom
    return losses, w


@pytest.mark.parametrize("optimizer,hyper", [
    ("sgd", {"train.lr": 0.05, "train.momentum": 0.9, "train.weight_decay": 0.01, "train.clip_norm": 0.0}),
    ("sgd", {"train.lr": 0.05, "train.momentum": 0.0, "train.weight_decay": 0.0, "train.clip_norm": 0.5}),
    ("adamw", {"train.lr": 0.02, "train.weight_decay": 0.1, "train.clip_norm": 1.0, "train.beta1": 0.9,
               "train.beta2": 0.95, "train.eps": 1e-8}),
])
def test_optimizers_and_mse_equal_numpy(tmp_path, optimizer, hyper):
    rng = np.random.default_rng(3)
    weights = _linear_model(tmp_path / "linear.onnx", rng)
    step = build_step_model(tmp_path / "linear.onnx", TrainSpec("mse:y:t", optimizer))
    assert set(step.manifest["weights"]) == {"W", "b"}
    batches = [{"x": rng.standard_normal((5, 4)).astype(np.float32),
                "t": rng.standard_normal((5, 3)).astype(np.float32)} for _ in range(6)]
    losses, state = _run_steps(step, weights, batches, hyper)
    expected_losses, expected = _numpy_train(weights, batches, hyper, optimizer)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for name in ("W", "b"):
        np.testing.assert_allclose(state[name], expected[name], rtol=1e-4, atol=1e-5)


def test_cross_entropy_ignores_minus_100_as_torch(tmp_path):
    """The mean over the positions whose target is not -100, of −log softmax at the target."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 7)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["h", "W"], ["logits"])], "head",
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", "seq", 6])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 7])],
                              [numpy_helper.from_array(w, "W")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(tmp_path / "head.onnx"))
    step = build_step_model(tmp_path / "head.onnx", TrainSpec("cross_entropy:logits:labels", "sgd"))
    h = rng.standard_normal((2, 5, 6)).astype(np.float32)
    labels = rng.integers(0, 7, (2, 5))
    labels[0, 1] = labels[1, 4] = -100
    losses, _ = _run_steps(step, {"W": w}, [{"h": h, "labels": labels}],
                           {"train.lr": 0.0, "train.momentum": 0.0, "train.weight_decay": 0.0, "train.clip_norm": 0.0})
    logits = (h @ w).reshape(-1, 7).astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    flat = labels.reshape(-1)
    keep = flat != -100
    expected = -logp[np.arange(flat.size)[keep], flat[keep]].mean()
    assert losses[0] == pytest.approx(expected, rel=1e-5)


def test_frozen_weights_stay_initializers(tmp_path):
    step = build_step_model(MLP, TrainSpec("cross_entropy:logits:target", "sgd", frozen=("layer0.*",)))
    kept = {t.name for t in step.model.graph.initializer}
    assert any(n.startswith("layer0.") for n in kept)
    assert not any(n.startswith("layer0.") for n in step.manifest["weights"])
    assert step.manifest["weights"]


def test_a_finite_additive_mask_is_not_trained():
    """The gpt sample's causal mask (0 and -1e4, a buffer in torch) is a constant of the step,
    not a weight with a gradient and optimizer slots; a weight that merely holds zeros is trained."""
    step = build_step_model(REPO / "sample_models" / "gpt.onnx", TrainSpec("cross_entropy:logits:target", "sgd"))
    assert "const.causal_mask_64" not in step.manifest["weights"]
    assert "const.causal_mask_64" in {t.name for t in step.model.graph.initializer}
    assert is_additive_mask(np.triu(np.full((4, 4), -np.inf), 1))
    assert is_additive_mask(np.triu(np.full((4, 4), np.finfo(np.float32).min), 1))
    assert not is_additive_mask(np.zeros((4, 4)))
    assert not is_additive_mask(np.triu(np.full((4, 4), -0.5), 1))


@pytest.mark.parametrize("loss,frozen,match", [
    ("cross_entropy:nope:target", (), "names no output"),
    ("cross_entropy:logits", (), "expected cross_entropy"),
    ("logits", (), "not a scalar"),
    ("cross_entropy:logits:x", (), "already a tensor"),
    ("cross_entropy:logits:target", ("*",), "nothing to train"),
])
def test_bad_losses_and_nothing_to_train_are_one_error(loss, frozen, match):
    with pytest.raises(TrainError, match=match):
        build_step_model(MLP, TrainSpec(loss, "sgd", frozen))


def test_an_operator_without_a_rule_names_the_node(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("Det", ["a"], ["y"], name="the_det")],
        "det", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.eye(3, dtype=np.float32), "W")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), str(tmp_path / "det.onnx"))
    with pytest.raises(TrainError, match="no gradient rule for Det node 'the_det'"):
        build_step_model(tmp_path / "det.onnx", TrainSpec("y", "sgd"))


# --- training plans under mpiexec, against the whole step model ----------------------------

def _data(path: Path, count: int = 24, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.standard_normal((count, 64)).astype(np.float32), target=rng.integers(0, 10, count))
    return path


def _plan(tmp_path: Path, name: str, *options: str) -> Path:
    out = tmp_path / name
    done = run_cli("plan", MLP, "--train", "--loss", "cross_entropy:logits:target", "--device", "cpu",
                   "--dim", "batch=8", "-o", out, *options)
    assert done.returncode == 0, done.stderr
    return out


def _close_state(actual: dict, expected: dict, rtol: float, atol: float = 0.0) -> None:
    """Within ``rtol`` of each tensor's largest magnitude, but for at most 1% of its elements
    that are within ``atol`` (AdamW: an element whose gradient is at rounding level moves by
    up to lr a step whichever sign the rounding gives it; docs/numerics.md)."""
    for name, value in expected.items():
        scale = float(np.abs(value).max()) or 1.0
        off = np.abs(actual[name] - value)
        assert float(off.max()) <= rtol * scale + atol, name
        assert float(np.mean(off > rtol * scale)) <= 0.01, name


CASES = {
    "1x2-data-sgd": (["--mesh", "1x2", "--optimizer", "sgd", "--policy", "data"],
                     ["--lr", "0.05", "--momentum", "0.9", "--weight-decay", "1e-4"], 2),
    "1x2-megatron-adamw-2mb": (["--mesh", "1x2", "--optimizer", "adamw", "--policy", "megatron", "--microbatches", "2"],
                           ["--lr", "0.01", "--weight-decay", "0.1", "--clip-norm", "1", "--betas", "0.9,0.95",
                            "--schedule", "cosine", "--warmup", "2"], 2),
    "2x2-auto-sgd": (["--mesh", "2x2", "--optimizer", "sgd", "--all-devices"],
                     ["--lr", "0.05", "--momentum", "0.9"], 4),
    "1x4-data-adamw": (["--mesh", "1x4", "--optimizer", "adamw", "--policy", "data"],
                       ["--lr", "0.01", "--weight-decay", "0.1", "--clip-norm", "1"], 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_plans_equal_the_whole_step_model(tmp_path, case):
    plan_options, train_options, ranks = CASES[case]
    plan_dir = _plan(tmp_path, "plan", *plan_options)
    data = _data(tmp_path / "data.npz")
    steps = 5
    done = run_mpi(ranks, "train", plan_dir, "--data", data, "--steps", steps, "--checkpoint", tmp_path / "ck",
                   "--log", tmp_path / "log.json", "--trace", tmp_path / "trace.json", *train_options, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    log = json.loads((tmp_path / "log.json").read_text())
    # the last step's trace: each working rank's runs of its program, one a microbatch
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    microbatches = read_plan(plan_dir).microbatches
    for rank in {d for stage in read_plan(plan_dir).stages for d in stage.devices}:
        runs = sorted(e["args"]["microbatch"] for e in events if e["pid"] == rank and e["name"].startswith("stage"))
        assert runs == list(range(microbatches)), (rank, runs)
    given = dict(zip(train_options[::2], train_options[1::2]))
    hyper = {"momentum": float(given.get("--momentum", 0)), "weight_decay": float(given.get("--weight-decay", 0)),
             "clip_norm": float(given.get("--clip-norm", 0))}
    if "--betas" in given:
        hyper["beta1"], hyper["beta2"] = map(float, given["--betas"].split(","))
    losses, state = run_whole(plan_dir, data, steps, float(given["--lr"]), hyper, given.get("--schedule", "constant"),
                              int(given.get("--warmup", 0)))
    np.testing.assert_allclose(log["losses"], losses, rtol=1e-4)
    assert log["losses"][-1] < log["losses"][0]
    trained = dict(Checkpoint(tmp_path / "ck").tensors())
    adam = "adamw" in plan_options
    _close_state(trained, state, 1e-4, float(given["--lr"]) * steps if adam else 0.0)


IN_PROCESS = {
    "1x2-data-adamw": ["--mesh", "1x2", "--optimizer", "adamw", "--policy", "data"],
    "1x4-data-sgd": ["--mesh", "1x4", "--optimizer", "sgd", "--policy", "data"],
    "1x4-megatron-adamw": ["--mesh", "1x4", "--optimizer", "adamw", "--policy", "megatron"],
    "1x4-auto-adamw-2mb": ["--mesh", "1x4", "--optimizer", "adamw", "--microbatches", "2"],
    "2x2-data-adamw": ["--mesh", "2x2", "--optimizer", "adamw", "--policy", "data", "--all-devices"],
}


@pytest.mark.parametrize("case", list(IN_PROCESS))
def test_training_plans_in_process_equal_the_whole_step_model(tmp_path, case):
    """Every rank's program run in this process (the collectives in memory), step after
    step, against the whole step model."""
    plan_dir = _plan(tmp_path, "plan", *IN_PROCESS[case])
    data = _data(tmp_path / "data.npz")
    hyper = {"momentum": 0.9, "weight_decay": 0.1, "clip_norm": 1.0}
    lr = 0.01 if "adamw" in IN_PROCESS[case] else 0.05
    losses, state = run_whole(plan_dir, data, 4, lr, hyper, in_process=True)
    expected_losses, expected = run_whole(plan_dir, data, 4, lr, hyper)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
    _close_state(state, expected, 1e-4, lr * 4 if "adamw" in IN_PROCESS[case] else 0.0)


@pytest.mark.parametrize("mesh", ["1x2", "2x2"])
def test_data_policy_all_reduces_each_gradient_and_keeps_weights_whole(tmp_path, mesh):
    """``--policy data`` on a GPT's training step is DDP's plan: every weight and slot whole
    on every device, the batch split, and no collective but one all-reduce per trained
    weight's gradient and the loss's sum and count."""
    out = tmp_path / "plan"
    done = run_cli("plan", REPO / "sample_models" / "training" / "gpt_adamw.onnx", "--train", "--loss",
                   "cross_entropy:logits:target", "--optimizer", "adamw", "--mesh", mesh, "--all-devices",
                   "--device", "cpu", "--dim", "batch=8", "--policy", "data", "-o", out)
    assert done.returncode == 0, done.stderr
    plan = json.loads((out / "plan.json").read_text())
    weights = plan["training"]["weights"]
    assert plan["state"] and all(set(entry["spec"]) <= set("R()") for entry in plan["state"])
    found = []

    def walk(item):
        if isinstance(item, dict):
            if item.get("op") in ("AllGather", "AllReduce", "ReduceScatter", "AllToAll"):
                found.append((item["op"], item["tensor"]))
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)

    walk(plan)
    assert {op for op, _ in found} == {"AllReduce"}
    assert len({tensor for _, tensor in found}) == len(weights) + 2   # a 2-D mesh's all-reduce: one per axis
    assert {"train.loss/total", "train.loss/count"} <= {tensor for _, tensor in found}


@pytest.mark.parametrize("mesh,policy", [("1x1", "auto"), ("1x2", "data"), ("1x2", "megatron")])
def test_memory_estimate_holds_the_state_once_and_the_step_peak(tmp_path, mesh, policy):
    """The estimate by liveness over the step: each trained weight and slot once at its
    local size (the new value is written into the old one's buffer: ``model.in_place``),
    the process's own bytes, and what the step's tensors add at its peak (the gradients at
    least); the stage's memory is their sum."""
    from meshplan.inter.step_memory import PROCESS_BYTES
    from meshplan.sharding import LogicalMesh, ShardingSpec

    out = _plan(tmp_path, "plan", "--mesh", mesh, "--optimizer", "adamw", "--policy", policy)
    plan = json.loads((out / "plan.json").read_text())
    memory, stage = plan["training"]["memory"], plan["stages"][0]
    logical = LogicalMesh(tuple(stage["logical_mesh"]), tuple(stage["devices"]))
    held = {"weights": 0, "optimizer": 0}
    for entry in plan["state"]:
        name = entry["input"]
        base = name if name in plan["training"]["weights"] else name.rsplit(".", 1)[0]
        info = plan["training"]["weights"][base]
        local = ShardingSpec.parse(entry["spec"]).local_shape(tuple(info["shape"]), logical)
        held["weights" if name == base else "optimizer"] += int(np.prod(local)) * np.dtype(info["dtype"]).itemsize
    # the old values are held all step, and the new ones take their buffers
    # (weights: the trained ones and the step's few constants)
    assert memory["optimizer"] == held["optimizer"]
    assert held["weights"] <= memory["weights"] < 1.01 * held["weights"]
    assert memory["gradients"] > 0
    step_peak = sum(memory.values()) - memory["process"]
    assert step_peak > held["weights"] + held["optimizer"]
    assert memory["process"] == PROCESS_BYTES and memory["activations"] > 0
    assert stage["memory_bytes"] == pytest.approx(sum(memory.values()))
    report = (out / "report.txt").read_text()
    assert "process 100.0 MiB" in report


def test_frozen_weights_in_external_data_stay_external_in_the_step_model(tmp_path):
    """A model whose weights lie in an external data file: the frozen ones are copied, byte
    for byte, into the step model's own data file (range by range, not loaded), and the
    plan trains as its whole step model does."""
    source = onnx.load(str(MLP))
    onnx.save(source, str(tmp_path / "mlp.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="mlp.onnx.data", size_threshold=0)
    out = tmp_path / "plan"
    done = run_cli("plan", tmp_path / "mlp.onnx", "--train", "--loss", "cross_entropy:logits:target", "--device",
                   "cpu", "--dim", "batch=8", "--mesh", "1x2", "--optimizer", "sgd", "--frozen", "layer0.*",
                   "--frozen", "layer1.weight", "-o", out)
    assert done.returncode == 0, done.stderr
    step = onnx.load(str(out / "training" / "step.onnx"), load_external_data=False)
    kept = {t.name: t for t in step.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert set(kept) == {"layer0.weight", "layer0.bias", "layer1.weight"}
    assert all(e.value == "step.onnx.data" for t in kept.values() for e in t.external_data if e.key == "location")
    step = onnx.load(str(out / "training" / "step.onnx"))
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(MLP)).graph.initializer}
    for tensor in step.graph.initializer:
        if tensor.name in kept:
            assert np.array_equal(numpy_helper.to_array(tensor), original[tensor.name])
    data = _data(tmp_path / "data.npz")
    losses, state = run_whole(out, data, 3, 0.05, {"momentum": 0.9}, in_process=True)
    expected_losses, expected = run_whole(out, data, 3, 0.05, {"momentum": 0.9})
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
    assert "layer0.weight" not in state and "layer2.weight" in state


def test_export_writes_large_tensors_to_one_data_file(tmp_path, monkeypatch):
    """Export streams: trained weights from the checkpoint, the others' external data copied
    by range, each tensor at or above the threshold into OUTPUT.data (the threshold lowered
    here so that the MLP's tensors cross it)."""
    import meshplan.trainer.export as export

    source = onnx.load(str(MLP))
    onnx.save(source, str(tmp_path / "mlp.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="mlp.onnx.data", size_threshold=0)
    out = tmp_path / "plan"
    done = run_cli("plan", tmp_path / "mlp.onnx", "--train", "--loss", "cross_entropy:logits:target", "--device",
                   "cpu", "--dim", "batch=8", "--mesh", "1x2", "--optimizer", "sgd", "--frozen", "layer5.*", "-o", out)
    assert done.returncode == 0, done.stderr
    data = _data(tmp_path / "data.npz")
    done = run_mpi(2, "train", out, "--data", data, "--steps", 2, "--lr", "0.05", "--checkpoint", tmp_path / "ck", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    monkeypatch.setattr(export, "EXTERNAL_BYTES", 2048)
    (tmp_path / "out").mkdir()
    export.export_trained(out, tmp_path / "ck", tmp_path / "out" / "trained.onnx")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["trained.onnx", "trained.onnx.data"]
    header = onnx.load(str(tmp_path / "out" / "trained.onnx"), load_external_data=False)
    external = {t.name for t in header.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert "layer0.weight" in external and "layer0.bias" not in external   # 64 KiB out, 1 KiB inline
    trained = dict(Checkpoint(tmp_path / "ck").tensors())
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(MLP)).graph.initializer}
    for tensor in onnx.load(str(tmp_path / "out" / "trained.onnx")).graph.initializer:
        expected = trained.get(tensor.name, original[tensor.name])
        assert np.array_equal(numpy_helper.to_array(tensor), expected), tensor.name
    assert not np.array_equal(trained["layer0.weight"], original["layer0.weight"])
    x = np.load(data)["x"][:8]
    ort.InferenceSession(str(tmp_path / "out" / "trained.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_a_profile_of_the_training_step_costs_every_operator_of_its_plan(tmp_path):
    """``profile --train`` times the step's own operators (forward, backward, update): a
    plan with the same training options takes every cost from it; another optimizer's plan
    refuses it in one line; a forward profile is still taken (backward analytic)."""
    common = ["--mesh", "1x1", "--device", "cpu", "--dim", "batch=8", "--budget-ms", "0.2", "--cache",
              tmp_path / "cache.sqlite"]
    train = ["--train", "--loss", "cross_entropy:logits:target", "--optimizer", "sgd"]
    done = run_cli("profile", MLP, *train, *common, "-o", tmp_path / "step.json")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "step.json").read_text())["model"]["training"]["optimizer"] == "sgd"
    done = run_cli("plan", MLP, *train, "--mesh", "1x1", "--device", "cpu", "--dim", "batch=8", "--profile",
                   tmp_path / "step.json", "-o", tmp_path / "plan")
    assert done.returncode == 0, done.stderr
    measured, analytic = map(int, re.search(r"costs: (\d+) operator\(s\) measured, (\d+) from the analytic",
                                            done.stdout).groups())
    assert measured > 0 and analytic == 0
    done = run_cli("plan", MLP, *train[:-1], "adamw", "--mesh", "1x1", "--device", "cpu", "--dim", "batch=8",
                   "--profile", tmp_path / "step.json", "-o", tmp_path / "other")
    assert done.returncode == 1 and "measured for another training step" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "other").exists()
    done = run_cli("profile", MLP, *common, "-o", tmp_path / "forward.json")
    assert done.returncode == 0, done.stderr
    done = run_cli("plan", MLP, *train, "--mesh", "1x1", "--device", "cpu", "--dim", "batch=8", "--profile",
                   tmp_path / "forward.json", "-o", tmp_path / "forward-plan")
    assert done.returncode == 0, done.stderr
    measured, analytic = map(int, re.search(r"costs: (\d+) operator\(s\) measured, (\d+) from the analytic",
                                            done.stdout).groups())
    assert measured > 0 and analytic > 0
    # a pipelined plan's estimate says which costs it took, as any plan's
    done = run_cli("profile", MLP, *train, *common[2:], "--mesh", "1x2", "-o", tmp_path / "step2.json")
    assert done.returncode == 0, done.stderr
    done = run_cli("plan", MLP, *train, "--mesh", "1x2", "--device", "cpu", "--dim", "batch=8", "--stages", "2",
                   "--profile", tmp_path / "step2.json", "-o", tmp_path / "piped")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "piped" / "plan.json").read_text())["estimate"]["cost_model"] == "profiled"
    assert "(profiled costs)" in done.stdout


def test_resume_continues_bitwise_on_its_plan_and_on_another_and_export_runs(tmp_path):
    """12 steps = 6 + resume 6 with each rank reading its own pieces (bitwise, same plan);
    another plan of the model resumes from the same checkpoint, each tensor put together."""
    split = _plan(tmp_path, "split", "--mesh", "1x2", "--optimizer", "adamw", "--policy", "megatron")
    whole_plan = _plan(tmp_path, "whole", "--mesh", "1x1", "--optimizer", "adamw")
    data = _data(tmp_path / "data.npz", count=20)
    common = ["--data", data, "--lr", "0.01", "--shuffle", "--seed", "7", "--schedule", "cosine", "--total-steps", "6",
              "-q"]
    runs = [(split, 6, "a", None), (split, 3, "b", None), (split, 3, "b", "b")]
    for plan_dir, steps, out, resume in runs:
        done = run_mpi(2, "train", plan_dir, "--steps", steps, "--checkpoint", tmp_path / out, *common,
                       *(["--resume", tmp_path / resume] if resume else []))
        assert done.returncode == 0, done.stdout + done.stderr
    a, b = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    assert a.step == b.step == 6 and sorted((a.path).glob("rank*.npz")) and len(list(a.path.glob("rank*.npz"))) == 2
    for (name, x), (other, y) in zip(a.tensors(), b.tensors()):
        assert name == other and np.array_equal(x, y), name
    logs = {}
    for plan_dir, ranks in ((split, 2), (whole_plan, 1)):
        log = tmp_path / f"{plan_dir.name}.json"
        done = run_mpi(ranks, "train", plan_dir, "--steps", 1, "--resume", tmp_path / "a", "--log", log, *common)
        assert done.returncode == 0, done.stdout + done.stderr
        logs[plan_dir.name] = json.loads(log.read_text())
    assert logs["whole"]["first_step"] == 6
    assert logs["whole"]["losses"][0] == pytest.approx(logs["split"]["losses"][0], rel=1e-4)
    done = run_cli("export", split, "--checkpoint", tmp_path / "a", "-o", tmp_path / "trained.onnx")
    assert done.returncode == 0, done.stderr
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "trained.onnx")).graph.initializer}
    for name, value in a.tensors():
        if name in trained:
            assert np.array_equal(trained[name], value)
    x = np.load(data)["x"][:8]
    ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_job_train_step_from_a_users_loop(tmp_path):
    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x2", "--optimizer", "adamw")
    data = _data(tmp_path / "data.npz")
    hyper = {"weight_decay": 0.05, "clip_norm": 0.5}
    losses, _ = run_whole(plan_dir, data, 3, 0.01, hyper)
    (tmp_path / "expected.json").write_text(json.dumps({"lr": 0.01, "hyper": hyper, "losses": losses}))
    assert run_mpi_script("train_step_case.py", 2, args=(plan_dir, data, tmp_path / "expected.json"))


@pytest.mark.parametrize("mesh, policy, microbatches", [("1x1", "auto", "1"), ("1x2", "data", "1"),
                                                       ("1x2", "megatron", "2")])
def test_a_training_job_keeps_its_state_on_the_device(tmp_path, mesh, policy, microbatches):
    """The path a CUDA job takes (``on_device``; here on host OrtValues): the new weights and
    optimizer state stay device tensors from step to step, written where the old ones lie
    (``model.in_place``), a gradient kept on the device reaches its all-reduce (with 2
    microbatches, a call before the last runs only what accumulates: ``runtime.accumulating``),
    and every loss equals the host path's."""
    plan_dir = _plan(tmp_path, "plan", "--mesh", mesh, "--policy", policy, "--optimizer", "adamw",
                     "--microbatches", microbatches)
    data = _data(tmp_path / "data.npz")
    hyper = {"weight_decay": 0.05}
    losses, _ = run_whole(plan_dir, data, 3, 0.01, hyper)
    (tmp_path / "expected.json").write_text(json.dumps({"lr": 0.01, "hyper": hyper, "losses": losses}))
    if mesh != "1x1":
        assert run_mpi_script("train_step_case.py", 2, args=(plan_dir, data, tmp_path / "expected.json", "device"))
        return
    from meshplan.runtime.buffers import DeviceTensor
    from meshplan.runtime.job import Job
    from meshplan.trainer.data import Batches

    job = Job(plan_dir, provider="cpu", on_device=True)
    batches = Batches(data, job.plan)
    found, addresses = [], []
    for _ in losses:
        found.append(job.train_step(batches.next(), 0.01, **hyper))
        assert all(isinstance(v, DeviceTensor) for v in job.state.values())
        addresses.append({n: v.address for n, v in job.state.items()})
    job.close()
    np.testing.assert_allclose(found, losses, rtol=1e-5)
    assert addresses[1] == addresses[2]   # each state written into its own buffer


def test_a_training_jobs_sessions_run_without_the_memory_pattern(tmp_path):
    """A training step's sessions run without onnxruntime's memory pattern and constant
    folding (each held memory the step's own tensors do not need: docs/training.md); an
    inference job's keep both."""
    from meshplan.runtime.job import Job

    training = Job(_plan(tmp_path, "plan", "--mesh", "1x1"), provider="cpu")
    inference = run_cli("plan", MLP, "--mesh", "1x1", "--device", "cpu", "--dim", "batch=8", "-o", tmp_path / "run")
    assert inference.returncode == 0, inference.stderr
    running = Job(tmp_path / "run", provider="cpu")
    for job, pattern in ((training, False), (running, True)):
        sessions = [s.session.session for s in job.session.segments if s.session is not None]
        assert sessions and all(s.get_session_options().enable_mem_pattern is pattern for s in sessions)


# --- bad input: one line, exit 1 ------------------------------------------------------------

def test_bad_training_input_is_one_line(tmp_path):
    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x1", "--optimizer", "sgd")
    rng = np.random.default_rng(0)
    cases = {
        "missing": ({"x": rng.standard_normal((16, 64)).astype(np.float32)}, "has no array 'target'"),
        "dtype": ({"x": rng.standard_normal((16, 64)), "target": rng.integers(0, 10, 16)}, "is float64"),
        "shape": ({"x": rng.standard_normal((16, 32)).astype(np.float32), "target": rng.integers(0, 10, 16)},
                  "samples of shape"),
        "few": ({"x": rng.standard_normal((4, 64)).astype(np.float32), "target": rng.integers(0, 10, 4)},
                "fewer than a batch"),
    }
    for name, (arrays, message) in cases.items():
        np.savez(tmp_path / f"{name}.npz", **arrays)
        done = run_mpi(1, "train", plan_dir, "--data", tmp_path / f"{name}.npz", "--steps", 1, timeout=120)
        assert done.returncode == 1, (name, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("meshplan: error:") and message in lines[0], (name, done.stderr)
    inference = tmp_path / "inference"
    assert run_cli("plan", MLP, "--mesh", "1x1", "--device", "cpu", "--dim", "batch=8", "-o", inference).returncode == 0
    done = run_mpi(1, "train", inference, "--data", _data(tmp_path / "d.npz"), "--steps", 1, timeout=120)
    assert done.returncode == 1 and "not a training plan" in done.stderr
    done = run_cli("plan", MLP, "--train", "--loss", "cross_entropy:logits:target", "--mesh", "1x1", "--device", "cpu",
                   "--dim", "batch=8", "--microbatches", "3", "-o", tmp_path / "mb")
    assert done.returncode == 1 and done.stderr.startswith("meshplan: error:") and "does not divide" in done.stderr
    assert not (tmp_path / "mb").exists()
    done = run_cli("plan", MLP, "--loss", "mse:logits:t", "--mesh", "1x1", "-o", tmp_path / "x")
    assert done.returncode != 0 and "go with --train" in done.stderr
    data = _data(tmp_path / "good.npz")
    done = run_mpi(1, "train", plan_dir, "--data", data, "--steps", 1, "--checkpoint", tmp_path / "ck", timeout=120)
    assert done.returncode == 0, done.stderr
    other = _plan(tmp_path, "other", "--mesh", "1x1", "--optimizer", "sgd", "--frozen", "layer0.*")
    done = run_mpi(1, "train", other, "--data", data, "--steps", 1, "--resume", tmp_path / "ck", timeout=120)
    assert done.returncode == 1 and "checkpoint of another model or optimizer" in done.stderr, done.stderr
    done = run_cli("export", other, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "other.onnx")
    assert done.returncode == 1 and "another model" in done.stderr and not (tmp_path / "other.onnx").exists()


def test_batch_normalization_in_training_mode_keeps_running_statistics_as_state(tmp_path):
    """Normalised by the batch's statistics; the running mean and variance are state, updated
    as ONNX says (momentum·old + (1 − momentum)·the batch's mean), and not trained."""
    rng = np.random.default_rng(0)
    c = 3
    inits = {"scale": rng.standard_normal(c).astype(np.float32), "bias": rng.standard_normal(c).astype(np.float32),
             "mean": np.zeros(c, np.float32), "var": np.ones(c, np.float32)}
    graph = helper.make_graph(
        [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "rm", "rv"],
                          training_mode=1, momentum=0.9)],
        "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", c, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", c, 4, 4])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8),
              str(tmp_path / "bn.onnx"))
    step = build_step_model(tmp_path / "bn.onnx", TrainSpec("mse:y:t", "sgd"))
    assert set(step.manifest["weights"]) == {"scale", "bias"}
    assert set(step.manifest["statistics"]) == {"mean", "var"}
    x = rng.standard_normal((6, c, 4, 4)).astype(np.float32) * 2 + 1
    batch = {"x": x, "t": rng.standard_normal((6, c, 4, 4)).astype(np.float32)}
    _, state = run_step_model(step, inits, [batch], {"train.lr": 0.1})
    mean = x.mean(axis=(0, 2, 3))
    np.testing.assert_allclose(state["mean"], 0.9 * inits["mean"] + 0.1 * mean, rtol=1e-5, atol=1e-6)
    assert not np.allclose(state["scale"], inits["scale"])


def test_a_rank_that_dies_mid_step_ends_the_job_and_leaves_the_last_checkpoint(tmp_path):
    """Rank 1 of a data-parallel job killed inside its third step (a checkpoint after every
    step): the job ends, no process of it is left, the checkpoint folder holds steps 1 and
    2 whole, and the job resumed from it takes the uninterrupted job's third step."""
    from tests.jobs import run_marked

    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x2", "--optimizer", "adamw", "--policy", "data")
    common = ["--data", _data(tmp_path / "data.npz"), "--lr", "0.01", "-q"]
    ended = run_marked(2, "train", plan_dir, "--steps", 5, "--checkpoint", tmp_path / "ck", "--checkpoint-every", 1,
                       *common, failure="rank-1-dies-at-3", timeout=120)
    assert ended.returncode not in (None, 0) and not ended.left, ended.stderr
    assert Checkpoint(tmp_path / "ck").step == 2
    resumed = run_mpi(2, "train", plan_dir, "--steps", 1, "--resume", tmp_path / "ck", "--log", tmp_path / "r.json",
                      *common, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    whole = run_mpi(2, "train", plan_dir, "--steps", 3, "--log", tmp_path / "w.json", *common, timeout=300)
    assert whole.returncode == 0, whole.stderr
    third = json.loads((tmp_path / "w.json").read_text())["losses"][2]
    assert json.loads((tmp_path / "r.json").read_text())["losses"] == [third]
