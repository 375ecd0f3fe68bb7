"""Plans for ranges of sizes, derived and empty dims, state, and the resident job.

The LLM exports are ``sample_models/llama_exports.py``'s (optimum's and torch dynamo's,
grouped-query attention, a key/value cache). Planned once with ranges, they run at every
size in-process and, under mpiexec, through ``meshplan.Job``: a prefill from an empty
cache then greedy decoding, every step against onnxruntime, with the cache kept on its
ranks (tests/mpi_scripts/generate_case.py).
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest

from conftest import REPO, run_cli, run_mpi, run_mpi_script, save_npz, load_npz

OPTIMUM = REPO / "sample_models" / "llama_optimum.onnx"
DYNAMO = REPO / "sample_models" / "llama_dynamo.onnx"
RESNET = REPO / "sample_models" / "resnet.onnx"
RANGES = {OPTIMUM: ["batch_size=1:4", "sequence_length=1:64", "past_sequence_length=0:63"],
          DYNAMO: ["s10=1:4", "s70=1:64", "s15=0:63"]}


def _plan(model, out, mesh, *extra, dims=None):
    args = ["plan", model, "--mesh", mesh, "-o", out, *extra]
    for dim in dims if dims is not None else RANGES[model]:
        args += ["--dim", dim]
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    return out


def _llm_feeds(batch: int, seq: int, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, 256, (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, past + seq), np.int64),
             "position_ids": np.broadcast_to(np.arange(past, past + seq), (batch, seq)).astype(np.int64).copy()}
    for layer in range(2):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = rng.standard_normal((batch, 2, past, 8)).astype(np.float32)
    return feeds


def _reference(model, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


# --- sizes ------------------------------------------------------------------------------------

def test_dim_ranges_parse_and_say_what_is_wrong():
    from meshplan.model.sizes import DimRange, parse_size

    assert parse_size("16") == 16 and parse_size("0") == 0
    assert parse_size("1:64") == DimRange(1, 64)
    r = parse_size("8:64:8@32")
    assert (r.lo, r.hi, r.step, r.cost_size, r.grain) == (8, 64, 8, 32, 8)
    assert parse_size("0:63").grain == 1 and parse_size("1:64").cost_size == 64
    assert [s for s in range(0, 70) if parse_size("8:64:8").accepts(s)] == list(range(8, 65, 8))
    for bad, fragment in [("4:2", "LO <= HI"), ("1:10:4", "multiple of STEP"), ("8:64:8@12", "not one of its sizes"),
                          ("-1", "negative"), ("a:b", "not an integer")]:
        with pytest.raises(ValueError, match=fragment):
            parse_size(bad)


def test_derived_dims_come_from_names_and_from_the_graph():
    from meshplan.model.sizes import derive_dims, parse_size, split_dims

    optimum = derive_dims(onnx.load(str(OPTIMUM), load_external_data=False),
                          split_dims({d.split("=")[0]: parse_size(d.split("=")[1]) for d in RANGES[OPTIMUM]}))
    assert {n: f.text for n, f in optimum.derived.items()} == {
        "past_sequence_length + sequence_length": "past_sequence_length + sequence_length"}
    dynamo = derive_dims(onnx.load(str(DYNAMO), load_external_data=False),
                         split_dims({d.split("=")[0]: parse_size(d.split("=")[1]) for d in RANGES[DYNAMO]}))
    assert {n: f.text for n, f in dynamo.derived.items()} == {"s43": "s10", "s53": "s15 + s70"}
    assert dynamo.resolve({"s10": 3, "s70": 1, "s15": 15})["s53"] == 16


def test_a_dim_that_follows_from_nothing_given_is_one_error_line(tmp_path):
    done = run_cli("plan", DYNAMO, "--mesh", "1x2", "--dim", "s10=2", "--dim", "s70=4", "-o", tmp_path / "p")
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "s15" in done.stderr, done.stderr


def test_fixed_sizes_with_an_empty_past_plan_and_run(tmp_path):
    """``--dim past=0`` (an empty cache) and only the free dims named: the mask's length is derived."""
    from meshplan.plan_format import read_plan
    from meshplan.runtime.inprocess import run_in_process

    plan_dir = _plan(OPTIMUM, tmp_path / "p", "1x2", "--max-stages", "1", "--all-devices",
                     dims=["batch_size=2", "sequence_length=5", "past_sequence_length=0"])
    feeds = _llm_feeds(2, 5, 0)
    got = run_in_process(read_plan(plan_dir), plan_dir, feeds)
    want = _reference(OPTIMUM, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-3, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("model", [OPTIMUM, DYNAMO], ids=["optimum", "dynamo"])
def test_one_ranged_plan_runs_every_size_in_process(tmp_path, model):
    """Planned once on one 1x2 tensor-parallel stage; run at several sizes (an empty past, a
    decode step, the top of every range) and compared with onnxruntime."""
    from meshplan.plan_format import read_plan
    from meshplan.runtime.inprocess import run_in_process

    plan_dir = _plan(model, tmp_path / "p", "1x2", "--max-stages", "1", "--all-devices", "--device", "cpu")
    plan = read_plan(plan_dir)
    assert plan.format_version == 2 and plan.is_ranged and len(plan.state) == 4
    assert any(stage.strategies for stage in plan.stages)   # something is split
    programs = [onnx.load(str(plan_dir / p.file)) for p in plan.programs]
    for program in programs:   # no size of a ranged dim is baked into a program's inputs
        ids = next(v for v in program.graph.input if v.name == "input_ids")
        assert not any(d.HasField("dim_value") for d in ids.type.tensor_type.shape.dim)
    for batch, seq, past in [(1, 16, 0), (2, 1, 15), (4, 64, 63), (3, 5, 7)]:
        feeds = _llm_feeds(batch, seq, past, seed=seq)
        got = run_in_process(plan, plan_dir, feeds)
        for name, value in _reference(model, feeds).items():
            np.testing.assert_allclose(got[name], value, rtol=1e-3, atol=1e-4, err_msg=f"{name} at {batch},{seq},{past}")


def test_plan_report_says_sizes_and_state(tmp_path):
    done = run_cli("plan", DYNAMO, "--mesh", "1x2", "-o", tmp_path / "p", "--dim", "s10=1:4", "--dim", "s70=1:64@1",
                   "--dim", "s15=0:63")
    assert done.returncode == 0, done.stderr
    assert "sizes: s10 1 to 4 (costed at 4), s70 1 to 64 (costed at 1), s15 0 to 63 (costed at 63)" in done.stdout
    assert "derived: s43 = s10, s53 = s15 + s70" in done.stdout
    assert "state: 4 output(s) kept on their devices" in done.stdout
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["sizes"]["ranges"]["s70"]["cost"] == 1
    assert {s["output"]: s["input"] for s in plan["state"]} == {
        f"present.{n}.{k}": f"past_key_values.{n}.{k}" for n in range(2) for k in ("key", "value")}


def test_state_off_and_given_by_hand(tmp_path):
    done = run_cli("plan", OPTIMUM, "--mesh", "1x2", "-o", tmp_path / "a", "--no-state",
                   *[a for d in RANGES[OPTIMUM] for a in ("--dim", d)])
    assert done.returncode == 0, done.stderr
    assert "state" not in json.loads((tmp_path / "a" / "plan.json").read_text())
    done = run_cli("plan", OPTIMUM, "--mesh", "1x2", "-o", tmp_path / "b", "--state", "logits=input_ids",
                   *[a for d in RANGES[OPTIMUM] for a in ("--dim", d)])
    assert done.returncode == 1 and "element type or rank" in done.stderr


def test_a_ranged_dim_splits_only_where_every_size_divides(tmp_path):
    """batch 1:32 never splits (1 and 7 do not divide); 2:32:2 splits under the data policy."""
    from meshplan.plan_format import read_plan

    whole = read_plan(_plan(RESNET, tmp_path / "a", "1x2", "--policy", "data", dims=["batch=1:32"]))
    split = read_plan(_plan(RESNET, tmp_path / "b", "1x2", "--policy", "data", dims=["batch=2:32:2"]))
    assert not any(stage.strategies for stage in whole.stages)
    assert any(stage.strategies for stage in split.stages)


def test_inputs_for_an_llm_make_sense(tmp_path):
    out = tmp_path / "in.npz"
    done = run_cli("inputs", OPTIMUM, "--dim", "batch_size=2", "--dim", "sequence_length=4",
                   "--dim", "past_sequence_length=3", "-o", out)
    assert done.returncode == 0, done.stderr
    assert "attention_mask: all ones [2, 7]" in done.stdout and "position_ids: 3 … 6" in done.stdout
    feeds = load_npz(out)
    assert (feeds["attention_mask"] == 1).all() and feeds["attention_mask"].shape == (2, 7)
    assert (feeds["position_ids"] == np.arange(3, 7)).all()
    assert not feeds["past_key_values.0.key"].any()
    done = run_cli("inputs", DYNAMO, "--dim", "s10=1", "--dim", "s70=3", "--dim", "s15=0", "-o", out)
    assert done.returncode == 0, done.stderr
    assert "derived s53 = 3" in done.stdout and "empty [1, 2, 0, 8] (no past)" in done.stdout
    assert load_npz(out)["past_key_values.1.value"].shape == (1, 2, 0, 8)


# --- under mpiexec --------------------------------------------------------------------------

@pytest.mark.mpi
def test_generation_through_the_resident_job_on_two_ranks(tmp_path):
    """Both exports on 1x2: as planned, and as one tensor-parallel stage."""
    plans = [_plan(OPTIMUM, tmp_path / "optimum-1x2", "1x2"), _plan(DYNAMO, tmp_path / "dynamo-1x2", "1x2"),
             _plan(DYNAMO, tmp_path / "dynamo-1x2-one-stage", "1x2", "--max-stages", "1", "--all-devices")]
    lines = run_mpi_script("generate_case.py", ranks=2, args=plans, timeout=300)
    assert sum("decode steps" in line for line in lines) == 3
    assert sum("cache bytes moved between ranks: 0" in line for line in lines) == 3


@pytest.mark.mpi
def test_generation_through_the_resident_job_on_four_ranks(tmp_path):
    """Both exports, planned once with ranges on 1x4 and on 2x2 (one of them as a single
    sharded stage over all four ranks: at these sizes its solver keeps the cache whole on
    each rank, which is its cheapest layout)."""
    plans = [_plan(OPTIMUM, tmp_path / "optimum-1x4", "1x4"), _plan(DYNAMO, tmp_path / "dynamo-1x4", "1x4"),
             _plan(OPTIMUM, tmp_path / "optimum-2x2", "2x2"), _plan(DYNAMO, tmp_path / "dynamo-2x2", "2x2"),
             _plan(DYNAMO, tmp_path / "dynamo-2x2-one-stage", "2x2", "--max-stages", "1", "--all-devices")]
    one = json.loads((tmp_path / "dynamo-2x2-one-stage" / "plan.json").read_text())
    assert len(one["stages"]) == 1 and one["stages"][0]["devices"] == [0, 1, 2, 3]
    assert any(one["stages"][0]["strategies"].values())      # sharded over the four ranks
    lines = run_mpi_script("generate_case.py", ranks=4, args=plans, timeout=400)
    assert sum("cache bytes moved between ranks: 0" in line for line in lines) == 5


@pytest.mark.mpi
def test_a_cnn_planned_for_a_range_of_batches_runs_each(tmp_path):
    """ResNet planned once with batch 1:32 runs 1, 7 and 32; a plan that splits the batch
    (2:32:2, data parallel) refuses 7 in one line and goes on."""
    whole = _plan(RESNET, tmp_path / "whole", "1x2", dims=["batch=1:32"])
    split = _plan(RESNET, tmp_path / "split", "1x2", "--policy", "data", dims=["batch=2:32:2"])
    lines = run_mpi_script("cnn_batches_case.py", ranks=2, args=[whole, "1,7,32", split, "2,32,7,16"])
    assert any("batch 7 refused: batch = 7 (input 'image' axis 0) is not a size this plan accepts: 2 to 32 in steps "
               "of 2" in line for line in lines), lines
    assert sum(line.startswith("ok ") and "matches" in line for line in lines) == 6


def write_buffer_model(path, cap: int = 8, width: int = 4, out: int = 16):
    """A model with fixed-capacity state: ``cache_out`` is ``cache_in`` [batch, cap, width]
    with row ``pos`` replaced by ``x``; ``y`` = (sum of the rows) @ w."""
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(1).standard_normal((width, out)).astype(np.float32)
    nodes = [
        helper.make_node("Range", ["zero", "cap", "one"], ["rows"]),
        helper.make_node("Equal", ["rows", "pos"], ["hit"]),
        helper.make_node("Cast", ["hit"], ["hitf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["hitf", "axes02"], ["onehot"]),
        helper.make_node("Sub", ["onef", "onehot"], ["keep"]),
        helper.make_node("Mul", ["cache_in", "keep"], ["kept"]),
        helper.make_node("Unsqueeze", ["x", "axes1"], ["row"]),
        helper.make_node("Mul", ["row", "onehot"], ["written"]),
        helper.make_node("Add", ["kept", "written"], ["cache_out"]),
        helper.make_node("ReduceSum", ["cache_out", "axes1"], ["total"], keepdims=0),
        helper.make_node("MatMul", ["total", "w"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(cap, np.int64), "cap"),
             numpy_helper.from_array(np.array(1, np.int64), "one"), numpy_helper.from_array(np.array(1, np.float32), "onef"),
             numpy_helper.from_array(np.array([0, 2], np.int64), "axes02"),
             numpy_helper.from_array(np.array([1], np.int64), "axes1"), numpy_helper.from_array(weight, "w")]
    graph = helper.make_graph(nodes, "buffer", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width]),
        helper.make_tensor_value_info("pos", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("cache_in", TensorProto.FLOAT, ["batch", cap, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out]),
         helper.make_tensor_value_info("cache_out", TensorProto.FLOAT, ["batch", cap, width])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.mpi
def test_fixed_capacity_state_is_updated_in_place_on_its_ranks(tmp_path):
    model = write_buffer_model(tmp_path / "buffer.onnx")
    plan_dir = _plan(model, tmp_path / "p", "1x2", "--state", "cache_out=cache_in", dims=["batch=1:4"])
    lines = run_mpi_script("fixed_state_case.py", ranks=2, args=[plan_dir, 6])
    assert len(lines) == 3


def test_memory_counts_state_at_its_largest(tmp_path):
    """On one device the stage's memory with state exceeds the one without by exactly the
    cache at the top of every range."""
    from meshplan.plan_format import read_plan

    dims = [a for d in RANGES[OPTIMUM] for a in ("--dim", d)]
    assert run_cli("plan", OPTIMUM, "--mesh", "1x1", "-o", tmp_path / "a", *dims).returncode == 0
    assert run_cli("plan", OPTIMUM, "--mesh", "1x1", "-o", tmp_path / "b", "--no-state", *dims).returncode == 0
    with_state, without = read_plan(tmp_path / "a"), read_plan(tmp_path / "b")
    cache = 4 * (4 * 2 * (63 + 64) * 8 * 4)   # four present tensors [4, 2, 127, 8] of float32
    assert with_state.stages[0].memory_bytes - without.stages[0].memory_bytes == cache


@pytest.fixture(scope="module")
def optimum_ranged(tmp_path_factory):
    """The optimum export's ranged canonical model and its graph, with its state pairs."""
    from meshplan.make_plan import state_pairs
    from meshplan.model.graph import build_graph
    from meshplan.model.sizes import derive_dims, parse_size, split_dims
    from meshplan.model.views import canonicalize_ranged

    header = onnx.load(str(OPTIMUM), load_external_data=False)
    sizes = derive_dims(header, split_dims({d.split("=")[0]: parse_size(d.split("=")[1]) for d in RANGES[OPTIMUM]}))
    canonical, views = canonicalize_ranged(OPTIMUM, sizes, tmp_path_factory.mktemp("optimum_ranged"))
    graph = build_graph(canonical.model, views)
    graph.state = state_pairs(header, None)
    return canonical, graph


@pytest.mark.parametrize("memory", [80e9, 2.5e5], ids=["roomy", "tight"])
def test_cost_tables_built_row_by_row_keep_state_and_peak_memory(optimum_ranged, memory):
    """The stage DP's tables (one chain pass per start layer and view) hold what
    ``stage_cost`` says for every stage of a ranged plan with state: a stage that would
    hold part of a state's readers and makers is infeasible, state and activations count
    at their largest sizes; on tight devices the memory-lean layouts come in too."""
    from dataclasses import replace

    from meshplan.cost.analytic import CostModel
    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.stage_cost import StageCosts, logical_meshes, submesh_shapes
    from meshplan.intra.intra_op import IntraOpPass
    from meshplan.make_plan import small_constants
    from meshplan.model.layers import cluster_layers

    cluster = make_cluster((2, 2), "cpu")
    cluster = replace(cluster, device=replace(cluster.device, memory_bytes=memory))
    canonical, graph = optimum_ranged
    assert graph.views and len(graph.state) == 4
    cost_model = CostModel(cluster)
    seconds_per_node = cost_model.graph_seconds(graph)
    layering = cluster_layers(graph, seconds_per_node, 12)
    constants = small_constants(canonical.model)
    intra = IntraOpPass(graph, layering, cost_model, cluster, constants)
    costs = StageCosts(graph, layering, seconds_per_node, cost_model, intra)
    assert costs._state_spans and max(hi - lo for lo, hi in costs._state_spans) > 0
    submeshes = submesh_shapes(cluster)
    seconds, params, acts = costs.tables(submeshes)
    infeasible = 0
    for s, submesh in enumerate(submeshes):
        for k, logical in enumerate(logical_meshes(submesh)):
            for i in range(layering.num_layers):
                for j in range(i, layering.num_layers):
                    want = costs.stage_cost(i, j + 1, submesh, logical)
                    got = (seconds[i, j, s, k], params[i, j, s, k], acts[i, j, s, k])
                    assert np.allclose(got, (want.seconds, want.param_bytes, want.act_bytes), rtol=1e-12), \
                        (i, j, submesh, logical, got, want)
                    infeasible += not np.isfinite(want.seconds)
    assert infeasible   # some stages would split a state's readers from its maker


@pytest.mark.mpi
def test_meshplan_run_takes_any_size_the_plan_accepts(tmp_path):
    """One ranged plan, two `meshplan run`s at different sizes, each checked by verify;
    a size outside the ranges is one error line."""
    plan_dir = _plan(OPTIMUM, tmp_path / "p", "1x2", "--max-stages", "1", "--all-devices")
    for batch, seq, past in [(1, 3, 0), (3, 1, 6)]:
        inputs = save_npz(tmp_path / f"in{batch}.npz", _llm_feeds(batch, seq, past))
        out = tmp_path / f"out{batch}.npz"
        done = run_mpi(2, "run", plan_dir, "--inputs", inputs, "--output", out, "--repeat", "2")
        assert done.returncode == 0, done.stderr
        assert f"per batch of {batch}" in done.stdout
        got, want = load_npz(out), _reference(OPTIMUM, _llm_feeds(batch, seq, past))
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-3, atol=1e-4, err_msg=name)
        done = run_cli("verify", plan_dir, "--inputs", inputs, "--outputs", out)
        assert done.returncode == 0, done.stdout + done.stderr
    inputs = save_npz(tmp_path / "big.npz", _llm_feeds(5, 2, 0))
    done = run_mpi(2, "run", plan_dir, "--inputs", inputs)
    assert done.returncode == 1
    assert "batch_size = 5 (input 'input_ids' axis 0) is not a size this plan accepts: 1 to 4" in done.stderr


def test_a_calls_sizes_are_checked_in_one_line_each(tmp_path):
    """What rank 0 refuses before any rank hears of a call (and verify before it runs)."""
    from meshplan.errors import RunError
    from meshplan.plan_format import read_plan
    from meshplan.runtime.call_sizes import check_inputs, shape_at

    plan = read_plan(_plan(OPTIMUM, tmp_path / "p", "1x2", "--device", "cpu"))
    good = {n: a.shape for n, a in _llm_feeds(2, 3, 4).items()}
    values = check_inputs(plan, good)
    assert values["past_sequence_length + sequence_length"] == 7
    assert shape_at(["batch_size", 2, "past_sequence_length + sequence_length", 8], values) == (2, 2, 7, 8)
    cases = [({"input_ids": (2, 65), "position_ids": (2, 65), "attention_mask": (2, 69)}, "sequence_length = 65 (input 'input_ids' axis 1) is not a size this plan "
                                      "accepts: 1 to 64"),
             ({"position_ids": (3, 3)}, "input 'position_ids' axis 0 is 3 but input 'input_ids' axis 0 is 2: both "
                                        "are batch_size"),
             ({"attention_mask": (2, 8)}, "input 'attention_mask' axis 1 is 8, but past_sequence_length + "
                                          "sequence_length = 7 at this call's sizes"),
             ({"past_key_values.0.key": (2, 3, 4, 8)}, "has shape [2, 3, 4, 8], the plan expects")]
    for change, message in cases:
        with pytest.raises(RunError, match=re.escape(message)):
            check_inputs(plan, {**good, **change})


def test_shape_of_a_split_cache_holds_at_every_size(optimum_ranged):
    """A Shape reading the cache an export's attention has just grown offers its split
    strategies in a ranged plan: they hold at the plan's other sizes too (the size views
    are ranged graphs as well), so the cache need not be gathered for its Shape readers."""
    from meshplan.intra.strategies import node_strategies
    from meshplan.sharding import LogicalMesh

    _, graph = optimum_ranged
    assert graph.ranged and all(view.ranged for view in graph.views.values())
    mesh = LogicalMesh((1, 2), (0, 1))
    readers = [node for node in graph.nodes if node.op_type == "Shape" and node.inputs[0] in graph.state]
    assert readers
    for node in readers:
        found = {str(s) for s in node_strategies(node, graph, mesh)}
        assert "RS1RR->R" in found, (node.name, found)
