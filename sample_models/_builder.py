"""A small helper for building ONNX graphs node by node with readable names.

Every generated tensor is named after the node that produces it, so a node
``layer3/attn/q_proj/matmul`` writes the tensor ``layer3/attn/q_proj/matmul``
(ONNX keeps node and tensor names in separate namespaces).  Weights use
torch-like dotted names such as ``layer3.attn.q_proj.weight``.

Random weights come from ``numpy.random.RandomState``, whose streams numpy
keeps frozen across releases, so regenerated files stay byte-identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
PRODUCER = "meshplan.sample_models"

Dim = int | str


class GraphBuilder:
    """Collects inputs, outputs, initializers and nodes of one ONNX graph."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._initializers: dict[str, onnx.TensorProto] = {}
        self._node_names: set[str] = set()

    def input(self, name: str, elem_type: int, shape: Sequence[Dim]) -> str:
        """Declare a graph input and return its name."""
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, name: str, elem_type: int, shape: Sequence[Dim]) -> str:
        """Declare an existing tensor as a graph output and return its name."""
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """Add a new initializer; the name must not be taken yet."""
        if name in self._initializers:
            raise ValueError(f"initializer {name!r} defined twice")
        self._initializers[name] = numpy_helper.from_array(np.asarray(array, order="C"), name)
        return name

    def const(self, name: str, array: np.ndarray) -> str:
        """Add a shared constant initializer once; later calls with the same name reuse it."""
        array = np.asarray(array)
        existing = self._initializers.get(name)
        if existing is None:
            return self.weight(name, array)
        if not np.array_equal(numpy_helper.to_array(existing), array):
            raise ValueError(f"constant {name!r} redefined with a different value")
        return name

    def i64(self, *values: int, scalar: bool = False) -> str:
        """A shared int64 constant: a scalar (``scalar=True``, one value) or a 1-D tensor."""
        if scalar:
            (value,) = values
            return self.const(f"const.i64.{value}", np.array(value, dtype=np.int64))
        label = "_".join(str(v) for v in values)
        return self.const(f"const.i64s.{label}", np.array(values, dtype=np.int64))

    def f32(self, value: float, label: str) -> str:
        """A shared float32 scalar constant named ``const.f32.<label>``."""
        return self.const(f"const.f32.{label}", np.array(value, dtype=np.float32))

    def op(self, op_type: str, inputs: Sequence[str], name: str, out: str | None = None,
           **attrs) -> str:
        """Append one single-output node named ``name``; return its output tensor name.

        The output tensor is called ``out`` when given (for graph outputs), else ``name``.
        """
        if name in self._node_names:
            raise ValueError(f"node {name!r} defined twice")
        self._node_names.add(name)
        output = out if out is not None else name
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=name, **attrs))
        return output

    def node(self, op_type: str, inputs: Sequence[str], name: str, outputs: Sequence[str], **attrs) -> list[str]:
        """Append one node named ``name`` with several outputs, each tensor called
        ``name/<output>``; return their names."""
        if name in self._node_names:
            raise ValueError(f"node {name!r} defined twice")
        self._node_names.add(name)
        names = [f"{name}/{label}" for label in outputs]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=name, **attrs))
        return names

    def build(self, doc: str = "") -> onnx.ModelProto:
        """Assemble the model with opset 17 and IR version 8."""
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs,
                                  initializer=list(self._initializers.values()))
        model = helper.make_model(graph, producer_name=PRODUCER,
                                  opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = IR_VERSION
        model.doc_string = doc
        return model


def normal(rng: np.random.RandomState, shape: Sequence[int], std: float,
           mean: float = 0.0) -> np.ndarray:
    """Float32 samples from N(mean, std**2)."""
    return (mean + std * rng.standard_normal(tuple(shape))).astype(np.float32)


def uniform(rng: np.random.RandomState, shape: Sequence[int], low: float,
            high: float) -> np.ndarray:
    """Float32 samples from U(low, high)."""
    return rng.uniform(low, high, tuple(shape)).astype(np.float32)


def linear(g: GraphBuilder, x: str, weight: np.ndarray, bias: np.ndarray | None,
           prefix: str, param: str, out: str | None = None) -> str:
    """``x @ weight (+ bias)`` as MatMul (+ Add) nodes ``<prefix>/matmul`` and ``<prefix>/add``.

    Weights are stored as ``<param>.weight`` / ``<param>.bias``; ``out`` names the
    final tensor (for graph outputs).
    """
    w = g.weight(f"{param}.weight", weight)
    if bias is None:
        return g.op("MatMul", [x, w], f"{prefix}/matmul", out=out)
    y = g.op("MatMul", [x, w], f"{prefix}/matmul")
    b = g.weight(f"{param}.bias", bias)
    return g.op("Add", [y, b], f"{prefix}/add", out=out)


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
