"""Weights an exporter stored twice: one torch parameter read in two places (a tied input
embedding and output head) becomes two initializers, the table and its transpose (torch's
dynamo exporter folds the head's transpose into a copy). Trained as two, each would get
only its own readers' gradient; torch updates the one parameter with their sum.

``retie`` finds such copies — an initializer equal to an embedding table (the data of a
Gather) or to its transpose — and makes the copy a node of the table (Identity or
Transpose), so reverse mode sums both gradients into the table. Only tables and the
initializers whose shape could be a copy of one are read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper


def _value(tensor: onnx.TensorProto, base: Path) -> np.ndarray:
    if tensor.data_location == TensorProto.EXTERNAL:
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        external_data_helper.load_external_data_for_tensor(copy, str(base))
        return numpy_helper.to_array(copy)
    return numpy_helper.to_array(tensor)


def retie(model: onnx.ModelProto, base: Path, names: set[str]) -> dict[str, dict]:
    """Rewrite ``model`` in place; ``names``: the initializers that may be trained. Returns
    {copy: {"of": table, "transposed": bool}} for each copy made a node."""
    graph = model.graph
    by_name = {t.name: t for t in graph.initializer if t.name in names}
    tables = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input and n.input[0] in by_name}
    found: dict[str, dict] = {}
    for table in sorted(tables):
        source = by_name[table]
        dims = tuple(source.dims)
        partners = [t for t in by_name.values() if t.name != table and t.name not in found and t.name not in tables
                    and t.data_type == source.data_type and tuple(t.dims) in (dims, dims[::-1])]
        if not partners:
            continue
        value = _value(source, base)
        for partner in partners:
            other = _value(partner, base)
            if tuple(other.shape) == dims and np.array_equal(other, value):
                found[partner.name] = {"of": table, "transposed": False}
            elif len(dims) == 2 and tuple(other.shape) == dims[::-1] and np.array_equal(other, value.T):
                found[partner.name] = {"of": table, "transposed": True}
    if not found:
        return found
    kept = [t for t in graph.initializer if t.name not in found]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    made = [helper.make_node("Transpose" if tie["transposed"] else "Identity", [tie["of"]], [copy],
                             name=f"train.tie/{copy}", **({"perm": [1, 0]} if tie["transposed"] else {}))
            for copy, tie in found.items()]
    nodes = made + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return found
