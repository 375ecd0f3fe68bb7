"""Training plans without programs (``meshplan plan --train --no-programs --stages/--max-stages``):
the planner's stage DP and sharding ILP weighing a training step (``inter.training_costs``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_cli
from test_cli_errors import _one_error_line

GPT = REPO / "sample_models" / "gpt.onnx"
LOSS = "cross_entropy:logits:labels"


@pytest.fixture(scope="module")
def gpt_graph(tmp_path_factory):
    from meshplan.make_plan import small_constants
    from meshplan.model.graph import build_graph
    from meshplan.model.load import canonicalize

    canonical = canonicalize(GPT, {"batch": 8, "seq": 32}, tmp_path_factory.mktemp("canonical"))
    return build_graph(canonical.model), small_constants(canonical.model)


@pytest.fixture(scope="module")
def steps():
    """The sample GPT's training steps: AdamW, SGD, and AdamW with the embeddings frozen."""
    from meshplan.training.step_model import TrainSpec, build_step_model

    return {"adamw": build_step_model(GPT, TrainSpec(loss=LOSS)),
            "sgd": build_step_model(GPT, TrainSpec(loss=LOSS, optimizer="sgd")),
            "frozen": build_step_model(GPT, TrainSpec(loss=LOSS, frozen=("embed.*",)))}


def _costs(graph, constants, training=None, microbatches=4, mesh=(1, 4), layers=8):
    from meshplan.cost.analytic import CostModel
    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.stage_cost import StageCosts
    from meshplan.inter.training_costs import TrainingOperatorCosts
    from meshplan.intra.intra_op import IntraOpPass
    from meshplan.model.layers import cluster_layers

    cluster = make_cluster(mesh, "h100-80g")
    cost_model = CostModel(cluster)
    seconds = cost_model.graph_seconds(graph)
    layering = cluster_layers(graph, seconds, layers)
    operator_costs = None if training is None else TrainingOperatorCosts(graph, cost_model, cluster, constants,
                                                                          training, microbatches)
    intra = IntraOpPass(graph, layering, cost_model, cluster, constants, operator_costs=operator_costs)
    return StageCosts(graph, layering, seconds, cost_model, intra, cluster, training, microbatches)


def test_one_device_stage_is_forward_and_backward_with_weights_gradients_and_slots(gpt_graph, steps):
    """On one device a training stage takes three forwards (the backward two) and sends twice
    (the activation on, its gradient back); it holds each weight its step trains 4 times
    under AdamW (weight, gradient, two slots), 3 times under SGD, a frozen one once; and
    without the step's list of what its backward reads, it keeps every activation its
    operators make, not just the largest."""
    from meshplan.inter.training_costs import TrainingCosting

    graph, constants = gpt_graph
    forward = _costs(graph, constants)
    adamw_costing = TrainingCosting.of(steps["adamw"])
    trained = adamw_costing.trained
    adamw = _costs(graph, constants, TrainingCosting("adamw", trained=trained))
    sgd_costing = TrainingCosting.of(steps["sgd"])
    assert sgd_costing.optimizer == "sgd" and sgd_costing.trained == trained
    sgd = _costs(graph, constants, TrainingCosting("sgd", trained=trained))
    rest = TrainingCosting.of(steps["frozen"]).trained      # all but the frozen embeddings
    params = {p for i in range(len(graph.nodes)) for p in graph.params_of(i)}
    # (the canonical model folds a weight sliced to static dims, the position table here,
    # into a constant of its own: the graph holds the others under the step's names)
    assert rest < trained and all(name.startswith("embed.") for name in trained - rest)
    assert len(trained & params) >= 0.9 * len(trained)
    partly = _costs(graph, constants, TrainingCosting("adamw", trained=rest))
    L = forward.num_layers
    checked = 0
    for start in range(L):
        for stop in range(start + 1, L + 1):
            f = forward.stage_cost(start, stop, (1, 1), (1, 1))
            t = adamw.stage_cost(start, stop, (1, 1), (1, 1))
            send = forward.send_seconds(stop)
            assert t.seconds == pytest.approx(3 * (f.seconds - send) + 2 * send, rel=1e-9)
            weights = forward.param_bytes(start, stop)
            trained_bytes = sum(graph.tensors[p].nbytes for p in _params(graph, forward, start, stop) if p in trained)
            assert t.param_bytes == pytest.approx(weights + 3 * trained_bytes)
            assert sgd.stage_cost(start, stop, (1, 1), (1, 1)).param_bytes == pytest.approx(weights + 2 * trained_bytes)
            partly_bytes = sum(graph.tensors[p].nbytes for p in _params(graph, forward, start, stop) if p in rest)
            assert partly.stage_cost(start, stop, (1, 1), (1, 1)).param_bytes == pytest.approx(weights + 3 * partly_bytes)
            assert t.act_bytes >= f.act_bytes
            checked += 1
    assert checked == L * (L + 1) // 2
    whole = adamw.stage_cost(0, L, (1, 1), (1, 1))
    made = sum(graph.tensors[n].peak_nbytes for node in graph.nodes for n in node.outputs
               if n and not graph.tensors[n].is_param)
    assert whole.act_bytes == pytest.approx(made + forward._cut_peak[0])


def test_a_stage_keeps_what_the_backward_reads(gpt_graph, steps):
    """With the step model's own list of what its backward reads, a training stage keeps
    those activations alone: fewer bytes than every output, exactly the saved tensors the
    range makes and what enters it."""
    from meshplan.inter.training_costs import TrainingCosting

    graph, constants = gpt_graph
    costing = TrainingCosting.of(steps["adamw"])
    saved = costing.saved
    outputs = {n for node in graph.nodes for n in node.outputs if n and not graph.tensors[n].is_param}
    assert 0 < len(saved & outputs) < len(outputs)
    every = _costs(graph, constants, TrainingCosting("adamw", trained=costing.trained))
    kept = _costs(graph, constants, costing)
    L = every.num_layers
    whole_every, whole_kept = every.stage_cost(0, L, (1, 1), (1, 1)), kept.stage_cost(0, L, (1, 1), (1, 1))
    made = sum(graph.tensors[n].peak_nbytes for n in saved & outputs)
    assert whole_kept.act_bytes == pytest.approx(made + kept._cut_peak[0])
    assert whole_kept.act_bytes < whole_every.act_bytes
    assert whole_kept.seconds == whole_every.seconds and whole_kept.param_bytes == whole_every.param_bytes


def test_recomputing_costs_a_forward_more_and_keeps_what_enters_each_layer(gpt_graph, steps):
    """Recomputing activations (Alpa's and Megatron-LM's checkpointing): a one-device stage
    takes four forwards instead of three (its sends as before), keeps per microbatch only
    what crosses into each of its layers and out of it, and holds once the largest of its
    layers' saved activations (the one recomputed layer's)."""
    from dataclasses import replace

    from meshplan.inter.training_costs import TrainingCosting

    graph, constants = gpt_graph
    costing = TrainingCosting.of(steps["adamw"])
    assert costing.forwards == 3 and replace(costing, recompute=True).forwards == 4
    forward = _costs(graph, constants)
    kept = _costs(graph, constants, costing)
    again = _costs(graph, constants, replace(costing, recompute=True))
    L = forward.num_layers
    saved = np.diff(kept._kept_prefix)    # each layer's activations its backward reads
    assert saved.max() > 0
    for start in range(L):
        for stop in range(start + 1, L + 1):
            f, k, r = (c.stage_cost(start, stop, (1, 1), (1, 1)) for c in (forward, kept, again))
            send = forward.send_seconds(stop)
            assert r.seconds == pytest.approx(4 * (f.seconds - send) + 2 * send, rel=1e-9)
            assert r.act_bytes == pytest.approx(float(forward._cut_peak[start:stop + 1].sum()))
            assert r.param_bytes == pytest.approx(k.param_bytes + float(saved[start:stop].max()))
    whole_kept, whole_again = kept.stage_cost(0, L, (1, 1), (1, 1)), again.stage_cost(0, L, (1, 1), (1, 1))
    assert whole_again.act_bytes < whole_kept.act_bytes
    # the DP's tables say the same as the stage costs, on one device and sharded
    seconds, params, acts = again.tables([(1, 1), (1, 4)])
    one, four = again.stage_cost(0, L, (1, 1), (1, 1)), again.stage_cost(0, L, (1, 4), (1, 4))
    assert params[0, L - 1, 0, 0] == pytest.approx(one.param_bytes) and acts[0, L - 1, 0, 0] == pytest.approx(
        one.act_bytes)
    views = [k for k in range(params.shape[3]) if np.isfinite(params[0, L - 1, 1, k])]
    assert any(params[0, L - 1, 1, k] == pytest.approx(four.param_bytes) for k in views)


def _params(graph, costs, start, stop):
    bounds = costs.layering.bounds
    return {p for i in range(bounds[start], bounds[stop]) for p in graph.params_of(i)}


def test_gpipe_tables_hold_every_microbatch_and_1f1b_leaves_the_count_to_the_dp(gpt_graph):
    from meshplan.inter.training_costs import TrainingCosting

    graph, constants = gpt_graph
    one_f = _costs(graph, constants, TrainingCosting("adamw", schedule="1f1b"), microbatches=8)
    gpipe = _costs(graph, constants, TrainingCosting("adamw", schedule="gpipe"), microbatches=8)
    s1, p1, a1 = one_f.tables([(1, 1), (1, 2)])
    s2, p2, a2 = gpipe.tables([(1, 1), (1, 2)])
    finite = np.isfinite(s1)
    assert finite.any() and np.array_equal(finite, np.isfinite(s2))
    assert np.allclose(s1[finite], s2[finite])
    assert np.all(a1[finite] > 0) and np.all(a2[finite] == 0)
    assert np.allclose(p2[finite], p1[finite] + 8 * a1[finite])
    assert TrainingCosting(schedule="1f1b").in_flight(0, 4, 8) == 4
    assert TrainingCosting(schedule="1f1b").in_flight(3, 4, 8) == 1
    assert TrainingCosting(schedule="1f1b").in_flight(0, 4, 2) == 2
    assert TrainingCosting(schedule="gpipe").in_flight(3, 4, 8) == 8


def test_a_split_batch_pays_the_gradient_all_reduce_and_a_split_weight_does_not(gpt_graph, steps):
    """The ILP weighs data parallelism's cost: a MatMul whose batch is split over an axis and
    whose weight is whole there leaves each device a partial gradient, summed once a step;
    split along the weight's columns instead, each device has its own slice's gradient."""
    from meshplan.cost.analytic import CostModel
    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.training_costs import TrainingCosting, TrainingOperatorCosts
    from meshplan.intra.operator_cost import OperatorCosts
    from meshplan.intra.strategies import node_strategies
    from meshplan.sharding import LogicalMesh

    graph, constants = gpt_graph
    cluster = make_cluster((1, 4), "h100-80g")
    cost_model = CostModel(cluster)
    mesh = LogicalMesh((1, 4), tuple(range(4)))
    collectives = OperatorCosts(graph, cost_model, cluster, constants).collectives((1, 4), (1, 4))
    per_step = {mb: TrainingOperatorCosts(graph, cost_model, cluster, constants,
                                                    TrainingCosting.of(steps["adamw"]), mb)
                for mb in (1, 4)}
    forward = OperatorCosts(graph, cost_model, cluster, constants)
    node = next(n for n in graph.nodes if n.op_type == "MatMul" and graph.tensors[n.inputs[1]].is_param)
    strategies = node_strategies(node, graph, mesh, constants, opset=graph.opset)
    batch_split = [s for s in strategies if s.inputs[0] is not None and s.inputs[0].dim_axes(0)
                   and (s.inputs[1] is None or s.inputs[1].is_replicated)]
    column_split = [s for s in strategies if s.inputs[1] is not None and s.inputs[1].dim_axes(1)
                    and not s.inputs[1].dim_axes(0)
                    and (s.inputs[0] is None or s.inputs[0].is_replicated)]
    assert batch_split and column_split
    costs = per_step[1]
    assert costs.gradient_seconds(node, batch_split[0], mesh, collectives) > 0
    assert costs.gradient_seconds(node, column_split[0], mesh, collectives) == 0
    for strategy in batch_split + column_split:
        once = per_step[1].strategy_seconds(node, strategy, mesh, collectives)
        quarter = per_step[4].strategy_seconds(node, strategy, mesh, collectives)
        compute = 3 * forward.compute_seconds(node, strategy, mesh)
        gradient = costs.gradient_seconds(node, strategy, mesh, collectives)
        assert once == pytest.approx(compute + gradient)
        assert quarter == pytest.approx(compute + gradient / 4)


def _plan(tmp_path: Path, name: str, *extra: str, mesh: str = "1x4", microbatches: int = 4, batch: int = 8):
    out = tmp_path / name
    result = run_cli(*["plan", str(GPT), "--train", "--loss", LOSS, "--mesh", mesh, "--dim", f"batch={batch}",
                      "--dim", "seq=32", "--microbatches", str(microbatches), "--no-programs", *extra, "-o", str(out)])
    return result, out


def test_training_estimate_plans_stages_with_their_memory_in_flight(tmp_path):
    from meshplan.plan_format import read_plan

    result, out = _plan(tmp_path, "est", "--stages", "2", microbatches=8)
    assert result.returncode == 0, result.stderr
    plan = read_plan(out)
    assert len(plan.stages) == 2 and not plan.programs
    t = plan.training
    assert t["estimate_only"] and t["schedule"] == "1f1b" and t["in_flight"] == [2, 1]
    assert t["optimizer"] == "adamw" and len(t["weights"]) > 0
    assert not (out / "schedule.json").exists() and not (out / "training").exists()
    report = (out / "report.txt").read_text()
    assert "training (estimated, no programs)" in report and "estimate: training step" in report
    svg = (out / "timeline.svg").read_text()
    assert "backward of microbatch 7" in svg and "forward of microbatch 7" in svg
    est = plan.estimate
    seconds = [s.seconds for s in plan.stages]
    assert est["latency_seconds"] == pytest.approx(sum(seconds) + 7 * max(seconds))
    # the same stages under GPipe hold all eight microbatches' activations: more memory
    gpipe_result, gpipe_out = _plan(tmp_path, "gpipe", "--stages", "2", "--schedule", "gpipe", microbatches=8)
    assert gpipe_result.returncode == 0, gpipe_result.stderr
    gpipe = read_plan(gpipe_out)
    assert gpipe.training["in_flight"] == [8, 8]
    assert max(s.memory_bytes for s in gpipe.stages) > max(s.memory_bytes for s in plan.stages)


def test_training_estimate_weighs_stage_counts_and_submeshes(tmp_path):
    """``--max-stages`` lets the DP choose; a training step's cost is at least three forward
    calls' (inference's plan of the same model and options as the floor)."""
    from meshplan.plan_format import read_plan

    result, out = _plan(tmp_path, "max", "--max-stages", "4", mesh="2x2")
    assert result.returncode == 0, result.stderr
    plan = read_plan(out)
    assert 1 <= len(plan.stages) <= 4 and plan.training["estimate_only"]
    forward = run_cli(*["plan", str(GPT), "--mesh", "2x2", "--dim", "batch=8", "--dim", "seq=32", "--microbatches",
                       "4", "--max-stages", "4", "--no-programs", "-o", str(tmp_path / "fwd")])
    assert forward.returncode == 0, forward.stderr
    inference = read_plan(tmp_path / "fwd")
    assert plan.estimate["latency_seconds"] > 2 * inference.estimate["latency_seconds"]
    assert json.loads((out / "plan.json").read_text())["training"]["held_per_weight"] == 4


def test_training_estimate_cannot_be_trained_or_exported(tmp_path):
    result, out = _plan(tmp_path, "est", "--stages", "2")
    assert result.returncode == 0, result.stderr
    data = tmp_path / "data.npz"
    np.savez(data, input_ids=np.zeros((8, 32), np.int64), labels=np.zeros((8, 32), np.int64))
    for args in (["train", str(out), "--data", str(data), "--steps", "1"], ["export", str(out), "--checkpoint",
                                                                           str(tmp_path), "-o", str(tmp_path / "m.onnx")]):
        refused = run_cli(*args)
        assert refused.returncode == 1
        line = _one_error_line(refused)
        assert "no programs" in line or "--no-programs" in line, line
    listed = run_cli("show", out, "--schedule")
    assert "no instruction lists" in _one_error_line(listed)
    shown = run_cli("show", out, "--operators", "1")
    assert shown.returncode == 0 and "stage 1" in shown.stdout, shown.stderr


def test_training_estimate_with_recomputation(tmp_path):
    """``--recompute``: the same stages slower and smaller, said in the report; refused
    without stages, and with programs on one stage (nothing written)."""
    from meshplan.plan_format import read_plan

    plain, plain_out = _plan(tmp_path, "plain", "--stages", "2", microbatches=8)
    again, again_out = _plan(tmp_path, "again", "--stages", "2", "--recompute", microbatches=8)
    assert plain.returncode == 0 and again.returncode == 0, plain.stderr + again.stderr
    kept, recomputed = read_plan(plain_out), read_plan(again_out)
    assert recomputed.training["recompute"] and not kept.training["recompute"]
    assert recomputed.estimate["latency_seconds"] > kept.estimate["latency_seconds"]
    assert max(s.memory_bytes for s in recomputed.stages) < max(s.memory_bytes for s in kept.stages)
    assert "recomputed before its backward" in (again_out / "report.txt").read_text()
    base = ["plan", str(GPT), "--train", "--loss", LOSS, "--mesh", "1x4", "--dim", "batch=8", "--dim", "seq=32",
            "--microbatches", "4", "--recompute"]
    weighed = run_cli(*base, "--max-stages", "2", "-o", str(tmp_path / "weighed"))   # (with programs)
    assert "--recompute goes with pipeline stages" in _one_error_line(weighed)
    alone = run_cli(*base, "-o", str(tmp_path / "alone"))
    assert alone.returncode == 2 and "--recompute goes with --train and --stages" in alone.stderr
    assert not (tmp_path / "weighed").exists() and not (tmp_path / "alone").exists()


def test_training_estimate_refuses_what_it_cannot_plan(tmp_path):
    bad_loss, _ = _plan(tmp_path, "loss", "--stages", "2", "--loss", "cross_entropy:nope:labels")
    assert bad_loss.returncode == 1 and "nope" in _one_error_line(bad_loss)
    bad_split, _ = _plan(tmp_path, "split", "--stages", "2", microbatches=3)
    assert bad_split.returncode == 1 and "3" in _one_error_line(bad_split)
    tiny = tmp_path / "tiny.toml"
    tiny.write_text('hosts = 1\ndevices_per_host = 4\n[device]\npreset = "h100-80g"\nmemory_gb = 0.0001\n')
    out = tmp_path / "tiny"
    small = run_cli(*["plan", str(GPT), "--train", "--loss", LOSS, "--cluster", str(tiny), "--dim", "batch=8",
                     "--dim", "seq=32", "--microbatches", "4", "--max-stages", "4", "--no-programs", "-o", str(out)])
    assert small.returncode == 1 and not out.exists()
    assert "memory" in _one_error_line(small) or "fit" in _one_error_line(small)


def test_regions_that_cannot_hold_the_weights_once_are_not_searched(tmp_path):
    """The sample GPT's trained weights held 4x (14.3 MiB) fit no single device of 8 MiB:
    the planner searches the 1x2 region and the whole mesh only, and still finds a plan
    (four stages, every device used, each within its memory)."""
    from meshplan.plan_format import read_plan

    cluster = tmp_path / "small.toml"
    cluster.write_text('hosts = 1\ndevices_per_host = 4\n[device]\npreset = "h100-80g"\nmemory_gb = 0.0078125\n')
    out = tmp_path / "small"
    done = run_cli("plan", GPT, "--train", "--loss", LOSS, "--cluster", cluster, "--dim", "batch=8", "--dim", "seq=32",
                   "--microbatches", "8", "--max-stages", "4", "--no-programs", "-o", out)
    assert done.returncode == 0, done.stderr
    plan = read_plan(out)
    held = sum(int(np.prod(w["shape"])) * np.dtype(w["dtype"]).itemsize for w in plan.training["weights"].values())
    memory = plan.cluster["device"]["memory_bytes"]
    assert 4 * held > memory and 4 * held <= 2 * memory
    assert plan.solver["regions"] == [[1, 2], [1, 4]]
    assert all(s.memory_bytes <= memory for s in plan.stages)
