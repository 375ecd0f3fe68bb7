"""A program's weights, streamed from the canonical model's data file to the program's.

The stage programs are cut from the canonical model with its large weights left as
external references (``model.weights`` wrote them to one data file beside it). A
device's shard of such a weight is a *pending slice*: the program holds a placeholder
(dims and dtype, no bytes) and ``write_program`` copies the slice from the canonical
data file into the program's own data file a bounded chunk at a time, read through a
read-only memory map. Emission therefore never holds a large weight, whole or sliced,
in memory; its peak is the graph plus one chunk.

Programs whose weights come to at most ``threshold`` bytes are written in one file, as
onnx saves a model with its weights inline (the bytes are the same either way).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from meshplan.model.weights import INLINE_BYTES, copy_range, load_tensor, point_to
from meshplan.sharding import take

CHUNK_BYTES = 16 * 1024 * 1024
PENDING = "<pending slice>"
# Element types whose items are not whole bytes (packed) or have no fixed size: sliced in memory.
_UNMAPPABLE = {onnx.TensorProto.STRING, onnx.TensorProto.INT4, onnx.TensorProto.UINT4}
for _name in ("FLOAT4E2M1", "INT2", "UINT2"):
    if hasattr(onnx.TensorProto, _name):
        _UNMAPPABLE.add(getattr(onnx.TensorProto, _name))


@dataclass(frozen=True)
class PendingSlice:
    """``slices`` of the external initializer ``source``; zeros when ``zero`` (a device of
    a partial group that does not hold the value)."""

    source: onnx.TensorProto
    slices: tuple[slice, ...]
    zero: bool = False


def itemsize(tensor: onnx.TensorProto) -> int:
    return np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


def nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of the tensor's data, held or referenced."""
    if tensor.data_type == onnx.TensorProto.STRING:
        return 0
    if not is_external(tensor) and tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    if tensor.data_type in _UNMAPPABLE:
        length = external_data_helper.ExternalDataInfo(tensor).length if is_external(tensor) else None
        return int(length) if length else (prod(tensor.dims) + 1) // 2
    return prod(tensor.dims) * itemsize(tensor)


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def load_small(model: onnx.ModelProto, base_dir: Path, limit_bytes: int) -> None:
    """Read the external initializers of at most ``limit_bytes`` into the model (the
    constants emission computes with); larger ones stay references."""
    for tensor in model.graph.initializer:
        if is_external(tensor) and (tensor.data_type in _UNMAPPABLE or nbytes(tensor) <= limit_bytes):
            tensor.CopyFrom(load_tensor(tensor, base_dir))


def can_defer(tensor: onnx.TensorProto) -> bool:
    """Is ``tensor`` an external reference whose slices can be streamed?"""
    return is_external(tensor) and tensor.data_type not in _UNMAPPABLE


def placeholder(name: str, source: onnx.TensorProto, shape: tuple[int, ...]) -> onnx.TensorProto:
    """An initializer of ``shape`` with ``source``'s type whose bytes are written later."""
    tensor = onnx.TensorProto(name=name, data_type=source.data_type, dims=list(shape))
    point_to(tensor, PENDING)
    return tensor


def _source_view(tensor: onnx.TensorProto, base_dir: Path) -> np.ndarray:
    """The external tensor's bytes as a read-only memory map of items of its size."""
    info = external_data_helper.ExternalDataInfo(tensor)
    path = base_dir / info.location
    dtype = np.dtype((np.void, itemsize(tensor)))
    return np.memmap(path, dtype=dtype, mode="r", offset=int(info.offset or 0), shape=tuple(tensor.dims))


def _write_array(view: np.ndarray, out) -> int:
    """Write ``view`` (C order) in chunks of leading-axis rows; return the bytes written."""
    if view.ndim == 0:
        data = np.ascontiguousarray(view).tobytes()
        out.write(data)
        return len(data)
    row = max(1, view[0:1].nbytes)
    step = max(1, CHUNK_BYTES // row)
    written = 0
    for start in range(0, view.shape[0], step):
        data = np.ascontiguousarray(view[start:start + step]).tobytes()
        out.write(data)
        written += len(data)
    return written


def _write_zeros(count: int, out) -> int:
    left = count
    block = bytes(min(count, CHUNK_BYTES))
    while left:
        n = min(left, len(block))
        out.write(block[:n])
        left -= n
    return count


def write_slice(pending: PendingSlice, base_dir: Path, out) -> int:
    """Stream a pending slice into ``out``; return the bytes written."""
    view = take(_source_view(pending.source, base_dir), pending.slices)
    if pending.zero:
        return _write_zeros(view.size * view.itemsize, out)
    return _write_array(view, out)


def materialize(tensor: onnx.TensorProto, pending: dict[str, PendingSlice], base_dir: Path) -> onnx.TensorProto:
    """``tensor`` with its bytes inline (a pending slice read, an external one loaded)."""
    if tensor.name in pending:
        job = pending[tensor.name]
        view = take(_source_view(job.source, base_dir), job.slices)
        dtype = helper.tensor_dtype_to_np_dtype(job.source.data_type)
        part = np.zeros(view.shape, dtype=dtype) if job.zero else np.ascontiguousarray(view).view(dtype)
        return numpy_helper.from_array(part, tensor.name)
    if is_external(tensor):
        return load_tensor(tensor, base_dir)
    return tensor


def write_program(model: onnx.ModelProto, pending: dict[str, PendingSlice], base_dir: Path, path: Path,
                  threshold: int) -> list[dict]:
    """Write ``model`` to ``path``: weights inline when they come to at most ``threshold``
    bytes, else every initializer of ``INLINE_BYTES`` or more streamed into ``path.data``.
    Returns the data files written ([{"file", "sha256"}])."""
    initializers = list(model.graph.initializer)
    total = sum(nbytes(t) for t in initializers)
    if total <= threshold:
        del model.graph.initializer[:]
        model.graph.initializer.extend(materialize(t, pending, base_dir) for t in initializers)
        onnx.save_model(model, str(path))
        return []
    data_path = path.with_name(path.name + ".data")
    offset = 0
    with open(data_path, "wb") as file:
        out = _Hashing(file)
        for tensor in model.graph.initializer:
            if tensor.name in pending:
                length = write_slice(pending[tensor.name], base_dir, out)
            elif is_external(tensor):
                length = copy_range(tensor, base_dir, out)
            elif tensor.data_type != onnx.TensorProto.STRING and nbytes(tensor) >= INLINE_BYTES:
                data = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
                out.write(data)
                length = len(data)
            else:
                continue
            point_to(tensor, data_path.name, offset, length)
            offset += length
    onnx.save_model(model, str(path))
    return [{"file": data_path.name, "sha256": out.hexdigest()}]


class _Hashing:
    """A file being written and the SHA-256 of what went into it (no second read)."""

    def __init__(self, file):
        self.file = file
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def hexdigest(self) -> str:
        return self.digest.hexdigest()
