"""One entry per ONNX op type: its sharding rule, FLOP formula, heaviness and policy class.

Adding an op is one ``define`` call in the module of its family (pointwise, contractions,
normalisations, shapes). An op type with no entry has no sharding rule (only the
replicated strategy), one FLOP per output element, is light and has no policy class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from meshplan.ops.view import OpView, Rule

RuleFn = Callable[[OpView], Iterable[Rule]]
FlopsFn = Callable[[OpView], float]
# f(op, input specs, output specs, mesh): the strategy's rewrites (input index → new int64
# value on every device), or None when the strategy cannot be run
RewriteFn = Callable[[OpView, tuple, tuple, object], tuple | None]

MATRIX = "matrix"   # policy class: a weight-bearing matrix product (Megatron's column/row split)


def per_element(count: float) -> FlopsFn:
    """``count`` FLOPs per output element."""
    def flops(op: OpView) -> float:
        return float(op.outs[0].size * count) if op.outs and op.outs[0] is not None else 0.0
    return flops


def no_flops(op: OpView) -> float:
    """Operators that only move or relabel data."""
    return 0.0


@dataclass(frozen=True)
class OpEntry:
    op_type: str
    rule: RuleFn | None = None          # None: only the replicated strategy
    flops: FlopsFn = per_element(1)
    heavy: bool = False                 # always gets ILP variables of its own
    policy: str | None = None           # policy class (MATRIX) for hand-written policies
    rewrite: RewriteFn | None = None


_ENTRIES: dict[str, OpEntry] = {}
_DEFAULT = OpEntry("")


def define(*op_types: str, rule: RuleFn | None = None, flops: FlopsFn | None = None, heavy: bool = False,
           policy: str | None = None, rewrite: RewriteFn | None = None) -> None:
    """Register one entry for each of ``op_types`` (an op type is defined once)."""
    for op_type in op_types:
        if op_type in _ENTRIES:
            raise ValueError(f"op {op_type} is defined twice")
        _ENTRIES[op_type] = OpEntry(op_type, rule, flops or per_element(1), heavy, policy, rewrite)


def rule(*op_types: str, **fields) -> Callable[[RuleFn], RuleFn]:
    """Decorator form of ``define`` for a rule function."""
    def add(fn: RuleFn) -> RuleFn:
        define(*op_types, rule=fn, **fields)
        return fn
    return add


def entry(op_type: str) -> OpEntry:
    return _ENTRIES.get(op_type, _DEFAULT)


def ops_with_rules() -> tuple[str, ...]:
    """The ONNX op types (default domain) that have sharding rules."""
    return tuple(sorted(op for op, e in _ENTRIES.items() if e.rule is not None))


def heavy_ops() -> frozenset[str]:
    return frozenset(op for op, e in _ENTRIES.items() if e.heavy)
