"""What a gradient rule sees of an operator, and the words rules are written in.

A rule (``registry.gradient``) takes a ``GradNode`` and returns one entry per input of the
node: the name of that input's gradient, or None where the input takes none (an integer
index, a shape, an input ``needs`` says nobody asks for). It builds the gradient from the
output gradients ``g.dy(i)`` with plain ONNX operators through ``g.op(...)`` — every one of
them runs on onnxruntime's CPU and CUDA providers — so a rule reads as its formula:

    @gradient("Tanh")
    def _tanh(g):            # dx = dy * (1 - y²)
        y = g.y(0)
        return [g.op("Mul", g.dy(0), g.op("Sub", g.const(1.0), g.op("Mul", y, y)))]

Shapes are the forward graph's inferred ones: a dim is an int, a symbol (str) or None
(unknown). A symbol never broadcasts against another dim: ``unbroadcast`` sums only over
axes that are missing or statically 1 in the input.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from meshplan.errors import TrainError

Dim = int | str | None


class Tape(Protocol):
    """The backward graph a rule adds nodes to (``training/autodiff.py``)."""

    def emit(self, op_type: str, inputs: Sequence[str], outputs: int, attrs: dict, domain: str) -> list[str]: ...
    def constant(self, value: np.ndarray) -> str: ...
    def shape_of(self, name: str) -> tuple[Dim, ...] | None: ...
    def dtype_of(self, name: str) -> np.dtype: ...


class GradNode:
    """One forward node as its gradient rule sees it."""

    def __init__(self, node, attrs: dict, output_grads: list[str | None], needs: list[bool], tape: Tape):
        self.node, self.attrs, self._dys, self.needs, self.tape = node, attrs, output_grads, needs, tape
        self.op_type, self.name = node.op_type, node.name
        self.inputs, self.outputs = list(node.input), list(node.output)

    # --- the forward node -------------------------------------------------------------------

    def x(self, index: int) -> str:
        """Input ``index``'s name (the forward value)."""
        return self.inputs[index]

    def y(self, index: int) -> str:
        """Output ``index``'s name (the forward value)."""
        return self.outputs[index]

    def has_input(self, index: int) -> bool:
        return index < len(self.inputs) and bool(self.inputs[index])

    def attr(self, name: str, default=None):
        return self.attrs.get(name, default)

    def shape(self, name: str) -> tuple[Dim, ...]:
        found = self.tape.shape_of(name)
        if found is None:
            raise GradientError(f"{self.op_type} node '{self.name}': tensor '{name}' has no inferred shape")
        return found

    def rank(self, name: str) -> int:
        return len(self.shape(name))

    def set_shape(self, name: str, shape) -> str:
        """Record the shape of a tensor a rule made (for ``unbroadcast``); returns ``name``."""
        self.tape.shapes[name] = tuple(shape)
        return name

    def dtype(self, name: str) -> np.dtype:
        return self.tape.dtype_of(name)

    @property
    def opset(self) -> int:
        """The model's default-domain opset (18 where the tape does not say)."""
        return int(getattr(self.tape, "opset", 18) or 18)

    def value(self, index: int) -> np.ndarray | None:
        """Input ``index``'s value where it is a known constant (axes, shapes), else None."""
        return getattr(self.tape, "known", {}).get(self.inputs[index]) if self.has_input(index) else None

    def need(self, index: int) -> bool:
        """Does anyone ask for input ``index``'s gradient?"""
        return index < len(self.needs) and self.needs[index]

    # --- the output gradients -----------------------------------------------------------------

    def dy(self, index: int = 0) -> str:
        """Output ``index``'s gradient (zeros where the loss does not depend on that output)."""
        found = self._dys[index]
        if found is None:
            found = self.op("ConstantOfShape", self.op("Shape", self.y(index)),
                            value=np.zeros(1, dtype=self.dtype(self.y(index))))
            self._dys[index] = found
        return found

    def has_dy(self, index: int) -> bool:
        return index < len(self._dys) and self._dys[index] is not None

    # --- emitting -------------------------------------------------------------------------------

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs):
        """Emit one node; its output's name (a list of names for ``outputs`` > 1)."""
        names = self.tape.emit(op_type, inputs, outputs, attrs, domain)
        return names[0] if outputs == 1 else names

    def const(self, value, like: str | None = None, dtype=None) -> str:
        """A constant: a scalar in the dtype of tensor ``like`` (default the first output's),
        or an array as given (int64 axes and shapes)."""
        if dtype is None and not isinstance(value, (np.ndarray, np.integer, np.bool_)):
            dtype = self.dtype(like or self.y(0))
        return self.tape.constant(np.asarray(value, dtype=dtype))

    def ints(self, values) -> str:
        """An int64 vector constant (axes, shapes, starts)."""
        return self.tape.constant(np.asarray(list(values), dtype=np.int64))

    def shape_tensor(self, name: str) -> str:
        return self.op("Shape", name)

    def zeros(self, like: str) -> str:
        """Zeros of tensor ``like``'s shape and dtype (the gradient of a step function)."""
        return self.op("ConstantOfShape", self.op("Shape", like), value=np.zeros(1, dtype=self.dtype(like)))

    def unbroadcast(self, grad: str, target: str, like: str | None = None) -> str:
        """``grad``, of tensor ``like``'s shape (default the first output's: the broadcast
        result), summed down to ``target``'s shape: over the leading axes ``target`` lacks and
        the axes where it is 1 and the result is not. An axis of ``target`` of unknown size is
        summed where it turns out to be 1 when the graph runs."""
        out, to = self.shape(like or self.y(0)), self.shape(target)
        lead = len(out) - len(to)
        if lead < 0:
            raise GradientError(f"{self.op_type} node '{self.name}': a gradient of rank {len(out)} "
                                f"for '{target}' of rank {len(to)}")
        axes = list(range(lead)) + [lead + a for a, d in enumerate(to) if d == 1 and out[lead + a] != 1]
        unknown = [a for a, d in enumerate(to) if d is None and out[lead + a] != 1]
        if not axes and not unknown:
            return grad
        summed = self.op("ReduceSum", grad, self.ints(axes), keepdims=1) if axes else grad
        for a in unknown:   # Where(size == 1, Σ over the axis, grad), cut to the size
            size = self.op("Gather", self.shape_tensor(target), self.ints([a]))
            one = self.op("Equal", size, self.ints([1]))
            summed = self.op("Slice", self.op("Where", one, self.op("ReduceSum", summed, self.ints([lead + a]),
                                                                    keepdims=1), summed),
                             self.ints([0]), size, self.ints([lead + a]))
        if lead:
            summed = self.op("Reshape", summed, self.shape_tensor(target))
        return summed

    def like_input(self, grad: str, index: int) -> str:
        """``grad`` cast to input ``index``'s dtype where the two differ."""
        want = self.dtype(self.x(index))
        if self.dtype(grad) == want:
            return grad
        return self.op("Cast", grad, to=_onnx_type(want))


class GradientError(TrainError):
    """A gradient rule cannot write the gradient of this node (say which, and why)."""


def _onnx_type(dtype: np.dtype) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
