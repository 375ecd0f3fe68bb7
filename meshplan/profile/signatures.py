"""Operator signatures: what an operator's cost depends on, so that each is timed once.

A signature is the op type and domain, the attributes, and the dtype, shape and role of
every input and output. An input's role is ``act`` (computed at run time), ``weight``
(an initializer) or ``const``: a small integer (or tiny) initializer — a Reshape target,
Slice starts, axes, a scalar exponent — whose *value* the timing model keeps, so that
onnxruntime sees what it would see in the real program.

Weights are initializers of the timing model (random values) when the node also has a
run-time input, as in the real program: onnxruntime prepacks constant weights (MatMul,
Gemm, and on CPU Conv's NCHWc layout) and a weight fed as a graph input would time the
slower unpacked kernel (a ResNet's convolutions: twice as slow). Such a node cannot be
folded away because its run-time input is a graph input. A node whose inputs are all
initializers gets its weights as graph inputs instead, so that it is not folded either.

Constant *values* are not part of the key: two Slices with the same input and output
shapes and different offsets cost the same. The output shapes are, which captures what
the constants do to the work (a Reshape target, a Pad amount, a TopK k).

The key is computed from ``(node, graph)`` alone, which is all a cost model sees.
Collecting signatures for timing also needs the constant values, read from the
canonical ONNX model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from meshplan.model.contrib_shapes import infer_with_contrib
from meshplan.model.graph import Graph, Node, TensorInfo
from meshplan.model.opsets import DEFAULT_OPSET
from meshplan.model.weights import tensor_value

# Initializers kept as constants in timing models.
CONSTANT_INT_ELEMENTS = 4096     # integer initializers up to this many elements (shapes, indices)
CONSTANT_ANY_ELEMENTS = 16       # any dtype up to this many elements (scalars such as exponents)

ACT, WEIGHT, CONST = "act", "weight", "const"

Shape = tuple[int, ...]
@dataclass(frozen=True)
class Variant:
    """Other local input shapes of a node (a sharded strategy's), with the new values of
    the shape constants the strategy rewrites (input index → int64 values) and of the
    attributes that change per device (MatMulNBits' K and N), so that the timed operator
    is the one the device's program runs."""

    shapes: tuple                                   # per input: a shape, or None
    rewrites: tuple[tuple[int, tuple[int, ...]], ...] = ()
    attributes: tuple[tuple[str, object], ...] = ()


Variants = Callable[[Node, Graph], Iterable[Variant]]


def is_constant_input(info: TensorInfo) -> bool:
    """Does this tensor stay an initializer (with its value) in a timing model?"""
    if not info.is_param:
        return False
    if info.dtype.kind in "iub":
        return info.size <= CONSTANT_INT_ELEMENTS
    return info.size <= CONSTANT_ANY_ELEMENTS


def input_role(info: TensorInfo) -> str:
    if is_constant_input(info):
        return CONST
    return WEIGHT if info.is_param else ACT


def _canonical_attr(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_canonical_attr(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "SerializeToString"):   # TensorProto, GraphProto, TypeProto, ...
        digest = hashlib.sha256(value.SerializeToString(deterministic=True)).hexdigest()[:20]
        return {type(value).__name__: digest}
    return repr(value)


@dataclass(frozen=True)
class OpSignature:
    """The cost-relevant identity of one operator application."""

    op_type: str
    domain: str
    attrs: str                                        # canonical JSON of the attributes
    inputs: tuple[tuple[str, Shape, str] | None, ...]   # (dtype, shape, role) or None if omitted
    outputs: tuple[tuple[str, Shape] | None, ...]

    def to_dict(self) -> dict:
        return {
            "op": self.op_type, "domain": self.domain, "attrs": json.loads(self.attrs),
            "inputs": [None if i is None else [i[0], list(i[1]), i[2]] for i in self.inputs],
            "outputs": [None if o is None else [o[0], list(o[1])] for o in self.outputs],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "OpSignature":
        return cls(
            data["op"], data.get("domain", ""), json.dumps(data.get("attrs", {}), sort_keys=True),
            tuple(None if i is None else (str(i[0]), tuple(int(d) for d in i[1]), str(i[2])) for i in data["inputs"]),
            tuple(None if o is None else (str(o[0]), tuple(int(d) for d in o[1])) for o in data["outputs"]),
        )

    @property
    def text(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:32]

    @property
    def input_key(self) -> str:
        """The key without output shapes: finds a variant when only its inputs are known."""
        body = self.to_dict()
        body["outputs"] = [None if o is None else o[0] for o in body["outputs"]]
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]

    def short(self) -> str:
        """A one-line description: ``MatMul f32[4,32,128] x f32[128,512]``."""
        parts = []
        for spec in self.inputs:
            if spec is None:
                continue
            dtype, shape, role = spec
            mark = {"const": "c", "weight": "w"}.get(role, "")
            parts.append(f"{_short_dtype(dtype)}[{','.join(map(str, shape))}]{mark}")
        return f"{self.op_type} " + " x ".join(parts)


def _short_dtype(dtype: str) -> str:
    return {"float32": "f32", "float16": "f16", "float64": "f64", "int64": "i64", "int32": "i32",
            "bool": "b", "uint8": "u8", "int8": "i8", "bfloat16": "bf16"}.get(dtype, dtype)


def _operands(names, tensors, shapes, with_role: bool):
    """(dtype, shape[, role]) per operand, ``shapes`` overriding the graph's; None for an
    omitted operand; None overall when an operand has no type."""
    found = []
    for index, name in enumerate(names):
        if not name:
            found.append(None)
            continue
        info = tensors.get(name)
        if info is None:
            return None
        shape = info.shape if shapes is None or shapes[index] is None else tuple(int(d) for d in shapes[index])
        entry = (info.dtype.name, tuple(shape))
        found.append(entry + (input_role(info),) if with_role else entry)
    return found


def signature_of(node: Node, graph: Graph, input_shapes=None, output_shapes=None) -> OpSignature | None:
    """The signature of ``node`` in ``graph`` (optionally with other input/output shapes).

    None when the node cannot be described by tensor shapes (a non-tensor input or output,
    or a subgraph attribute: such nodes are costed analytically).
    """
    tensors = graph.tensors
    attrs = {}
    for name, value in node.attrs.items():
        if isinstance(value, onnx.GraphProto) or (isinstance(value, list) and value and isinstance(value[0], onnx.GraphProto)):
            return None
        attrs[name] = _canonical_attr(value)
    inputs = _operands(node.inputs, tensors, input_shapes, with_role=True)
    outputs = _operands(node.outputs, tensors, output_shapes, with_role=False)
    if inputs is None or outputs is None:
        return None
    return OpSignature(node.op_type, node.domain, json.dumps(attrs, sort_keys=True), tuple(inputs), tuple(outputs))


@dataclass
class TimingSpec:
    """Everything needed to build the one-node timing model of a signature."""

    signature: OpSignature
    attributes: list[bytes]                   # the node's serialized AttributeProtos
    constants: dict[int, np.ndarray]          # input index → value, for constant inputs
    opsets: dict[str, int]                    # the model's opset imports

    def to_dict(self) -> dict:
        return {
            "signature": self.signature.to_dict(),
            "attributes": [a.hex() for a in self.attributes],
            "constants": {str(i): {"dtype": v.dtype.name, "shape": list(v.shape), "values": v.ravel().tolist()}
                          for i, v in self.constants.items()},
            "opsets": self.opsets,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "TimingSpec":
        constants = {int(i): np.array(c["values"], dtype=c["dtype"]).reshape(c["shape"])
                     for i, c in data["constants"].items()}
        return cls(OpSignature.from_dict(data["signature"]), [bytes.fromhex(a) for a in data["attributes"]],
                   constants, {k: int(v) for k, v in data["opsets"].items()})


@dataclass
class Collected:
    """One distinct signature, with how often it occurs and what it costs analytically."""

    spec: TimingSpec
    count: int = 0                          # occurrences in the graphs it was collected from
    nodes: list[str] = field(default_factory=list)   # a few node names, for reports
    sources: set[str] = field(default_factory=set)   # labels of the graphs / variant sets
    estimate: float = 0.0                   # analytic seconds (orders work, sizes the progress)

    @property
    def signature(self) -> OpSignature:
        return self.spec.signature


def constant_values(model: onnx.ModelProto, graph: Graph, base_dir: str | Path | None = None) -> dict[str, np.ndarray]:
    """Values of the initializers that timing models keep as constants."""
    wanted = {name for name, info in graph.tensors.items() if is_constant_input(info)}
    found = {}
    for tensor in model.graph.initializer:
        if tensor.name in wanted:
            found[tensor.name] = tensor_value(tensor, Path(base_dir) if base_dir else None)
    return found


def opset_map(model: onnx.ModelProto) -> dict[str, int]:
    return {(op.domain or ""): op.version for op in model.opset_import}


def collect_signatures(
    graph: Graph, model: onnx.ModelProto, base_dir: str | Path | None = None, *,
    label: str = "model", variants: Variants | None = None, into: dict[str, Collected] | None = None,
    estimate: Callable[[Node, Graph], float] | None = None,
) -> dict[str, Collected]:
    """The distinct signatures of ``graph``'s nodes (key → Collected), adding to ``into``.

    ``model`` is the canonical ONNX model the graph was built from (for attributes and
    constant values; ``base_dir`` is where its external data lives). ``variants(node,
    graph)`` may yield extra input-shape tuples per node (sharded shapes); their output
    shapes are inferred, and a variant onnx cannot infer is skipped.
    """
    found = {} if into is None else into
    protos = {n.name: n for n in model.graph.node}
    constants = constant_values(model, graph, base_dir)
    opsets = opset_map(model)
    for node in graph.nodes:
        signature = signature_of(node, graph)
        if signature is None:
            continue
        proto = protos.get(node.name)
        attributes = [a.SerializeToString() for a in proto.attribute] if proto is not None else []
        const = {i: constants[name] for i, name in enumerate(node.inputs)
                 if name and name in constants and signature.inputs[i] is not None and signature.inputs[i][2] == CONST}
        if any(spec is not None and spec[2] == CONST and i not in const for i, spec in enumerate(signature.inputs)):
            continue  # a constant whose value we cannot read: leave it to the analytic model
        spec = TimingSpec(signature, attributes, const, opsets)
        _add(found, spec, node, label, estimate(node, graph) if estimate else 0.0)
        if variants is None:
            continue
        for variant in variants(node, graph) or ():
            shapes = tuple(None if s is None else tuple(int(d) for d in s) for s in variant.shapes)
            if len(shapes) != len(node.inputs) or shapes == tuple(s[1] if s else None for s in signature.inputs):
                continue
            if any(i not in const for i, _ in variant.rewrites):
                continue  # a rewritten input that is not a readable constant: nothing to time
            # A sharded constant (a packed integer weight, say) is timed on a block of its
            # local shape: what the device holds differs only in its values.
            local = {i: v[tuple(slice(0, d) for d in shapes[i])] if shapes[i] is not None else v
                     for i, v in const.items()}
            local.update({i: np.asarray(v, dtype=np.int64) for i, v in variant.rewrites})
            local_attrs = _with_attributes(attributes, dict(variant.attributes))
            local_spec = TimingSpec(signature, local_attrs, local, opsets)
            outputs = infer_output_shapes(local_spec, shapes)
            if outputs is None:
                continue
            sharded = signature_of(node, graph, shapes, outputs)
            if sharded is not None:
                scale = _size_ratio(signature, sharded)
                _add(found, TimingSpec(sharded, local_attrs, local, opsets), node, f"{label}:variant",
                     scale * (estimate(node, graph) if estimate else 0.0))
    return found


def _with_attributes(serialized: list[bytes], values: dict) -> list[bytes]:
    """The node's serialized attributes with those named in ``values`` replaced."""
    if not values:
        return serialized
    out = []
    for data in serialized:
        attribute = onnx.AttributeProto.FromString(data)
        if attribute.name in values:
            attribute = onnx.helper.make_attribute(attribute.name, values[attribute.name])
        out.append(attribute.SerializeToString())
    return out


def _size_ratio(base: OpSignature, variant: OpSignature) -> float:
    def total(sig):
        return sum(int(np.prod(s[1])) for s in sig.inputs if s is not None) or 1
    return total(variant) / total(base)


def _add(found: dict[str, Collected], spec: TimingSpec, node: Node, label: str, estimate: float) -> None:
    key = spec.signature.key
    entry = found.get(key)
    if entry is None:
        entry = found[key] = Collected(spec, estimate=estimate)
    entry.count += 1
    entry.sources.add(label)
    if len(entry.nodes) < 3:
        entry.nodes.append(node.name)


def infer_output_shapes(spec: TimingSpec, input_shapes) -> tuple | None:
    """Output shapes of the signature's node for other input shapes (None if onnx rejects them)."""
    signature = spec.signature
    variant = OpSignature(signature.op_type, signature.domain, signature.attrs,
                          tuple(None if s is None else (s[0], tuple(input_shapes[i]), s[2])
                                for i, s in enumerate(signature.inputs)),
                          tuple(None if o is None else (o[0], ()) for o in signature.outputs))
    model = build_timing_model(TimingSpec(variant, spec.attributes, spec.constants, spec.opsets), copies=1,
                               unknown_outputs=True)
    try:
        inferred = infer_with_contrib(
            model, lambda m: onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True))
    except Exception:  # onnx raises several types for shapes it cannot reconcile
        return None
    shapes = {}
    for value in list(inferred.graph.output) + list(inferred.graph.value_info):
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)
    outputs = []
    for index, out in enumerate(signature.outputs):
        if out is None:
            outputs.append(None)
            continue
        name = _output_name(index, 0)
        if name not in shapes:
            return None
        outputs.append(shapes[name])
    return tuple(outputs)


def _input_name(index: int) -> str:
    return f"in{index}"


def _output_name(index: int, copy: int) -> str:
    return f"out{index}_{copy}"


def build_timing_model(spec: TimingSpec, copies: int = 1, unknown_outputs: bool = False,
                       weights: dict[int, np.ndarray] | None = None) -> onnx.ModelProto:
    """A model with ``copies`` independent applications of the node to the same inputs.

    Constant inputs are initializers with their values; weights given in ``weights``
    (input index → array) are initializers too; every other input is a graph input. Each
    copy's outputs are graph outputs (so none is pruned). Timing K copies against one
    separates the operator's own time from the fixed cost of a session run.
    """
    from meshplan.model.load import set_ir_version

    signature = spec.signature
    weights = weights or {}
    inputs, initializers, names = [], [], []
    for index, item in enumerate(signature.inputs):
        if item is None:
            names.append("")
            continue
        dtype, shape, role = item
        name = _input_name(index)
        names.append(name)
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        if role == CONST:
            initializers.append(numpy_helper.from_array(np.asarray(spec.constants[index]), name))
        elif index in weights:
            initializers.append(numpy_helper.from_array(np.asarray(weights[index]), name))
        else:
            inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
    # Trailing omitted inputs are dropped (onnx allows omitting them only by position).
    while names and names[-1] == "":
        names.pop()
    attributes = []
    for data in spec.attributes:
        attr = onnx.AttributeProto()
        attr.ParseFromString(data)
        attributes.append(attr)
    nodes, outputs = [], []
    for copy in range(copies):
        out_names = []
        for index, item in enumerate(signature.outputs):
            if item is None:
                out_names.append("")
                continue
            name = _output_name(index, copy)
            out_names.append(name)
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(item[0]))
            outputs.append(helper.make_tensor_value_info(name, elem, None if unknown_outputs else list(item[1])))
        while out_names and out_names[-1] == "":
            out_names.pop()
        node = helper.make_node(signature.op_type, names, out_names, name=f"op_{copy}", domain=signature.domain or None)
        node.attribute.extend(attributes)
        nodes.append(node)
    graph = helper.make_graph(nodes, "timing", inputs, outputs, initializer=initializers)
    opsets = dict(spec.opsets)
    opsets.setdefault("", DEFAULT_OPSET)
    if signature.domain and signature.domain not in opsets:
        opsets[signature.domain] = 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    return set_ir_version(model)
