"""Hints: ONNX multi-device annotations read as constraints on the search.

A model's annotations (IR 11: ``ModelProto.configuration``, ``NodeProto.device_configurations``)
say, per node, its pipeline stage and the layout of some of its inputs and outputs. Read
here as they are written — one configuration chosen, each node's stage and each tensor's
``onnx_sharding.DeviceLayout`` with the metadata the standard has no field for
(``meshplan.partial``, ``meshplan.segments``) and, from a meshplan plan, each stage's mesh
(``meshplan.stages``) — and checked for what can be checked without the planned graph
(devices in range, axes listed once, pieces matching the devices). ``inter.hints`` holds
them against the graph and turns them into pinned strategies and forced stage cuts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import onnx

from meshplan.errors import HintError
from meshplan.onnx_sharding import LayoutProblem, DeviceLayout, from_proto, read_metadata

STAGES_KEY = "meshplan.stages"


@dataclass(frozen=True)
class TensorHint:
    tensor: str
    layout: DeviceLayout          # devices are the configuration's indices (ranks), or None


@dataclass(frozen=True)
class NodeHint:
    name: str                     # the node's name in the annotated model ("" if it has none)
    outputs: tuple[str, ...]      # its outputs (an unnamed node is found by them)
    op_type: str
    stage: int | None
    tensors: tuple[TensorHint, ...]

    @property
    def label(self) -> str:
        return self.name or (self.outputs[0] if self.outputs else self.op_type)


@dataclass(frozen=True)
class Hints:
    origin: str                   # where they come from, for messages
    configuration: str
    num_devices: int
    nodes: tuple[NodeHint, ...]
    # stage → {"devices", "submesh", "logical_mesh"} where the annotations name each stage's mesh
    stages: dict = field(default_factory=dict)


def has_annotations(model: onnx.ModelProto) -> bool:
    return bool(len(model.configuration)) or any(len(node.device_configurations) for node in model.graph.node)


def strip_annotations(model: onnx.ModelProto) -> None:
    """Remove every multi-device annotation (the configurations and each node's)."""
    del model.configuration[:]
    for node in model.graph.node:
        del node.device_configurations[:]


def read_hints(model: onnx.ModelProto, origin: str, num_devices: int) -> Hints | None:
    """The hints ``model``'s annotations give a mesh of ``num_devices``; None when it has none.
    HintError (one line naming the node) for annotations that cannot be read."""
    if not any(len(node.device_configurations) for node in model.graph.node):
        return None
    declared = {c.name: c for c in model.configuration}
    used = {c.configuration_id for node in model.graph.node for c in node.device_configurations}
    for node in model.graph.node:
        for config in node.device_configurations:
            if config.configuration_id not in declared:
                raise HintError(f"hint for node '{_label(node)}' in {origin}: configuration "
                                f"'{config.configuration_id}' is not declared by the model")
    fitting = [name for name in sorted(used) if declared[name].num_devices == num_devices]
    if len(fitting) != 1:
        found = ", ".join(f"'{n}' ({declared[n].num_devices} devices)" for n in sorted(used))
        why = "several configurations fit" if fitting else "no configuration is for that many devices"
        raise HintError(f"the hints in {origin} are for configurations {found}; the mesh has {num_devices} devices: "
                        f"{why}")
    chosen = fitting[0]
    nodes = []
    for node in model.graph.node:
        for config in node.device_configurations:
            if config.configuration_id == chosen:
                nodes.append(_node_hint(node, config, origin, num_devices))
    return Hints(origin, chosen, num_devices, tuple(nodes), _stages(model, origin, num_devices))


def _label(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if len(node.output) else node.op_type)


def _node_hint(node: onnx.NodeProto, config, origin: str, num_devices: int) -> NodeHint:
    label = _label(node)
    try:
        partial, segments = read_metadata({e.key: e.value for e in node.metadata_props})
    except LayoutProblem as exc:
        raise HintError(f"hint for node '{label}' in {origin}: {exc}") from None
    stage = int(config.pipeline_stage) if config.HasField("pipeline_stage") else None
    if stage is not None and stage < 0:
        raise HintError(f"hint for node '{label}' in {origin}: pipeline stage {stage} is negative")
    tensors = []
    seen = set()
    for spec in config.sharding_spec:
        name = spec.tensor_name
        if name in seen:
            raise HintError(f"hint for node '{label}' in {origin}: tensor '{name}' has two sharding specs")
        seen.add(name)
        try:
            layout = from_proto(spec, partial.get(name, ()), segments.get(name, ()))
        except LayoutProblem as exc:
            raise HintError(f"hint for node '{label}' in {origin}: tensor '{name}': {exc}") from None
        named = {d for group in (layout.holders or ()) for d in group} | {d for g in layout.partial for d in g}
        bad = sorted(d for d in named if not 0 <= d < num_devices)
        if bad:
            raise HintError(f"hint for node '{label}' in {origin}: tensor '{name}' names device {bad[0]}, "
                            f"outside the configuration's {num_devices}")
        held = [d for group in (layout.holders or ()) for d in group]
        if len(held) != len(set(held)):
            twice = next(d for d in held if held.count(d) > 1)
            raise HintError(f"hint for node '{label}' in {origin}: tensor '{name}' gives device {twice} two pieces")
        if any(not group for group in layout.holders or ()):
            raise HintError(f"hint for node '{label}' in {origin}: tensor '{name}' has a piece no device holds")
        tensors.append(TensorHint(name, layout))
    return NodeHint(node.name, tuple(node.output), node.op_type, stage, tuple(tensors))


def _stages(model: onnx.ModelProto, origin: str, num_devices: int) -> dict:
    text = next((e.value for e in model.metadata_props if e.key == STAGES_KEY), None)
    if text is None:
        return {}
    try:
        found = {}
        for entry in json.loads(text):
            devices = [int(d) for d in entry["devices"]]
            found[int(entry["stage"])] = {"devices": devices, "submesh": tuple(int(x) for x in entry["submesh"]),
                                          "logical_mesh": tuple(int(x) for x in entry["logical_mesh"])}
            if any(not 0 <= d < num_devices for d in devices):
                raise ValueError(f"stage {entry['stage']} names a device outside the configuration")
    except (ValueError, TypeError, KeyError) as exc:
        raise HintError(f"the {STAGES_KEY} metadata of {origin} is malformed ({exc})") from None
    return found
