"""A training step's calls before its last microbatch (``runtime.accumulating``): the program
pruned to what accumulates computes the same accumulated gradients and loss sums, to the bit,
without the update, the norm or the masks that hand the weights and slots back unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from meshplan.model.inputs import random_inputs
from meshplan.plan_format import read_plan
from meshplan.runtime.program import ProgramRunner
from meshplan.runtime.state_layout import state_updates
from meshplan.training.optimizers import APPLY, GRAD_NORM, idle_outputs

from test_training import _plan


def _feeds(model: onnx.ModelProto, apply: float) -> dict[str, np.ndarray]:
    """Every input of ``model`` (``random_inputs``), its floats moved into [0.25, 0.75) (AdamW's
    slots and hyperparameters where they make sense), ``APPLY`` as given."""
    found = {n: np.asarray(np.abs(v) % 0.5 + 0.25, v.dtype) if v.dtype.kind == "f" else v
             for n, v in random_inputs(model, {}, int_high=10).items()}
    found[APPLY] = np.asarray(apply, found[APPLY].dtype)
    return found


def test_a_call_before_the_last_microbatch_runs_only_what_accumulates(tmp_path):
    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x1", "--optimizer", "adamw", "--microbatches", "2")
    updates = state_updates(read_plan(plan_dir))
    program = onnx.load(str(plan_dir / "rank0.onnx"), load_external_data=False)
    runner = ProgramRunner(plan_dir / "rank0.onnx", ["CPUExecutionProvider"], updates=updates)
    accumulators = {o for o in updates if ".grad_acc." in o or o.startswith("train.acc.")}
    # every weight and slot is handed back unchanged when APPLY is 0; the accumulators are not
    assert runner.idle == idle_outputs(program.graph, updates)
    assert set(runner.idle) == set(updates) - accumulators and accumulators
    wanted = (set(updates) - set(runner.idle)) | {"train.loss"}
    pruned = runner.pruned(wanted)
    assert runner.pruned(set(wanted)) is pruned        # made once for a set of outputs
    assert pruned.graph_outputs == wanted and GRAD_NORM not in pruned.graph_outputs
    pruned_nodes = onnx.load_from_string(pruned.segments[0].source).graph.node
    assert len(pruned_nodes) < 0.8 * len(program.graph.node)
    assert not any(n.op_type == "Sqrt" for n in pruned_nodes)      # no norm, no AdamW denominator
    feeds = _feeds(program, apply=0.0)
    whole = runner.run(dict(feeds), None)
    alone = pruned.run(dict(feeds), None)
    for name in wanted:
        assert np.array_equal(alone[name], whole[name]), name
    for output, state in runner.idle.items():   # what the job keeps as it is
        assert np.array_equal(whole[output], feeds[state]), output


def test_the_last_call_runs_without_the_masks_and_writes_the_state_in_place(tmp_path):
    """The step's last call (APPLY 1) on the program without its masks: the same outputs, to
    the bit, every weight and slot now written into its old buffer."""
    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x1", "--optimizer", "adamw", "--microbatches", "2")
    updates = state_updates(read_plan(plan_dir))
    program = onnx.load(str(plan_dir / "rank0.onnx"), load_external_data=False)
    runner = ProgramRunner(plan_dir / "rank0.onnx", ["CPUExecutionProvider"], updates=updates)
    applying = runner.applying()
    assert runner.applying() is applying
    assert set(applying.segments[0].in_place) == set(updates)                 # weights and slots too now
    assert set(runner.segments[0].in_place) == set(updates) - set(runner.idle)   # (the accumulators only)
    assert not any(n.op_type == "Where" and n.output[0] in runner.idle
                   for n in onnx.load_from_string(applying.segments[0].source).graph.node)
    feeds = _feeds(program, apply=1.0)
    whole = runner.run(dict(feeds), None)
    alone = applying.run({n: v.copy() for n, v in feeds.items()}, None)
    assert set(alone) >= set(updates)
    for name in updates:
        assert np.array_equal(alone[name], whole[name]), name


def test_a_step_of_one_call_has_nothing_to_prune(tmp_path):
    """A step of one microbatch has no masks: nothing is idle, a call runs whole."""
    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x1", "--optimizer", "sgd")
    runner = ProgramRunner(plan_dir / "rank0.onnx", ["CPUExecutionProvider"], lazy=True,
                           updates=state_updates(read_plan(plan_dir)))
    assert runner.idle == {}


def test_a_job_keeping_its_state_on_the_device_prunes_its_calls_too(tmp_path):
    """The path a CUDA job takes (``on_device``; here on host OrtValues) with 2 microbatches a
    step: its first call runs the pruned program, its last the one without masks, both
    keeping their tensors where the program's are kept; every loss and weight equals the
    host path's to the bit, and the state stays device tensors."""
    from meshplan.runtime.buffers import DeviceTensor
    from meshplan.runtime.job import Job
    from meshplan.trainer.data import Batches

    from test_training import _data

    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x1", "--optimizer", "adamw", "--microbatches", "2")
    data = _data(tmp_path / "data.npz")
    found = {}
    for on_device in (False, True):
        job = Job(plan_dir, provider="cpu", on_device=on_device)
        batches = Batches(data, job.plan)
        losses = [job.train_step(batches.next(), 0.01, weight_decay=0.05) for _ in range(3)]
        variants = job.session._variants
        assert "applying" in variants and len(variants) == 2     # the last call's and the others'
        assert all((v.kept_on is not None) == on_device for v in variants.values())
        if on_device:
            assert all(isinstance(v, DeviceTensor) for v in job.state.values())
        state = {n: np.array(v.numpy() if isinstance(v, DeviceTensor) else v) for n, v in job.state.items()}
        found[on_device] = (losses, state)
        job.close()
    assert found[True][0] == found[False][0]
    for name, value in found[False][1].items():
        assert np.array_equal(found[True][1][name], value), name


def test_a_plan_of_several_microbatches_estimates_the_update_once(tmp_path):
    """The step's estimate is M calls less M − 1 times what only the last runs
    (``inter.accumulated_step``): the nodes the pruned calls leave out; the report and
    ``meshplan show`` say so; a plan of one microbatch keeps its latency as its step."""
    from meshplan.emit.report import text_report
    from meshplan.inter.accumulated_step import applying_only
    from meshplan.show import show_plan

    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x1", "--optimizer", "adamw", "--microbatches", "2")
    plan = read_plan(plan_dir)
    call, update = plan.estimate["latency_seconds"], plan.estimate["update_seconds"][0]
    assert 0.0 < update < call
    assert plan.step_seconds == pytest.approx(2 * call - update)
    assert plan.estimate["throughput_per_second"] == pytest.approx(8 / plan.step_seconds)
    assert "training step" in text_report(plan) and "in 2 calls of 4" in text_report(plan)
    assert "= 2 calls x" in show_plan(plan_dir)
    updates = state_updates(plan)
    program = onnx.load(str(plan_dir / "rank0.onnx"), load_external_data=False)
    runner = ProgramRunner(plan_dir / "rank0.onnx", ["CPUExecutionProvider"], lazy=True, updates=updates)
    wanted = (set(updates) - set(runner.idle)) | {"train.loss"}
    kept = {n.name for n in onnx.load_from_string(runner.pruned(wanted).segments[0].source).graph.node}
    alone = set(applying_only(program.graph, updates))
    assert alone and not alone & kept and alone | kept == {n.name for n in program.graph.node}

    whole = read_plan(_plan(tmp_path, "whole", "--mesh", "1x1", "--optimizer", "adamw"))
    assert "step_seconds" not in whole.estimate
    assert whole.step_seconds == whole.estimate["latency_seconds"]
