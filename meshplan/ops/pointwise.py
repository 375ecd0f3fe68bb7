"""Pointwise operators: split any output dim (inputs follow it or broadcast); the linear
ones also pass partial sums through."""

from __future__ import annotations

import numpy as np

from meshplan.ops.registry import define, no_flops, per_element, rule
from meshplan.ops.view import P, R, OpView, Rule, need


def broadcast(op: OpView, operands: int | None = None) -> list[Rule]:
    """Split any output dim; each input splits its matching dim or broadcasts it (R).

    Only the first ``operands`` inputs (default all) take part; the others stay R.
    """
    out = op.out_shape
    rank = len(out)
    rules = []
    for d in range(rank):
        ins = []
        for info in op.ins[:operands]:
            shape = info.shape if info is not None else ()
            e = d - (rank - len(shape))
            ins.append(e if e >= 0 and shape[e] == out[d] else R)
        rules.append((tuple(ins), (d,) * len(op.outs)))
    return rules


def all_partial(op: OpView) -> Rule:
    return (P,) * len(op.ins), (P,) * len(op.outs)


def one_partial(op: OpView, index: int) -> Rule:
    """Linear in input ``index`` alone: it partial, the others replicated, the output partial."""
    return tuple(P if j == index else R for j in range(len(op.ins))), (P,)


# FLOPs per output element where more than one.
_COSTLY = {"Erf": 8, "Tanh": 6, "Sigmoid": 4, "Gelu": 10, "Exp": 4, "Log": 4, "Pow": 4, "Sqrt": 2}

# Nonlinear: splits only.
UNARY = (
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "BitwiseNot", "Ceil", "Celu", "Cos", "Cosh",
    "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "IsInf", "IsNaN", "LeakyRelu", "Log",
    "Mish", "Not", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh",
    "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu",
)
NONLINEAR_BROADCAST = (
    "And", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Clip", "Equal", "Greater", "GreaterOrEqual",
    "Less", "LessOrEqual", "Max", "Min", "Mod", "Or", "PRelu", "Pow", "Xor",
)
# f(x1 + x2) = f(x1) + f(x2): a partial input gives a partial output.
UNARY_LINEAR = ("Neg",)
# Sums of their inputs: all inputs partial over the same axes give a partial output.
ADDITIVE = ("Add", "Sub", "Sum", "Mean")

for _op in UNARY + NONLINEAR_BROADCAST:
    define(_op, rule=broadcast, flops=per_element(_COSTLY.get(_op, 1)))
define(*UNARY_LINEAR, *ADDITIVE, rule=lambda op: broadcast(op) + [all_partial(op)])
define("Identity", rule=lambda op: broadcast(op) + [all_partial(op)], flops=no_flops)
# Linear in each factor: one partial factor times replicated ones.
define("Mul", rule=lambda op: broadcast(op) + [one_partial(op, i) for i in range(len(op.ins))])
define("Div", rule=lambda op: broadcast(op) + [one_partial(op, 0)])           # linear in the numerator
define("Where", rule=lambda op: broadcast(op) + [((R, P, P), (P,))])          # in (X, Y) together


@rule("Cast", flops=no_flops)
def _cast(op: OpView) -> list[Rule]:
    """Linear between floating types that do not lose precision."""
    src, dst = op.ins[0].dtype, op.outs[0].dtype
    exact = np.issubdtype(src, np.floating) and np.issubdtype(dst, np.floating) and dst.itemsize >= src.itemsize
    return broadcast(op) + ([all_partial(op)] if exact else [])


@rule("Dropout", flops=no_flops)
def _dropout(op: OpView) -> list[Rule]:
    """Inference dropout is the identity (the mask output is all true)."""
    if op.has_input(2):
        mode = op.const(2)
        need(mode is not None and not bool(mode))
    if "is_test" in op.node.attrs or (op.opset is not None and op.opset < 7):
        need(op.attr("is_test", 0))   # opset 1-6: is_test=0 means training
    return broadcast(op)
