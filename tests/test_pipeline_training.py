"""Pipelined training equal to one device's and to torch's: the training step cut into stages
(``training.pipeline_step``), scheduled 1F1B or GPipe (``emit.train_schedule``) and run stage
by stage in one process (``runtime.pipeline_inprocess``), against the torch references of
sample_models/training and the whole step on onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from meshplan.emit.schedule import Instruction
from meshplan.emit.train_schedule import GPIPE, ONE_F_ONE_B, play, run_order, training_schedule
from meshplan.errors import PlanError, TrainError
from meshplan.runtime.pipeline_inprocess import PipelineRunner
from meshplan.testing.train_reference import even_stages, run_step_model
from meshplan.training.optimizers import DEFAULTS
from meshplan.training.pipeline_step import STATE, split_step
from meshplan.training.step_model import BACKWARD, FORWARD, TrainSpec, build_step_model
from sample_models.training import load_case
from tests.training_cases import assert_final_like_torch, batches, hyper


def _pipeline(name: str, stages: int, microbatches: int):
    case = load_case(name)
    settings = case["settings"]
    step = build_step_model(case["model_path"], TrainSpec(settings["loss"], settings["optimizer"],
                                                          microbatches=microbatches, stages=stages))
    return case, step, split_step(step, even_stages(step, case["model_path"], stages), stages)


def _train(case, runner: PipelineRunner) -> list[float]:
    settings = case["settings"]
    losses = []
    for k, batch in enumerate(batches(case)):
        controls = {**DEFAULTS, **hyper(settings), "train.lr": case["lrs"][k], "train.step": k + 1}
        losses.append(runner.step(batch, controls)["train.loss"])
    return losses


@pytest.mark.parametrize("name,stages,kind", [
    ("gpt_adamw", 2, ONE_F_ONE_B), ("gpt_adamw", 4, ONE_F_ONE_B), ("gpt_adamw", 4, GPIPE),
    ("gpt2_tied", 3, ONE_F_ONE_B), ("gpt2_tied", 2, GPIPE), ("mlp_sgd", 2, ONE_F_ONE_B),
    ("mlp_sgd_dynamo", 3, GPIPE), ("cnn_sgd", 2, ONE_F_ONE_B)])
def test_pipeline_trains_as_torch_and_one_device(name, stages, kind):
    """Four microbatches a step through two to four stages: each step's loss within 1e-3 of
    torch's and 1e-5 of the whole step's on one device, the final weights as torch's."""
    case, step, pipeline = _pipeline(name, stages, 4)
    assert len({stage for stage, _ in pipeline.parts}) == stages
    runner = PipelineRunner(pipeline, 4, case["initial"], kind)
    losses = _train(case, runner)
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-3)
    whole = build_step_model(case["model_path"], TrainSpec(case["settings"]["loss"], case["settings"]["optimizer"],
                                                           microbatches=4))
    one_device, _ = run_step_model(whole, case["initial"], batches(case), hyper(case["settings"]), list(case["lrs"]))
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)
    assert_final_like_torch(case, step.manifest["tied"], runner.state_values())


@pytest.mark.parametrize("name,stages,kind", [("gpt_adamw", 3, ONE_F_ONE_B), ("gpt2_tied", 2, GPIPE)])
def test_stages_keeping_their_tensors_on_the_device_train_the_same(name, stages, kind, monkeypatch):
    """Each stage's state and held tensors as OrtValues where its sessions compute (a GPU's
    path: ``StageRunner(device=...)``, here on OrtValues in host memory): the same losses and
    final weights, to the bit, as the stages on numpy arrays; only sends, the loss and the
    norm come to the host."""
    from meshplan.runtime import pipeline_stage

    case, step, pipeline = _pipeline(name, stages, 4)
    on_host = PipelineRunner(pipeline, 4, case["initial"], kind)
    expected = _train(case, on_host)
    copied = []
    host = pipeline_stage._host
    monkeypatch.setattr(pipeline_stage, "_host", lambda value: copied.append(type(value).__name__) or host(value))
    on_device = PipelineRunner(pipeline, 4, case["initial"], kind, device=("cpu", 0))
    assert all(type(v).__name__ == "OrtValue" for runner in on_device.stages for v in runner.state.values())
    losses = _train(case, on_device)
    assert losses == expected
    # per step: each send, the loss of each of the 4 microbatches' backward and the norm (no
    # state goes to the host and back)
    sends = sum(1 for listed in on_device.lists for ins in listed if ins.op == "send")
    assert copied.count("OrtValue") == len(losses) * (sends + 4 + 1)
    final, again = on_host.state_values(), on_device.state_values()
    assert sorted(final) == sorted(again) and all(np.array_equal(final[n], again[n]) for n in final)
    assert max(on_device.peak_kept) > 0 and on_device.peak_kept == on_host.peak_kept


@pytest.mark.parametrize("name,stages,kind", [("gpt_adamw", 2, ONE_F_ONE_B), ("gpt2_tied", 3, GPIPE)])
def test_recomputing_stages_train_the_same_and_keep_less(name, stages, kind, monkeypatch):
    """With recomputation each stage's backward computes its forward's activations again from
    the stage's inputs: the same steps as keeping them (losses within 1e-5, torch's within
    1e-3, the final weights as torch's), and the stages hold fewer bytes of microbatches in
    flight (what is held after each forward and backward run)."""
    from meshplan.runtime import pipeline_stage

    in_flight: dict[int, int] = {}
    run = pipeline_stage.StageRunner.run

    def measured(self, phase, mb, links=None):
        run(self, phase, mb, links)
        if phase in (FORWARD, BACKWARD):
            in_flight[self.stage] = max(in_flight.get(self.stage, 0), sum(v.nbytes for v in self.held.values()))

    monkeypatch.setattr(pipeline_stage.StageRunner, "run", measured)
    case, step, kept_pipeline = _pipeline(name, stages, 4)
    again_pipeline = split_step(step, even_stages(step, case["model_path"], stages), stages, recompute=True)
    assert set(again_pipeline.recomputed) == set(range(stages))
    for stage in range(stages):   # the forward hands on what it made only to other stages
        forward, backward = again_pipeline.parts[(stage, FORWARD)], again_pipeline.parts[(stage, BACKWARD)]
        assert not set(forward.outputs) & set(backward.inputs)
        assert set(forward.inputs) <= set(backward.inputs)
    kept = PipelineRunner(kept_pipeline, 4, case["initial"], kind)
    kept_losses = _train(case, kept)
    kept_bytes, in_flight = dict(in_flight), {}
    again = PipelineRunner(again_pipeline, 4, case["initial"], kind)
    again_losses = _train(case, again)
    np.testing.assert_allclose(again_losses, kept_losses, rtol=1e-5)
    np.testing.assert_allclose(again_losses, case["losses"], rtol=1e-3)
    assert_final_like_torch(case, step.manifest["tied"], again.state_values())
    # (the last stage runs each backward right after its forward: what it holds then is what it sends back)
    assert all(in_flight[s] <= kept_bytes[s] for s in range(stages)), (in_flight, kept_bytes)
    assert sum(in_flight.values()) < 0.8 * sum(kept_bytes.values()), (in_flight, kept_bytes)


def test_recomputing_a_training_mode_dropout_is_refused(tmp_path):
    """A Dropout in training mode whose mask the backward reads cannot run twice (a second
    mask would differ): split with recomputation, one error naming the node; without, the
    step splits."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {f"w{i}": (rng.standard_normal((8, 8)) * 0.3).astype(np.float32) for i in range(2)}
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["m0"], name="mm0"),
             helper.make_node("Dropout", ["m0", "ratio", "on"], ["d0", "mask0"], name="drop0", seed=1),
             helper.make_node("MatMul", ["d0", "w1"], ["m1"], name="mm1"),
             helper.make_node("Tanh", ["m1"], ["y"], name="tanh1")]
    constants = [numpy_helper.from_array(np.float32(0.1), "ratio"), numpy_helper.from_array(np.bool_(True), "on")]
    graph = helper.make_graph(nodes, "drop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()] + constants)
    path = tmp_path / "drop.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), str(path))
    step = build_step_model(path, TrainSpec("mse:y:t", "sgd", microbatches=2, stages=2))
    placed = {"mm0": 0, "drop0": 0, "mm1": 1, "tanh1": 1}
    split_step(step, placed, 2)
    with pytest.raises(TrainError, match="random numbers in its forward \\(Dropout node 'drop0'\\)"):
        split_step(build_step_model(path, TrainSpec("mse:y:t", "sgd", microbatches=2, stages=2)), placed, 2,
                   recompute=True)


def test_float16_model_trains_as_on_one_device(tmp_path):
    """A float16 model (its weights, activations and gradients in float16) in two stages,
    with SGD: each step's loss and the final weights as the whole step's within float16's
    rounding (a cut stops onnxruntime fusing across it, so an element may round once
    differently). AdamW without float32 master weights amplifies such a rounding where a
    gradient is near float16's smallest values: not compared here (docs/training.md)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {f"w{i}": (rng.standard_normal((16, 16)) * 0.3).astype(np.float16) for i in range(4)}
    nodes, x = [], "x"
    for i in range(4):
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Tanh", [f"m{i}"], [f"h{i}"], name=f"tanh{i}")]
        x = f"h{i}"
    graph = helper.make_graph(nodes, "mlp16", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 16])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT16, ["batch", 16])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    path = tmp_path / "mlp16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), str(path))
    step = build_step_model(path, TrainSpec(f"mse:{x}:t", "sgd", microbatches=4, stages=2))
    runner = PipelineRunner(split_step(step, even_stages(step, path, 2), 2), 4, weights)
    data = [{"x": rng.standard_normal((8, 16)).astype(np.float16), "t": rng.standard_normal((8, 16)).astype(np.float32)}
            for _ in range(5)]
    losses = [runner.step(b, {**DEFAULTS, "train.lr": 0.05, "train.step": k + 1})["train.loss"]
              for k, b in enumerate(data)]
    whole = build_step_model(path, TrainSpec(f"mse:{x}:t", "sgd", microbatches=4))
    expected, state = run_step_model(whole, weights, data, {"train.lr": 0.05})
    np.testing.assert_allclose(losses, expected, rtol=1e-3)
    found = runner.state_values()
    for name in weights:
        assert found[name].dtype == np.float16
        np.testing.assert_allclose(found[name].astype(np.float32), state[name].astype(np.float32), atol=1e-3)


def test_tied_embedding_spans_stages():
    """Hugging Face GPT-2's embedding, tied to its head: the table lives on the first stage,
    the last receives it each step and sends the head's gradient of it back, where the two
    gradients meet."""
    case, step, pipeline = _pipeline("gpt2_tied", 3, 4)
    (copy, tie), = step.manifest["tied"].items()
    table = tie["of"]
    assert pipeline.home[table] == 0
    assert any(c.tensor == table and c.made_in == STATE and c.src == 0 and c.dst == 2 for c in pipeline.crossings)
    tie_node = f"train.tie/{copy}"
    assert pipeline.placement[tie_node] == (2, FORWARD)
    back = [c for c in pipeline.crossings if c.made_in == BACKWARD and c.src == 2 and c.dst == 0]
    assert back, "the head's gradient of the table goes back to its stage"
    made = {o: n for n in step.model.graph.node for o in n.output}
    assert any(step.origin.get(made[c.tensor].name) == tie_node for c in back)


@pytest.mark.parametrize("kind", [ONE_F_ONE_B, GPIPE])
def test_in_flight_microbatches(kind):
    """Four stages, eight microbatches: under 1F1B stage i holds the activations of at most
    S − i microbatches, under GPipe all eight; measured on the runs, and fewer bytes kept."""
    case, _, pipeline = _pipeline("gpt_adamw", 4, 8)
    for stage in range(4):
        runs = run_order(stage, 4, 8, kind)
        depth = np.cumsum([1 if p == FORWARD else -1 if p == BACKWARD else 0 for p, _ in runs])
        assert int(depth.max()) == (4 - stage if kind == ONE_F_ONE_B else 8)
        assert [m for p, m in runs if p == BACKWARD] == list(range(8))
    runner = PipelineRunner(pipeline, 8, case["initial"], kind)
    _train({**case, "settings": {**case["settings"], "steps": 1}}, runner)
    expected = [4, 3, 2, 1] if kind == ONE_F_ONE_B else [8, 8, 8, 8]
    assert runner.peak_in_flight == expected


def test_one_f_one_b_keeps_less_than_gpipe():
    case, _, pipeline = _pipeline("gpt_adamw", 4, 8)
    kept = {}
    for kind in (ONE_F_ONE_B, GPIPE):
        runner = PipelineRunner(pipeline, 8, case["initial"], kind)
        _train({**case, "settings": {**case["settings"], "steps": 1}}, runner)
        kept[kind] = runner.peak_kept
    assert all(a < b for a, b in zip(kept[ONE_F_ONE_B], kept[GPIPE]))


def test_schedule_sends_before_receives_and_plays():
    _, _, pipeline = _pipeline("gpt_adamw", 3, 4)
    lists = training_schedule(pipeline, 4, ONE_F_ONE_B)
    done = play(lists)
    assert len(done) == sum(len(x) for x in lists)
    sends = {(i.crossing, i.mb) for x in lists for i in x if i.op == "send"}
    receives = [(i.crossing, i.mb) for x in lists for i in x if i.op == "receive"]
    assert sorted(receives) == sorted(sends) and len(set(receives)) == len(receives)
    runs = [(i.part, i.mb) for i in lists[0] if i.op == "run"]
    assert runs[-2:] == [("norm", 3), ("update", 3)]
    assert ("clip", 3) in [(i.part, i.mb) for i in lists[2] if i.op == "run"]


def test_replicas_sum_once_after_the_last_backward():
    """Stages of two data-parallel replicas: one ``reduce`` a stage, right after its last
    microbatch's backward and before it sends what the update reads; a list that sends a
    step's sum before summing it is refused."""
    from meshplan.emit.train_schedule import check_training_schedule, per_microbatch

    _, _, pipeline = _pipeline("gpt_adamw", 2, 4)
    lists = training_schedule(pipeline, 4, ONE_F_ONE_B, replicas=2)
    for items in lists:
        reduces = [i for i, item in enumerate(items) if item.op == "reduce"]
        assert len(reduces) == 1
        assert items[reduces[0] - 1] == Instruction("run", 3, part=BACKWARD)
    check_training_schedule(pipeline, lists, 4, ONE_F_ONE_B, replicas=2)
    last = lists[1]
    at = next(i for i, item in enumerate(last) if item.op == "send" and item.mb == 3
              and not per_microbatch(pipeline.crossings[item.crossing])
              and pipeline.crossings[item.crossing].made_in == BACKWARD)
    reduce = next(i for i, item in enumerate(last) if item.op == "reduce")
    last.insert(reduce, last.pop(at))
    with pytest.raises(PlanError, match="before its replicas' sum"):
        check_training_schedule(pipeline, lists, 4, ONE_F_ONE_B, replicas=2)


def test_deadlocked_schedule_is_refused():
    """A first stage that waits for a gradient before it sends the activation the later
    stages need to make it."""
    _, _, pipeline = _pipeline("gpt_adamw", 2, 4)
    lists = training_schedule(pipeline, 4, GPIPE)
    grad = next(i for i in lists[0] if i.op == "receive"
                and pipeline.crossings[i.crossing].made_in == BACKWARD)
    lists[0] = [grad] + [i for i in lists[0] if i != grad]
    with pytest.raises(PlanError, match="would deadlock"):
        play(lists)


def test_unknown_schedule_is_refused():
    with pytest.raises(PlanError, match="unknown pipeline schedule 'zigzag'"):
        run_order(0, 2, 4, "zigzag")


def test_bad_cuts_are_refused():
    case = load_case("mlp_sgd")
    settings = case["settings"]
    spec = TrainSpec(settings["loss"], settings["optimizer"], microbatches=2, stages=2)
    step = build_step_model(case["model_path"], spec)
    stages = even_stages(step, case["model_path"], 2)
    backwards = {name: 1 - s for name, s in stages.items()}
    with pytest.raises(TrainError, match="follow the forward graph's order"):
        split_step(build_step_model(case["model_path"], spec), backwards, 2)
    with pytest.raises(TrainError, match="two or more stages"):
        split_step(build_step_model(case["model_path"], spec), stages, 1)
    with pytest.raises(TrainError, match="stage 5 is not one of the 2"):
        split_step(build_step_model(case["model_path"], spec), {**stages, next(iter(stages)): 5}, 2)
    plain = build_step_model(case["model_path"], TrainSpec(settings["loss"], settings["optimizer"]))
    with pytest.raises(TrainError, match="accumulates its gradients"):
        split_step(plain, stages, 2)


def test_instruction_round_trips_with_a_crossing():
    ins = Instruction("send", 3, crossing=7)
    assert Instruction.from_dict(ins.to_dict()) == ins


def test_a_stage_that_fails_ends_the_step_with_its_error(monkeypatch):
    """The stages of one process run side by side, each in a thread: a stage whose backward
    fails ends the step with that failure, the stages waiting on it stopping instead of
    waiting for ever."""
    from meshplan.runtime import pipeline_stage

    case, _, pipeline = _pipeline("gpt_adamw", 3, 4)
    runner = PipelineRunner(pipeline, 4, case["initial"], ONE_F_ONE_B)
    run = pipeline_stage.StageRunner.run

    def failing(self, phase, mb, links=None):
        if self.stage == 1 and phase == BACKWARD and mb == 1:
            raise ValueError("stage 1 fails here")
        run(self, phase, mb, links)

    monkeypatch.setattr(pipeline_stage.StageRunner, "run", failing)
    with pytest.raises(ValueError, match="stage 1 fails here"):
        _train(case, runner)


def test_a_replica_that_fails_in_the_update_ends_the_step(monkeypatch):
    """Two replicas a stage updating in row blocks: replica 1 of stage 0 fails in its update,
    where its stage's other replica waits to gather the new weights from it; the step ends
    with that failure."""
    from meshplan.runtime import pipeline_stage
    from meshplan.training.sharded_update import update_shards

    case, _, pipeline = _pipeline("gpt_adamw", 2, 4)
    pipeline.sharded = update_shards(pipeline, 2)
    assert pipeline.sharded
    runner = PipelineRunner(pipeline, 4, case["initial"], ONE_F_ONE_B, replicas=2)
    run = pipeline_stage.StageRunner.run

    def failing(self, phase, mb, links=None):
        if self.stage == 0 and self.replica == 1 and phase == "update":
            raise ValueError("replica 1 fails here")
        run(self, phase, mb, links)

    monkeypatch.setattr(pipeline_stage.StageRunner, "run", failing)
    with pytest.raises(ValueError, match="replica 1 fails here"):
        _train(case, runner)


@pytest.mark.parametrize("kind", [ONE_F_ONE_B, GPIPE])
def test_the_played_step_is_alpas_time_at_equal_stages_and_waits_on_sends_and_the_norm(kind):
    """``timed_step`` plays the lists' runs against each other: at equal stages without sends
    or an update it takes Alpa's Σ t + (B − 1)·max t; a send's time and the norm's round trip
    to the last stage's clipping and back lengthen it as the runs' waits say."""
    from meshplan.emit.train_schedule import timed_step
    from meshplan.training.pipeline_step import CLIP, NORM, UPDATE_PHASE

    S, B, f, b = 3, 4, 1.0, 2.0
    took = {(s, p): t for s in range(S) for p, t in ((FORWARD, f), (BACKWARD, b))}
    rows, total = timed_step(S, B, kind, took, {})
    assert total == pytest.approx(S * (f + b) + (B - 1) * (f + b))
    for s, row in enumerate(rows):
        assert all(a[3] <= c[2] + 1e-12 for a, c in zip(row, row[1:]))     # one run at a time
    sent = {(s, p): 0.25 for s in range(S) for p in (FORWARD, BACKWARD)}
    _, slower = timed_step(S, B, kind, took, sent)
    assert slower > total + 2 * (S - 1) * 0.25 - 1e-12      # at least the first microbatch's way there and back
    tail = {**took, **{(s, NORM): 0.5 for s in range(S)}, (S - 1, CLIP): 0.1,
            **{(s, UPDATE_PHASE): 0.3 for s in range(S)}}
    rows, ended = timed_step(S, B, kind, tail, {}, scalar=0.05)
    last_backward = max(r[3] for row in rows for r in row if r[0] == BACKWARD)
    clip = next(r for r in rows[S - 1] if r[0] == CLIP)
    norms = [next(r for r in row if r[0] == NORM) for row in rows]
    assert clip[2] == pytest.approx(max(n[3] + (0.05 if s != S - 1 else 0.0) for s, n in enumerate(norms)))
    assert ended == pytest.approx(max(clip[3] + 0.05 + 0.3, last_backward + 0.5 + 0.3))


def _partial(part) -> str:
    return next(n for n in part.outputs if n.endswith(f"/stage{part.stage}"))


@pytest.mark.parametrize("name", ["gpt_adamw", "mlp_sgd"])
def test_an_update_run_group_by_group_trains_the_same(name):
    """A stage's update cut into groups of its outputs (``update_chunks``: each weight's new
    value with its slots', at most 8 groups of about equal bytes, every output once) and run
    group by group, computing the mean gradients again from the accumulated ones, trains
    exactly as the whole update run at once."""
    from meshplan.training.pipeline_step import UPDATE_CHUNKS, UPDATE_PHASE, update_chunks

    case, _, pipeline = _pipeline(name, 2, 4)
    weights = pipeline.step.manifest["weights"]
    for stage in range(2):
        part = pipeline.parts[(stage, UPDATE_PHASE)]
        groups = pipeline.chunks[stage]
        assert groups == update_chunks(part.model)
        flat = [n for group in groups for n in group]
        assert sorted(flat) == sorted(part.outputs) and len(flat) == len(set(flat))
        assert 1 < len(groups) <= UPDATE_CHUNKS
        for group in groups:
            for weight in (o[:-len(".updated")] for o in group if o[:-len(".updated")] in weights):
                assert {o for o in part.outputs if o.startswith(weight + ".")} <= set(group)
        # the update computes the mean gradients again from what the norm read: the norm
        # hands on its partial sum alone
        norm = pipeline.parts[(stage, "norm")]
        assert norm.outputs == [f"{_partial(norm)}"]
        assert set(part.inputs) >= {n for n in norm.inputs if n.startswith("train.update/Add")}
    grouped = _train(case, PipelineRunner(pipeline, 4, case["initial"], ONE_F_ONE_B))
    _, _, whole = _pipeline(name, 2, 4)
    whole.chunks = {}
    assert grouped == _train(case, PipelineRunner(whole, 4, case["initial"], ONE_F_ONE_B))
