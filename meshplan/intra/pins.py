"""Pinned strategies: the layer ILP's choice of an operator restricted to the strategies
that lay its hinted tensors out as the hints say (``inter.hints`` makes them from the
model's annotations).

A hint names devices by their position in the stage (the k-th smallest rank of the stage
is device k); on a logical mesh of another device count the pin does not apply (the stage
DP rules those stages out instead). A strategy matches when every hinted tensor, each time
the operator reads or writes it, has the hinted layout on the mesh
(``onnx_sharding.encode``): the same split axes and pieces, the same devices holding each
piece where the hint names them, the same addend groups.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from meshplan.intra.strategies import Strategy
from meshplan.model.graph import Graph, Node
from meshplan.onnx_sharding import DeviceLayout, encode
from meshplan.sharding import LogicalMesh, ShardingSpec


@dataclass(frozen=True)
class NodePin:
    devices: int | None                              # the stage's device count, where the hint names devices
    tensors: tuple[tuple[str, DeviceLayout], ...]    # tensor → its layout, devices as positions in the stage


class Pins:
    """The pinned operators of a graph, by node index."""

    def __init__(self, graph: Graph, pins: dict[int, NodePin]):
        self.graph = graph
        self.pins = dict(pins)
        self._layouts: dict[tuple, DeviceLayout] = {}

    def __bool__(self) -> bool:
        return bool(self.pins)

    def layer_key(self, start: int, stop: int, devices: int) -> str:
        """What the pins of nodes [start, stop) that apply on a mesh of ``devices`` add to the
        layer's fingerprint, by operand position (layers alike pinned alike share an ILP);
        "" where none applies."""
        found = []
        for i in sorted(self.pins):
            pin = self.pins[i]
            if not start <= i < stop or (pin.devices is not None and pin.devices != devices):
                continue
            operands = list(self.graph.nodes[i].inputs) + list(self.graph.nodes[i].outputs)
            found.append((i - start, pin.devices, [(operands.index(t), layout) for t, layout in pin.tensors]))
        return hashlib.sha256(repr(found).encode()).hexdigest() if found else ""

    def layout(self, spec: ShardingSpec, name: str, mesh: LogicalMesh) -> DeviceLayout:
        key = (spec, spec.segments, name, mesh.shape)
        if key not in self._layouts:
            self._layouts[key] = encode(spec, self.graph.tensors[name].shape, mesh)
        return self._layouts[key]

    def matches(self, node: Node, strategy: Strategy, pin: NodePin, mesh: LogicalMesh) -> bool:
        specs = list(zip(list(node.inputs) + list(node.outputs), list(strategy.inputs) + list(strategy.outputs)))
        for tensor, wanted in pin.tensors:
            for name, spec in specs:
                if name == tensor and spec is not None and not self.layout(spec, name, mesh).same_as(wanted):
                    return False
        return True

    def allowed(self, index: int, node: Node, strategies: list[Strategy], mesh: LogicalMesh) -> np.ndarray | None:
        """Which of ``strategies`` the pin of node ``index`` allows on ``mesh`` (a mesh of
        positions 0..n-1); None where no pin applies."""
        pin = self.pins.get(index)
        if pin is None or (pin.devices is not None and pin.devices != mesh.size):
            return None
        return np.array([self.matches(node, s, pin, mesh) for s in strategies], dtype=bool)
