"""What a sharding rule sees of an operator, and the words rules are written in.

A rule is written for ONE mesh axis, as a placement per operand (inputs, then outputs):
a tensor dim index to split that dim, ``R`` (replicated) or ``P`` (partial sum). For
example MatMul's contraction rule is ``(1, 0) → (P,)``: split A's columns and B's rows,
and each device holds an addend of the product.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from meshplan.model.graph import Graph, Node, TensorInfo

R, P = "R", "P"
Place = int | str                                    # dim to split, R or P
Rule = tuple[tuple[Place, ...], tuple[Place, ...]]   # (per input, per output); missing trailing inputs are R

# Initializers of at most this many elements are "small constants": their values are read
# by rules (shape targets, axes, pads) and so are part of a layer's structural fingerprint.
SMALL_CONSTANT_ELEMENTS = 64


class OpView:
    """A node with its operands' shapes and dtypes, attributes and known constants."""

    def __init__(self, node: Node, graph: Graph, constants: Mapping[str, np.ndarray], opset: int | None):
        self.node, self.graph, self.constants, self.opset = node, graph, constants, opset

        def info(name: str) -> TensorInfo | None:
            if not name:
                return None
            if name not in graph.tensors:
                raise ValueError(f"tensor '{name}' of {node.op_type} node '{node.name}' has no shape in the graph")
            return graph.tensors[name]

        self.ins = [info(n) for n in node.inputs]
        self.outs = [info(n) for n in node.outputs]

    @property
    def rank(self) -> int:
        """Rank of the first input."""
        return len(self.ins[0].shape)

    def shape(self, index: int) -> tuple[int, ...] | None:
        return self.ins[index].shape if index < len(self.ins) and self.ins[index] is not None else None

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.outs[0].shape

    def attr(self, name: str, default=None):
        return self.node.attrs.get(name, default)

    def has_input(self, index: int) -> bool:
        return index < len(self.ins) and self.ins[index] is not None

    def const(self, index: int) -> np.ndarray | None:
        """Value of input ``index`` when it is a known constant."""
        if not self.has_input(index):
            return None
        value = self.constants.get(self.node.inputs[index])
        return None if value is None else np.asarray(value)

    def is_constant(self, index: int) -> bool:
        """Whether input ``index`` is an initializer (so a per-device value can replace it)."""
        return self.has_input(index) and (self.ins[index].is_param or self.node.inputs[index] in self.constants)

    def ints(self, attr: str | None, index: int | None) -> list[int] | None:
        """An int list given as attribute ``attr`` or as constant input ``index``; None if unknown or absent."""
        if attr is not None and attr in self.node.attrs:
            return [int(v) for v in self.node.attrs[attr]]
        value = None if index is None else self.const(index)
        return None if value is None else [int(v) for v in value.reshape(-1)]

    def axis(self, value: int, rank: int | None = None) -> int:
        rank = self.rank if rank is None else rank
        return value + rank if value < 0 else value


@dataclass(frozen=True)
class LocalShape:
    """A strategy's rewrite of a shape input that holds at every size (a ranged plan): each
    entry divided by ``divisors[i]`` (how many pieces the output's dim i is split into)
    where it is 2 or more, kept where it is 0, 1 or -1 (copy, broadcast, infer). The
    emitter computes it for a constant input and inserts Div/Where nodes for one computed
    at run time. ``divisors`` is aligned with the input's entries."""

    divisors: tuple[int, ...]

    def apply(self, values) -> tuple[int, ...]:
        return tuple(int(v) // k if v >= 2 else int(v) for v, k in zip(values, self.divisors))


class NoRule(Exception):
    """Raised by a rule function when only the replicated strategy is correct."""


def need(condition) -> None:
    if not condition:
        raise NoRule
