"""onnxruntime's normalisations: SimplifiedLayerNormalization (RMSNorm, in the default
domain) and the com.microsoft SkipLayerNormalization and SkipSimplifiedLayerNormalization
(the residual add fused in front). They normalise over the last dim (``axis`` for the
simplified one): every dim before it splits, with the scale and bias whole. Nothing
passes partial sums through (the normalisation is not linear)."""

from __future__ import annotations

from meshplan.ops.grad_words import GradNode
from meshplan.ops.reductions import _layer_norm, normalization_grad
from meshplan.ops.registry import define, gradient, per_element
from meshplan.ops.view import R, OpView, Rule

MICROSOFT = "com.microsoft"

# (X, scale) -> (Y, inv_std_var): as LayerNormalization without the bias and the mean.
define("SimplifiedLayerNormalization", rule=_layer_norm, flops=per_element(6))


@gradient("SimplifiedLayerNormalization")
def _rms_norm_grad(g: GradNode) -> list:
    """y = x·rstd·scale, rstd = 1/√(mean(x²) + ε) over the axes from ``axis``."""
    rank = g.rank(g.x(0))
    axes = list(range(int(g.attr("axis", -1)) % rank, rank))
    dx, xhat = normalization_grad(g, axes, False, float(g.attr("epsilon", 1e-5)), g.x(1))
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
