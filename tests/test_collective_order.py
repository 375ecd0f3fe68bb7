"""A rank's program ordered so that its collectives cut it as few times as they must
(``emit.collective_order``)."""

from __future__ import annotations

import onnx
from onnx import helper

from conftest import REPO, run_cli
from meshplan.emit.collective_order import order_by_levels
from meshplan.plan_format import COLLECTIVE_DOMAIN


def _op(kind, inputs, out):
    return helper.make_node(kind, inputs, [out], name=out)


def _all_reduce(source, out):
    return helper.make_node("AllReduce", [source], [out], name=out, domain=COLLECTIVE_DOMAIN, axis=0)


def _cuts(nodes) -> int:
    """Runs of nodes between collectives that hold at least one node (sessions)."""
    marks = [i for i, n in enumerate(nodes) if n.domain == COLLECTIVE_DOMAIN]
    return sum(1 for a, b in zip([-1] + marks, marks + [len(nodes)]) if b - a > 1)


def _topological(nodes, inputs) -> bool:
    seen = set(inputs)
    for node in nodes:
        if any(i and i not in seen for i in node.input):
            return False
        seen.update(node.output)
    return True


def test_gradients_reduced_together_and_the_update_stays_late():
    """Two layers' backward, each gradient all-reduced as it is made and reshaped at once
    (the order the sharding rules emit): after ordering, the backward is one run, both
    all-reduces follow it, and the update (with a node reading only a moment, which must not
    move up into the backward) is the last run."""
    nodes = [
        _op("Relu", ["x"], "h"),
        _op("Mul", ["h", "w1"], "g1_partial"), _all_reduce("g1_partial", "g1"), _op("Reshape", ["g1", "s"], "g1r"),
        _op("Mul", ["h", "w2"], "g2_partial"), _all_reduce("g2_partial", "g2"), _op("Reshape", ["g2", "s"], "g2r"),
        _op("Mul", ["m", "beta"], "m_decayed"),
        _op("Add", ["g1r", "g2r"], "g"), _op("Add", ["g", "m_decayed"], "m_new"),
    ]
    ordered = order_by_levels(nodes, ["m_new"])
    assert sorted(n.name for n in ordered) == sorted(n.name for n in nodes)
    assert _topological(ordered, ["x", "w1", "w2", "s", "m", "beta"])
    assert _cuts(nodes) == 3 and _cuts(ordered) == 2
    names = [n.name for n in ordered]
    assert names.index("g1") < names.index("g2")   # collectives keep their order
    assert names.index("m_decayed") > names.index("g2")   # what only the update reads stays late


def test_a_chain_of_collectives_keeps_its_order_and_a_subgraph_keeps_everything():
    chain = [_op("Relu", ["x"], "a"), _all_reduce("a", "b"), _op("Relu", ["b"], "c"), _all_reduce("c", "d"),
             _op("Relu", ["d"], "e")]
    assert [n.name for n in order_by_levels(chain, ["e"])] == [n.name for n in chain]
    body = helper.make_graph([_op("Identity", ["g1"], "y")], "body", [],
                             [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    branching = [_op("Relu", ["x"], "h"), _all_reduce("h", "g1"), _op("Relu", ["x"], "k"),
                 helper.make_node("If", ["cond"], ["z"], then_branch=body, else_branch=body, name="if")]
    assert [n.name for n in order_by_levels(branching, ["z", "k"])] == [n.name for n in branching]


def test_a_data_parallel_training_step_runs_as_a_few_sessions(tmp_path):
    """The sample GPT's 1x2 data-parallel training step: 71 all-reduces, 3 sessions."""
    from meshplan.runtime.program import ProgramRunner

    out = tmp_path / "plan"
    done = run_cli("plan", REPO / "sample_models" / "gpt.onnx", "--train", "--loss", "cross_entropy:logits:targets",
                   "--optimizer", "adamw", "--mesh", "1x2", "--device", "cpu", "--dim", "batch=4", "--dim", "seq=16",
                   "--policy", "data", "-o", out)
    assert done.returncode == 0, done.stderr
    runner = ProgramRunner(out / "rank0.onnx", ["CPUExecutionProvider"], lazy=True)
    assert sum(1 for s in runner.segments if s.collective is not None) == 71
    assert runner.sessions <= 4
