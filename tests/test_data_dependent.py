"""Data-dependent shapes: NonZero's count and what it flows into get a symbolic dim with
an upper bound; the planner sizes them at the bound and never splits those dims; one
crossing stages goes whole, its shape first; the programs run with the actual size."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshplan.cost.cluster import make_cluster
from meshplan.errors import ModelError
from meshplan.inter.pipeline import PlanOptions
from meshplan.intra.strategies import node_strategies
from meshplan.make_plan import make_plan
from meshplan.model.bounds import read_bounds, read_sampled
from meshplan.model.graph import build_graph
from meshplan.model.load import canonicalize
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from meshplan.sharding import LogicalMesh
from tests.conftest import assert_close, check_against_onnxruntime, run_cli

ROWS, WIDTH = 8, 16


def _selected_rows_model(path, expose: bool = False):
    """y = x with the rows whose sum is positive replaced by relu(row @ w) @ w2: NonZero
    picks the rows (a data-dependent count), Gather, MatMul, ScatterND put them back.
    ``expose``: the selected rows' activations are a second model output."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((WIDTH, 2 * WIDTH)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((2 * WIDTH, WIDTH)).astype(np.float32), "w2"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "first"),
             numpy_helper.from_array(np.array([-1, 2 * WIDTH], np.int64), "flat")]
    nodes = [
        helper.make_node("ReduceSum", ["x", "one"], ["sums"], keepdims=0),
        helper.make_node("Greater", ["sums", "zero"], ["positive"]),
        helper.make_node("NonZero", ["positive"], ["found"]),
        helper.make_node("Squeeze", ["found", "first"], ["rows"]),
        helper.make_node("Gather", ["x", "rows"], ["picked"], axis=0),
        helper.make_node("MatMul", ["picked", "w"], ["wide"]),
        helper.make_node("Reshape", ["wide", "flat"], ["wide_flat"]),
        helper.make_node("Relu", ["wide_flat"], ["act"]),
        helper.make_node("MatMul", ["act", "w2"], ["narrow"]),
        helper.make_node("Unsqueeze", ["rows", "one"], ["index"]),
        helper.make_node("ScatterND", ["x", "index", "narrow"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "selected_rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, WIDTH])]
                              + ([helper.make_tensor_value_info("act", TensorProto.FLOAT, ["selected", 2 * WIDTH])]
                                 if expose else []), inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _inputs(seed=0):
    x = np.random.default_rng(seed).standard_normal((ROWS, WIDTH)).astype(np.float32)
    return {"x": -np.abs(x) if seed == 2 else x}   # seed 2: no row selected


def test_data_dependent_dims_get_symbols_and_bounds(tmp_path):
    canonical = canonicalize(_selected_rows_model(tmp_path / "m.onnx"), {}, tmp_path / "work")
    bounds = read_bounds(canonical.model)
    graph = build_graph(canonical.model)
    # NonZero of ROWS booleans selects at most ROWS rows; the Reshape's -1 keeps that bound.
    for name, shape in [("found", (1, ROWS)), ("rows", (ROWS,)), ("picked", (ROWS, WIDTH)),
                        ("wide_flat", (ROWS, 2 * WIDTH)), ("narrow", (ROWS, WIDTH))]:
        info = graph.tensors[name]
        assert info.shape == shape and info.is_data_dependent, name
        assert info.dynamic == (len(shape) - 1 if name == "found" else 0,), name
    assert not graph.tensors["y"].is_data_dependent and not graph.tensors["sums"].is_data_dependent
    assert set(bounds.values()) == {ROWS}
    # The canonical file declares the symbols, not the bounds: onnxruntime runs any count.
    typed = {v.name: v for v in canonical.model.graph.value_info}
    assert typed["picked"].type.tensor_type.shape.dim[0].dim_param in bounds


def test_dynamic_dims_are_never_split(tmp_path):
    canonical = canonicalize(_selected_rows_model(tmp_path / "m.onnx"), {}, tmp_path / "work")
    graph = build_graph(canonical.model)
    mesh = LogicalMesh((2, 2), (0, 1, 2, 3))
    split_somewhere = False
    for node in graph.nodes:
        for strategy in node_strategies(node, graph, mesh):
            for name, spec in zip(node.inputs + node.outputs, strategy.inputs + strategy.outputs):
                if not name or spec is None:
                    continue
                info = graph.tensors[name]
                assert all(spec.dims[axis] == "R" for axis in info.dynamic), (node.name, str(strategy))
                split_somewhere |= info.is_data_dependent and not spec.is_replicated
    assert split_somewhere   # the MatMuls still split their weights' static dims


def _cut_through(path, tmp_path):
    """The selected-rows model on four one-device stages: data-dependent tensors cross."""
    plan = make_plan(path, make_cluster((1, 4), "cpu"), {}, tmp_path / "plan",
                     PlanOptions(num_layers=len(onnx.load(str(path)).graph.node), submeshes=[(1, 1)], all_devices=True))
    assert len(plan.stages) == 4
    crossing = [t for t in plan.transfers if t.dst_stage >= 0]
    assert crossing and all(t.is_dynamic for t in crossing)   # sent whole, shape first
    assert not any(r.tensor == t.tensor for r in plan.reshardings for t in crossing)
    return plan


def test_data_dependent_tensors_cross_stages_in_process(tmp_path):
    plan = _cut_through(_selected_rows_model(tmp_path / "m.onnx"), tmp_path)
    for seed in range(3):
        feeds = _inputs(seed)
        assert_close(run_in_process(plan, tmp_path / "plan", feeds), reference_outputs(plan, feeds))


@pytest.mark.mpi
@pytest.mark.parametrize("seed", [0, 2], ids=["some_rows", "no_rows"])
def test_data_dependent_tensors_cross_stages_under_mpiexec(seed, tmp_path):
    plan = _cut_through(_selected_rows_model(tmp_path / "m.onnx"), tmp_path)
    check_against_onnxruntime(plan, tmp_path / "plan", _inputs(seed), tmp_path, "--repeat", "2")


@pytest.mark.parametrize("mesh", [(1, 2), (1, 4), (2, 2)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_selected_rows_plan_runs_in_process(mesh, tmp_path):
    path = _selected_rows_model(tmp_path / "m.onnx")
    plan = make_plan(path, make_cluster(mesh, "cpu"), {}, tmp_path / "plan", PlanOptions(num_layers=4, all_devices=True))
    for seed in range(3):   # different inputs select different numbers of rows
        feeds = _inputs(seed)
        assert_close(run_in_process(plan, tmp_path / "plan", feeds), reference_outputs(plan, feeds))


@pytest.mark.mpi
def test_selected_rows_run_under_mpiexec(tmp_path):
    """The products split Megatron's way (the automatic plan keeps this small model whole)."""
    path = _selected_rows_model(tmp_path / "m.onnx")
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan",
                     PlanOptions(num_layers=1, all_devices=True, policy="megatron"))
    assert any(spec != "R" * len(spec) for s in plan.stages for spec in s.strategies.values())
    check_against_onnxruntime(plan, tmp_path / "plan", _inputs(1), tmp_path)


@pytest.mark.mpi
@pytest.mark.parametrize("seed", [0, 2], ids=["some_rows", "no_rows"])
def test_a_data_dependent_output_reaches_rank_0_shape_first(seed, tmp_path):
    path = _selected_rows_model(tmp_path / "m.onnx", expose=True)
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan",
                     PlanOptions(num_layers=4, submeshes=[(1, 1)], all_devices=True))
    sent = [t for t in plan.transfers if t.tensor == "act"]
    assert len(sent) == 1 and sent[0].src_rank == 1 and sent[0].shape == [-1, 2 * WIDTH]
    check_against_onnxruntime(plan, tmp_path / "plan", _inputs(seed), tmp_path)


def _range_model(path):
    """r = arange(max(n)): no rule bounds the length (a value read as a size)."""
    nodes = [helper.make_node("ReduceMax", ["n"], ["top"], keepdims=0),
             helper.make_node("Range", ["zero", "top", "step"], ["r"]),
             helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["rf", "rf"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "step")]
    graph = helper.make_graph(nodes, "range", [helper.make_tensor_value_info("n", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["length"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_a_dim_no_rule_bounds_takes_a_sample_runs_size(tmp_path):
    path = _range_model(tmp_path / "range.onnx")
    canonical = canonicalize(path, {}, tmp_path / "work")
    graph = build_graph(canonical.model)
    sampled = read_sampled(canonical.model)
    assert graph.tensors["r"].is_data_dependent and graph.tensors["y"].is_data_dependent
    symbol = next(d.dim_param for v in canonical.model.graph.value_info if v.name == "r"
                  for d in v.type.tensor_type.shape.dim)
    assert sampled == [symbol] and read_bounds(canonical.model)[symbol] == graph.tensors["r"].shape[0] > 0
    assert not (tmp_path / "work" / "sample-run.onnx").exists()
    plan = make_plan(path, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan", PlanOptions())
    for top in (0, 5, 300):   # any length runs, whatever the sample gave
        feeds = {"n": np.array([1, top, 2], np.int64)}
        out = run_in_process(plan, tmp_path / "plan", feeds)
        assert out["y"].shape == (max(top, 2),)
        assert_close(out, reference_outputs(plan, feeds))


def test_a_dim_without_a_bound_or_a_sample_is_one_error_line(tmp_path):
    # StringSplit's width is the most pieces of a string: no rule, and no random strings.
    node = helper.make_node("StringSplit", ["s"], ["pieces", "counts"], delimiter=" ")
    graph = helper.make_graph([node], "split", [helper.make_tensor_value_info("s", TensorProto.STRING, [2])],
                              [helper.make_tensor_value_info("pieces", TensorProto.STRING, [2, None]),
                               helper.make_tensor_value_info("counts", TensorProto.INT64, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "split.onnx")
    with pytest.raises(ModelError, match="has a dynamic dimension after folding, with no known upper bound"):
        canonicalize(tmp_path / "split.onnx", {}, tmp_path / "work")
    done = run_cli("plan", tmp_path / "split.onnx", "--mesh", "1x2", "-o", tmp_path / "plan")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("meshplan: error:") and "no known upper bound" in done.stderr


def _bound_case(name):
    """(nodes, inputs, initializers, output, expected shape at the bound) for one rule."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    scalar = lambda n, v, dt=np.int64: numpy_helper.from_array(np.array(v, dt), n)   # noqa: E731
    return {
        "compress_axis": ([helper.make_node("ReduceSum", ["x", "one"], ["sums"], keepdims=0),
                           helper.make_node("Greater", ["sums", "zero"], ["mask"]),
                           helper.make_node("Compress", ["x", "mask"], ["y"], axis=0)],
                          [("x", f, [6, 5])], [scalar("zero", 0.0, np.float32), scalar("one", [1])], "y", (6, 5)),
        "unique": ([helper.make_node("Unique", ["x"], ["y", "first", "inverse", "counts"], sorted=1)],
                   [("x", f, [4, 3])], [], "y", (12,)),
        "top_k_computed_k": ([helper.make_node("ReduceMax", ["k_src"], ["kmax"], axes=[1], keepdims=0),
                              helper.make_node("Cast", ["kmax"], ["k1"], to=i64),
                              helper.make_node("Clip", ["k1", "kzero", "seven"], ["k"]),
                              helper.make_node("TopK", ["x", "k"], ["y", "idx"], axis=1)],
                             [("x", f, [2, 7]), ("k_src", f, [1, 3])],
                             [scalar("kzero", 0), scalar("seven", 7)], "y", (2, 7)),
        "nms": ([helper.make_node("NonMaxSuppression", ["boxes", "scores", "limit"], ["y"])],
                [("boxes", f, [2, 5, 4]), ("scores", f, [2, 3, 5])], [scalar("limit", [4])], "y", (30, 3)),
        "concat_of_two": ([helper.make_node("NonZero", ["x"], ["a"]),
                           helper.make_node("NonZero", ["z"], ["b"]),
                           helper.make_node("Concat", ["a", "b"], ["y"], axis=1)],
                          [("x", f, [3, 2]), ("z", f, [4, 2])], [], "y", (2, 14)),
    }[name]


@pytest.mark.parametrize("name", ["compress_axis", "unique", "top_k_computed_k", "nms", "concat_of_two"])
def test_each_rule_bounds_its_output(name, tmp_path):
    nodes, inputs, inits, output, expected = _bound_case(name)
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(output, TensorProto.INT64 if name in ("nms", "concat_of_two")
                                                             else TensorProto.FLOAT, [None] * len(expected))],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    canonical = canonicalize(tmp_path / "m.onnx", {}, tmp_path / "work")
    info = build_graph(canonical.model).tensors[output]
    assert info.shape == expected and info.is_data_dependent
    assert read_sampled(canonical.model) == []   # bounded by a rule, not by a sample run
    plan = make_plan(tmp_path / "m.onnx", make_cluster((1, 2), "cpu"), {}, tmp_path / "plan", PlanOptions())
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, _, s in inputs}
    assert_close(run_in_process(plan, tmp_path / "plan", feeds), reference_outputs(plan, feeds))
