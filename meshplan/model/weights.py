"""Weights of the canonical model: small ones in memory, large ones only as dims and dtypes.

Before folding, initializers of at most ``limit`` elements are read (from the source's
external data where they live there); larger ones are never read: those stored in the
protobuf have their bytes set aside, those in external files stay references to them.
The canonical file keeps initializers under ``INLINE_BYTES`` inline and puts every other
one in one data file beside it, copied from the source in bounded chunks, so that
neither planning nor emission needs memory for more than one tensor.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from meshplan.errors import ModelError
from meshplan.model.fold import first_line, is_loaded

INLINE_BYTES = 1024
_HELD = "<held in memory>"
_CHUNK = 16 * 1024 * 1024


def _nbytes(tensor: onnx.TensorProto) -> int:
    if tensor.data_type == onnx.TensorProto.STRING:
        return 0
    return prod(tensor.dims) * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


def split_weights(model: onnx.ModelProto, source_dir: Path, limit: int) -> dict[str, bytes]:
    """Load the small initializers; set the large inline ones' bytes aside (returned by name)."""
    held = {}
    for tensor in model.graph.initializer:
        small = prod(tensor.dims) <= limit
        if not is_loaded(tensor) and small:
            try:
                external_data_helper.load_external_data_for_tensor(tensor, str(source_dir))
            except (OSError, ValueError, onnx.checker.ValidationError) as exc:
                raise ModelError(f"cannot read the model's external data: {first_line(exc)}") from exc
        elif is_loaded(tensor) and not small and tensor.data_type != onnx.TensorProto.STRING:
            held[tensor.name] = _raw_bytes(tensor)
            point_to(tensor, _HELD)
    return held


def write_weights(model: onnx.ModelProto, held: dict[str, bytes], source_dir: Path, data_path: Path) -> None:
    """Give every initializer of ``INLINE_BYTES`` or more its place in ``data_path``."""
    offset = 0
    with open(data_path, "wb") as out:
        for tensor in model.graph.initializer:
            data = held.get(tensor.name)
            if data is None and is_loaded(tensor):
                if tensor.data_type == onnx.TensorProto.STRING:
                    continue
                data = _raw_bytes(tensor)
                if len(data) < INLINE_BYTES:
                    continue
            if data is not None:
                out.write(data)
                length = len(data)
            else:
                length = copy_range(tensor, source_dir, out)
            point_to(tensor, data_path.name, offset, length)
            offset += length
    if offset == 0:
        data_path.unlink()


def _raw_bytes(tensor: onnx.TensorProto) -> bytes:
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


def point_to(tensor: onnx.TensorProto, location: str, offset: int = 0, length: int = 0) -> None:
    """Make ``tensor`` an external reference (its data fields cleared)."""
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def copy_range(tensor: onnx.TensorProto, source_dir: Path, out) -> int:
    """Copy an external tensor's bytes from the source's data file, chunk by chunk;
    return how many."""
    info = external_data_helper.ExternalDataInfo(tensor)
    base = source_dir.resolve()
    path = (base / info.location).resolve()
    start = int(info.offset or 0)
    size = int(info.length) if info.length is not None else _nbytes(tensor)
    problem = None
    if Path(info.location).is_absolute() or base not in path.parents:
        problem = f"its location {info.location!r} is outside the model's directory"
    elif not path.is_file():
        problem = f"{info.location!r} is not there"
    elif start + size > path.stat().st_size:
        problem = f"{info.location!r} is shorter than offset {start} + length {size}"
    if problem:
        raise ModelError(f"cannot read the external data of tensor '{tensor.name}': {problem}")
    with open(path, "rb") as source:
        source.seek(start)
        left = size
        while left:
            chunk = source.read(min(left, _CHUNK))
            if not chunk:
                raise ModelError(f"the external data of tensor '{tensor.name}' ends early in {info.location!r}")
            out.write(chunk)
            left -= len(chunk)
    return size
