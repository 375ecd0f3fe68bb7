"""Plans in ONNX's own words: every plan directory holds annotated.onnx, the canonical model
with IR 11 multi-device annotations. It passes onnx's full checker and runs in onnxruntime
(beside the planned model, whose weights it refers to), and onnx-ir reads back the stages
and layouts of plan.json. The layout mapping (``onnx_sharding``) is checked on its own:
every spec of small tensors on 2x2, 1x4 and 4x1 meshes goes to a ShardingSpecProto and back."""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx_ir._multi_device import _check_device_configurations   # onnx-ir's own validation (not yet public)

from meshplan.emit.annotate import ANNOTATED_FILE, MULTI_DEVICE_IR
from meshplan.model.tensor_places import tensor_places
from meshplan.onnx_sharding import (DeviceLayout, LayoutProblem, SplitDim, decode, encode, from_proto, normalised,
                                    read_metadata, to_proto)
from meshplan.sharding import PLACEMENTS, LogicalMesh, ShardingSpec
from tests.conftest import ANNOTATED_CASES

CASE_IDS = [f"{name}-{mesh[0]}x{mesh[1]}" for name, mesh in ANNOTATED_CASES]


# --- the mapping ------------------------------------------------------------------------------

def _every_spec(rank: int):
    for dims in itertools.product(PLACEMENTS, repeat=rank):
        for partial in ((), (0,), (1,), (0, 1)):
            try:
                yield ShardingSpec(tuple(dims), partial)
            except ValueError:
                continue


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (4, 1)])
def test_every_spec_goes_to_the_standard_and_back(shape):
    mesh = LogicalMesh(shape, (5, 9, 2, 7))          # ranks in no particular order
    tensor = (8, 4, 12)
    seen = {}
    for spec in _every_spec(3):
        if not spec.is_valid_for(tensor, mesh):
            continue
        layout = encode(spec, tensor, mesh)
        proto = to_proto(layout, "t")
        back = from_proto(onnx.ShardingSpecProto.FromString(proto.SerializeToString()), layout.partial)
        assert back.same_as(layout) and back.holders == layout.holders
        # every device holds exactly one piece; pieces are row-major over the split axes
        assert sorted(d for g in layout.holders for d in g) == sorted(mesh.ranks)
        assert len(layout.holders) == layout.shards == int(np.prod([d.shards for d in layout.dims]))
        # read relative to the devices (the k-th smallest rank is device k), as hints are
        renamed = LogicalMesh(shape, tuple(sorted(mesh.ranks).index(r) for r in mesh.ranks))
        decoded = decode(layout.renumbered(sorted(mesh.ranks)), tensor, renamed)
        assert decoded is not None and _plain(decoded, mesh) == _plain(spec, mesh)
        # different layouts never share an encoding
        key = (tuple((d.axis, d.shards) for d in layout.dims), layout.holders, layout.partial)
        assert seen.setdefault(key, _plain(spec, mesh)) == _plain(spec, mesh)


def _plain(spec: ShardingSpec, mesh: LogicalMesh) -> ShardingSpec:
    """The spec without splits or addends along mesh axes of size 1 (the same layout)."""
    return ShardingSpec(spec.normalised(mesh).dims, tuple(a for a in spec.partial if mesh.shape[a] > 1))


def test_a_split_lists_the_pieces_row_major_and_groups_the_copies():
    mesh = LogicalMesh((2, 2), (0, 1, 2, 3))
    layout = encode(ShardingSpec.parse("S0S1"), (4, 6), mesh)
    assert [(d.axis, d.shards, d.size) for d in layout.dims] == [(0, 2, 4), (1, 2, 6)]
    assert layout.holders == ((0,), (1,), (2,), (3,))
    proto = to_proto(encode(ShardingSpec.parse("RS1"), (4, 6), mesh), "w")
    assert list(proto.device) == [-1, -2]
    assert {e.key: list(e.value) for e in proto.index_to_device_group_map} == {-1: [0, 2], -2: [1, 3]}
    whole = to_proto(encode(ShardingSpec.parse("RR"), (4, 6), mesh), "w")
    assert list(whole.device) == [-1] and not whole.sharded_dim
    partial = encode(ShardingSpec.parse("S0R+P1"), (4, 6), mesh)
    assert partial.holders == ((0, 1), (2, 3)) and partial.partial == ((0, 1), (2, 3))


def test_heads_shared_by_devices_are_exact_in_the_standard():
    """2 key/value heads on 4 devices: 2 pieces, each held by the 2 devices whose query heads read it."""
    mesh = LogicalMesh((1, 4), (0, 1, 2, 3))
    spec = ShardingSpec.parse("RS1RR").with_segments({1: ((2, 2),)})
    layout = encode(spec, (1, 2, 16, 8), mesh)
    assert [(d.axis, d.shards) for d in layout.dims] == [(1, 2)]
    assert layout.holders == ((0, 1), (2, 3))
    assert decode(layout, (1, 2, 16, 8), mesh, {1: ((2, 2),)}) == spec


def test_a_packed_qkv_dim_carries_its_segments():
    mesh = LogicalMesh((1, 4), (0, 1, 2, 3))
    segments = {2: ((32, 4), (16, 2), (16, 2))}
    spec = ShardingSpec.parse("RRS1").with_segments(segments)
    layout = encode(spec, (1, 3, 64), mesh)
    assert layout.segments == ((2, ((32, 4), (16, 2), (16, 2))),)
    assert [(d.axis, d.shards) for d in layout.dims] == [(2, 4)]
    partial, found = read_metadata({"meshplan.segments": json.dumps({"t": {"2": [[32, 4], [16, 2], [16, 2]]}})})
    assert found == {"t": ((2, ((32, 4), (16, 2), (16, 2))),)} and partial == {}
    assert decode(layout, (1, 3, 64), mesh, segments) == spec


def test_axes_written_in_any_order_or_from_the_back_are_read():
    proto = onnx.ShardingSpecProto(tensor_name="t", device=[0, 2, 1, 3])
    for axis in (-1, 0):   # axis 1 first (from the back), then axis 0
        dim = proto.sharded_dim.add()
        dim.axis = axis
        simple = dim.simple_sharding.add()
        simple.num_shards = 2
    layout = normalised(from_proto(proto), 2)
    assert [(d.axis, d.shards) for d in layout.dims] == [(0, 2), (1, 2)]
    assert layout.holders == ((0,), (1,), (2,), (3,))   # the pieces renumbered row-major over axes 0, 1
    with pytest.raises(LayoutProblem, match="out of range"):
        normalised(DeviceLayout((SplitDim(2, 2),), None), 2)
    with pytest.raises(LayoutProblem, match="device entries"):
        normalised(DeviceLayout((SplitDim(0, 2),), ((0,),)), 2)


def test_weights_inside_a_model_file_are_found_at_their_bytes(tmp_path):
    rng = np.random.default_rng(0)
    values = {"raw": rng.standard_normal((16, 8)).astype(np.float32), "f16": rng.standard_normal(40).astype(np.float16)}
    packed = onnx.helper.make_tensor("packed", onnx.TensorProto.FLOAT, [6], rng.standard_normal(6).tolist())
    longs = onnx.helper.make_tensor("longs", onnx.TensorProto.INT64, [3], [1, 2, 3])   # varints: no place
    inits = [onnx.numpy_helper.from_array(v, k) for k, v in values.items()] + [packed, longs]
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["raw"], ["y"])], "g", [],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [16, 8])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    places = tensor_places(path, onnx.load(str(path)))
    data = path.read_bytes()
    assert set(places) == {"raw", "f16", "packed"}
    for name, value in list(values.items()) + [("packed", onnx.numpy_helper.to_array(packed))]:
        place = places[name]
        assert place.location == "m.onnx"
        got = np.frombuffer(data[place.offset:place.offset + place.length], dtype=value.dtype)
        np.testing.assert_array_equal(got, value.ravel())


# --- annotated.onnx of real plans ---------------------------------------------------------------

@pytest.mark.parametrize("case_id", CASE_IDS)
def test_annotated_model_passes_the_full_checker_and_runs_beside_the_model(case_id, annotated_cases):
    case = annotated_cases[case_id]
    path = case.plan_dir / ANNOTATED_FILE
    model = onnx.load(str(path), load_external_data=False)
    assert model.ir_version >= MULTI_DEVICE_IR
    meta = {e.key: e.value for e in model.metadata_props}
    assert meta["meshplan.weights_dir"] == str(case.model_dir.resolve())
    # its weights are the model's own bytes, referred to: nothing of them is in the file
    weights = sum(int(np.prod(t.dims)) * 4 for t in onnx.load(str(case.model), load_external_data=False).graph.initializer)
    assert path.stat().st_size < weights / 4
    beside = case.model_dir / "annotated.onnx"
    shutil.copy(path, beside)
    try:
        onnx.checker.check_model(str(beside), full_check=True)
        session = ort.InferenceSession(str(beside), providers=["CPUExecutionProvider"])
        reference = ort.InferenceSession(str(case.model), providers=["CPUExecutionProvider"])
        feeds = case.inputs(case.plan.batch["microbatch_size"])   # the canonical model runs one microbatch
        for got, want in zip(session.run(None, feeds), reference.run(None, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    finally:
        beside.unlink()
    # given the directory, onnxruntime loads it where it is too
    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", meta["meshplan.weights_dir"])
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _layout(spec: ir.ShardingSpec, partial, segments) -> DeviceLayout:
    groups = {entry.key: tuple(entry.value) for entry in spec.index_to_device_group_map}
    holders = tuple(tuple(sorted(groups.get(d, (d,)))) for d in spec.device)
    dims = tuple(SplitDim(d.axis, d.simple_shardings[0].num_shards) for d in spec.sharded_dims)
    name = spec.value.name
    return DeviceLayout(dims, holders, partial.get(name, ()), segments.get(name, ()))


def _planned_specs(stage, node: ir.Node) -> dict[str, ShardingSpec]:
    """The specs plan.json gives the node's tensors (replicated where it lists no strategy)."""
    names = [v.name if v is not None else "" for v in node.inputs] + [v.name for v in node.outputs]
    strategy = stage.strategies.get(node.name)
    texts = strategy.replace("->", ",").split(",") if strategy else [None] * len(names)
    found = {}
    for name, text, value in zip(names, texts, list(node.inputs) + list(node.outputs)):
        if name and name not in found:
            found[name] = ShardingSpec.parse(text) if text else ShardingSpec.replicated(len(value.shape))
    return found


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_onnx_ir_reads_back_the_stages_and_specs_of_plan_json(case_id, annotated_cases):
    case = annotated_cases[case_id]
    model = ir.load(str(case.plan_dir / ANNOTATED_FILE))
    assert _check_device_configurations(model) == []
    (config,) = model.device_configurations
    mesh = case.mesh
    assert config.num_devices == mesh[0] * mesh[1] and len(config.device_names) == config.num_devices
    nodes = {node.name: node for node in model.graph}
    compared = 0
    for stage in case.plan.stages:
        logical = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
        for name in stage.operators:
            node = nodes[name]
            (annotation,) = node.device_configurations
            assert annotation.configuration is config and annotation.pipeline_stage == stage.index
            planned = _planned_specs(stage, node)
            partial, segments = read_metadata(dict(node.metadata_props))
            specs = {spec.value.name: spec for spec in annotation.sharding_specs}
            assert set(specs) == set(planned), name
            for tensor, spec in specs.items():
                shape = tuple(spec.value.shape.numpy())
                layout = _layout(spec, partial, segments)
                assert set(layout.devices) == set(stage.devices)
                found = decode(layout, shape, logical, dict(segments.get(tensor, ())))
                assert found is not None and found.normalised(logical) == planned[tensor].normalised(logical), \
                    (name, tensor, found, planned[tensor])
                compared += 1
    assert compared > 100
    if case.name == "llama":   # the memory forces a sharded stage: the annotations show splits
        split = [s for n in nodes.values() for c in n.device_configurations for s in c.sharding_specs if s.sharded_dims]
        assert split


def test_parameter_expressions_are_annotated_as_derived(tmp_path):
    """A tied embedding's transposed table (a parameter expression) carries the layout the
    head reads it in, derived on its stage."""
    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_plan import make_plan
    from sample_models.llama import make_llama, save_llama

    path = save_llama(tmp_path / "tied.onnx", make_llama(layers=1, hidden=64, heads=4, ffn=96, vocab=2048, tied=True))
    plan = make_plan(path, make_cluster((1, 2), "h100-80g"), {"batch": 2, "seq": 8}, tmp_path / "plan",
                     PlanOptions(policy="megatron", max_stages=1))
    model = onnx.load(str(tmp_path / "plan" / ANNOTATED_FILE), load_external_data=False)
    (transpose,) = [n for n in model.graph.node if n.name == "lm_head/transpose"]
    (annotation,) = transpose.device_configurations
    assert annotation.pipeline_stage == 0
    head = plan.stages[0].strategies.get("lm_head/matmul", "RRR,RR->RRR")
    layout = from_proto(next(s for s in annotation.sharding_spec if s.tensor_name == transpose.output[0]))
    mesh = LogicalMesh(tuple(plan.stages[0].logical_mesh), tuple(plan.stages[0].devices))
    spec = decode(normalised(layout, 2), (64, 2048), mesh)
    assert str(spec) == head.split("->")[0].split(",")[1]
    table = from_proto(next(s for s in annotation.sharding_spec if s.tensor_name == transpose.input[0]))
    assert decode(normalised(table, 2), (2048, 64), mesh) is not None


def test_a_ranged_plan_is_annotated_and_replans_alike(tmp_path):
    """A plan for a range of batch sizes: annotated.onnx keeps the batch symbolic, passes
    the full checker and runs at two sizes beside the model; its annotations as hints give
    the same plan.json."""
    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_plan import make_plan
    from meshplan.model.sizes import parse_size
    from sample_models import SAMPLES

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    model = model_dir / "gpt.onnx"
    shutil.copy(SAMPLES["gpt"].path, model)
    cluster = make_cluster((1, 2), "h100-80g")
    dims = {"batch": parse_size("2:8:2"), "seq": 16}
    plan = make_plan(model, cluster, dims, tmp_path / "plan", PlanOptions())
    assert plan.is_ranged
    beside = model_dir / ANNOTATED_FILE
    shutil.copy(tmp_path / "plan" / ANNOTATED_FILE, beside)
    onnx.checker.check_model(str(beside), full_check=True)
    loaded = onnx.load(str(beside), load_external_data=False)
    assert loaded.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    session = ort.InferenceSession(str(beside), providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    for batch in (2, 6):
        feeds = {"input_ids": np.random.default_rng(batch).integers(0, 512, size=(batch, 16), dtype=np.int64)}
        np.testing.assert_allclose(session.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-5, atol=1e-6)
    again = make_plan(model, cluster, dims, tmp_path / "again", PlanOptions(), hints=tmp_path / "plan")
    assert any("the free plan keeps them" in note for note in again.notes)
    assert (tmp_path / "again" / "plan.json").read_bytes() == (tmp_path / "plan" / "plan.json").read_bytes()
