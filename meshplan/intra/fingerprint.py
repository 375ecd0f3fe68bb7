"""Structural fingerprints of layers: layers with equal fingerprints have equal ILPs."""

from __future__ import annotations

import hashlib

import numpy as np

from meshplan.model.layers import Layering
from meshplan.model.graph import Graph
from meshplan.intra.strategies import tied_sources
from meshplan.ops import SMALL_CONSTANT_ELEMENTS


def layer_fingerprints(graph: Graph, layering: Layering, constants: dict[str, np.ndarray]) -> list[str]:
    """One structural fingerprint per layer: operators, attributes, shapes, small constants,
    wiring inside the layer and which outputs leave it. Equal fingerprints, equal ILPs."""
    producers, consumers = graph.producers(), graph.consumers()
    tied = set(tied_sources(graph))
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
                    origin += _chain(graph, name, constants) + ("t" if tied.intersection(info.sources or (name,)) else "")
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


def _chain(graph: Graph, name: str, constants: dict[str, np.ndarray]) -> str:
    """The structure of a parameter expression: what a reader's strategies may derive
    from it and what its sources weigh."""
    node = graph.chains.get(name)
    if node is None:
        info = graph.tensors[name]
        value = constants.get(name)
        shown = repr(value.tolist()) if value is not None and value.size <= SMALL_CONSTANT_ELEMENTS else ""
        return f"{info.shape}:{info.dtype}{shown}"
    attrs = repr(sorted((k, repr(v)) for k, v in node.attrs.items()))
    return f"({node.op_type}{attrs}<" + ",".join(_chain(graph, n, constants) if n else "-" for n in node.inputs) + ">)"
