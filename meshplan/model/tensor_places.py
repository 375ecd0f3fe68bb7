"""Where each initializer's bytes lie in a model's own files, so that another model can
refer to them as external data instead of copying them.

An initializer stored as external data lies in its data file at its offset. One stored in
the protobuf lies inside the model file itself: its ``raw_data`` (or packed
``float_data`` / ``double_data``, the same little-endian bytes) is found by walking the
protobuf wire format of the file, memory-mapped, without parsing the tensors. A tensor
stored some other way (varint-encoded ``int64_data``, strings) has no such place.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper

# field numbers of onnx.proto
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_NAME, _TENSOR_RAW, _TENSOR_FLOAT, _TENSOR_DOUBLE = 8, 9, 4, 10
_PACKED = {_TENSOR_FLOAT: (onnx.TensorProto.FLOAT, onnx.TensorProto.COMPLEX64),
           _TENSOR_DOUBLE: (onnx.TensorProto.DOUBLE, onnx.TensorProto.COMPLEX128)}


@dataclass(frozen=True)
class Place:
    location: str      # relative to the model's directory
    offset: int
    length: int


def tensor_places(path: str | os.PathLike, header: onnx.ModelProto) -> dict[str, Place]:
    """Initializer name → where its bytes are, for the model file ``path`` whose graph (read
    without external data) is ``header``; tensors with no such place are left out."""
    path = Path(path)
    places: dict[str, Place] = {}
    inline = {}
    for tensor in header.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = external_data_helper.ExternalDataInfo(tensor)
            length = int(info.length) if info.length is not None else _nbytes(tensor)
            places[tensor.name] = Place(info.location, int(info.offset or 0), length)
        elif tensor.data_type != onnx.TensorProto.STRING:
            inline[tensor.name] = tensor
    if inline:
        for name, (field, offset, length) in _inline_data(path).items():
            tensor = inline.get(name)
            if tensor is None or length != _nbytes(tensor):
                continue
            if field in _PACKED and tensor.data_type not in _PACKED[field]:
                continue
            places[name] = Place(path.name, offset, length)
    return places


def _nbytes(tensor: onnx.TensorProto) -> int:
    return prod(tensor.dims) * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


def _varint(buf, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, wire type, start, end) of each field in ``buf[start:end]``; ``start``
    and ``end`` bound the payload of length-delimited fields."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
            yield field, wire, pos, pos
        elif wire == 1:
            pos += 8
            yield field, wire, pos - 8, pos
        elif wire == 2:
            length, pos = _varint(buf, pos)
            yield field, wire, pos, pos + length
            pos += length
        elif wire == 5:
            pos += 4
            yield field, wire, pos - 4, pos
        else:            # groups (3, 4) are not used by onnx.proto
            raise ValueError(f"unexpected wire type {wire}")


def _inline_data(path: Path) -> dict[str, tuple[int, int, int]]:
    """Initializer name → (field, offset, length) of its data field in the model file."""
    found: dict[str, tuple[int, int, int]] = {}
    if path.stat().st_size == 0:
        return found
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            for field, wire, start, end in _fields(buf, 0, len(buf)):
                if field != _MODEL_GRAPH or wire != 2:
                    continue
                for g_field, g_wire, g_start, g_end in _fields(buf, start, end):
                    if g_field != _GRAPH_INITIALIZER or g_wire != 2:
                        continue
                    name, data = None, None
                    for t_field, t_wire, t_start, t_end in _fields(buf, g_start, g_end):
                        if t_field == _TENSOR_NAME and t_wire == 2:
                            name = bytes(buf[t_start:t_end]).decode("utf-8", "replace")
                        elif t_field in (_TENSOR_RAW, _TENSOR_FLOAT, _TENSOR_DOUBLE) and t_wire == 2:
                            data = (t_field, t_start, t_end - t_start)
                    if name is not None and data is not None:
                        if name in found:          # written twice: protobuf would merge; refer to neither
                            found[name] = (-1, 0, -1)
                        else:
                            found[name] = data
        except (IndexError, ValueError):
            return {}
    return {name: place for name, place in found.items() if place[0] >= 0}
