"""Pointwise operators: split any output dim (inputs follow it or broadcast); the linear
ones also pass partial sums through."""

from __future__ import annotations

import numpy as np

from meshplan.ops.grad_words import GradientError, GradNode
from meshplan.ops.registry import define, gradient, no_flops, per_element, rule
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


# --- gradients: dx from dy, one formula per op (x, y the forward values) -------------------

def _unary(formula):
    """A unary op's rule from ``formula(g, x, y, dy)`` → dx."""
    return lambda g: [formula(g, g.x(0), g.y(0), g.dy(0))]


def _times(g: GradNode, dy: str, factor: str) -> str:
    return g.op("Mul", dy, factor)


gradient("Identity")(_unary(lambda g, x, y, dy: dy))
gradient("Neg")(_unary(lambda g, x, y, dy: g.op("Neg", dy)))
# dx = dy·[x > 0]
gradient("Relu")(_unary(lambda g, x, y, dy: g.op("Where", g.op("Greater", x, g.const(0.0)), dy,
                                                  g.const(0.0))))
# dx = dy·(1 − y²)
gradient("Tanh")(_unary(lambda g, x, y, dy: _times(g, dy, g.op("Sub", g.const(1.0), g.op("Mul", y, y)))))
# dx = dy·y·(1 − y)
gradient("Sigmoid")(_unary(lambda g, x, y, dy: _times(g, dy, g.op("Mul", y, g.op("Sub", g.const(1.0), y)))))
# dx = dy·y
gradient("Exp")(_unary(lambda g, x, y, dy: _times(g, dy, y)))
# dx = dy / x
gradient("Log")(_unary(lambda g, x, y, dy: g.op("Div", dy, x)))
# dx = dy / (2·y)
gradient("Sqrt")(_unary(lambda g, x, y, dy: g.op("Div", dy, g.op("Mul", y, g.const(2.0)))))
# dx = −dy·y²
gradient("Reciprocal")(_unary(lambda g, x, y, dy: g.op("Neg", _times(g, dy, g.op("Mul", y, y)))))
# dx = dy·sign(x)
gradient("Abs")(_unary(lambda g, x, y, dy: _times(g, dy, g.op("Sign", x))))
# dx = dy·2/√π·exp(−x²)
gradient("Erf")(_unary(lambda g, x, y, dy: _times(g, dy, g.op("Mul", g.const(2.0 / np.sqrt(np.pi)),
                                                               g.op("Exp", g.op("Neg", g.op("Mul", x, x)))))))
# dx = dy·sigmoid(x)
gradient("Softplus")(_unary(lambda g, x, y, dy: _times(g, dy, g.op("Sigmoid", x))))
# dx = dy·cos(x), −dy·sin(x)
gradient("Sin")(_unary(lambda g, x, y, dy: _times(g, dy, g.op("Cos", x))))
gradient("Cos")(_unary(lambda g, x, y, dy: g.op("Neg", _times(g, dy, g.op("Sin", x)))))
# dx = dy·(x > 0 ? 1 : alpha)
gradient("LeakyRelu")(_unary(lambda g, x, y, dy: g.op("Where", g.op("Greater", x, g.const(0.0)), dy,
                                                       g.op("Mul", dy, g.const(g.attr("alpha", 0.01))))))
# dx = dy·(x > 0 ? 1 : y + alpha)
gradient("Elu")(_unary(lambda g, x, y, dy: g.op("Where", g.op("Greater", x, g.const(0.0)), dy,
                                                 g.op("Mul", dy, g.op("Add", y, g.const(g.attr("alpha", 1.0)))))))


@gradient("Gelu")
def _gelu_grad(g: GradNode) -> list:
    """dx = dy·gelu'(x): erf form Φ(x) + x·φ(x); tanh form the derivative of
    0.5·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³)."""
    tanh = g.attr("approximate", "none") in ("tanh", b"tanh")
    return [g.op("Mul", g.dy(0), (_gelu_tanh if tanh else _gelu_erf)(g, g.x(0)))]


@gradient("Add", "Sub")
def _add_grad(g: GradNode) -> list:
    dy = g.dy(0)
    da = g.unbroadcast(dy, g.x(0)) if g.need(0) else None
    db = None
    if g.need(1):
        db = g.unbroadcast(dy if g.op_type == "Add" else g.op("Neg", dy), g.x(1))
    return [da, db]


@gradient("Sum")
def _sum_grad(g: GradNode) -> list:
    return [g.unbroadcast(g.dy(0), g.x(i)) if g.need(i) else None for i in range(len(g.inputs))]


@gradient("Mean")
def _mean_grad(g: GradNode) -> list:
    scaled = g.op("Div", g.dy(0), g.const(float(len(g.inputs))))
    return [g.unbroadcast(scaled, g.x(i)) if g.need(i) else None for i in range(len(g.inputs))]


@gradient("Mul")
def _mul_grad(g: GradNode) -> list:
    a, b, dy = g.x(0), g.x(1), g.dy(0)
    return [g.unbroadcast(g.op("Mul", dy, b), a) if g.need(0) else None,
            g.unbroadcast(g.op("Mul", dy, a), b) if g.need(1) else None]


@gradient("Div")
def _div_grad(g: GradNode) -> list:
    """d(a/b) = dy/b, −dy·y/b."""
    a, b, dy = g.x(0), g.x(1), g.dy(0)
    da = g.unbroadcast(g.op("Div", dy, b), a) if g.need(0) else None
    db = g.unbroadcast(g.op("Neg", g.op("Div", g.op("Mul", dy, g.y(0)), b)), b) if g.need(1) else None
    return [da, db]


@gradient("Pow")
def _pow_grad(g: GradNode) -> list:
    """d(a^b) = dy·b·a^(b−1), dy·y·ln(a)."""
    a, b, dy = g.x(0), g.x(1), g.dy(0)
    da = db = None
    if g.need(0):
        bf = b if g.dtype(b) == g.dtype(a) else g.like_input(b, 0)
        da = g.unbroadcast(g.op("Mul", dy, g.op("Mul", bf, g.op("Pow", a, g.op("Sub", bf, g.const(1.0, like=a))))),
                           a)
    if g.need(1):
        db = g.unbroadcast(g.op("Mul", dy, g.op("Mul", g.y(0), g.op("Log", a))), b)
    return [da, db]


@gradient("Max", "Min")
def _max_grad(g: GradNode) -> list:
    """The gradient goes to the input that gave the result (to each where several tie)."""
    dy, zero = g.dy(0), g.const(0.0)
    return [g.unbroadcast(g.op("Where", g.op("Equal", g.x(i), g.y(0)), dy, zero), g.x(i)) if g.need(i) else None
            for i in range(len(g.inputs))]


@gradient("Where")
def _where_grad(g: GradNode) -> list:
    cond, dy, zero = g.x(0), g.dy(0), g.const(0.0)
    return [None,
            g.unbroadcast(g.op("Where", cond, dy, zero), g.x(1)) if g.need(1) else None,
            g.unbroadcast(g.op("Where", cond, zero, dy), g.x(2)) if g.need(2) else None]


@gradient("Clip")
def _clip_grad(g: GradNode) -> list:
    """dy where the input lies inside [min, max]; the bounds take none."""
    x, dy = g.x(0), g.dy(0)
    inside = g.op("Equal", x, g.y(0))
    return [g.op("Where", inside, dy, g.const(0.0))] + [None] * (len(g.inputs) - 1)


@gradient("Cast")
def _cast_grad(g: GradNode) -> list:
    return [g.like_input(g.dy(0), 0)]


@gradient("Dropout")
def _dropout_grad(g: GradNode) -> list:
    """dx = dy·mask/(1 − ratio) in training mode (the mask output: the one the forward run
    drew); dx = dy in inference mode (a mode given at run time: Where(mode, scale, 1))."""
    dy = g.dy(0)
    mode = g.value(2) if g.has_input(2) else np.array(False)
    if mode is not None and not bool(mode):
        return [dy] + [None] * (len(g.inputs) - 1)
    if len(g.outputs) < 2 or not g.outputs[1]:
        raise GradientError(f"Dropout node '{g.name}' in training mode has no mask output: its gradient "
                            "needs the mask its forward run drew", hint="give the node its mask output")
    x = g.x(0)
    ratio = g.like_input(g.x(1), 0) if g.has_input(1) else g.const(0.5, like=x)
    scale = g.op("Div", g.const(1.0, like=x), g.op("Sub", g.const(1.0, like=x), ratio))
    if mode is None:
        scale = g.op("Where", g.x(2), scale, g.const(1.0, like=x))
    kept = g.op("Where", g.y(1), dy, g.const(0.0, like=x))
    return [g.op("Mul", kept, scale)] + [None] * (len(g.inputs) - 1)


def _passed(g: GradNode, where: str) -> str:
    """dy where ``where`` holds, else 0."""
    return g.op("Where", where, g.dy(0), g.const(0.0))


def _attr(g: GradNode, name: str, default: float) -> str:
    return g.const(float(g.attr(name, default)))


# dx = 0 (a step function: zero almost everywhere)
gradient("Sign", "Floor", "Ceil", "Round")(_unary(lambda g, x, y, dy: g.zeros(x)))
# dx = dy·[x > alpha]
gradient("ThresholdedRelu")(_unary(lambda g, x, y, dy: _passed(g, g.op("Greater", x, _attr(g, "alpha", 1.0)))))
# dx = dy·[|x| > lambd]
gradient("Shrink")(_unary(lambda g, x, y, dy: _passed(g, g.op("Greater", g.op("Abs", x), _attr(g, "lambd", 0.5)))))
# dx = dy / (1 + |x|)²
gradient("Softsign")(_unary(lambda g, x, y, dy: g.op("Div", dy, _squared(g, g.op("Add", g.const(1.0),
                                                                                 g.op("Abs", x))))))
# dx = dy·cosh(x), dy·sinh(x), dy·(1 + y²), dy/(1 + x²)
gradient("Sinh")(_unary(lambda g, x, y, dy: _times(g, dy, g.op("Cosh", x))))
gradient("Cosh")(_unary(lambda g, x, y, dy: _times(g, dy, g.op("Sinh", x))))
gradient("Tan")(_unary(lambda g, x, y, dy: _times(g, dy, g.op("Add", g.const(1.0), _squared(g, y)))))
gradient("Atan")(_unary(lambda g, x, y, dy: g.op("Div", dy, g.op("Add", g.const(1.0), _squared(g, x)))))
# dx = dy/√(1 − x²), −dy/√(1 − x²), dy/√(x² + 1), dy/√(x² − 1), dy/(1 − x²)
gradient("Asin")(_unary(lambda g, x, y, dy: g.op("Div", dy, g.op("Sqrt", g.op("Sub", g.const(1.0), _squared(g, x))))))
gradient("Acos")(_unary(lambda g, x, y, dy: g.op("Neg", g.op("Div", dy, g.op("Sqrt", g.op(
    "Sub", g.const(1.0), _squared(g, x)))))))
gradient("Asinh")(_unary(lambda g, x, y, dy: g.op("Div", dy, g.op("Sqrt", g.op("Add", _squared(g, x), g.const(1.0))))))
gradient("Acosh")(_unary(lambda g, x, y, dy: g.op("Div", dy, g.op("Sqrt", g.op("Sub", _squared(g, x), g.const(1.0))))))
gradient("Atanh")(_unary(lambda g, x, y, dy: g.op("Div", dy, g.op("Sub", g.const(1.0), _squared(g, x)))))


def _squared(g: GradNode, name: str) -> str:
    return g.op("Mul", name, name)


@gradient("HardSigmoid")
def _hard_sigmoid_grad(g: GradNode) -> list:
    """dx = dy·alpha·[0 < alpha·x + beta < 1] (y strictly between its bounds)."""
    y = g.y(0)
    inside = g.op("And", g.op("Greater", y, g.const(0.0)), g.op("Less", y, g.const(1.0)))
    return [g.op("Mul", _passed(g, inside), _attr(g, "alpha", 0.2))]


@gradient("HardSwish")
def _hard_swish_grad(g: GradNode) -> list:
    """y = x·max(0, min(1, x/6 + ½)): dx = dy·(x < −3 ? 0 : x > 3 ? 1 : x/3 + ½)."""
    x = g.x(0)
    ramp = g.op("Add", g.op("Div", x, g.const(3.0)), g.const(0.5))
    slope = g.op("Where", g.op("Less", x, g.const(-3.0)), g.const(0.0),
                 g.op("Where", g.op("Greater", x, g.const(3.0)), g.const(1.0), ramp))
    return [g.op("Mul", g.dy(0), slope)]


@gradient("Selu")
def _selu_grad(g: GradNode) -> list:
    """dx = dy·gamma·(x > 0 ? 1 : alpha·eˣ)."""
    x = g.x(0)
    negative = g.op("Mul", _attr(g, "alpha", 1.67326319217681884765625), g.op("Exp", x))
    slope = g.op("Where", g.op("Greater", x, g.const(0.0)), g.const(1.0), negative)
    return [g.op("Mul", g.op("Mul", g.dy(0), _attr(g, "gamma", 1.05070102214813232421875)), slope)]


@gradient("Celu")
def _celu_grad(g: GradNode) -> list:
    """dx = dy·(x > 0 ? 1 : exp(x/alpha))."""
    x, dy = g.x(0), g.dy(0)
    negative = g.op("Mul", dy, g.op("Exp", g.op("Div", x, _attr(g, "alpha", 1.0))))
    return [g.op("Where", g.op("Greater", x, g.const(0.0)), dy, negative)]


@gradient("Mish")
def _mish_grad(g: GradNode) -> list:
    """y = x·tanh(softplus(x)): dx = dy·(t + x·σ(x)·(1 − t²)), t = tanh(softplus(x))."""
    x = g.x(0)
    t = g.op("Tanh", g.op("Softplus", x))
    sech2 = g.op("Sub", g.const(1.0), _squared(g, t))
    return [g.op("Mul", g.dy(0), g.op("Add", t, g.op("Mul", g.op("Mul", x, g.op("Sigmoid", x)), sech2)))]


@gradient("PRelu")
def _prelu_grad(g: GradNode) -> list:
    """y = x > 0 ? x : slope·x: dx = dy·(x > 0 ? 1 : slope), dslope = dy·(x > 0 ? 0 : x)."""
    x, slope, dy = g.x(0), g.x(1), g.dy(0)
    positive = g.op("Greater", x, g.const(0.0))
    dx = g.unbroadcast(g.op("Where", positive, dy, g.op("Mul", dy, slope)), x) if g.need(0) else None
    dslope = g.unbroadcast(g.op("Where", positive, g.const(0.0), g.op("Mul", dy, x)), slope) if g.need(1) else None
    return [dx, dslope]


# --- com.microsoft activations (onnxruntime's fused forms, as transformers exports write them)

MICROSOFT = "com.microsoft"


def _gelu_erf(g: GradNode, x: str) -> str:
    """d/dx x·Φ(x) = Φ(x) + x·φ(x)."""
    c = lambda v: g.const(v, like=x)
    cdf = g.op("Mul", c(0.5), g.op("Add", c(1.0), g.op("Erf", g.op("Mul", x, c(1 / np.sqrt(2.0))))))
    pdf = g.op("Mul", c(1 / np.sqrt(2 * np.pi)), g.op("Exp", g.op("Mul", c(-0.5), g.op("Mul", x, x))))
    return g.op("Add", cdf, g.op("Mul", x, pdf))


def _gelu_tanh(g: GradNode, x: str) -> str:
    """d/dx 0.5·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³)."""
    c = lambda v: g.const(v, like=x)
    k = np.sqrt(2.0 / np.pi)
    x2 = g.op("Mul", x, x)
    t = g.op("Tanh", g.op("Mul", c(k), g.op("Add", x, g.op("Mul", c(0.044715), g.op("Mul", x2, x)))))
    du = g.op("Mul", c(k), g.op("Add", c(1.0), g.op("Mul", c(3 * 0.044715), x2)))
    sech2 = g.op("Sub", c(1.0), g.op("Mul", t, t))
    return g.op("Add", g.op("Mul", c(0.5), g.op("Add", c(1.0), t)), g.op("Mul", g.op("Mul", c(0.5), x),
                                                                        g.op("Mul", sech2, du)))


def _biased_gelu(derivative):
    """Gelu of x + bias (bias optional, broadcast over the last dim): dx = dy·gelu'(x + bias),
    dbias = Σ dx over the leading dims."""
    def rule(g: GradNode) -> list:
        x = g.op("Add", g.x(0), g.x(1)) if g.has_input(1) else g.x(0)
        dx = g.op("Mul", g.dy(0), derivative(g, x))
        return [dx if g.need(0) else None] + ([g.unbroadcast(dx, g.x(1)) if g.need(1) else None]
                                               if g.has_input(1) else [])
    return rule


gradient("Gelu", domain=MICROSOFT)(_biased_gelu(_gelu_erf))
gradient("BiasGelu", domain=MICROSOFT)(_biased_gelu(_gelu_erf))
gradient("FastGelu", domain=MICROSOFT)(_biased_gelu(_gelu_tanh))


@gradient("QuickGelu", domain=MICROSOFT)
def _quick_gelu_grad(g: GradNode) -> list:
    """y = x·σ(αx): dx = dy·(s + αx·s·(1 − s)), s = σ(αx)."""
    x = g.x(0)
    ax = g.op("Mul", x, g.const(float(g.attr("alpha", 1.702)), like=x))
    s = g.op("Sigmoid", ax)
    d = g.op("Add", s, g.op("Mul", ax, g.op("Mul", s, g.op("Sub", g.const(1.0, like=x), s))))
    return [g.op("Mul", g.dy(0), d)]
