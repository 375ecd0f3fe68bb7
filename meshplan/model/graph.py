"""The planner's view of a canonical model: nodes in topological order and typed tensors.

Built from an ONNX model whose shapes are all static (see ``load.canonicalize``).
Weight data is never needed here: a parameter's size comes from its dims. A parameter is
an initializer or a parameter expression (``param_exprs``): a tensor computed from
initializers alone, whose chain of nodes is kept apart from ``nodes`` in ``chains``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod

import numpy as np
import onnx
from onnx import helper

from meshplan.errors import ModelError
from meshplan.model.bounds import read_bounds
from meshplan.model.opsets import DEFAULT_OPSET
from meshplan.model.param_exprs import find_chains, sources_of


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    is_param: bool = False
    sources: tuple[str, ...] = ()   # a parameter expression: the initializers it is computed from
    dynamic: tuple[int, ...] = ()   # data-dependent dims (``bounds``): ``shape`` holds their upper bounds
    # A plan for ranges of sizes (``views``): ``shape`` is at the cost sizes, ``peak`` at the
    # top of every range, ``ranged`` the dims that follow the sizes of a call and ``grains``
    # per dim the gcd of every size it takes (a split must divide it).
    ranged: tuple[int, ...] = ()
    peak: tuple[int, ...] | None = None
    grains: tuple[int, ...] | None = None

    @property
    def split_sizes(self) -> tuple[int, ...]:
        """What a split of each dim must divide: its size, or for a ranged dim every size."""
        return self.shape if self.grains is None else self.grains

    @property
    def peak_nbytes(self) -> int:
        """Bytes at the largest sizes the plan accepts."""
        return prod(self.shape if self.peak is None else self.peak) * self.dtype.itemsize

    @property
    def is_data_dependent(self) -> bool:
        return bool(self.dynamic)

    @property
    def is_derived(self) -> bool:
        return bool(self.sources)

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class Node:
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]   # "" marks an omitted optional input
    outputs: tuple[str, ...]
    attrs: dict = field(hash=False, compare=False)


@dataclass
class Graph:
    nodes: list[Node]
    tensors: dict[str, TensorInfo]
    inputs: list[str]          # graph inputs that are not parameters
    outputs: list[str]
    opset: int = DEFAULT_OPSET  # version of the default ONNX domain
    chains: dict[str, Node] = field(default_factory=dict)   # parameter expression → the node computing it
    memo: dict = field(default_factory=dict, repr=False, compare=False)   # the planner's per-graph caches
    # A ranged plan: the same graph at other sizes ("top": every range at its top; "probe":
    # sizes unlike the cost sizes), at each of which a strategy must hold too.
    views: dict = field(default_factory=dict, repr=False, compare=False)
    # A ranged plan's graph or one of its views: shapes are computed at run time (rules that
    # read a shape, or take one as an input, hold in any layout the emitter scales).
    ranged: bool = field(default=False, compare=False)
    state: dict[str, str] = field(default_factory=dict)   # state output → the input it becomes in the next call

    def producers(self) -> dict[str, int]:
        """Tensor name → index of the node that produces it."""
        return {out: i for i, node in enumerate(self.nodes) for out in node.outputs if out}

    def consumers(self) -> dict[str, list[int]]:
        """Tensor name → indices of the nodes that read it (in order, no duplicates)."""
        found: dict[str, list[int]] = {}
        for i, node in enumerate(self.nodes):
            for name in dict.fromkeys(node.inputs):
                if name:
                    found.setdefault(name, []).append(i)
        return found

    def params_of(self, index: int) -> list[str]:
        """The initializers node ``index`` reads, directly or through parameter expressions."""
        found: dict[str, None] = {}
        for name in self.nodes[index].inputs:
            if name and self.tensors[name].is_param:
                found.update(dict.fromkeys(self.tensors[name].sources or (name,)))
        return list(found)

    @property
    def param_bytes(self) -> int:
        """Bytes of the stored parameters (each initializer once)."""
        return sum(t.nbytes for t in self.tensors.values() if t.is_param and not t.is_derived)


def _dtype(elem_type: int, name: str) -> np.dtype:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError) as exc:
        raise ModelError(f"tensor '{name}' has an unsupported element type {elem_type}") from exc


def _value_info(value: onnx.ValueInfoProto, bounds: dict[str, int]) -> TensorInfo:
    tensor_type = value.type.tensor_type
    dims = tensor_type.shape.dim
    shape = tuple(bounds[d.dim_param] if d.dim_param in bounds else d.dim_value for d in dims)
    dynamic = tuple(axis for axis, d in enumerate(dims) if d.dim_param in bounds)
    return TensorInfo(value.name, shape, _dtype(tensor_type.elem_type, value.name), dynamic=dynamic)


def build_graph(model: onnx.ModelProto, views=None) -> Graph:
    """Graph of a canonical model (static shapes everywhere but bounded data-dependent
    dims, nodes topologically sorted). A ranged model's shapes come from ``views``
    (``views.SizeViews``: the model at its cost and top sizes); its ``top`` is the same
    graph at the top sizes."""
    g = model.graph
    bounds = read_bounds(model)
    tensors: dict[str, TensorInfo] = {}
    for init in g.initializer:
        tensors[init.name] = TensorInfo(init.name, tuple(init.dims), _dtype(init.data_type, init.name), True)
    for value in list(g.input) + list(g.value_info) + list(g.output):
        if value.name not in tensors and value.type.HasField("tensor_type"):
            tensors[value.name] = _value_info(value, bounds) if views is None else views.info(value)
    if views is not None:
        for node in g.node:
            for name in node.output:
                if name and name not in tensors:
                    tensors[name] = views.info_of(name)
    nodes = []
    for node in g.node:
        for out in node.output:
            if out and out not in tensors:
                raise ModelError(f"tensor '{out}' of node '{node.name}' has no inferred type")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        nodes.append(Node(node.name, node.op_type, node.domain or "", tuple(node.input), tuple(node.output), attrs))
    inputs = [v.name for v in g.input if not tensors[v.name].is_param]
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), DEFAULT_OPSET)
    outputs = [v.name for v in g.output]
    initializers = {t.name for t in g.initializer}
    chains = find_chains(nodes, initializers, set(outputs))
    for name in chains:
        tensors[name] = replace(tensors[name], is_param=True, sources=sources_of(name, chains, initializers))
    nodes = [node for node in nodes if not (node.outputs and node.outputs[0] in chains)]
    graph = Graph(nodes=nodes, tensors=tensors, inputs=inputs, outputs=outputs, opset=opset, chains=chains)
    if views is not None:
        for label, shapes in (("top", None), ("probe", views.probe)):
            if shapes is None:
                other = {name: replace(info, shape=info.peak) if info.peak is not None else info
                         for name, info in tensors.items()}
            else:
                other = {name: replace(info, shape=shapes.get(name, info.shape)) for name, info in tensors.items()}
            graph.views[label] = Graph(nodes=nodes, tensors=other, inputs=inputs, outputs=outputs, opset=opset,
                                       chains=chains, ranged=True)
        graph.ranged = True
    return graph
