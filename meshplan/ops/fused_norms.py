"""onnxruntime's normalisations: SimplifiedLayerNormalization (RMSNorm, in the default
domain) and the com.microsoft SkipLayerNormalization and SkipSimplifiedLayerNormalization
(the residual add fused in front). They normalise over the last dim (``axis`` for the
simplified one): every dim before it splits, with the scale and bias whole. Nothing
passes partial sums through (the normalisation is not linear)."""

from __future__ import annotations

from meshplan.ops.grad_words import GradNode
from meshplan.ops.reductions import _layer_norm, _stat, normalization_grad
from meshplan.ops.registry import define, gradient, per_element
from meshplan.ops.view import R, OpView, Rule

MICROSOFT = "com.microsoft"

# (X, scale) -> (Y, inv_std_var): as LayerNormalization without the bias and the mean.
define("SimplifiedLayerNormalization", rule=_layer_norm, flops=per_element(6))


@gradient("SimplifiedLayerNormalization")
def _rms_norm_grad(g: GradNode) -> list:
    """y = x·rstd·scale, rstd = 1/√(mean(x²) + ε) over the axes from ``axis`` (output 1, where
    the loss reads it, adds its own)."""
    rank = g.rank(g.x(0))
    axes = list(range(int(g.attr("axis", -1)) % rank, rank))
    dx, xhat = normalization_grad(g, axes, False, float(g.attr("epsilon", 1e-5)), g.x(1), drstd=_stat(g, 1))
    dscale = g.unbroadcast(g.op("Mul", g.dy(0), xhat), g.x(1)) if g.need(1) else None
    return [dx if g.need(0) else None, dscale]


def _skip_layer_norm(op: OpView) -> list[Rule]:
    """(input, skip, gamma, [beta], [bias]) -> (output, mean, inv_std_var, input+skip+bias):
    the dims before the last; skip splits with the input where it has that dim (it may
    broadcast over the batch), gamma, beta and bias stay whole; every output follows."""
    x, skip = op.shape(0), op.shape(1)
    rules: list[Rule] = []
    for d in range(len(x) - 1):
        e = d - (len(x) - len(skip))
        rules.append(((d, e if e >= 0 and skip[e] == x[d] else R), (d, d, d, d)))
    return rules


define("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", domain=MICROSOFT, rule=_skip_layer_norm,
       flops=per_element(8))


@gradient("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", domain=MICROSOFT)
def _skip_norm_grad(g: GradNode) -> list:
    """s = input + skip (+ bias), y = x̂(s)·gamma (+ beta) over the last dim (x̂ = s·rstd for the
    simplified one), output 3 = s: ds = the norm's dx + d(output 3) (+ the mean's and
    inv_std_var's); dinput = ds, dskip = ds summed to skip's shape, dbias = Σ ds, dgamma =
    Σ dy·x̂, dbeta = Σ dy."""
    simplified = g.op_type == "SkipSimplifiedLayerNormalization"
    x, skip, gamma = g.x(0), g.x(1), g.x(2)
    bias, beta = (3, None) if simplified else (4, 3)
    source = g.set_shape(g.op("Add", x, skip), g.shape(x))
    if g.has_input(bias):
        source = g.set_shape(g.op("Add", source, g.x(bias)), g.shape(x))
    parts, xhat = [], None
    normed = any(g.has_dy(k) for k in (0, 2)) or (g.has_dy(1) and not simplified)
    if normed:
        dx, xhat = normalization_grad(g, [g.rank(x) - 1], not simplified, float(g.attr("epsilon", 1e-12)),
                                      gamma, source=source, dmean=None if simplified else _stat(g, 1),
                                      drstd=_stat(g, 2))
        parts.append(dx)
    if g.has_dy(3):
        parts.append(g.dy(3))
    ds = parts[0] if len(parts) == 1 else g.op("Add", *parts)
    grads = [ds if g.need(0) else None, g.unbroadcast(ds, skip, like=x) if g.need(1) else None,
             g.unbroadcast(g.op("Mul", g.dy(0), xhat), gamma, like=x) if g.need(2) and xhat else None]
    grads += [None] * (len(g.inputs) - 3)
    if beta is not None and g.has_input(beta) and g.need(beta):
        grads[beta] = g.unbroadcast(g.dy(0), g.x(beta), like=x)
    if g.has_input(bias) and g.need(bias):
        grads[bias] = g.unbroadcast(ds, g.x(bias), like=x)
    return grads
