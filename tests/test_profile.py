"""meshplan.profile without MPI: signatures, timing, cache, profile file, cost model, CLI."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from cli.main import main as meshplan_command
from cli.profile_cmd import profile as profile_command
from meshplan.cost.cluster import make_cluster
from meshplan.errors import PlanError
from meshplan.model.graph import build_graph
from meshplan.files import file_sha256
from meshplan.model.load import infer_shapes
from meshplan.profile import ProfiledCostModel, ProfileOptions, load_profile, profile_model, write_profile
from meshplan.profile.cache import OpKey, ProfileCache
from meshplan.profile.comm import cluster_fits, fit_latency_bandwidth
from meshplan.profile.errors import ProfileError
from meshplan.profile.signatures import Variant, build_timing_model, collect_signatures, signature_of
from meshplan.profile.timing import OpTimer, TimingConfig, cuda_usable, resolve_provider
from meshplan.reshard.steps import CollectiveModel
from meshplan.sharding import LogicalMesh
from meshplan.profile.variants import sharded_variants
from sample_models import SAMPLES
from tests.conftest import run_signature, sharded_signatures

FAST = TimingConfig(budget_seconds=0.002, warmup_seconds=0.0005, min_repeats=3, max_repeats=50, max_copies=4)
F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, F32, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, F32, None) for n in outputs], initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return infer_shapes(model)


def _weights(name, shape):
    return numpy_helper.from_array(np.ones(shape, dtype=np.float32), name)


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    onnx.save_model(SAMPLES["mlp"].build(), str(path))
    return path


def _options(tmp_path, **kw):
    return ProfileOptions(provider="cpu", threads=1, cache_path=tmp_path / "cache.sqlite", timing=FAST, **kw)


# --- signatures ---------------------------------------------------------------------

def test_same_operator_twice_is_one_signature():
    model = _model(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="a"), helper.make_node("MatMul", ["h", "w2"], ["y"], name="b"),
         helper.make_node("MatMul", ["y", "w3"], ["z"], name="c")],
        [("x", [8, 64])], ["z"], [_weights("w1", [64, 64]), _weights("w2", [64, 64]), _weights("w3", [64, 32])])
    graph = build_graph(model)
    found = collect_signatures(graph, model)
    assert len(found) == 2
    counts = sorted(entry.count for entry in found.values())
    assert counts == [1, 2]
    twice = next(e for e in found.values() if e.count == 2)
    assert twice.nodes == ["a", "b"]
    assert signature_of(graph.nodes[0], graph).key == signature_of(graph.nodes[1], graph).key
    assert signature_of(graph.nodes[0], graph).key != signature_of(graph.nodes[2], graph).key


def test_gpt_signatures_dedup_across_layers(tmp_path):
    from meshplan.model.load import canonicalize

    path = tmp_path / "gpt.onnx"
    onnx.save_model(SAMPLES["gpt"].build(), str(path))
    canonical = canonicalize(path, {"batch": 2, "seq": 8}, tmp_path)
    graph = build_graph(canonical.model)
    found = collect_signatures(graph, canonical.model, canonical.path.parent)
    assert len(found) < len(graph.nodes) / 4           # four identical layers share their signatures
    assert sum(e.count for e in found.values()) == len(graph.nodes)


def test_sharded_variants_run_with_their_rewritten_shape_constants(tmp_path):
    """Every sharded signature of the GPT sample (Reshape targets rewritten to local shapes)
    builds and runs in onnxruntime: none is timed with the whole tensor's constants."""
    path = tmp_path / "gpt.onnx"
    onnx.save_model(SAMPLES["gpt"].build(), str(path))
    reshapes = sharded_signatures(path, {"batch": 4, "seq": 8}, (2, 2), "Reshape", tmp_path)
    assert reshapes
    for entry in reshapes:
        run_signature(entry)


def test_shape_constants_stay_initializers_weights_become_inputs():
    shape = numpy_helper.from_array(np.array([4, 16], dtype=np.int64), "target")
    model = _model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                    helper.make_node("Reshape", ["h", "target"], ["y"], name="rs")],
                   [("x", [8, 8])], ["y"], [_weights("w", [8, 8]), shape])
    graph = build_graph(model)
    found = collect_signatures(graph, model)
    reshape = next(e for e in found.values() if e.signature.op_type == "Reshape")
    assert reshape.signature.inputs[1][2] == "const"
    timing = build_timing_model(reshape.spec)
    assert [i.name for i in timing.graph.initializer] == ["in1"]
    assert numpy_helper.to_array(timing.graph.initializer[0]).tolist() == [4, 16]
    matmul = next(e for e in found.values() if e.signature.op_type == "MatMul")
    assert [i[2] for i in matmul.signature.inputs] == ["act", "weight"]
    timing = build_timing_model(matmul.spec, copies=3, weights={1: np.ones((8, 8), np.float32)})
    assert [i.name for i in timing.graph.input] == ["in0"]          # the activation stays an input: nothing folds
    assert [i.name for i in timing.graph.initializer] == ["in1"]    # the weight can be prepacked, as in the program
    assert len(timing.graph.node) == 3 and len(timing.graph.output) == 3
    onnx.checker.check_model(timing)


def test_variants_add_sharded_shapes():
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [("x", [8, 64])], ["y"],
                   [_weights("w", [64, 32])])
    graph = build_graph(model)

    def halves(node, graph):
        yield Variant(((8, 64), (64, 16)))         # column-split weight
        yield Variant(((8, 64), (63, 5)))          # impossible: skipped

    found = collect_signatures(graph, model, variants=halves)
    assert len(found) == 2
    variant = next(e for e in found.values() if "model:variant" in e.sources)
    assert variant.signature.outputs[0][1] == (8, 16)


def test_sharded_variants_follow_the_planners_meshes():
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [("x", [8, 64])], ["y"],
                   [_weights("w", [64, 32])])
    graph = build_graph(model)
    node = graph.nodes[0]
    assert list(sharded_variants(make_cluster((1, 1), "cpu"))(node, graph)) == []   # one device: nothing sharded
    pair = [v.shapes for v in sharded_variants(make_cluster((1, 2), "cpu"))(node, graph)]
    assert len(pair) == len(set(pair))
    assert {((4, 64), (64, 32)), ((8, 32), (32, 32)), ((8, 64), (64, 16))} <= set(pair)   # batch, rows, columns
    quad = {v.shapes for v in sharded_variants(make_cluster((2, 2), "cpu"))(node, graph)}
    assert set(pair) <= quad                                          # the 1x2 submesh is tried on 2x2 too
    assert {((2, 64), (64, 32)), ((8, 64), (64, 8)), ((4, 64), (64, 16))} <= quad   # 1x4 view, 2x2 mesh
    variants = sharded_variants(make_cluster((1, 2), "cpu"))
    found = collect_signatures(graph, model, variants=variants)
    assert len(found) == 1 + len([v for v in pair if v != ((8, 64), (64, 32))])


# --- timing -------------------------------------------------------------------------

def _matmul_spec(n):
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [("x", [n, n])], ["y"],
                   [_weights("w", [n, n])])
    graph = build_graph(model)
    return next(iter(collect_signatures(graph, model).values())).spec


def test_big_matmul_takes_longer_than_small():
    timer = OpTimer("CPUExecutionProvider", 1, FAST)
    small = timer.time(_matmul_spec(16))
    big = timer.time(_matmul_spec(256))
    assert small.error is None and big.error is None
    assert 0 < small.seconds < big.seconds
    assert big.seconds > 5 * small.seconds
    assert small.copies > 1            # a tiny operator is timed as K copies


def test_untimeable_operator_is_an_error_not_a_crash():
    spec = _matmul_spec(8)
    spec.signature = spec.signature.__class__("NoSuchOp", "", "{}", spec.signature.inputs, spec.signature.outputs)
    result = OpTimer("CPUExecutionProvider", 1, FAST).time(spec)
    assert result.seconds is None and result.error


def test_bad_provider():
    with pytest.raises(ProfileError, match="unknown provider"):
        resolve_provider("tpu")
    if not cuda_usable():
        with pytest.raises(ProfileError, match="CUDA"):
            resolve_provider("cuda")
    assert resolve_provider("cpu") == "CPUExecutionProvider"


# --- profile_model and the cache ------------------------------------------------------

def test_second_run_uses_the_cache(mlp_path, tmp_path, monkeypatch):
    cluster = make_cluster((1, 2), "cpu")
    first = profile_model(mlp_path, [("model", {"batch": 8})], cluster, _options(tmp_path))
    assert first.measured == first.profile.stats["signatures"] > 0 and first.cached == 0

    def no_timing(self, spec):
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(OpTimer, "time", no_timing)
    second = profile_model(mlp_path, [("model", {"batch": 8})], cluster, _options(tmp_path))
    assert second.measured == 0 and second.cached == first.measured
    assert {k: e.seconds for k, e in second.profile.operators.items()} == \
           {k: e.seconds for k, e in first.profile.operators.items()}
    assert all(e.source == "cache" for e in second.profile.operators.values())


def test_other_dims_time_only_what_is_new(mlp_path, tmp_path):
    cluster = make_cluster((1, 2), "cpu")
    profile_model(mlp_path, [("model", {"batch": 8})], cluster, _options(tmp_path))
    run = profile_model(mlp_path, [("model", {"batch": 8}), ("microbatches=2", {"batch": 4})], cluster, _options(tmp_path))
    assert run.cached > 0 and run.measured > 0
    assert run.measured + run.cached == run.profile.stats["signatures"]


def test_corrupt_cache_is_rebuilt(mlp_path, tmp_path):
    cache = tmp_path / "cache.sqlite"
    cache.write_bytes(b"this is not a database" * 100)
    run = profile_model(mlp_path, [("model", {"batch": 8})], make_cluster((1, 2), "cpu"), _options(tmp_path))
    assert run.cache_moved_aside is not None and run.cache_moved_aside.read_bytes().startswith(b"this is not")
    with sqlite3.connect(cache) as conn:
        assert conn.execute("SELECT COUNT(*) FROM op_times").fetchone()[0] == run.measured


def test_foreign_sqlite_file_is_not_written_into(tmp_path):
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    cache = ProfileCache(path)
    assert cache.moved_aside is not None
    cache.close()


def test_interrupt_keeps_what_was_measured(mlp_path, tmp_path, monkeypatch):
    real = OpTimer.time
    calls = []

    def interrupted(self, spec):
        calls.append(spec)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, spec)

    monkeypatch.setattr(OpTimer, "time", interrupted)
    with pytest.raises(KeyboardInterrupt):
        profile_model(mlp_path, [("model", {"batch": 8})], make_cluster((1, 2), "cpu"), _options(tmp_path))
    with ProfileCache(tmp_path / "cache.sqlite") as cache:
        assert cache.count_ops() == 2


def test_cache_is_keyed_by_threads_and_hardware(tmp_path):
    with ProfileCache(tmp_path / "c.sqlite") as cache:
        key = OpKey("cpu-a", "CPUExecutionProvider", "1.0", 1)
        cache.put_op(key, "sig", "MatMul", "{}", 1e-3)
        assert cache.get_ops(key, ["sig"])["sig"].seconds == 1e-3
        assert cache.get_ops(OpKey("cpu-a", "CPUExecutionProvider", "1.0", 2), ["sig"]) == {}
        assert cache.get_ops(OpKey("cpu-b", "CPUExecutionProvider", "1.0", 1), ["sig"]) == {}


# --- the profile file and the cost model ---------------------------------------------

@pytest.fixture()
def mlp_profile(mlp_path, tmp_path):
    cluster = make_cluster((1, 2), "cpu")
    run = profile_model(mlp_path, [("model", {"batch": 8})], cluster, _options(tmp_path))
    path = write_profile(run.profile, tmp_path / "mlp.profile.json")
    return path, cluster


def test_profile_file_contents(mlp_profile, mlp_path):
    path, _ = mlp_profile
    data = json.loads(path.read_text())
    assert data["format_version"] == 1 and data["kind"] == "meshplan-profile"
    assert data["model"]["sha256"] == file_sha256(mlp_path)
    assert data["model"]["dims"] == {"batch": 8}
    assert data["provider"] == "CPUExecutionProvider" and data["threads"] == 1 and data["onnxruntime"]
    assert data["communication_source"] == "cluster"
    assert all(f["source"] == "cluster" and f["bandwidth"] > 0 for f in data["communication"])
    assert data["cuda_aware_mpi"]["value"] is None
    measured = [op["seconds"] for op in data["operators"].values() if op["seconds"] is not None]
    assert measured and all(seconds > 0 for seconds in measured)


def test_profile_mismatch_is_a_plan_error(mlp_profile, mlp_path, tmp_path):
    path, cluster = mlp_profile
    sha = file_sha256(mlp_path)
    assert load_profile(path, sha, cluster).model["sha256"] == sha
    with pytest.raises(PlanError, match="another model"):
        load_profile(path, "0" * 64, cluster)
    with pytest.raises(PlanError, match="mesh 1x2, the plan is for 1x4"):
        load_profile(path, sha, make_cluster((1, 4), "cpu"))
    with pytest.raises(PlanError, match="device 'cpu'"):
        load_profile(path, sha, make_cluster((1, 2), "h100-80g"))
    newer = json.loads(path.read_text())
    newer["format_version"] = 99
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    with pytest.raises(PlanError, match="newer"):
        load_profile(tmp_path / "newer.json", sha, cluster)
    with pytest.raises(PlanError, match="not found"):
        load_profile(tmp_path / "missing.json", sha, cluster)


def test_profiled_cost_model(mlp_profile, mlp_path, tmp_path):
    from meshplan.model.load import canonicalize

    path, cluster = mlp_profile
    profile = load_profile(path, file_sha256(mlp_path), cluster)
    (tmp_path / "b8").mkdir()
    (tmp_path / "b3").mkdir()
    graph = build_graph(canonicalize(mlp_path, {"batch": 8}, tmp_path / "b8").model)
    model = ProfiledCostModel(cluster, profile)
    seconds = model.graph_seconds(graph)
    assert model.measured_nodes == len(graph.nodes) and model.analytic_nodes == 0
    # the measured operators count as many times over as the model run whole took their sum
    whole = profile.composition
    assert whole["label"] == "model" and whole["whole_seconds"] > 0
    assert whole["operators_seconds"] == pytest.approx(profile.total_seconds("model"))
    assert profile.composition_factor == pytest.approx(whole["whole_seconds"] / whole["operators_seconds"])
    for node, value in zip(graph.nodes, seconds):
        assert value == pytest.approx(profile.op_seconds(signature_of(node, graph).key) * profile.composition_factor)
    assert sum(seconds) == pytest.approx(whole["whole_seconds"])
    # a profile from before the composition was measured: the operators as timed
    older = json.loads(path.read_text())
    del older["composition"]
    (tmp_path / "older.json").write_text(json.dumps(older))
    plain = ProfiledCostModel(cluster, load_profile(tmp_path / "older.json", file_sha256(mlp_path), cluster))
    assert plain.graph_seconds(graph) == [profile.op_seconds(signature_of(n, graph).key) for n in graph.nodes]
    # Another batch size: no measured signature, the analytic model answers.
    other = build_graph(canonicalize(mlp_path, {"batch": 3}, tmp_path / "b3").model)
    fresh = ProfiledCostModel(cluster, profile)
    fresh.graph_seconds(other)
    assert fresh.analytic_nodes > 0
    # Communication from the profile's (cluster-derived) fits.
    assert model.transfer_seconds(1e6, 0, 1) == pytest.approx(cluster.intra_host.seconds(1e6))
    assert model.collective_seconds("all_reduce", 1e6, 2, inter_host=False) > model.collective_seconds("all_reduce", 1e3, 2, False)
    assert model.collective_seconds("all_reduce", 1e6, 1, inter_host=False) == 0.0


def test_fit_latency_bandwidth():
    sizes = [1024 * 4**i for i in range(7)]
    points = [[s, 20e-6 + s / 5e9] for s in sizes]
    latency, bandwidth, error = fit_latency_bandwidth(points)
    assert latency == pytest.approx(20e-6, rel=1e-3) and bandwidth == pytest.approx(5e9, rel=1e-3) and error < 1e-6
    latency, bandwidth, _ = fit_latency_bandwidth([[s, 1e-5] for s in sizes])   # flat: still a finite bandwidth
    assert latency >= 0 and 0 < bandwidth < float("inf")
    latency, bandwidth, _ = fit_latency_bandwidth([[s, s / 1e9] for s in sizes])  # no latency
    assert latency >= 0 and bandwidth == pytest.approx(1e9, rel=1e-2)


def test_cluster_fits_cover_every_axis_group():
    fits = cluster_fits(make_cluster((2, 4), "cpu"))
    assert {(f.axis, f.group_size) for f in fits} == {(0, 2), (1, 2), (1, 4)}
    assert all(f.latency > 0 and f.bandwidth > 0 for f in fits)
    # an all-reduce of two is one exchange, as the sharding pass's collective model costs it
    cluster = make_cluster((2, 4), "cpu")
    pair = next(f for f in fits if f.collective == "all_reduce" and (f.axis, f.group_size) == (0, 2))
    assert pair.latency == pytest.approx(cluster.inter_host.latency)
    model = CollectiveModel({0: cluster.inter_host, 1: cluster.intra_host})
    assert pair.latency + 1e6 / pair.bandwidth == pytest.approx(model.all_reduce_seconds(1e6, 0, LogicalMesh((2, 4), tuple(range(8)))))


# --- command line ---------------------------------------------------------------------

def test_cli_profile_and_cache_hit(mlp_path, tmp_path):
    runner = CliRunner()
    args = [str(mlp_path), "--mesh", "1x2", "--dim", "batch=8", "--provider", "cpu", "--threads", "1",
            "--cache", str(tmp_path / "c.sqlite"), "--budget-ms", "2", "--microbatches", "2", "-o", str(tmp_path / "p.json")]
    first = runner.invoke(profile_command, args)
    assert first.exit_code == 0, first.output
    assert "costliest operators" in first.output and "share" in first.output and "PASSED" in first.output
    second = runner.invoke(profile_command, args)
    assert second.exit_code == 0, second.output
    assert " 0 timed" in second.output
    data = json.loads((tmp_path / "p.json").read_text())
    assert [d["label"] for d in data["model"]["program_dims"]] == ["model", "microbatches=2"]


def test_cli_errors(mlp_path, tmp_path):
    runner = CliRunner()
    base = [str(mlp_path), "--dim", "batch=8", "-o", str(tmp_path / "p.json"), "--cache", str(tmp_path / "c.sqlite")]
    result = runner.invoke(profile_command, [*base, "--mesh", "1x2", "--provider", "tpu"])
    assert result.exit_code == 1 and "unknown provider" in result.output
    result = runner.invoke(profile_command, [*base])
    assert result.exit_code == 2 and "exactly one of --mesh and --cluster" in result.output
    result = runner.invoke(profile_command, [str(tmp_path / "missing.onnx"), "--mesh", "1x2", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 1 and "model file not found" in result.output
    result = runner.invoke(profile_command, [*base, "--mesh", "1x2", "--microbatches", "3"])
    assert result.exit_code == 1 and "not divisible" in result.output
    if not cuda_usable():
        result = runner.invoke(profile_command, [*base, "--mesh", "1x2", "--provider", "cuda"])
        assert result.exit_code == 1 and "CUDA execution provider is not usable" in result.output
        assert "Traceback" not in result.output


def test_cli_plan_takes_the_device_from_the_profile(mlp_profile, mlp_path, tmp_path):
    path, _ = mlp_profile                      # measured for device cpu on 1x2
    runner = CliRunner()
    base = ["plan", str(mlp_path), "--mesh", "1x2", "--dim", "batch=8", "--profile", str(path)]
    result = runner.invoke(meshplan_command, [*base, "-o", str(tmp_path / "plan")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["cluster"]["device"]["name"] == "cpu"
    assert "operator(s) measured" in result.output
    result = runner.invoke(meshplan_command, [*base, "--device", "cpu", "-o", str(tmp_path / "same")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(meshplan_command, [*base, "--device", "h100-80g", "-o", str(tmp_path / "other")])
    errors = [line for line in result.output.splitlines() if line.startswith("meshplan: error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert "device 'cpu'" in errors[0] and "'h100-80g'" in errors[0] and "leave out --device" in errors[0]
    assert not (tmp_path / "other").exists()
    custom = json.loads(path.read_text())
    custom["device"] = "my-gpu"                # made with a cluster file's own device
    (tmp_path / "custom.json").write_text(json.dumps(custom))
    result = runner.invoke(meshplan_command, ["plan", str(mlp_path), "--mesh", "1x2", "--dim", "batch=8",
                                              "--profile", str(tmp_path / "custom.json"), "-o", str(tmp_path / "c")])
    assert result.exit_code == 1 and "'my-gpu', which is not a device preset" in result.output, result.output


def test_a_model_too_large_or_failing_to_run_whole_has_no_composition(tmp_path):
    """Above the weights' limit the model is not run whole, and a model onnxruntime cannot
    run is not either: the reason is recorded, and plans count the operators as timed."""
    from meshplan.profile.document import Profile
    from meshplan.profile.timing import WHOLE_MODEL_BYTES, time_whole_model

    model = _model([helper.make_node("Relu", ["x"], ["y"])], [("x", [4, 8])], ["y"])
    path = tmp_path / "relu.onnx"
    onnx.save_model(model, str(path))
    ran = time_whole_model(model, path, "CPUExecutionProvider", 1, 128)
    assert ran["seconds"] > 0 and ran["runs"] >= 3
    assert "GiB" in time_whole_model(model, path, "CPUExecutionProvider", 1, WHOLE_MODEL_BYTES + 1)["skipped"]
    assert time_whole_model(model, tmp_path / "missing.onnx", "CPUExecutionProvider", 1, 128)["skipped"]
    assert Profile({}, [1, 1], "cpu", "", "", "", 1, 1, {}, [], "cluster", {},
                   composition={"skipped": "too large"}).composition_factor == 1.0
