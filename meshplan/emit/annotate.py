"""``annotated.onnx``: the canonical model with the plan in ONNX's multi-device annotations.

What it holds (docs/annotations.md has the whole mapping):

- one ``DeviceConfigurationProto`` for the cluster (``meshplan.HxD``, a device per rank,
  named ``host{h}/device{d}``);
- on every operator, and on every node of a parameter expression (a Transpose of a
  weight: replayed on each device from the weight's slices), a
  ``NodeDeviceConfigurationProto`` with its ``pipeline_stage`` (the plan's stage index) and
  a ``ShardingSpecProto`` for each of its inputs and outputs: the layout it reads and
  writes them in, its devices the configuration's device indices, which are ranks
  (``meshplan.onnx_sharding``); what the standard has no field for goes into the node's
  metadata: ``meshplan.partial`` (addends) and ``meshplan.segments`` (dims split by heads
  whose pieces are not contiguous runs), as ``onnx_sharding.metadata_entries`` writes them;
- for people and ``meshplan show``: node metadata ``meshplan.layer`` (the planner's layer),
  ``meshplan.costs`` (``intra.explain``) and ``meshplan.hinted`` (on the operators a hint
  pinned, where the hints changed the plan), and model metadata ``meshplan.stages``
  (each stage's devices, submesh and logical mesh), ``meshplan.weights_dir`` and
  ``meshplan.plan_checksum`` (the plan.json it describes).

Its weights are the model's own files, referred to, never copied: every initializer the
planned model has is external data whose ``location`` is relative to the planned model's
directory (``meshplan.weights_dir``): its own data file, or the model file itself for a
weight stored inside it, at the weight's byte offset (``model.tensor_places``). Only the
tensors canonicalisation computed (folded constants, a static batch's cut constants)
are stored inline. ONNX's loaders look for external data beside the model file and refuse
links to other directories, so a reader names that directory (docs/annotations.md shows
how for onnx, onnxruntime and onnx-ir).
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from meshplan.intra.strategies import Strategy, derive
from meshplan.model.graph import Graph, Node
from meshplan.model.hints import STAGES_KEY
from meshplan.model.load import CanonicalModel, read_model
from meshplan.model.opsets import set_ir_version
from meshplan.model.tensor_places import tensor_places
from meshplan.model.weights import INLINE_BYTES, point_to, tensor_value
from meshplan.onnx_sharding import encode, metadata_entries, to_proto
from meshplan.plan_format import Plan, Stage
from meshplan.sharding import LogicalMesh, ShardingSpec

ANNOTATED_FILE = "annotated.onnx"
MULTI_DEVICE_IR = 11           # the first IR version with device configurations
LAYER_KEY = "meshplan.layer"
COSTS_KEY = "meshplan.costs"
WEIGHTS_DIR_KEY = "meshplan.weights_dir"
PLAN_KEY = "meshplan.plan_checksum"
HINTED_KEY = "meshplan.hinted"
OWN_KEYS = (LAYER_KEY, COSTS_KEY, HINTED_KEY, "meshplan.partial", "meshplan.segments")


def configuration_name(mesh) -> str:
    return f"meshplan.{mesh[0]}x{mesh[1]}"


def device_names(mesh) -> list[str]:
    return [f"host{h}/device{d}" for h in range(mesh[0]) for d in range(mesh[1])]


def stage_mesh(stage: Stage) -> LogicalMesh:
    return LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))


def stage_strategy(node: Node, graph: Graph, stage: Stage, shardings: dict) -> Strategy:
    """The node's strategy in the plan (replicated on a stage of one device)."""
    found = shardings.get(stage.index, {}).get(node.name)
    if found is not None:
        return found

    def whole(name):
        return ShardingSpec.replicated(len(graph.tensors[name].shape)) if name else None

    return Strategy(tuple(whole(n) for n in node.inputs), tuple(whole(n) for n in node.outputs))


def dim_names(model: onnx.ModelProto) -> dict[str, dict[int, str]]:
    """Tensor → {axis: dim_param} for the dims the canonical model leaves symbolic."""
    found: dict[str, dict[int, str]] = {}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param:
                found.setdefault(value.name, {})[axis] = dim.dim_param
    return found


def annotate_node(proto: onnx.NodeProto, node: Node, strategy: Strategy, stage: Stage, graph: Graph,
                  configuration: str, names: dict[str, dict[int, str]]) -> None:
    """Give ``proto`` its stage and the layouts of its inputs and outputs under ``strategy``."""
    mesh = stage_mesh(stage)
    config = proto.device_configurations.add()
    config.configuration_id = configuration
    config.pipeline_stage = stage.index
    partial, segments = {}, {}
    seen: set[str] = set()
    for name, spec in zip(list(node.inputs) + list(node.outputs), list(strategy.inputs) + list(strategy.outputs)):
        if not name or spec is None or name in seen:
            continue
        seen.add(name)
        layout = encode(spec, graph.tensors[name].shape, mesh, names.get(name))
        config.sharding_spec.append(to_proto(layout, name))
        if layout.partial:
            partial[name] = layout.partial
        if layout.segments:
            segments[name] = dict(layout.segments)
    _set_metadata(proto, metadata_entries(partial, segments))


def _set_metadata(proto, entries: dict[str, str]) -> None:
    kept = [(e.key, e.value) for e in proto.metadata_props if e.key not in entries]
    del proto.metadata_props[:]
    for key, value in kept + sorted(entries.items()):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value


def _clear_annotations(model: onnx.ModelProto) -> None:
    """Drop annotations the planned model carried (they were hints, or another tool's)."""
    del model.configuration[:]
    for proto in model.graph.node:
        del proto.device_configurations[:]
        kept = [(e.key, e.value) for e in proto.metadata_props if e.key not in OWN_KEYS]
        del proto.metadata_props[:]
        for key, value in kept:
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value


def _refer_to_source(model: onnx.ModelProto, canonical: CanonicalModel) -> None:
    """Point every weight at its place in the planned model's files; store the tensors
    canonicalisation made inline."""
    header = read_model(canonical.source, load_external_data=False)
    places = tensor_places(canonical.source, header)
    declared = {t.name: (t.data_type, tuple(t.dims)) for t in header.graph.initializer}
    del header
    for tensor in model.graph.initializer:
        place = places.get(tensor.name)
        same = declared.get(tensor.name) == (tensor.data_type, tuple(tensor.dims))
        if place is not None and same and (place.length >= INLINE_BYTES or tensor.data_location == onnx.TensorProto.EXTERNAL):
            point_to(tensor, place.location, place.offset, place.length)
        elif tensor.data_location == onnx.TensorProto.EXTERNAL:
            value = tensor_value(tensor, canonical.path.parent)
            tensor.CopyFrom(onnx.numpy_helper.from_array(value, tensor.name))


def annotated_model(plan: Plan, shardings: dict, graph: Graph, canonical: CanonicalModel, constants,
                    explanations: dict[str, dict] | None = None) -> onnx.ModelProto:
    """The canonical model annotated with ``plan`` (see the module's description)."""
    model = onnx.ModelProto()
    model.CopyFrom(canonical.model)
    _clear_annotations(model)
    mesh = plan.cluster["mesh"]
    config = model.configuration.add()
    config.name = configuration_name(mesh)
    config.num_devices = mesh[0] * mesh[1]
    config.device.extend(device_names(mesh))
    names = dim_names(model)
    protos = {proto.name: proto for proto in model.graph.node}
    chain_nodes = {node.name: node for node in graph.chains.values()}
    bounds = plan.layer_bounds
    index = {node.name: i for i, node in enumerate(graph.nodes)}
    done: set[str] = set()
    explanations = explanations or {}
    hinted = set(plan.hinted)
    for stage in plan.stages:
        mesh_of_stage = LogicalMesh(tuple(stage.logical_mesh), tuple(range(len(stage.devices))))
        for name in stage.operators:
            node = graph.nodes[index[name]]
            strategy = stage_strategy(node, graph, stage, shardings)
            annotate_node(protos[name], node, strategy, stage, graph, config.name, names)
            extra = {}
            if bounds:
                extra[LAYER_KEY] = str(_layer_of(index[name], bounds))
            if name in explanations:
                extra[COSTS_KEY] = json.dumps(explanations[name], separators=(",", ":"))
            if name in hinted:
                extra[HINTED_KEY] = "layouts"
            _set_metadata(protos[name], extra)
            for tensor, spec in zip(node.inputs, strategy.inputs):
                if not tensor or spec is None or not graph.tensors[tensor].is_derived:
                    continue
                steps = derive(graph, tensor, spec, mesh_of_stage, constants, graph.opset) or ()
                for chain_node, chain_strategy in steps:
                    if chain_node.name in done or chain_node.name not in chain_nodes or chain_node.name not in protos:
                        continue
                    done.add(chain_node.name)
                    annotate_node(protos[chain_node.name], chain_node, chain_strategy, stage, graph, config.name, names)
    stages = [{"stage": s.index, "devices": s.devices, "submesh": s.submesh, "logical_mesh": s.logical_mesh,
               "layers": s.layers} for s in plan.stages]
    _set_metadata(model, {STAGES_KEY: json.dumps(stages, separators=(",", ":")),
                          WEIGHTS_DIR_KEY: str(canonical.source.resolve().parent),
                          PLAN_KEY: plan.to_dict()["checksum"]})
    _refer_to_source(model, canonical)
    set_ir_version(model)
    model.ir_version = max(model.ir_version, MULTI_DEVICE_IR)
    return model


def _layer_of(node: int, bounds) -> int:
    for layer in range(len(bounds) - 1):
        if bounds[layer] <= node < bounds[layer + 1]:
            return layer
    return len(bounds) - 2


def write_annotated(plan: Plan, shardings: dict, graph: Graph, canonical: CanonicalModel, out_dir: Path, constants,
                    explanations: dict[str, dict] | None = None) -> Path:
    path = Path(out_dir) / ANNOTATED_FILE
    onnx.save_model(annotated_model(plan, shardings, graph, canonical, constants, explanations), str(path))
    return path
