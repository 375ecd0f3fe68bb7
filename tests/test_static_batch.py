"""Microbatches on a static batch dimension: the dynamo-exported GPT (static batch 8)
planned with --microbatches 4 and run in-process and under mpiexec; the rewrite itself
against onnxruntime; --batch-dim's forms; and the clear refusals."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshplan.cost.cluster import make_cluster
from meshplan.errors import ModelError, PlanError
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import batch_layout, make_plan, static_batch_rewrite
from meshplan.model.load import canonicalize
from meshplan.runtime.inprocess import reference_outputs, run_in_process
from sample_models import SAMPLE_DIR, SAMPLES, make_inputs
from tests.conftest import assert_close, check_against_onnxruntime, run_cli, save_npz

DYNAMO = SAMPLE_DIR / "gpt_dynamo.onnx"


def _ids(seed: int = 0) -> dict[str, np.ndarray]:
    return {"input_ids": np.random.RandomState(seed).randint(0, 256, (8, 16)).astype(np.int64)}


def _session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


# --- the dynamo export -----------------------------------------------------------------

def test_dynamo_sample_has_a_static_batch():
    model = onnx.load(str(DYNAMO), load_external_data=False)
    assert DYNAMO.stat().st_size < 2 * 1024 * 1024
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [8, 16]
    assert not any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)


@pytest.mark.parametrize("parts", [4, 8])
def test_rewritten_model_is_the_sliced_batch(parts, tmp_path):
    """The canonical model rewritten to 8/parts samples, run by onnxruntime on the first
    microbatch, gives the original model's outputs for those samples."""
    batch, dims = batch_layout(onnx.load(str(DYNAMO), load_external_data=False), {}, parts)
    canonical = canonicalize(DYNAMO, dims, tmp_path, static_batch_rewrite(batch, parts))
    size = 8 // parts
    assert [d.dim_value for d in canonical.model.graph.input[0].type.tensor_type.shape.dim] == [size, 16]
    assert batch["axes"] == {"input_ids": 0, "logits": 0}
    assert len(batch["rewritten"]["shape_constants"]) == 4      # the Reshape targets with 8 (or 8 x 16) in them
    assert len(batch["rewritten"]["constants_cut"]) == 3        # the position table and the two causal masks
    ids = _ids()["input_ids"]
    full = _session(DYNAMO).run(None, {"input_ids": ids})[0]
    for mb in (0, parts - 1):
        part = _session(canonical.path).run(None, {"input_ids": ids[mb * size:(mb + 1) * size]})[0]
        np.testing.assert_allclose(part, full[mb * size:(mb + 1) * size], rtol=1e-4, atol=1e-5)


@pytest.mark.mpi
def test_dynamo_export_plans_and_runs_with_microbatches(tmp_path):
    plan_dir = tmp_path / "plan"
    result = run_cli("plan", DYNAMO, "--mesh", "1x2", "--device", "cpu", "--microbatches", "4", "-o", plan_dir)
    assert result.returncode == 0, result.stderr
    assert ("batch: static dimension 8 (axis 0 of input_ids) rewritten to 2 per microbatch: 4 shape constant(s), "
            "3 constant(s) cut to one microbatch") in result.stdout
    from meshplan.plan_format import read_plan

    plan = read_plan(plan_dir)
    assert plan.microbatches == 4 and plan.batch["size"] == 8 and plan.batch["microbatch_size"] == 2
    assert [s.shape for s in plan.inputs] == [[8, 16]] and [s.shape for s in plan.outputs] == [[8, 16, 256]]
    check_against_onnxruntime(plan, plan_dir, _ids(1), tmp_path)
    verified = run_cli("verify", plan_dir, "--inputs", save_npz(tmp_path / "v.npz", _ids(2)))
    assert verified.returncode == 0 and "PASSED" in verified.stdout, verified.stderr


def test_dynamo_export_sharded_stage(tmp_path):
    """A data-parallel stage inside a microbatch: the rewritten constants split again."""
    plan = make_plan(DYNAMO, make_cluster((1, 2), "cpu"), {}, tmp_path / "plan",
                     PlanOptions(microbatches=2, max_stages=1, policy="data"))
    assert plan.stages[0].strategies
    inputs = _ids(3)
    assert_close(run_in_process(plan, tmp_path / "plan", inputs), reference_outputs(plan, inputs))


def test_exporter_shape_computations_folded_at_a_static_batch(tmp_path):
    """The GPT sample (its Reshape targets built by Shape -> Gather -> Concat, positions by
    Range) with its inputs and outputs declared static: folding turns the shape
    computations into constants holding the batch, which the rewrite then changes."""
    model = SAMPLES["gpt"].load()
    for value in list(model.graph.input) + list(model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_value = {"batch": 4, "seq": 16}[dim.dim_param]
    plan, plan_dir = _plan(model, tmp_path, 2)
    assert plan.batch["microbatch_size"] == 2 and len(plan.batch["rewritten"]["shape_constants"]) > 0
    _check(plan, plan_dir, make_inputs("gpt", {"batch": 4, "seq": 16}, seed=4))


# --- small static models ----------------------------------------------------------------

def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _plan(model: onnx.ModelProto, tmp_path, microbatches: int, batch_dim=(), dims=None, mesh=(1, 2)):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    plan_dir = tmp_path / "plan"
    plan = make_plan(path, make_cluster(mesh, "cpu"), dims or {}, plan_dir,
                     PlanOptions(microbatches=microbatches, batch_dim=tuple(batch_dim)))
    return plan, plan_dir


def _check(plan, plan_dir, inputs):
    assert_close(run_in_process(plan, plan_dir, inputs), reference_outputs(plan, inputs))


def _seq_first(x_shape=(16, 8, 4), y_shape=(16, 8, 4), z_shape=(8, 3)) -> onnx.ModelProto:
    """x [16 (seq), 8 (batch), 4]: y = relu(x) keeps the batch at axis 1; z flattens each
    sample's [16, 4] after a transpose (Reshape [8, 64]) and projects it."""
    rng = np.random.RandomState(0)
    nodes = [
        helper.make_node("Relu", ["x"], ["y"]),
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["t", "flat"], ["f"]),
        helper.make_node("MatMul", ["f", "w"], ["z"]),
    ]
    return _model(nodes, [_vi("x", list(x_shape))], [_vi("y", list(y_shape)), _vi("z", list(z_shape))],
                  [_const("flat", [8, 64], np.int64), _const("w", rng.randn(64, 3))])


@pytest.mark.parametrize("batch_dim, symbolic", [("x:1", False), ("batch", True), ("x:1", True)])
def test_batch_dim_not_at_axis_zero(batch_dim, symbolic, tmp_path):
    """A batch at axis 1 of the input, at axis 0 of one output and 1 of the other; static,
    or symbolic (fixed by --dim, then rewritten as a static one)."""
    model = (_seq_first(["seq", "batch", 4], ["seq", "batch", 4], ["batch", 3]) if symbolic else _seq_first())
    plan, plan_dir = _plan(model, tmp_path, 4, [batch_dim], {"batch": 8, "seq": 16} if symbolic else {})
    assert plan.batch["dim"] == ("batch" if symbolic else None)
    assert plan.batch["axes"] == {"x": 1, "y": 1, "z": 0}
    assert [s.shape for s in plan.outputs] == [[16, 8, 4], [8, 3]]
    _check(plan, plan_dir, {"x": np.random.RandomState(1).randn(16, 8, 4).astype(np.float32)})


def test_batch_dim_negative_axis(tmp_path):
    layout, _ = batch_layout(_seq_first(), {}, 2, ("x:-2",))
    assert layout["axes"] == {"x": 1} and layout["microbatch_size"] == 4


def test_default_axis_zero_of_the_seq_first_model_is_refused(tmp_path):
    """Without --batch-dim, axis 0 (16) is taken for the batch; after the Transpose and
    Reshape the MatMul sums over it, which the rewrite refuses."""
    with pytest.raises(PlanError, match="MatMul node 'MatMul_3' .* carries the batch at axis 1"):
        _plan(_seq_first(), tmp_path, 2)
    assert not (tmp_path / "plan").exists()


def _symbolic_two_dims() -> onnx.ModelProto:
    """pos ['seq'] comes first, so the default batch would be 'seq'; x is ['batch', 'seq', 4]."""
    nodes = [helper.make_node("Unsqueeze", ["pos", "axes"], ["p"]), helper.make_node("Add", ["x", "p"], ["y"])]
    return _model(nodes, [_vi("pos", ["seq"]), _vi("x", ["batch", "seq", 4])], [_vi("y", ["batch", "seq", 4])],
                  [_const("axes", [1], np.int64)])


@pytest.mark.parametrize("batch_dim", ["batch", "x:0"])
def test_batch_dim_names_a_symbolic_dim(batch_dim, tmp_path):
    plan, plan_dir = _plan(_symbolic_two_dims(), tmp_path, 2, [batch_dim], {"batch": 4, "seq": 8})
    assert plan.batch["dim"] == "batch" and plan.batch["batched_inputs"] == ["x"]
    rng = np.random.RandomState(0)
    _check(plan, plan_dir, {"pos": rng.randn(8).astype(np.float32), "x": rng.randn(4, 8, 4).astype(np.float32)})


def test_symbolic_default_picks_the_first_input(tmp_path):
    """Without --batch-dim the first input's axis 0 ('seq') is the batch: at axis 1 of x and
    y, so rewritten as a static batch, and the report says so."""
    from meshplan.emit.report import text_report

    plan, plan_dir = _plan(_symbolic_two_dims(), tmp_path, 2, dims={"batch": 4, "seq": 8})
    assert plan.batch["dim"] == "seq" and plan.batch["axes"] == {"pos": 0, "x": 1, "y": 1}
    assert "batch: dimension 'seq' 8 (axis 0 of pos, axis 1 of x) rewritten to 4 per microbatch" in text_report(plan)
    rng = np.random.RandomState(0)
    _check(plan, plan_dir, {"pos": rng.randn(8).astype(np.float32), "x": rng.randn(4, 8, 4).astype(np.float32)})


@pytest.mark.parametrize("batch_dim, message", [
    ("heads", "--batch-dim 'heads' is neither a symbolic dimension nor INPUT:AXIS"),
    ("ids:0", "--batch-dim ids:0: the model has no input 'ids' (inputs: x [16, 8, 4])"),
    ("x:3", "--batch-dim x:3: input 'x' [16, 8, 4] has no axis 3"),
    ("x:-4", "has no axis -4"),
])
def test_batch_dim_that_does_not_exist(batch_dim, message):
    with pytest.raises(PlanError) as error:
        batch_layout(_seq_first(), {}, 2, (batch_dim,))
    assert message in str(error.value)


def test_batch_dim_left_unknown():
    with pytest.raises(ModelError, match=r"the batch dimension 'batch' is unknown \(fix it with --dim batch=INT\)"):
        batch_layout(_symbolic_two_dims(), {"seq": 8}, 2, ("batch",))


def test_batch_dim_places_of_different_sizes():
    model = _model([helper.make_node("Add", ["a", "b"], ["c"])], [_vi("a", [8, 4]), _vi("b", [8, 4])], [_vi("c", [8, 4])])
    with pytest.raises(PlanError, match=r"different sizes \(a:0 is 8, b:1 is 4\)"):
        batch_layout(model, {}, 2, ("a:0", "b:1"))


def test_static_batch_not_divisible():
    with pytest.raises(PlanError, match=r"the static batch \(axis 1 of input 'x'\) = 8 is not divisible by --microbatches 3"):
        batch_layout(_seq_first(), {}, 3, ("x:1",))


def _refused(model, tmp_path, match, microbatches=2, batch_dim=()):
    with pytest.raises(PlanError, match=match):
        _plan(model, tmp_path, microbatches, batch_dim)
    assert not (tmp_path / "plan").exists()


def test_reduction_over_the_batch_is_refused(tmp_path):
    model = _model([helper.make_node("ReduceMean", ["x"], ["y"], axes=[0], keepdims=0)],
                   [_vi("x", [8, 4])], [_vi("y", [4])])
    _refused(model, tmp_path, r"ReduceMean node 'ReduceMean_0' \(its input 'x' carries the batch at axis 0\): "
                              "the operator combines values across the batch axis")


def test_reshape_that_cuts_the_batch_unevenly_is_refused(tmp_path):
    """[8, 16] -> [4, 32]: four microbatches of 2 samples are rows of the [4, 32] view,
    eight of one sample are not."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"])]
    model = _model(nodes, [_vi("x", [8, 16])], [_vi("y", [4, 32])], [_const("shape", [4, 32], np.int64)])
    _refused(model, tmp_path / "eight", "Reshape node 'Reshape_0' .*: the new shape does not keep each microbatch of 1 "
             r"sample\(s\) inside one dimension", microbatches=8)
    plan, plan_dir = _plan(model, tmp_path / "four", 4)
    _check(plan, plan_dir, {"x": np.arange(128, dtype=np.float32).reshape(8, 16)})


def _seq_major(output_flat: bool = False) -> onnx.ModelProto:
    """What torch's MultiheadAttention does with a batch-first input: x [8, 4, 6] goes
    seq-first ([4, 8, 6]) and is flattened to [32, 6] for a projection, so the batch sits
    inside dim 0 after the 4 positions; a constant [32, 5] the same for every sample is
    added; then back to [8, 4, 5]."""
    rng = np.random.RandomState(0)
    per_position = np.repeat(rng.randn(4, 1, 5), 8, axis=1).reshape(32, 5)
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["t", "flat"], ["f"]),
        helper.make_node("MatMul", ["f", "w"], ["p"]),
        helper.make_node("Add", ["p", "bias"], ["q"]),
        helper.make_node("Reshape", ["q", "unflat"], ["u"]),
        helper.make_node("Transpose", ["u"], ["y"], perm=[1, 0, 2]),
    ]
    outputs = [_vi("q", [32, 5])] if output_flat else [_vi("y", [8, 4, 5])]
    return _model(nodes, [_vi("x", [8, 4, 6])], outputs,
                  [_const("flat", [32, 6], np.int64), _const("w", rng.randn(6, 5)), _const("bias", per_position),
                   _const("unflat", [4, 8, 5], np.int64)])


def test_batch_inside_a_flattened_dim(tmp_path):
    plan, plan_dir = _plan(_seq_major(), tmp_path, 4)
    assert plan.batch["rewritten"] == {"shape_constants": ["flat", "unflat"], "constants_cut": ["bias"]}
    _check(plan, plan_dir, {"x": np.random.RandomState(1).randn(8, 4, 6).astype(np.float32)})


def test_output_with_the_batch_inside_a_dim_is_refused(tmp_path):
    _refused(_seq_major(output_flat=True), tmp_path, "model output 'q' carries the batch inside its axis 0, after 4 other")


def test_constant_that_differs_between_microbatches_is_refused(tmp_path):
    """A per-sample constant cannot be one program's constant for every microbatch."""
    model = _model([helper.make_node("Add", ["x", "c"], ["y"])], [_vi("x", [8, 4])], [_vi("y", [8, 4])],
                   [_const("c", np.arange(8).reshape(8, 1))])
    _refused(model, tmp_path, r"constant 'c' \[8, 1\] differs between the microbatches")


def test_constant_the_same_for_every_microbatch_is_cut(tmp_path):
    same = np.tile(np.arange(4, dtype=np.float32), (8, 1))
    model = _model([helper.make_node("Add", ["x", "c"], ["y"])], [_vi("x", [8, 4])], [_vi("y", [8, 4])],
                   [_const("c", same)])
    plan, plan_dir = _plan(model, tmp_path, 4)
    assert plan.batch["rewritten"] == {"shape_constants": [], "constants_cut": ["c"]}
    _check(plan, plan_dir, {"x": np.random.RandomState(0).randn(8, 4).astype(np.float32)})


def test_expansion_left_in_the_graph_follows_the_batch(tmp_path):
    """An Expand to the batch that folding keeps (its output is too large to fold) is
    given the microbatch shape."""
    nodes = [helper.make_node("Expand", ["row", "shape"], ["wide"]), helper.make_node("Add", ["x", "wide"], ["y"])]
    model = _model(nodes, [_vi("x", [8, 128, 128])], [_vi("y", [8, 128, 128])],
                   [_const("row", np.arange(128)), _const("shape", [8, 128, 128], np.int64)])
    plan, plan_dir = _plan(model, tmp_path, 2)
    assert plan.batch["rewritten"]["shape_constants"] == ["shape"]
    _check(plan, plan_dir, {"x": np.random.RandomState(0).randn(8, 128, 128).astype(np.float32)})


def test_computed_tensor_that_cannot_follow_the_batch_is_refused(tmp_path):
    """ConstantOfShape has no rule that splits its output: its [8, 128, 128] zeros (too
    large to fold) cannot be made per microbatch."""
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["zeros"]), helper.make_node("Add", ["x", "zeros"], ["y"])]
    model = _model(nodes, [_vi("x", [8, 128, 128])], [_vi("y", [8, 128, 128])],
                   [_const("shape", [8, 128, 128], np.int64)])
    _refused(model, tmp_path, r"tensor 'zeros' \(output of ConstantOfShape node 'ConstantOfShape_0'\) is needed per "
                              "microbatch along axis 0, which ConstantOfShape cannot give")


def test_unnamed_batched_input_is_refused(tmp_path):
    model = _model([helper.make_node("Add", ["x", "y"], ["z"])], [_vi("x", [8, 4]), _vi("y", [8, 4])], [_vi("z", [8, 4])])
    _refused(model, tmp_path, r"input 'y' has size 8 at axis 0 .* --batch-dim y:0", batch_dim=["x:0"])
    plan, plan_dir = _plan(model, tmp_path / "both", 2, ["x:0", "y:0"])
    rng = np.random.RandomState(0)
    _check(plan, plan_dir, {"x": rng.randn(8, 4).astype(np.float32), "y": rng.randn(8, 4).astype(np.float32)})


# --- the command line -------------------------------------------------------------------

@pytest.mark.parametrize("args, fragment", [
    (["--microbatches", "3"], "the static batch (axis 0 of input 'input_ids') = 8 is not divisible by --microbatches 3"),
    (["--microbatches", "2", "--batch-dim", "input_ids:5"], "--batch-dim input_ids:5: input 'input_ids' [8, 16] has no axis 5"),
])
def test_cli_one_error_line(args, fragment, tmp_path):
    result = run_cli("plan", DYNAMO, "--mesh", "1x2", *args, "-o", tmp_path / "out")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("meshplan: error:") and fragment in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_profile_measures_the_rewritten_microbatch(tmp_path):
    """``profile --microbatches 4`` times the programs a 4-microbatch plan runs (2 samples),
    so that plan takes every operator's cost from measurements."""
    from click.testing import CliRunner

    from cli.plan_cmd import plan as plan_command
    from cli.profile_cmd import profile as profile_command

    runner = CliRunner()
    profiled = runner.invoke(profile_command, [
        str(DYNAMO), "--mesh", "1x1", "--provider", "cpu", "--threads", "1", "--cache", str(tmp_path / "c.sqlite"),
        "--budget-ms", "0.5", "--microbatches", "4", "-o", str(tmp_path / "p.json")])
    assert profiled.exit_code == 0, profiled.output
    planned = runner.invoke(plan_command, [str(DYNAMO), "--mesh", "1x1", "--microbatches", "4",
                                           "--profile", str(tmp_path / "p.json"), "-o", str(tmp_path / "plan")])
    assert planned.exit_code == 0, planned.output
    assert "costs: 60 operator(s) measured, 0 from the analytic model" in planned.output, planned.output
