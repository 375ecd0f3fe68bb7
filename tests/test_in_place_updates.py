"""A training step's new weights and slots written into the old ones' buffers (``model.in_place``):
which pairs the rule lets through, and that a step run so equals the step run with new
buffers, to the bit."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from meshplan.model.in_place import updates_in_place
from meshplan.plan_format import read_plan
from meshplan.runtime.program import ProgramRunner
from meshplan.runtime.sessions import StageSession
from meshplan.runtime.state_layout import state_updates

from test_training import _data, _plan


def _safe(nodes, candidates, read_later=(), outputs=()):
    return updates_in_place(nodes, candidates, read_later, outputs)


def test_a_new_value_made_after_every_read_of_the_old_is_written_in_place():
    nodes = [("MatMul", ["x", "w"], ["y"]),
             ("Mul", ["w", "keep"], ["decayed"]),
             ("ReduceSum", ["y"], ["loss"]),
             ("Mul", ["y", "y"], ["g"]),
             ("Sub", ["decayed", "g"], ["w.updated"])]
    assert _safe(nodes, {"w.updated": "w"}) == {"w.updated": "w"}


def test_a_read_of_the_old_value_not_before_the_write_keeps_it_apart():
    nodes = [("Mul", ["w", "keep"], ["decayed"]),
             ("Sub", ["decayed", "g"], ["w.updated"]),
             ("Relu", ["w"], ["late"])]          # no path from it to the write: may run after it
    assert _safe(nodes, {"w.updated": "w"}) == {}
    # the writing node reading the old value itself: elementwise kernels promise no order
    assert _safe([("Mul", ["w", "k"], ["n"]), ("Where", ["apply", "n", "w"], ["w.updated"])],
                 {"w.updated": "w"}) == {}


def test_a_view_of_the_old_value_counts_as_the_old_value():
    nodes = [("Reshape", ["w", "shape"], ["view"]),
             ("Mul", ["w", "keep"], ["decayed"]),
             ("Sub", ["decayed", "g"], ["w.updated"]),
             ("Relu", ["view"], ["late"])]       # reads w's buffer after the write
    assert _safe(nodes, {"w.updated": "w"}) == {}
    before = [nodes[0], ("Relu", ["view"], ["early"]), ("Add", ["w", "early"], ["decayed"]), nodes[2]]
    assert _safe(before, {"w.updated": "w"}) == {"w.updated": "w"}
    assert _safe(before, {"w.updated": "w"}, outputs={"view", "w.updated"}) == {}   # a view handed out


def test_what_is_read_later_and_one_buffer_for_two_outputs_are_refused():
    nodes = [("Mul", ["w", "keep"], ["a"]), ("Neg", ["a"], ["b"])]
    assert _safe(nodes, {"b": "w"}, read_later={"w"}) == {}
    assert _safe(nodes, {"a": "w", "b": "w"}) == {}
    assert _safe(nodes, {"b": "w"}) == {"b": "w"}


def _value(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_a_session_writes_the_new_state_where_the_old_lies_and_computes_the_same(tmp_path):
    """An SGD-like step over two weights, one of them read again after its update (refused):
    run in place and plainly, the same numbers; the safe one's buffer holds its new value."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("MatMul", ["y", "v"], ["z"]),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0),
             helper.make_node("Mul", ["w", "lr"], ["dw"]),
             helper.make_node("Sub", ["dw", "loss"], ["w.updated"]),
             helper.make_node("Mul", ["v", "lr"], ["dv"]),
             helper.make_node("Sub", ["dv", "loss"], ["v.updated"]),
             helper.make_node("Neg", ["v"], ["late"])]
    graph = helper.make_graph(nodes, "step", [_value("x", [2, 3]), _value("w", [3, 3]), _value("v", [3, 3]),
                                              _value("lr", [])],
                              [_value("loss", []), _value("w.updated", [3, 3]), _value("v.updated", [3, 3]),
                               _value("late", [3, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "step.onnx"
    onnx.save(model, path)
    runner = ProgramRunner(path, ["CPUExecutionProvider"], updates={"w.updated": "w", "v.updated": "v"})
    assert runner.segments[0].in_place == {"w.updated": "w"}
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3)).astype(np.float32), "w": rng.standard_normal((3, 3)).astype(np.float32),
             "v": rng.standard_normal((3, 3)).astype(np.float32), "lr": np.asarray(0.5, dtype=np.float32)}
    plain = StageSession(path, ["CPUExecutionProvider"]).run(dict(feeds))
    training = StageSession(path, ["CPUExecutionProvider"], in_place={"w.updated": "w"}, training=True)
    mine = {k: np.array(v) for k, v in feeds.items()}
    found = training.run(mine, writable=frozenset({"w", "v"}))
    assert found["w.updated"] is mine["w"]
    assert found["v.updated"] is not mine["v"]
    for name, value in plain.items():
        np.testing.assert_array_equal(found[name], value)
    np.testing.assert_array_equal(mine["v"], feeds["v"])   # the refused one's input untouched


def test_a_data_parallel_programs_update_segment_writes_every_state_in_place(tmp_path):
    """The 1x2 data-parallel MLP's rank program, cut at its all-reduces: every weight and slot
    is written in place in the segment that updates it, and the plan's memory estimate no
    longer counts a second copy of them."""
    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x2", "--policy", "data", "--optimizer", "adamw")
    plan = read_plan(plan_dir)
    updates = state_updates(plan)
    assert updates and all(o.endswith(".updated") for o in updates)
    runner = ProgramRunner(plan_dir / "rank0.onnx", ["CPUExecutionProvider"], lazy=True, updates=updates)
    written = {}
    for segment in runner.segments:
        written.update(segment.in_place or {})
    assert written == updates
    assert len(runner.segments) > 1


def test_a_job_keeps_each_state_in_its_buffer_from_step_to_step(tmp_path):
    from meshplan.runtime.job import Job
    from meshplan.testing.train_reference import run_whole
    from meshplan.trainer.data import Batches

    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x1", "--optimizer", "adamw")
    data = _data(tmp_path / "data.npz")
    expected, _ = run_whole(plan_dir, data, 3, 0.01, {"weight_decay": 0.05})
    job = Job(plan_dir, provider="cpu")
    batches = Batches(data, job.plan)
    found, held = [], []
    for _ in expected:
        found.append(job.train_step(batches.next(), 0.01, weight_decay=0.05))
        held.append(dict(job.state))
    job.close()
    np.testing.assert_allclose(found, expected, rtol=1e-6)
    assert held[1].keys() == held[2].keys() and all(held[1][n] is held[2][n] for n in held[1])


def test_a_step_of_several_microbatches_writes_only_its_accumulators_in_place(tmp_path):
    """With ``--microbatches``, a weight's and slot's last node is ``Where(apply, new, old)``,
    which reads the old value: those stay apart; the accumulated gradients and the loss's
    sum and count are written in place."""
    plan_dir = _plan(tmp_path, "plan", "--mesh", "1x1", "--optimizer", "adamw", "--microbatches", "2")
    updates = state_updates(read_plan(plan_dir))
    runner = ProgramRunner(plan_dir / "rank0.onnx", ["CPUExecutionProvider"], lazy=True, updates=updates)
    written = runner.segments[0].in_place
    accumulators = {o for o in updates if ".grad_acc." in o or o.startswith("train.acc.")}
    assert accumulators and set(written) == accumulators


def test_the_estimate_counts_a_weight_gathered_from_its_shards_until_its_last_reader():
    """``inter.step_memory``: a weight kept split over a 1x2 mesh and read whole by two
    products holds a whole copy from the first of them to the last (beside its own half),
    and its new value, written in place, adds nothing."""
    from meshplan.inter.step_memory import PROCESS_BYTES, step_memory
    from meshplan.intra.strategies import Strategy
    from meshplan.model.graph import Graph, Node, TensorInfo
    from meshplan.sharding import LogicalMesh, ShardingSpec

    f32 = np.dtype(np.float32)
    tensors = {name: TensorInfo(name, shape, f32) for name, shape in
               {"x": (4, 256), "w": (256, 256), "y": (4, 256), "big": (4096, 256), "z": (4, 256),
                "w.updated": (256, 256), "grad/w": (256, 256)}.items()}
    R, S0 = ShardingSpec(("R", "R")), ShardingSpec(("S1", "R"))
    nodes = [Node("first", "MatMul", "", ("x", "w"), ("y",), {}),
             Node("between", "Relu", "", ("y",), ("big",), {}),
             Node("second", "MatMul", "", ("y", "w"), ("z",), {}),
             Node("grad", "Mul", "", ("w", "z"), ("grad/w",), {}),
             Node("update", "Sub", "", ("grad/w", "z"), ("w.updated",), {})]
    strategies = {"first": Strategy((R, R), (R,)), "second": Strategy((R, R), (R,)),
                  "between": Strategy((R,), (R,)), "grad": Strategy((S0, R), (S0,)),
                  "update": Strategy((S0, R), (S0,))}
    graph = Graph(nodes, tensors, ["x", "w"], ["z", "w.updated"], state={"w.updated": "w"})
    mesh = LogicalMesh((1, 2), (0, 1))
    found = step_memory(graph, strategies, {"w": S0}, mesh, {"w"})
    half, whole = 128 * 256 * 4, 256 * 256 * 4
    assert found["weights"] == half + whole   # its own half and the whole copy, at the peak ("big" alive)
    assert found["process"] == PROCESS_BYTES
    assert found["activations"] >= 4096 * 256 * 4


def test_adamws_squares_of_a_gradient_wait_for_the_norm():
    """The update's nodes (``optimizers.build_update``): a node that reads only gradients
    (and constants) makes nothing that lives on: each g·g the norm sums is read once, by its
    ReduceSum, and the g² of the second moment is made from a product that reads the
    clipping's factor, so onnxruntime cannot make it while the backward pass still runs."""
    from meshplan.training.optimizers import build_update

    weights = {"w": ("grad/w", np.dtype(np.float32)), "b": ("grad/b", np.dtype(np.float32))}
    emitted = build_update("adamw", weights)
    readers: dict[str, list] = {}
    for node in emitted.nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    gradients = {"grad/w", "grad/b"}
    squares = [o for node in emitted.nodes if node.input and set(node.input) <= gradients for o in node.output]
    assert len(squares) == 2   # the norm's g·g, one a weight
    for name in squares:
        assert [n.op_type for n in readers.get(name, [])] == ["ReduceSum"], name


# --- pipelined stages ------------------------------------------------------------------------

def test_runs_one_after_another_write_in_place_only_what_no_later_run_reads():
    """``written_in_place`` over groups of a graph's outputs, each run on its own: a state a
    later group still reads keeps its buffer."""
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Mul", ["a", "k"], ["ta"]), helper.make_node("Add", ["ta", "k"], ["a.updated"]),
         helper.make_node("Mul", ["b", "k"], ["tb"]), helper.make_node("Add", ["tb", "k"], ["b.updated"]),
         helper.make_node("Sub", ["a", "k"], ["d"])], "g",
        [helper.make_tensor_value_info(n, f, [4]) for n in ("a", "b", "k")],
        [helper.make_tensor_value_info(n, f, [4]) for n in ("a.updated", "b.updated", "d")])
    from meshplan.model.in_place import written_in_place

    both = {"a.updated": "a", "b.updated": "b"}
    assert written_in_place(graph, [["a.updated", "b.updated"]], {"a", "b"}) == [both]
    assert written_in_place(graph, [["a.updated", "b.updated"]], {"b"}) == [{"b.updated": "b"}]
    # d reads a, in the same run (and may run after the write) or in the run after
    assert written_in_place(graph, [["a.updated", "b.updated", "d"]], {"a", "b"}) == [{"b.updated": "b"}]
    assert written_in_place(graph, [["a.updated"], ["b.updated", "d"]], {"a", "b"}) == [{}, {"b.updated": "b"}]
    assert written_in_place(graph, [["d"], ["a.updated", "b.updated"]], {"a", "b"}) == [{}, both]


def _pipeline_runner(name="gpt_adamw", stages=2, device=None):
    from meshplan.runtime.pipeline_inprocess import PipelineRunner
    from meshplan.testing.train_reference import even_stages
    from meshplan.training.pipeline_step import split_step
    from meshplan.training.step_model import TrainSpec, build_step_model
    from sample_models.training import load_case

    case = load_case(name)
    settings = case["settings"]
    step = build_step_model(case["model_path"], TrainSpec(settings["loss"], settings["optimizer"],
                                                          microbatches=4, stages=stages))
    pipeline = split_step(step, even_stages(step, case["model_path"], stages), stages)
    return case, pipeline, PipelineRunner(pipeline, 4, case["initial"], device=device)


def _train_steps(case, runner, steps=3):
    from meshplan.training.optimizers import DEFAULTS
    from tests.training_cases import batches, hyper

    losses = []
    for k, batch in enumerate(list(batches(case))[:steps]):
        controls = {**DEFAULTS, **hyper(case["settings"]), "train.lr": case["lrs"][k], "train.step": k + 1}
        losses.append(runner.step(batch, controls)["train.loss"])
    return losses


def test_a_pipelined_update_needs_no_mask_and_writes_every_weight_and_slot_in_place():
    """A stage's update runs with APPLY 1: its masks ``Where(apply, new, old)`` are gone, so
    AdamW's new weights and slots, and the backward's accumulated gradients, take their old
    values' buffers, step after step; the caller's weights stay as they were."""
    from meshplan.training.optimizers import APPLY
    from meshplan.training.pipeline_step import UPDATE_PHASE

    case, pipeline, runner = _pipeline_runner()
    for (stage, phase), part in pipeline.parts.items():
        if phase == UPDATE_PHASE:
            graph = part.model.graph
            masked = [n for n in graph.node if n.op_type == "Where" and n.output[0] in {v.name for v in graph.output}
                      and n.input[2] + ".updated" == n.output[0]]
            assert not masked and not any(APPLY in n.input for n in graph.node)
    given = {n: v.copy() for n, v in case["initial"].items()}
    buffers = [{n: v for n, v in r.state.items()} for r in runner.runners]
    for r in runner.runners:
        written = {i for pairs in r.in_place.values() for i in pairs.values()}
        assert written == set(r.state), sorted(set(r.state) - written)[:3]
    _train_steps(case, runner)
    for r, before in zip(runner.runners, buffers):
        assert all(r.state[n] is before[n] for n in before)
    assert all(np.array_equal(case["initial"][n], given[n]) for n in given)


def test_a_pipeline_written_in_place_trains_to_the_bit_as_with_new_buffers(monkeypatch):
    """The same steps with nothing written in place: every loss and every state the same
    bits, on numpy arrays and on OrtValues (the device path); the tied GPT-2's embedding,
    which another stage borrows, keeps its buffer apart."""
    from meshplan.runtime import pipeline_stage

    for name, stages, device in [("gpt_adamw", 2, None), ("gpt2_tied", 3, None), ("gpt_adamw", 2, ("cpu", 0))]:
        case, _, runner = _pipeline_runner(name, stages, device)
        if name == "gpt2_tied":
            lent = {c.tensor for c in runner.pipeline.crossings if c.made_in == "state"}
            assert lent and not any(i in lent for r in runner.runners for p in r.in_place.values()
                                    for i in p.values())
        losses, state = _train_steps(case, runner), runner.state_values()
        with monkeypatch.context() as m:
            m.setattr(pipeline_stage, "written_in_place", lambda graph, groups, writable: [{} for _ in groups])
            case, _, plain = _pipeline_runner(name, stages, device)
            assert not any(r.in_place for r in plain.runners)
            again, state_again = _train_steps(case, plain), plain.state_values()
        assert losses == again
        assert all(np.array_equal(state[n], state_again[n]) for n in state)
