"""Parameter expressions: tensors computed from initializers alone through layout and
elementwise operators (a transposed, reshaped, cast or dequantized weight, a slice of a
fused one).

Such a tensor is a *parameter* to the planner: its producing nodes (the expression's
*chain*) leave the planner's node list, and the tensor is sharded, costed and budgeted
like a weight, by the bytes of the *source* initializers it is computed from. The
emitter stores each device's slice of the sources and replays the chain on that slice
(see ``intra.strategies.derive`` and ``emit.shard``).

Only operators whose sharding rules map an output split back to an input split take
part; a node that produces a graph output, has several outputs, or reads a graph input
stays an ordinary node.
"""

from __future__ import annotations

from typing import Iterable

CHAIN_OPS = frozenset({
    "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast", "DequantizeLinear",
    "Tile", "Slice", "Identity", "Add", "Sub", "Mul", "Div", "Neg",
})


def find_chains(nodes: Iterable, initializers: set[str], outputs: set[str]) -> dict[str, object]:
    """Tensor name → the node computing it, for every parameter expression's node, in
    topological order. ``nodes`` have ``op_type``, ``domain``, ``inputs`` and ``outputs``."""
    static = set(initializers)
    found: dict[str, object] = {}
    for node in nodes:
        produced = [name for name in node.outputs if name]
        if (node.op_type in CHAIN_OPS and node.domain in ("", "ai.onnx") and len(produced) == 1
                and len(node.outputs) == 1 and produced[0] not in outputs
                and all(name in static for name in node.inputs if name)):
            static.add(produced[0])
            found[produced[0]] = node
    return found


def sources_of(name: str, chains: dict[str, object], initializers: set[str]) -> tuple[str, ...]:
    """The initializers a parameter expression reads, in first-read order (``name`` itself
    when it is an initializer)."""
    if name in initializers:
        return (name,)
    found: dict[str, None] = {}
    for source in chains[name].inputs:
        if source:
            found.update(dict.fromkeys(sources_of(source, chains, initializers)))
    return tuple(found)
