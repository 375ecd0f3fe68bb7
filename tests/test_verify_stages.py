"""``meshplan verify`` stage by stage: each stage's programs against the original model's
subgraph of that stage, fed the reference outputs of the stages before, in bounded
memory (the 2 GB decoder of test_large_model.py measures it)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.runtime import staged
from meshplan.runtime.inprocess import reference_outputs
from meshplan.runtime.staged import verify_by_stages
from sample_models import SAMPLE_DIR, make_inputs
from sample_models.gpt import make_gpt
from tests.conftest import assert_close, run_cli, save_npz

DIMS = {"batch": 4, "seq": 16}


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """A GPT planned as two sharded stages on 2x2 (Megatron: a stage per host) with two
    microbatches (reshardings between)."""
    work = tmp_path_factory.mktemp("two-stages")
    path = work / "gpt.onnx"
    onnx.save(make_gpt(layers=2, hidden=64, heads=4, vocab=128, max_seq=32), str(path))
    plan = make_plan(path, make_cluster((2, 2), "cpu"), DIMS, work / "plan",
                     PlanOptions(max_stages=2, microbatches=2, policy="megatron"))
    assert len(plan.stages) == 2 and plan.reshardings and all(s.collectives for s in plan.stages)
    return plan, work / "plan", make_inputs(onnx.load(str(path)), DIMS, seed=5)


@pytest.mark.parametrize("piece_bytes", [None, 1], ids=["default-pieces", "one-node-pieces"])
def test_every_stage_matches_its_subgraph(two_stages, piece_bytes):
    plan, plan_dir, inputs = two_stages
    result = verify_by_stages(plan, plan_dir, inputs, piece_bytes=piece_bytes)
    assert [s.index for s in result.stages] == [0, 1]
    assert all(s.ok and s.comparisons for s in result.stages)
    assert {c.name for c in result.stages[0].comparisons} == set(plan.stages[0].outputs)
    if piece_bytes == 1:     # every node reading a weight runs alone
        assert all(s.pieces > 1 for s in result.stages)
    expected = reference_outputs(plan, inputs)
    assert_close(result.reference, expected)
    assert_close(result.outputs, expected)


def test_a_wrong_stage_is_the_one_reported(two_stages, monkeypatch):
    """Stage 1's devices are fed a perturbed tensor: stage 0 passes, stage 1 does not."""
    plan, plan_dir, inputs = two_stages
    feeds = staged._feeds

    def perturbed(stage, mesh, rank, reference, micro):
        got = feeds(stage, mesh, rank, reference, micro)
        if stage.index == 1:
            name = next(n for n in got if n not in micro)
            noise = np.random.default_rng(rank).standard_normal(got[name].shape)   # no norm undoes it
            got[name] = (got[name] + noise).astype(got[name].dtype)
        return got

    monkeypatch.setattr(staged, "_feeds", perturbed)
    result = verify_by_stages(plan, plan_dir, inputs)
    assert [s.ok for s in result.stages] == [True, False]


def test_static_batch_with_microbatches(tmp_path):
    """The dynamo export (static batch 8) in four microbatches: the canonical model is cut
    again at the microbatch size."""
    path = SAMPLE_DIR / "gpt_dynamo.onnx"
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan", PlanOptions(microbatches=4))
    inputs = {"input_ids": np.random.RandomState(1).randint(0, 256, (8, 16)).astype(np.int64)}
    result = verify_by_stages(plan, tmp_path / "plan", inputs)
    assert all(s.ok for s in result.stages)
    assert_close(result.outputs, reference_outputs(plan, inputs))


def test_cli_stages_flag_and_automatic_choice(two_stages, tmp_path, monkeypatch):
    plan, plan_dir, inputs = two_stages
    in_path = save_npz(tmp_path / "in.npz", inputs)
    done = run_cli("verify", plan_dir, "--inputs", in_path, "--stages")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("stage by stage (--stages)")
    assert [line.split(" (")[0] for line in lines if line.startswith("stage ") and "ranks" in line] == \
        ["stage 0", "stage 1"]
    assert lines[-1].startswith("PASSED") and "stage by stage" in lines[-1]
    done = run_cli("verify", plan_dir, "--inputs", in_path, "--whole-model")
    assert done.returncode == 0 and done.stdout.startswith("in-process:"), done.stdout + done.stderr
    monkeypatch.setattr(staged, "available_memory", lambda: 10**12)
    assert not staged.needs_stages(plan)
    monkeypatch.setattr(staged, "available_memory", lambda: 2 * 10**5)
    assert staged.needs_stages(plan)


def test_half_precision_pieces_equal_the_whole_model(tmp_path, monkeypatch):
    """A float16 chain cut into one-node pieces: handing float32 between pieces gives the
    whole model's outputs bit for bit; handing float16 (rounding at every cut) would not."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, previous = [], [], "x"
    for i in range(4):
        weights.append(numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float16), f"w{i}"))
        nodes += [helper.make_node("MatMul", [previous, f"w{i}"], [f"h{i}"]),
                  helper.make_node("Tanh", [f"h{i}"], [f"t{i}"])]
        previous = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [8, 64])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT16, [8, 64])], weights)
    path = tmp_path / "chain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan")
    inputs = {"x": rng.standard_normal((8, 64)).astype(np.float16)}
    whole = reference_outputs(plan, inputs)[previous]
    result = verify_by_stages(plan, tmp_path / "plan", inputs, piece_bytes=1)
    assert all(s.ok for s in result.stages)
    assert np.array_equal(result.reference[previous], whole)
    monkeypatch.setattr(staged, "_half", lambda value: False)
    rounded = verify_by_stages(plan, tmp_path / "plan", inputs, piece_bytes=1).reference[previous]
    assert not np.array_equal(rounded, whole)


def test_stages_with_a_missing_model_is_one_line(two_stages, tmp_path):
    plan, plan_dir, inputs = two_stages
    in_path = save_npz(tmp_path / "in.npz", inputs)
    done = run_cli("verify", plan_dir, "--inputs", in_path, "--stages", "--model", tmp_path / "gone.onnx")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("meshplan: error:")] == \
        [f"meshplan: error: the planned model {tmp_path / 'gone.onnx'} is not there "
         "(pass its new location with --model)"], done.stderr
