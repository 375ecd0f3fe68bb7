"""Structural fingerprints of layers: layers with equal fingerprints have equal ILPs."""

from __future__ import annotations

import hashlib

import numpy as np

from meshplan.model.layers import Layering
from meshplan.model.graph import Graph
from meshplan.ops import SMALL_CONSTANT_ELEMENTS


def layer_fingerprints(graph: Graph, layering: Layering, constants: dict[str, np.ndarray]) -> list[str]:
    """One structural fingerprint per layer: operators, attributes, shapes, small constants,
    wiring inside the layer and which outputs leave it. Equal fingerprints, equal ILPs."""
    producers, consumers = graph.producers(), graph.consumers()
    owner = layering.layer_of_node()
    outputs = set(graph.outputs)
    keys = []
    for layer in range(layering.num_layers):
        start, stop = layering.bounds[layer], layering.bounds[layer + 1]
        digest = hashlib.sha256()
        for i in range(start, stop):
            node = graph.nodes[i]
            parts = [node.op_type, node.domain, repr(sorted((k, repr(v)) for k, v in node.attrs.items()))]
            for name in node.inputs:
                if not name:
                    parts.append("-")
                    continue
                info = graph.tensors[name]
                where = producers.get(name)
                origin = f"n{where - start}" if where is not None and start <= where < stop else "in"
                if info.is_param:
                    value = constants.get(name)
                    origin = "c" + (repr(value.tolist()) if value is not None and value.size <= SMALL_CONSTANT_ELEMENTS else "")
                parts.append(f"{origin}:{info.shape}:{info.dtype}")
            for name in node.outputs:
                if not name:                     # an optional output left out
                    parts.append("o:-")
                    continue
                escapes = name in outputs or any(owner[c] != layer for c in consumers.get(name, []))
                parts.append(f"o:{graph.tensors[name].shape}:{graph.tensors[name].dtype}:{escapes}")
            digest.update("|".join(parts).encode())
            digest.update(b";")
        keys.append(digest.hexdigest())
    return keys
