"""One entry per ONNX op type: its sharding rule, FLOP formula, heaviness and policy class.

Adding an op is one ``define`` call in the module of its family (pointwise, contractions,
normalisations, shapes, quantized); its gradient rule (``gradient``, the words in
``ops/grad_words.py``) is written beside it. An op type with no entry has no sharding rule (only the
replicated strategy), one FLOP per output element, is light and has no policy class.
Entries are per domain: an op of another domain (``com.microsoft``) without an entry of
its own takes the FLOPs and heaviness of the default-domain op of that name, never its rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

from meshplan.ops.view import OpView, Rule

RuleFn = Callable[[OpView], Iterable[Rule]]
FlopsFn = Callable[[OpView], float]
# f(op, input specs, output specs, mesh): the strategy's rewrites (input index → new int64
# value on every device), or None when the strategy cannot be run
RewriteFn = Callable[[OpView, tuple, tuple, object], tuple | None]
# f(op, local input shapes, local output shapes): the attributes that change on a device
# (MatMulNBits' K and N), by name
LocalAttrsFn = Callable[[OpView, list, list], dict]
# f(op): the segments of its operands' dims (operand index over inputs then outputs → dim →
# ((size, heads), ...)): a packed QKV input split by heads, key/value heads fewer than devices
SegmentsFn = Callable[[OpView], dict]
# f(g: GradNode): the gradient of each input (a tensor name, or None where the input takes none)
# from the gradients of the outputs, as ONNX nodes the rule emits (``ops/grad_words.py``)
GradFn = Callable[[object], list]

MATRIX = "matrix"   # policy class: a weight-bearing matrix product (Megatron's column/row split)
ATTENTION = "attention"   # policy class: attention over heads (Megatron splits it by heads)


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
    domain: str = ""
    partial_bias: int | None = None     # input index of a weight that may be partial (held by one device)
    local_attrs: LocalAttrsFn | None = None
    segments: SegmentsFn | None = None
    cache_outputs: tuple[int, ...] = ()   # outputs a device keeps between calls (an attention's present key/value)
    lookups: tuple[int, ...] = ()         # inputs read only where indexed (a Gather's table): no more bytes than out
    grad: GradFn | None = None            # reverse-mode rule; None: no gradient flows through the op


_ENTRIES: dict[tuple[str, str], OpEntry] = {}
_GRADS: dict[tuple[str, str], GradFn] = {}      # gradient rules, by (domain, op type)
_DEFAULT = OpEntry("")


def _domain(domain: str | None) -> str:
    return "" if domain in (None, "", "ai.onnx") else domain


def define(*op_types: str, rule: RuleFn | None = None, flops: FlopsFn | None = None, heavy: bool = False,
           policy: str | None = None, rewrite: RewriteFn | None = None, domain: str = "",
           partial_bias: int | None = None, local_attrs: LocalAttrsFn | None = None,
           segments: SegmentsFn | None = None, cache_outputs: tuple[int, ...] = (),
           lookups: tuple[int, ...] = ()) -> None:
    """Register one entry for each of ``op_types`` (an op type is defined once per domain)."""
    for op_type in op_types:
        key = (_domain(domain), op_type)
        if key in _ENTRIES:
            raise ValueError(f"op {op_type} is defined twice")
        _ENTRIES[key] = OpEntry(op_type, rule, flops or per_element(1), heavy, policy, rewrite, key[0],
                                partial_bias, local_attrs, segments, tuple(cache_outputs), tuple(lookups),
                                _GRADS.get(key))


def rule(*op_types: str, **fields) -> Callable[[RuleFn], RuleFn]:
    """Decorator form of ``define`` for a rule function."""
    def add(fn: RuleFn) -> RuleFn:
        define(*op_types, rule=fn, **fields)
        return fn
    return add


def gradient(*op_types: str, domain: str = "") -> Callable[[GradFn], GradFn]:
    """Decorator: ``fn`` is the gradient rule of ``op_types`` in ``domain``. One rule per op
    type and domain. An op with no entry gets none from this (a com.microsoft op keeps taking
    the default-domain op's FLOPs and heaviness): the rule is kept beside the entries."""
    def add(fn: GradFn) -> GradFn:
        for op_type in op_types:
            key = (_domain(domain), op_type)
            if key in _GRADS:
                raise ValueError(f"op {op_type} has two gradient rules")
            _GRADS[key] = fn
            if key in _ENTRIES:
                _ENTRIES[key] = replace(_ENTRIES[key], grad=fn)
        return fn
    return add


def grad_of(op_type: str, domain: str | None = "") -> GradFn | None:
    """The gradient rule of ``op_type`` in ``domain`` (that very domain's rule only)."""
    return _GRADS.get((_domain(domain), op_type))


def ops_with_gradients(domain: str = "") -> tuple[str, ...]:
    """The op types of ``domain`` (default: the default domain) that have gradient rules."""
    return tuple(sorted(op for (d, op) in _GRADS if d == _domain(domain)))


def entry(op_type: str, domain: str | None = "") -> OpEntry:
    """The entry of ``op_type`` in ``domain``, else of the default-domain op of that name."""
    return _ENTRIES.get((_domain(domain), op_type)) or _ENTRIES.get(("", op_type), _DEFAULT)


def rule_of(op_type: str, domain: str | None = "") -> RuleFn | None:
    """The sharding rule of ``op_type`` in ``domain`` (an entry of that very domain only)."""
    found = _ENTRIES.get((_domain(domain), op_type))
    return None if found is None else found.rule


def ops_with_rules(domain: str = "") -> tuple[str, ...]:
    """The ONNX op types of ``domain`` (default: the default domain) that have sharding rules."""
    return tuple(sorted(op for (d, op), e in _ENTRIES.items() if d == _domain(domain) and e.rule is not None))


def heavy_ops() -> frozenset[str]:
    return frozenset(op for (_, op), e in _ENTRIES.items() if e.heavy)
