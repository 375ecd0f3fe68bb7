"""Where a rank's tensors live while it runs, and how they reach mpi4py.

Two implementations of one small interface, chosen once per run:

* :class:`HostBuffers`: numpy arrays in host memory (the host path). With onnxruntime's
  CUDA provider, ``session.run`` copies every output to the host, so tensors cross
  the network from host memory: they are *staged through the host*.
* :class:`DeviceBuffers`: onnxruntime ``OrtValue``\\ s in the execution provider's memory
  (the device path). Programs run with IOBinding, their outputs bound to the device;
  slicing, concatenating and re-laying out tensors for communication runs as tiny
  one-operator onnxruntime models on the same device; and a tensor goes to mpi4py as
  :class:`MpiView`, which describes the OrtValue's memory through
  ``__cuda_array_interface__`` (pointer, shape, type), so a CUDA-aware MPI reads and
  writes GPU memory directly. mpi4py only takes the pointer from that interface, so the
  same path also runs with OrtValues in host memory (the CPU provider), which is how it
  is tested on machines without a GPU.

Every method takes and returns the implementation's own tensor type; both give the same
bits (only data movement, no arithmetic, happens here).
"""

from __future__ import annotations

import ctypes
import math

from typing import Sequence

import numpy as np

from meshplan.model.opsets import DEFAULT_OPSET

Box = tuple[slice, ...]


class HostBuffers:
    """numpy arrays in host memory."""

    name = "host"

    def from_host(self, array: np.ndarray) -> np.ndarray:
        return array

    def to_host(self, x: np.ndarray) -> np.ndarray:
        # a tensor kept where its session computes (``DeviceTensor``) comes out as a copy
        return x.numpy() if isinstance(x, DeviceTensor) else x

    def empty(self, shape: Sequence[int], dtype) -> np.ndarray:
        return np.empty(tuple(shape), dtype=dtype)

    def shape(self, x: np.ndarray) -> tuple[int, ...]:
        return tuple(x.shape)

    def take(self, x: np.ndarray, box: Box) -> np.ndarray:
        """The contiguous copy of ``x[box]``."""
        return np.asarray(x[box], order="C")   # (ascontiguousarray makes 0-d arrays 1-d)

    def pack(self, x: np.ndarray, axis: int, k: int) -> np.ndarray:
        """``x`` cut into ``k`` equal pieces along ``axis``, stacked on a new axis 0."""
        return np.ascontiguousarray(np.stack(np.split(x, k, axis=axis)))

    def unpack(self, x: np.ndarray, axis: int) -> np.ndarray:
        """The pieces ``x[0], x[1], …`` concatenated along ``axis`` (undoes :meth:`pack`)."""
        return np.ascontiguousarray(np.concatenate(list(x), axis=axis))

    def assembler(self, shape: Sequence[int], dtype) -> "_HostAssembler":
        return _HostAssembler(np.empty(tuple(shape), dtype=dtype))

    def mpi(self, x: np.ndarray) -> np.ndarray:
        """``x`` typed, for MPI's reductions."""
        return x

    def mpi_bytes(self, x: np.ndarray) -> np.ndarray:
        """``x``'s bytes, for moving it: every MPI moves bytes, not every MPI knows float16
        or bfloat16 (Open MPI 4 answers MPI_ERR_TYPE)."""
        return byte_view(x)


class _HostAssembler:
    def __init__(self, out: np.ndarray):
        self.out = out

    def put(self, box: Box, piece: np.ndarray) -> None:
        self.out[box] = piece

    def finish(self) -> np.ndarray:
        return self.out


HOST = HostBuffers()


def byte_view(array: np.ndarray) -> np.ndarray:
    """A C-contiguous array's memory as a flat uint8 array (no copy)."""
    return array.reshape(-1).view(np.uint8)


class MpiView:
    """An OrtValue's memory as mpi4py sees a device array (``__cuda_array_interface__``,
    version 3: C-contiguous, no stream to wait on because every producer is finished
    before a view is made). Keeps the OrtValue alive while MPI uses it."""

    def __init__(self, value, shape: tuple[int, ...], dtype: np.dtype, address: int | None = None):
        self.value = value
        self.__cuda_array_interface__ = {
            "shape": tuple(int(s) for s in shape),
            "typestr": np.dtype(dtype).str,
            "data": (int(value.data_ptr()) if address is None else address, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


class DeviceTensor:
    """An OrtValue with its shape and numpy dtype (read once, not per use); or a view of
    some rows of one (``x[a:b]``: its first dim from ``a`` to ``b``, a contiguous run of
    its memory), which a session binds by address."""

    __slots__ = ("value", "shape", "dtype", "offset", "device", "_address")

    def __init__(self, value, shape: Sequence[int], dtype, offset: int = 0, device: tuple[str, int] | None = None):
        self.value = value
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.offset = offset        # bytes from the OrtValue's start (a view of rows)
        self.device = device        # (device type, id) of the OrtValue's memory, where known
        self._address = None        # read once: an OrtValue's memory stays where it is

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def whole(self) -> bool:
        """The OrtValue itself, not a view of some of its rows."""
        return self.offset == 0 and self.shape == tuple(self.value.shape())

    @property
    def address(self) -> int:
        if self._address is None:
            self._address = int(self.value.data_ptr()) + self.offset
        return self._address

    def __getitem__(self, rows: slice) -> "DeviceTensor":
        """Rows ``rows`` of the first dim (step 1), as a view of the same memory."""
        start, stop, step = rows.indices(self.shape[0])
        if step != 1 or not self.shape:
            raise ValueError("a device tensor's view is a run of rows")
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        return DeviceTensor(self.value, (stop - start, *self.shape[1:]), self.dtype, self.offset + start * row,
                            self.device)

    def box_numpy(self, box: tuple) -> np.ndarray | None:
        """``box`` of this tensor alone copied to the host (a prompt's last logits, not the
        whole prompt's), where its memory is equally spaced runs (``box_runs``); else None."""
        known = _RUNS_SEEN.get(id(box))   # a decode step asks for the same box object each step
        if known is not None and known[0] is box and known[1] == self.shape and known[2] == self.dtype.itemsize:
            runs = known[3]
        else:
            runs = box_runs(self.shape, box, self.dtype.itemsize)
            if len(_RUNS_SEEN) >= 256:
                _RUNS_SEEN.clear()
            _RUNS_SEEN[id(box)] = (box, self.shape, self.dtype.itemsize, runs)   # (the box kept: its id stays its)
        if runs is None:
            return None
        first, width, pitch, count, shape = runs
        found = np.empty(shape, self.dtype)
        if found.nbytes == 0:
            return found
        source = self.address + first
        if self.value.device_name().lower() == "cuda":
            from meshplan.providers import cuda_copy_to_host

            return found if cuda_copy_to_host(found.ctypes.data, source, width, pitch, count) else None
        memory = np.frombuffer((ctypes.c_char * (pitch * (count - 1) + width)).from_address(source), np.uint8)
        target = found.reshape(-1).view(np.uint8)
        if count == 1:
            target[...] = memory
        else:
            target.reshape(count, width)[...] = np.lib.stride_tricks.as_strided(memory, (count, width), (pitch, 1))
        return found

    def numpy(self) -> np.ndarray:
        """A host copy (of the view's rows only). onnxruntime gives a tensor in host memory
        as a view of its buffer, which the next run may overwrite: copied; one in device
        memory as a new array of its own: kept as it is."""
        whole = np.asarray(self.value.numpy())
        fresh = whole.flags.owndata
        if self.whole:
            return whole if fresh else np.array(whole, copy=True)
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        start = self.offset // row if row else 0
        rows = whole[start:start + self.shape[0]]
        return rows if fresh else np.array(rows, copy=True)


_RUNS_SEEN: dict[int, tuple] = {}   # id(box) → (box, shape, itemsize, ``box_runs``'s answer)


def box_runs(shape: tuple[int, ...], box: tuple, itemsize: int) -> tuple | None:
    """Where ``box`` (slices, one per leading dim) of a C-ordered tensor of ``shape`` lies in
    its memory, if it cuts one dim into a run (step 1) and leaves the others whole: (first
    byte, bytes per run, bytes from one run to the next, runs, the box's shape); else None."""
    box = (box if isinstance(box, tuple) else (box,))[:len(shape)]
    if not all(isinstance(s, slice) for s in box):
        return None
    cut, start, stop = None, 0, 0
    for axis, (dim, s) in enumerate(zip(shape, box)):
        first, last, step = s.indices(dim)
        if step != 1:
            return None
        last = max(first, last)
        if (first, last) == (0, dim):
            continue
        if cut is not None:
            return None
        cut, start, stop = axis, first, last
    if cut is None:
        size = math.prod(shape) * itemsize
        return 0, size, size, 1, tuple(shape)
    inner = math.prod(shape[cut + 1:]) * itemsize
    return (start * inner, (stop - start) * inner, shape[cut] * inner, math.prod(shape[:cut]),
            (*shape[:cut], stop - start, *shape[cut + 1:]))


class DeviceBuffers:
    """OrtValues on ``device_type``:``device_id`` (``"cuda"`` or ``"cpu"``), moved by
    one-operator onnxruntime models on ``providers``; each distinct operation is built
    and loaded once, then reused."""

    name = "device"

    def __init__(self, device_type: str, device_id: int, providers: list):
        self.device_type = device_type
        self.device_id = device_id
        self.providers = providers
        self._kernels: dict[tuple, object] = {}

    # --- moving to and from the host --------------------------------------------------

    def from_host(self, array: np.ndarray) -> DeviceTensor:
        import onnxruntime as ort

        array = np.asarray(array, order="C")   # 0-d stays 0-d; in host memory the OrtValue wraps (and keeps) it
        value = ort.OrtValue.ortvalue_from_numpy(array, self.device_type, self.device_id)
        return DeviceTensor(value, array.shape, array.dtype, device=(self.device_type, self.device_id))

    def to_host(self, x: DeviceTensor) -> np.ndarray:
        return x.numpy()

    def empty(self, shape: Sequence[int], dtype) -> DeviceTensor:
        import onnxruntime as ort

        shape = [int(s) for s in shape]
        value = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(dtype), self.device_type, self.device_id)
        return DeviceTensor(value, shape, dtype, device=(self.device_type, self.device_id))

    def shape(self, x: DeviceTensor) -> tuple[int, ...]:
        return x.shape

    def wrap(self, value) -> DeviceTensor:
        """A session output (an OrtValue) as a :class:`DeviceTensor`."""
        return DeviceTensor(value, value.shape(), ort_dtype(value), device=(self.device_type, self.device_id))

    def mpi(self, x: DeviceTensor) -> MpiView:
        return MpiView(x.value, x.shape, x.dtype, x.address)

    def mpi_bytes(self, x: DeviceTensor) -> MpiView:
        return MpiView(x.value, (x.nbytes,), np.dtype(np.uint8), x.address)

    # --- data movement on the device ------------------------------------------------------
    # Kernels are shape-generic (symbolic dims; slice bounds and shapes are inputs), so a
    # rank builds one per operation, tensor rank and dtype, not one per shape.

    def take(self, x: DeviceTensor, box: Box) -> DeviceTensor:
        bounds = [_bounds(s, n) for s, n in zip(box, x.shape)]
        if all(a == 0 and b == n for (a, b), n in zip(bounds, x.shape)):
            return x
        key = ("take", len(x.shape), x.dtype.str)
        shape = tuple(b - a for a, b in bounds)
        return self._run(key, lambda: _slice_model(len(x.shape), x.dtype), [x],
                         {"starts": [a for a, _ in bounds], "ends": [b for _, b in bounds]}, shape)

    def pack(self, x: DeviceTensor, axis: int, k: int) -> DeviceTensor:
        split = list(x.shape[:axis]) + [k, x.shape[axis] // k] + list(x.shape[axis + 1:])
        shape = (k,) + tuple(x.shape[axis] // k if d == axis else n for d, n in enumerate(x.shape))
        key = ("pack", len(x.shape), axis, x.dtype.str)
        return self._run(key, lambda: _pack_model(len(x.shape), x.dtype, axis), [x], {"split": split}, shape)

    def unpack(self, x: DeviceTensor, axis: int) -> DeviceTensor:
        k, piece = x.shape[0], list(x.shape[1:])
        merged = piece[:axis] + [k * piece[axis]] + piece[axis + 1:]
        key = ("unpack", len(x.shape), axis, x.dtype.str)
        return self._run(key, lambda: _unpack_model(len(x.shape), x.dtype, axis), [x], {"merged": merged},
                         tuple(merged))

    def assembler(self, shape: Sequence[int], dtype) -> "_DeviceAssembler":
        return _DeviceAssembler(self, tuple(int(s) for s in shape), np.dtype(dtype))

    def assemble(self, shape: tuple[int, ...], dtype: np.dtype, pieces: list[tuple[Box, DeviceTensor]]) -> DeviceTensor:
        """The tensor of ``shape`` tiled by ``pieces`` (boxes relative to it, forming a
        grid: every dimension cut at the same points throughout)."""
        boxes = [tuple(_bounds(s, n) for s, n in zip(box, shape)) for box, _ in pieces]
        if len(pieces) == 1 and all(a == 0 and b == n for (a, b), n in zip(boxes[0], shape)):
            return pieces[0][1]
        order = sorted(range(len(pieces)), key=lambda i: boxes[i])
        counts = tuple(len({boxes[i][d] for i in order}) for d in range(len(shape)))
        if int(np.prod(counts)) != len(pieces):
            raise ValueError(f"{len(pieces)} pieces do not form a grid over a tensor of shape {list(shape)}")
        key = ("assemble", counts, dtype.str)
        return self._run(key, lambda: _assemble_model(counts, dtype), [pieces[i][1] for i in order], {}, shape)

    def _run(self, key: tuple, build, inputs: list[DeviceTensor], host_inputs: dict, shape) -> DeviceTensor:
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = _Kernel(build(), self.providers)
        return kernel.run(inputs, host_inputs, self.device_type, self.device_id, tuple(shape))

    @property
    def kernels(self) -> int:
        """How many distinct one-operator models this rank has built."""
        return len(self._kernels)


class _DeviceAssembler:
    def __init__(self, buffers: DeviceBuffers, shape: tuple[int, ...], dtype: np.dtype):
        self.buffers, self.shape, self.dtype = buffers, shape, dtype
        self.pieces: list[tuple[Box, DeviceTensor]] = []

    def put(self, box: Box, piece: DeviceTensor) -> None:
        self.pieces.append((box, piece))

    def finish(self) -> DeviceTensor:
        return self.buffers.assemble(self.shape, self.dtype, self.pieces)


def _bounds(s: slice, size: int) -> tuple[int, int]:
    start, stop, step = s.indices(size)
    if step != 1:
        raise ValueError("only unit-step slices move between devices")
    return start, stop


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
              "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def ort_dtype(value) -> np.dtype:
    """The numpy dtype of an OrtValue: its ONNX element type where this onnxruntime
    reports one (``element_type``), else from its type name (older releases)."""
    kind = value.element_type() if callable(getattr(value, "element_type", None)) else value.data_type()
    if isinstance(kind, int):
        from onnx import helper

        return np.dtype(helper.tensor_dtype_to_np_dtype(kind))
    if kind in _ORT_TYPES:
        return np.dtype(_ORT_TYPES[kind])
    raise ValueError(f"tensors of type {kind} cannot move between devices")


# --- one-operator models --------------------------------------------------------------


class _Kernel:
    def __init__(self, model, providers: list):
        import onnxruntime as ort

        from meshplan.providers import session_options

        options = session_options(threads=1)
        options.log_severity_level = 3
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        self.inputs = [i.name for i in self.session.get_inputs() if not i.name.startswith("shape_")]
        self.output = self.session.get_outputs()[0].name

    def run(self, inputs: list[DeviceTensor], host_inputs: dict, device_type: str, device_id: int,
            shape: tuple[int, ...]) -> DeviceTensor:
        binding = self.session.io_binding()
        for name, x in zip(self.inputs, inputs):
            binding.bind_ortvalue_input(name, x.value)
        for name, values in host_inputs.items():   # bounds and shapes: small int64 vectors on the host
            binding.bind_cpu_input(f"shape_{name}", np.asarray(values, dtype=np.int64))
        binding.bind_output(self.output, device_type, device_id)
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        (value,) = binding.get_outputs()
        return DeviceTensor(value, shape, inputs[0].dtype)


def _model(nodes, inputs, outputs, initializers=()):
    from onnx import helper

    graph = helper.make_graph(nodes, "move", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)], ir_version=8)


def _value(name: str, dtype, rank: int):
    """A tensor input or output of any shape of ``rank`` dimensions."""
    from onnx import helper

    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                         [f"{name}_{d}" for d in range(rank)])


def _vector(name: str):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(f"shape_{name}", TensorProto.INT64, [None])


def _slice_model(rank: int, dtype):
    from onnx import helper

    node = helper.make_node("Slice", ["x", "shape_starts", "shape_ends"], ["y"])
    return _model([node], [_value("x", dtype, rank), _vector("starts"), _vector("ends")], [_value("y", dtype, rank)])


def _pack_model(rank: int, dtype, axis: int):
    """[..., k·p, ...] → reshape [..., k, p, ...] → move the k axis to the front."""
    from onnx import helper

    perm = [axis] + [d for d in range(rank + 1) if d != axis]
    nodes = [helper.make_node("Reshape", ["x", "shape_split"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=perm)]
    return _model(nodes, [_value("x", dtype, rank), _vector("split")], [_value("y", dtype, rank + 1)])


def _unpack_model(rank: int, dtype, axis: int):
    """[k, ...p at axis...] → move k next to ``axis`` → merge them."""
    from onnx import helper

    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=perm),
             helper.make_node("Reshape", ["t", "shape_merged"], ["y"])]
    return _model(nodes, [_value("x", dtype, rank), _vector("merged")], [_value("y", dtype, rank - 1)])


def _assemble_model(counts: tuple[int, ...], dtype):
    """Nested Concats over a grid of ``prod(counts)`` pieces given in row-major grid
    order: the innermost Concats join along the last dimension, the outermost along the first."""
    from onnx import helper

    nodes = []
    rank = len(counts)
    names = [f"p{i}" for i in range(int(np.prod(counts)))]
    level = names
    for dim in reversed(range(rank)):
        k = counts[dim]
        if k == 1:
            continue
        joined = []
        for g in range(len(level) // k):
            out = f"c{len(nodes)}"
            nodes.append(helper.make_node("Concat", level[g * k:(g + 1) * k], [out], axis=dim))
            joined.append(out)
        level = joined
    nodes.append(helper.make_node("Identity", [level[0]], ["y"]))
    return _model(nodes, [_value(n, dtype, rank) for n in names], [_value("y", dtype, rank)])
