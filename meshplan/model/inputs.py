"""Random, valid inputs for an ONNX model once its symbolic dimensions are fixed."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

from meshplan.errors import ModelError

DEFAULT_INT_HIGH = 10


def resolve_shape(value: onnx.ValueInfoProto, dims: Mapping[str, int]) -> tuple[int, ...]:
    """The concrete shape of a graph input, with symbolic dims taken from ``dims``."""
    shape = []
    for axis, dim in enumerate(value.type.tensor_type.shape.dim):
        if dim.HasField("dim_value"):
            shape.append(dim.dim_value)
        elif dim.dim_param in dims:
            shape.append(int(dims[dim.dim_param]))
        elif dim.dim_param:
            raise ModelError(f"dimension {dim.dim_param!r} of input '{value.name}' is unknown", hint=f"fix it with --dim {dim.dim_param}=INT")
        else:
            raise ModelError(f"input '{value.name}': axis {axis} has neither a size nor a name")
    return tuple(shape)


def gather_index_bound(model: onnx.ModelProto, name: str) -> int | None:
    """The largest valid id for tensor ``name`` used as Gather indices into initializers.

    Returns the smallest table size along the gathered axis over all such Gathers
    (an exclusive upper bound), or None when ``name`` indexes no initializer table.
    """
    tables = {init.name: init for init in model.graph.initializer}
    bound = None
    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[1] != name:
            continue
        table = tables.get(node.input[0])
        if table is None:
            continue
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        size = table.dims[axis]
        bound = size if bound is None else min(bound, size)
    return bound


def random_inputs(model: onnx.ModelProto, dims: Mapping[str, int], seed: int = 0,
                  int_high: int | None = None) -> dict[str, np.ndarray]:
    """Random feeds for every true graph input (initializers listed as inputs are skipped).

    Floats are standard normal; integers lie in ``[0, int_high)``, where ``int_high``
    defaults to the size of the embedding table the input indexes (see
    :func:`gather_index_bound`) or ``DEFAULT_INT_HIGH``; booleans are fair coin flips.
    """
    rng = np.random.default_rng(seed)
    initializers = {init.name for init in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        shape = resolve_shape(value, dims)
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if np.issubdtype(dtype, np.floating):
            array = rng.standard_normal(shape).astype(dtype)
        elif np.issubdtype(dtype, np.integer):
            high = int_high or gather_index_bound(model, value.name) or DEFAULT_INT_HIGH
            array = rng.integers(0, high, shape).astype(dtype)
        elif dtype == np.bool_:
            array = rng.integers(0, 2, shape).astype(np.bool_)
        else:
            raise ModelError(f"input '{value.name}': no random generator for dtype {dtype}")
        feeds[value.name] = array
    return feeds


__all__ = ["DEFAULT_INT_HIGH", "gather_index_bound", "random_inputs", "resolve_shape"]
