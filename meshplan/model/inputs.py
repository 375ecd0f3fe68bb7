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


def _consumers(model: onnx.ModelProto, name: str) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if name in node.input]


def _role(model: onnx.ModelProto, value: onnx.ValueInfoProto) -> str | None:
    """What an LLM-shaped input is: ``mask``, ``positions``, ``past`` or ``ids`` (token ids),
    by its name, then by how the graph reads it; None for anything else."""
    name = value.name.lower()
    elem = value.type.tensor_type.elem_type
    integer = np.issubdtype(helper.tensor_dtype_to_np_dtype(elem), np.integer) or elem == onnx.TensorProto.BOOL
    if name.startswith(("past_key_values", "past.", "past_")) or ".past" in name or name.startswith("cache"):
        return "past"
    if "attention_mask" in name or (integer and name.endswith("mask")):
        return "mask"
    if "position_ids" in name or name in ("positions", "position"):
        return "positions"
    if integer and gather_index_bound(model, value.name):
        return "ids"
    # by use: an integer tensor only compared, cast or multiplied (never an index) is a mask
    uses = {node.op_type for node in _consumers(model, value.name)}
    if integer and uses and uses <= {"Cast", "Equal", "Not", "Greater", "Less", "Where", "Mul", "Sub", "Unsqueeze"}:
        return "mask"
    return None


def llm_inputs(model: onnx.ModelProto, dims: Mapping[str, int], seed: int = 0) -> tuple[dict[str, np.ndarray], list[str]]:
    """Inputs that make sense for an LLM-shaped model, and what was chosen (one line per
    input whose values are not random): an all-ones attention mask, position ids counting
    from the past length, and zero (or empty) past keys and values; token ids and other
    inputs random as ``random_inputs`` makes them."""
    feeds = random_inputs(model, dims, seed)
    initializers = {init.name for init in model.graph.initializer}
    values = [v for v in model.graph.input if v.name not in initializers]
    roles = {v.name: _role(model, v) for v in values}
    notes = []
    past_len = 0
    for v in values:
        if roles[v.name] == "past" and len(feeds[v.name].shape) >= 3:
            past_len = int(feeds[v.name].shape[-2])
    for v in values:
        role, array = roles[v.name], feeds[v.name]
        if role == "past":
            feeds[v.name] = np.zeros_like(array)
            notes.append(f"{v.name}: zeros {list(array.shape)} (a past of {past_len})"
                         if array.size else f"{v.name}: empty {list(array.shape)} (no past)")
        elif role == "mask":
            feeds[v.name] = np.ones_like(array)
            notes.append(f"{v.name}: all ones {list(array.shape)}")
        elif role == "positions" and array.ndim >= 1:
            seq = array.shape[-1]
            feeds[v.name] = np.broadcast_to(np.arange(past_len, past_len + seq), array.shape).astype(array.dtype).copy()
            notes.append(f"{v.name}: {past_len} … {past_len + seq - 1} (after a past of {past_len})")
    return feeds, notes


__all__ = ["DEFAULT_INT_HIGH", "gather_index_bound", "llm_inputs", "random_inputs", "resolve_shape"]
