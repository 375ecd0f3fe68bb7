"""Weights of the canonical model: small ones in memory, large ones only as dims and dtypes.

Before folding, initializers of at most ``limit`` elements are read (from the source's
external data where they live there); larger ones are never read: those stored in the
protobuf have their bytes set aside, those in external files stay references to them.
The canonical file keeps initializers under ``INLINE_BYTES`` inline and puts every other
one in one data file beside it, copied from the source in bounded chunks, so that
neither planning nor emission needs memory for more than one tensor.
"""

from __future__ import annotations

import os
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


def split_weights(model: onnx.ModelProto, source_dir: Path, limit: int, read_external: bool = True) -> dict[str, bytes]:
    """Load the small initializers (those in external data files only if ``read_external``);
    set the large inline ones' bytes aside (returned by name)."""
    held = {}
    for tensor in model.graph.initializer:
        small = prod(tensor.dims) <= limit
        if not is_loaded(tensor) and small and read_external:
            try:
                external_data_helper.load_external_data_for_tensor(tensor, str(source_dir))
            except (OSError, ValueError, onnx.checker.ValidationError) as exc:
                raise ModelError(f"cannot read the model's external data: {first_line(exc)}") from exc
        elif is_loaded(tensor) and not small and tensor.data_type != onnx.TensorProto.STRING:
            held[tensor.name] = _raw_bytes(tensor)
            point_to(tensor, _HELD)
    return held


def write_weights(model: onnx.ModelProto, held: dict[str, bytes], source_dir: Path, data_path: Path) -> None:
    """Give every initializer of ``INLINE_BYTES`` or more its place beside the canonical
    model: those held in memory in ``data_path``; those in the source's external data
    files stay where they are, read through a symbolic link to each file beside
    ``data_path`` (no copy; where no link can be made, the ranges are copied into
    ``data_path``). Only meshplan reads the canonical model's weights (``load_tensor``,
    ``copy_range``): onnx's own loader refuses linked data files."""
    offset = 0
    links: dict[Path, str | None] = {}
    with open(data_path, "wb") as out:
        for tensor in model.graph.initializer:
            data = held.get(tensor.name)
            if data is None and is_loaded(tensor):
                if tensor.data_type == onnx.TensorProto.STRING:
                    continue
                data = _raw_bytes(tensor)
                if len(data) < INLINE_BYTES:
                    continue
            if data is None:
                path, start, size = check_range(tensor, source_dir)
                if path not in links:
                    links[path] = _link_beside(path, data_path, len(links))
                if links[path] is not None:
                    point_to(tensor, links[path], start, size)
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


def _link_beside(source: Path, data_path: Path, index: int) -> str | None:
    """A symbolic link to ``source`` next to ``data_path``: its name, or None if it
    cannot be made. (Not a hard link: onnx's checker refuses a data file with several
    links, and the source model is checked again by every later command.)"""
    name = f"{data_path.name}.source{index}"
    try:
        os.symlink(source.resolve(), data_path.with_name(name))
    except OSError:
        return None
    return name


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


def check_range(tensor: onnx.TensorProto, source_dir: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor's bytes, checked: named inside the
    model's directory (a link there, made by ``write_weights``, is followed) and within
    the file."""
    info = external_data_helper.ExternalDataInfo(tensor)
    base = source_dir.resolve()
    path = Path(os.path.normpath(base / info.location))
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
    return path, start, size


def load_tensor(tensor: onnx.TensorProto, base_dir: Path) -> onnx.TensorProto:
    """A copy of an external ``tensor`` with its bytes inline, read by meshplan itself:
    the canonical model's data files may be hard links of the source's, which onnx's
    own loader refuses."""
    path, start, size = check_range(tensor, base_dir)
    with open(path, "rb") as source:
        source.seek(start)
        data = source.read(size)
    if len(data) != size:
        raise ModelError(f"the external data of tensor '{tensor.name}' ends early in {path.name!r}")
    loaded = onnx.TensorProto()
    loaded.CopyFrom(tensor)
    del loaded.external_data[:]
    loaded.data_location = onnx.TensorProto.DEFAULT
    loaded.raw_data = data
    return loaded


def tensor_value(tensor: onnx.TensorProto, base_dir: Path | None) -> np.ndarray:
    """The tensor's value, its external bytes read with ``load_tensor``."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL and base_dir is not None:
        tensor = load_tensor(tensor, Path(base_dir))
    return numpy_helper.to_array(tensor)


def copy_range(tensor: onnx.TensorProto, source_dir: Path, out) -> int:
    """Copy an external tensor's bytes from its data file, chunk by chunk; return how many."""
    path, start, size = check_range(tensor, source_dir)
    info = external_data_helper.ExternalDataInfo(tensor)
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


def read_initializers(path: str | os.PathLike, names) -> "iter":
    """(name, array) of the initializers ``names`` of the model at ``path``, one at a time
    (each read from its external data only when its turn comes)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    wanted = set(names)
    for tensor in model.graph.initializer:
        if tensor.name in wanted:
            yield tensor.name, tensor_value(tensor, path.parent)
            tensor.Clear()
