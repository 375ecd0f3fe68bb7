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

from typing import Sequence

import numpy as np

Box = tuple[slice, ...]


class HostBuffers:
    """numpy arrays in host memory."""

    name = "host"

    def from_host(self, array: np.ndarray) -> np.ndarray:
        return array

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def empty(self, shape: Sequence[int], dtype) -> np.ndarray:
        return np.empty(tuple(shape), dtype=dtype)

    def shape(self, x: np.ndarray) -> tuple[int, ...]:
        return tuple(x.shape)

    def take(self, x: np.ndarray, box: Box) -> np.ndarray:
        """The contiguous copy of ``x[box]``."""
        return np.ascontiguousarray(x[box])

    def pack(self, x: np.ndarray, axis: int, k: int) -> np.ndarray:
        """``x`` cut into ``k`` equal pieces along ``axis``, stacked on a new axis 0."""
        return np.ascontiguousarray(np.stack(np.split(x, k, axis=axis)))

    def unpack(self, x: np.ndarray, axis: int) -> np.ndarray:
        """The pieces ``x[0], x[1], …`` concatenated along ``axis`` (undoes :meth:`pack`)."""
        return np.ascontiguousarray(np.concatenate(list(x), axis=axis))

    def assembler(self, shape: Sequence[int], dtype) -> "_HostAssembler":
        return _HostAssembler(np.empty(tuple(shape), dtype=dtype))

    def mpi(self, x: np.ndarray) -> np.ndarray:
        return x


class _HostAssembler:
    def __init__(self, out: np.ndarray):
        self.out = out

    def put(self, box: Box, piece: np.ndarray) -> None:
        self.out[box] = piece

    def finish(self) -> np.ndarray:
        return self.out


HOST = HostBuffers()


class MpiView:
    """An OrtValue's memory as mpi4py sees a device array (``__cuda_array_interface__``,
    version 3: C-contiguous, no stream to wait on because every producer is finished
    before a view is made). Keeps the OrtValue alive while MPI uses it."""

    def __init__(self, value, shape: tuple[int, ...], dtype: np.dtype):
        self.value = value
        self.__cuda_array_interface__ = {
            "shape": tuple(int(s) for s in shape),
            "typestr": np.dtype(dtype).str,
            "data": (int(value.data_ptr()), False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


class DeviceTensor:
    """An OrtValue with its shape and numpy dtype (read once, not per use)."""

    __slots__ = ("value", "shape", "dtype")

    def __init__(self, value, shape: Sequence[int], dtype):
        self.value = value
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)


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

        array = np.ascontiguousarray(array)   # in host memory the OrtValue wraps (and keeps) it
        value = ort.OrtValue.ortvalue_from_numpy(array, self.device_type, self.device_id)
        return DeviceTensor(value, array.shape, array.dtype)

    def to_host(self, x: DeviceTensor) -> np.ndarray:
        return np.array(x.value.numpy(), copy=True)

    def empty(self, shape: Sequence[int], dtype) -> DeviceTensor:
        import onnxruntime as ort

        shape = [int(s) for s in shape]
        value = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(dtype), self.device_type, self.device_id)
        return DeviceTensor(value, shape, dtype)

    def shape(self, x: DeviceTensor) -> tuple[int, ...]:
        return x.shape

    def wrap(self, value) -> DeviceTensor:
        """A session output (an OrtValue) as a :class:`DeviceTensor`."""
        return DeviceTensor(value, value.shape(), ort_dtype(value))

    def mpi(self, x: DeviceTensor) -> MpiView:
        return MpiView(x.value, x.shape, x.dtype)

    # --- data movement on the device ------------------------------------------------------

    def take(self, x: DeviceTensor, box: Box) -> DeviceTensor:
        bounds = tuple(_bounds(s, n) for s, n in zip(box, x.shape))
        if all(a == 0 and b == n for (a, b), n in zip(bounds, x.shape)):
            return x
        key = ("take", x.shape, x.dtype.str, bounds)
        return self._run(key, lambda: _slice_model(x.shape, x.dtype, bounds), [x])[0]

    def pack(self, x: DeviceTensor, axis: int, k: int) -> DeviceTensor:
        key = ("pack", x.shape, x.dtype.str, axis, k)
        return self._run(key, lambda: _pack_model(x.shape, x.dtype, axis, k), [x])[0]

    def unpack(self, x: DeviceTensor, axis: int) -> DeviceTensor:
        key = ("unpack", x.shape, x.dtype.str, axis)
        return self._run(key, lambda: _unpack_model(x.shape, x.dtype, axis), [x])[0]

    def assembler(self, shape: Sequence[int], dtype) -> "_DeviceAssembler":
        return _DeviceAssembler(self, tuple(int(s) for s in shape), np.dtype(dtype))

    def assemble(self, shape: tuple[int, ...], dtype: np.dtype, pieces: list[tuple[Box, DeviceTensor]]) -> DeviceTensor:
        """The tensor of ``shape`` tiled by ``pieces`` (boxes relative to it, forming a grid)."""
        boxes = tuple(tuple(_bounds(s, n) for s, n in zip(box, shape)) for box, _ in pieces)
        if len(pieces) == 1 and all(a == 0 and b == n for (a, b), n in zip(boxes[0], shape)):
            return pieces[0][1]
        order = sorted(range(len(pieces)), key=lambda i: boxes[i])
        boxes = tuple(boxes[i] for i in order)
        key = ("assemble", shape, dtype.str, boxes)
        return self._run(key, lambda: _assemble_model(shape, dtype, boxes), [pieces[i][1] for i in order])[0]

    def _run(self, key: tuple, build, inputs: list[DeviceTensor]) -> list[DeviceTensor]:
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = _Kernel(build(), self.providers)
        return kernel.run(inputs, self.device_type, self.device_id)


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
    """The numpy dtype of an OrtValue (onnxruntime reports an ONNX type number or a name)."""
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

        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [(o.name, tuple(o.shape)) for o in self.session.get_outputs()]

    def run(self, inputs: list[DeviceTensor], device_type: str, device_id: int) -> list[DeviceTensor]:
        binding = self.session.io_binding()
        for name, x in zip(self.inputs, inputs):
            binding.bind_ortvalue_input(name, x.value)
        for name, _ in self.outputs:
            binding.bind_output(name, device_type, device_id)
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        dtype = inputs[0].dtype
        return [DeviceTensor(v, shape, dtype) for v, (_, shape) in zip(binding.get_outputs(), self.outputs)]


def _model(nodes, inputs, outputs, initializers=()):
    from onnx import helper

    graph = helper.make_graph(nodes, "move", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _value(name: str, dtype: np.dtype, shape: Sequence[int]):
    from onnx import helper

    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(shape))


def _ints(name: str, values: Sequence[int]):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array(list(values), dtype=np.int64), name)


def _slice_model(shape, dtype, bounds):
    from onnx import helper

    axes = [d for d, ((a, b), n) in enumerate(zip(bounds, shape)) if (a, b) != (0, n)]
    out_shape = [b - a for a, b in bounds]
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])
    return _model([node], [_value("x", dtype, shape)], [_value("y", dtype, out_shape)],
                  [_ints("starts", [bounds[d][0] for d in axes]), _ints("ends", [bounds[d][1] for d in axes]),
                   _ints("axes", axes)])


def _pack_model(shape, dtype, axis, k):
    """[..., k·p, ...] → reshape [..., k, p, ...] → move the k axis to the front."""
    from onnx import helper

    split = list(shape[:axis]) + [k, shape[axis] // k] + list(shape[axis + 1:])
    perm = [axis] + [d for d in range(len(split)) if d != axis]
    out_shape = [split[p] for p in perm]
    nodes = [helper.make_node("Reshape", ["x", "split"], ["r"]), helper.make_node("Transpose", ["r"], ["y"], perm=perm)]
    return _model(nodes, [_value("x", dtype, shape)], [_value("y", dtype, out_shape)], [_ints("split", split)])


def _unpack_model(shape, dtype, axis):
    """[k, ...p at axis...] → move k next to ``axis`` → merge them."""
    from onnx import helper

    k, piece = shape[0], list(shape[1:])
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, len(shape)))
    merged = piece[:axis] + [k * piece[axis]] + piece[axis + 1:]
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=perm), helper.make_node("Reshape", ["t", "merged"], ["y"])]
    return _model(nodes, [_value("x", dtype, shape)], [_value("y", dtype, merged)], [_ints("merged", merged)])


def _assemble_model(shape, dtype, boxes):
    """Nested Concats over a grid of pieces: group by the first dimension's interval,
    assemble each group over the remaining dimensions, concatenate the groups."""
    from onnx import helper

    nodes = []
    names = [f"p{i}" for i in range(len(boxes))]

    def build(items: list[int], dim: int) -> str:
        if dim == len(shape):
            if len(items) != 1:
                raise ValueError("the pieces of a tensor overlap")
            return names[items[0]]
        groups: dict[tuple[int, int], list[int]] = {}
        for i in items:
            groups.setdefault(boxes[i][dim], []).append(i)
        parts = [build(groups[span], dim + 1) for span in sorted(groups)]
        if len(parts) == 1:
            return parts[0]
        out = f"c{len(nodes)}"
        nodes.append(helper.make_node("Concat", parts, [out], axis=dim))
        return out

    top = build(list(range(len(boxes))), 0)
    nodes.append(helper.make_node("Identity", [top], ["y"]))
    inputs = [_value(n, dtype, [b - a for a, b in box]) for n, box in zip(names, boxes)]
    return _model(nodes, inputs, [_value("y", dtype, shape)])
