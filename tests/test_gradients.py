"""Every gradient rule (``ops.registry.gradient``) held to central differences.

Each property test draws shapes and attributes with hypothesis, builds the operator over
random inputs and compares the gradient the rule writes with central differences of the
same graph (``meshplan.testing.gradcheck``) in float64: they agree to ~1e-7. Operators
onnxruntime's CPU provider has no float64 kernel for (Conv, the pools but MaxPool, Erf and
Gelu, the inverse trigonometric and hyperbolic functions, Celu, Shrink, Mean, InstanceNormalization,
Resize, the com.microsoft operators) are checked in float32 with a step of 1e-2 and a
tolerance of 2e-2 relative to the gradient's scale: float32 rounding of the outputs over the
step is ~1e-5 of them, and a wrong rule is off by O(1). Inputs of functions with kinks
(Relu, Max, Clip, Floor, the pools' maxima) are drawn away from the kinks.

``covers`` records which op types each test exercises; ``test_every_rule_is_exercised``
fails for a rule without a test. The rest: an operator without a rule on the gradient path
is a ``GradientError`` naming it and its node, integer and boolean paths carry no gradient,
a tensor read twice (a tied embedding) gets the sum, a float16 weight behind a Cast gets a
float16 gradient, training-mode Dropout scales by its mask (and without one is an error).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes
from onnx import TensorProto, helper, numpy_helper

import meshplan.ops  # noqa: F401  (registers the rules)
from meshplan.ops import registry
from meshplan.ops.grad_words import GradientError
from meshplan.testing.gradcheck import gradcheck
from meshplan.training.autodiff import gradients

MS = "com.microsoft"
N = helper.make_node
F64, F32 = np.float64, np.float32
# A fixed set of examples in the suite (derandomize); GRADIENT_EXAMPLES=200 GRADIENT_RANDOM=1
# for a longer, fresh search.
EXAMPLES = int(os.environ.get("GRADIENT_EXAMPLES", 5))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("GRADIENT_RANDOM"),
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(SETTINGS, max_examples=max(3, EXAMPLES * 3 // 5))

COVERED: set[tuple[str, str]] = set()


def covers(*op_types: str, domain: str = ""):
    """Mark a test as exercising ``op_types`` (for ``test_every_rule_is_exercised``)."""
    COVERED.update((domain, op) for op in op_types)
    return lambda fn: fn


def check(nodes, inputs: dict, wrt: list, tol: float | None = None, **kw):
    """Hold the rules of ``nodes`` to central differences; float32 inputs: step 1e-2, tolerance 2e-2."""
    single = any(np.asarray(v).dtype == F32 for v in inputs.values())
    kw.setdefault("eps", 1e-2 if single else 1e-6)
    kw.setdefault("samples", 12)
    result = gradcheck(nodes, inputs, wrt, **kw)
    name, err = result.worst()
    limit = tol if tol is not None else (2e-2 if single else 1e-6)
    assert err < limit, f"{[n.op_type for n in nodes]} d{name}: error {err:.3g} " \
                        f"(analytic {result.analytic[name].ravel()[:6]}, numeric {result.numeric[name].ravel()[:6]})"
    return result


def rand(seed: int, shape, dtype=F64, low: float | None = None, high: float | None = None):
    rng = np.random.default_rng(seed)
    if low is not None:
        return rng.uniform(low, high, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def away(seed: int, shape, dtype=F64, points=(0.0,), gap: float = 0.1):
    """Random values at least ``gap`` from each of ``points`` (the kinks of a function)."""
    rng = np.random.default_rng(seed)
    values = rng.uniform(-2.5, 2.5, shape)
    for p in points:
        near = np.abs(values - p) < gap
        values = np.where(near, p + np.where(values >= p, gap, -gap) + (values - p), values)
    return values.astype(dtype)


def distinct(seed: int, shape, dtype=F64, spacing: float = 0.05):
    """Values that differ pairwise by at least ``spacing`` (no ties for a maximum)."""
    count = int(np.prod(shape))
    values = np.random.default_rng(seed).permutation(count) * spacing - count * spacing / 2
    return values.reshape(shape).astype(dtype)


seeds = st.integers(0, 2**16)


# --- pointwise -----------------------------------------------------------------------------

# op → (dtype, value domain (low, high) or kinks to avoid, attribute strategies)
UNARY = {
    "Identity": (F64, None, {}), "Neg": (F64, None, {}), "Abs": (F64, [0.0], {}),
    "Relu": (F64, [0.0], {}), "Tanh": (F64, None, {}), "Sigmoid": (F64, None, {}), "Exp": (F64, None, {}),
    "Log": (F64, (0.2, 3.0), {}), "Sqrt": (F64, (0.2, 3.0), {}), "Reciprocal": (F64, (0.3, 3.0), {}),
    "Softplus": (F64, None, {}), "Sin": (F64, None, {}), "Cos": (F64, None, {}),
    "LeakyRelu": (F64, [0.0], {"alpha": st.floats(0.01, 0.5)}),
    "Elu": (F64, [0.0], {"alpha": st.floats(0.1, 2.0)}),
    "HardSigmoid": (F64, [-2.0, 2.0, -1.0, 1.5], {"alpha": st.sampled_from([0.2, 0.5]),
                                                   "beta": st.sampled_from([0.5, 0.25])}),
    "HardSwish": (F64, [-3.0, 3.0], {}),
    "Softsign": (F64, None, {}),
    "Selu": (F64, [0.0], {"alpha": st.floats(1.0, 2.0), "gamma": st.floats(0.5, 1.5)}),
    "Mish": (F64, None, {}),
    "Sign": (F64, [0.0], {}), "Floor": (F64, [-2.0, -1.0, 0.0, 1.0, 2.0], {}),
    "Ceil": (F64, [-2.0, -1.0, 0.0, 1.0, 2.0], {}),
    "Round": (F64, [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5], {}),
    "ThresholdedRelu": (F64, [0.5, 1.0], {"alpha": st.sampled_from([0.5, 1.0])}),
    # no float64 kernel on onnxruntime's CPU provider (Shrink's computes in float32)
    "Erf": (F32, None, {}), "Celu": (F32, [0.0], {"alpha": st.floats(0.5, 2.0)}),
    "Shrink": (F32, [-0.5, 0.5, -1.0, 1.0], {"lambd": st.sampled_from([0.5, 1.0]), "bias": st.floats(-0.5, 0.5)}),
    "Sinh": (F32, (-2.0, 2.0), {}), "Cosh": (F32, (-2.0, 2.0), {}), "Tan": (F32, (-1.0, 1.0), {}),
    "Atan": (F32, None, {}), "Asin": (F32, (-0.8, 0.8), {}), "Acos": (F32, (-0.8, 0.8), {}),
    "Asinh": (F32, None, {}), "Acosh": (F32, (1.3, 3.0), {}), "Atanh": (F32, (-0.8, 0.8), {}),
}


def unary_input(seed, shape, dtype, domain):
    if domain is None:
        return rand(seed, shape, dtype)
    if isinstance(domain, tuple):
        return rand(seed, shape, dtype, *domain)
    return away(seed, shape, dtype, points=domain, gap=0.1)


@covers(*UNARY)
@pytest.mark.parametrize("op", sorted(UNARY))
@FEW
@given(data=st.data(), shape=st.lists(st.integers(1, 4), min_size=0, max_size=3), seed=seeds)
def test_unary(op, data, shape, seed):
    dtype, domain, attr_strategies = UNARY[op]
    attrs = {k: data.draw(v) for k, v in attr_strategies.items()}
    check([N(op, ["x"], ["y"], **attrs)], {"x": unary_input(seed, shape, dtype, domain)}, ["x"])


@covers("Gelu")
@FEW
@given(approximate=st.sampled_from(["none", "tanh"]), shape=st.lists(st.integers(1, 4), max_size=3), seed=seeds)
def test_gelu(approximate, shape, seed):
    # opset 20's Gelu; its erf form has no float64 kernel (Erf)
    check([N("Gelu", ["x"], ["y"], approximate=approximate)], {"x": rand(seed, shape, F32)}, ["x"], opset=20)


BINARY = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min")


@covers(*BINARY)
@pytest.mark.parametrize("op", BINARY)
@SETTINGS
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3), seed=seeds)
def test_binary_broadcast(op, shapes, seed):
    a_shape, b_shape = shapes.input_shapes
    a, b = rand(seed, a_shape), rand(seed + 1, b_shape)
    if op == "Div":
        b = away(seed + 1, b_shape, points=[0.0], gap=0.5)
    if op == "Pow":
        a = rand(seed, a_shape, low=0.3, high=2.0)
    check([N(op, ["a", "b"], ["y"])], {"a": a, "b": b}, ["a", "b"])


@covers("Sum", "Mean", "Max", "Min")
@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
@FEW
@given(shapes=mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3), seed=seeds)
def test_variadic(op, shapes, seed):
    dtype = F32 if op == "Mean" else F64   # Mean: no float64 kernel
    inputs = {f"x{k}": rand(seed + k, s, dtype) for k, s in enumerate(shapes.input_shapes)}
    check([N(op, list(inputs), ["y"])], inputs, list(inputs))


@covers("Where")
@SETTINGS
@given(shapes=mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3), seed=seeds)
def test_where(shapes, seed):
    c_shape, a_shape, b_shape = shapes.input_shapes
    inputs = {"c": np.asarray(rand(seed, c_shape) > 0), "a": rand(seed + 1, a_shape), "b": rand(seed + 2, b_shape)}
    check([N("Where", ["c", "a", "b"], ["y"])], inputs, ["a", "b"])


@covers("PRelu")
@SETTINGS
@given(data=st.data(), shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), seed=seeds)
def test_prelu(data, shape, seed):
    # unidirectional: a suffix of x's shape, some dims 1
    tail = shape[data.draw(st.integers(0, len(shape))):]
    slope_shape = [d if data.draw(st.booleans()) else 1 for d in tail]
    check([N("PRelu", ["x", "s"], ["y"])], {"x": away(seed, shape), "s": rand(seed + 1, slope_shape)}, ["x", "s"])


@covers("Clip")
@SETTINGS
@given(bounds=st.sampled_from([(None, None), (-0.5, None), (None, 0.7), (-1.0, 1.0)]),
       shape=st.lists(st.integers(1, 4), max_size=3), seed=seeds)
def test_clip(bounds, shape, seed):
    lo, hi = bounds
    points = [p for p in bounds if p is not None]
    names = ["x", "lo" if lo is not None else "", "hi" if hi is not None else ""]
    while names[-1] == "":
        names.pop()
    constants = {k: np.array(v) for k, v in (("lo", lo), ("hi", hi)) if v is not None}
    check([N("Clip", names, ["y"])], {"x": away(seed, shape, points=points or [0.0])}, ["x"], initializers=constants)


@covers("Cast")
@FEW
@given(shape=st.lists(st.integers(1, 4), max_size=3), seed=seeds)
def test_cast(shape, seed):
    # float32 → float64 (the float32 input: the looser tolerance)
    check([N("Cast", ["x"], ["y"], to=TensorProto.DOUBLE)], {"x": rand(seed, shape, F32)}, ["x"])


@covers("Dropout")
@FEW
@given(form=st.sampled_from(["plain", "inference", "ratio0"]), mask=st.booleans(),
       shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=seeds)
def test_dropout_differences(form, mask, shape, seed):
    """Inference mode is the identity (the mask output present or not); training mode with
    ratio 0 keeps everything (the differences are deterministic there)."""
    outputs = ["y", "mask"] if mask or form == "ratio0" else ["y"]
    if form == "plain":
        node, constants = N("Dropout", ["x"], outputs), {}
    else:
        node = N("Dropout", ["x", "r", "t"], outputs)
        constants = {"r": np.array(0.0 if form == "ratio0" else 0.5), "t": np.array(form == "ratio0")}
    check([node], {"x": rand(seed, shape)}, ["x"], outputs=["y"], initializers=constants)


# --- products ------------------------------------------------------------------------------

@covers("MatMul")
@SETTINGS
@given(batch=mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=3),
       mkn=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
       vector=st.sampled_from(["", "a", "b", "ab"]), seed=seeds)
def test_matmul(batch, mkn, vector, seed):
    m, k, n = mkn
    a_shape = (k,) if "a" in vector else batch.input_shapes[0] + (m, k)
    b_shape = (k,) if "b" in vector else batch.input_shapes[1] + (k, n)
    check([N("MatMul", ["a", "b"], ["y"])], {"a": rand(seed, a_shape), "b": rand(seed + 1, b_shape)}, ["a", "b"])


@covers("Gemm")
@SETTINGS
@given(mkn=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
       trans=st.tuples(st.booleans(), st.booleans()),
       alpha=st.sampled_from([1.0, 0.7]), beta=st.sampled_from([1.0, -1.3]),
       bias=st.sampled_from(["none", "scalar", "n", "1n", "m1", "mn"]), seed=seeds)
def test_gemm(mkn, trans, alpha, beta, bias, seed):
    m, k, n = mkn
    ta, tb = trans
    inputs = {"a": rand(seed, (k, m) if ta else (m, k)), "b": rand(seed + 1, (n, k) if tb else (k, n))}
    if bias != "none":
        inputs["c"] = rand(seed + 2, {"scalar": (), "n": (n,), "1n": (1, n), "m1": (m, 1), "mn": (m, n)}[bias])
    node = N("Gemm", list(inputs), ["y"], transA=int(ta), transB=int(tb), alpha=alpha, beta=beta)
    check([node], inputs, list(inputs))


EQUATIONS = ["ij,jk->ik", "bij,bjk->bik", "bhqd,bhkd->bhqk", "ij,kj->ik", "i,j->ij", "ij,ij->i", "ij,jk",
             "...ij,...jk->...ik", "bnd,dh->bnh", "i,i->", "ij->", "ijk->kj", "ij,j->i", "bij->b"]


@covers("Einsum")
@SETTINGS
@given(equation=st.sampled_from(EQUATIONS), sizes=st.lists(st.integers(1, 3), min_size=12, max_size=12),
       lead=st.lists(st.integers(1, 2), min_size=2, max_size=2), seed=seeds)
def test_einsum(equation, sizes, lead, seed):
    size = dict(zip("ijkbhqdnE", sizes))
    terms = equation.split("->")[0].split(",")
    shapes = [tuple(lead) * (1 if "..." in t else 0) + tuple(size[c] for c in t.replace("...", "")) for t in terms]
    if "..." in equation:   # broadcast the ellipsis: the second operand's first dim is 1
        shapes[1] = (1,) + shapes[1][1:]
    inputs = {f"x{k}": rand(seed + k, s) for k, s in enumerate(shapes)}
    check([N("Einsum", list(inputs), ["y"], equation=equation)], inputs, list(inputs))


@st.composite
def windows(draw, max_rank: int = 2, ceil: bool = False):
    """Window attributes (strides, dilations, pads below the kernel or auto_pad) and an input
    size for them (SAME: padding enough that the windows reach the end, as onnxruntime needs)."""
    rank = draw(st.integers(1, max_rank))
    kernel = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    strides = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    dilations = draw(st.lists(st.integers(1, 2), min_size=rank, max_size=rank))
    pad_kind = draw(st.sampled_from(["NOTSET", "pads", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    attrs = {"kernel_shape": kernel, "strides": strides}
    if pad_kind == "pads":
        attrs["pads"] = [min(draw(st.integers(0, 2)), k - 1) for k in kernel * 2]
    elif pad_kind != "NOTSET":
        attrs["auto_pad"] = pad_kind
    reach = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    sizes = [r + draw(st.integers(0, 4)) for r in reach]
    if pad_kind.startswith("SAME"):
        assume(all((-(-i // s) - 1) * s + k - i >= 0 for i, s, k in zip(sizes, strides, kernel)))
    if ceil and pad_kind in ("NOTSET", "pads") and draw(st.booleans()):
        # ceil_mode, where onnx and onnxruntime size the output alike: the last window starts
        # inside the input or its begin pad
        pads = attrs.get("pads", [0] * 2 * rank)
        last = [-(-(i + b + e - r) // s) * s for i, b, e, r, s in zip(sizes, pads[:rank], pads[rank:], reach, strides)]
        assume(all(t < i + b for t, i, b in zip(last, sizes, pads[:rank])))
        attrs["ceil_mode"] = 1
    return attrs, dilations, sizes


@covers("Conv")
@SETTINGS
@given(window=windows(), groups=st.sampled_from(["one", "two", "depthwise"]), bias=st.booleans(),
       seed=seeds)
def test_conv(window, groups, bias, seed):
    attrs, dilations, sizes = window
    if attrs.get("auto_pad") not in ("SAME_UPPER", "SAME_LOWER"):   # onnxruntime: no dilations with SAME
        attrs["dilations"] = dilations
    channels, group = {"one": (3, 1), "two": (4, 2), "depthwise": (4, 4)}[groups]
    out = {"one": 2, "two": 4, "depthwise": 8}[groups]
    inputs = {"x": rand(seed, [2, channels] + sizes, F32),
              "w": rand(seed + 1, [out, channels // group] + attrs["kernel_shape"], F32)}
    if bias:
        inputs["b"] = rand(seed + 2, [out], F32)
    check([N("Conv", list(inputs), ["y"], group=group, **attrs)], inputs, list(inputs))


@covers("ConvTranspose")
@SETTINGS
@given(window=windows(), group=st.sampled_from([1, 2]), extra=st.booleans(), bias=st.booleans(), seed=seeds)
def test_conv_transpose(window, group, extra, bias, seed):
    attrs, dilations, sizes = window
    rank = len(sizes)
    if attrs.get("auto_pad") in ("SAME_UPPER", "SAME_LOWER"):
        dilations = [1] * rank
    attrs["dilations"] = dilations
    if extra and "auto_pad" not in attrs:   # output_padding below the stride
        attrs["output_padding"] = [s - 1 for s in attrs["strides"]]
    x_sizes = [max(1, s - 2) for s in sizes]
    ends = attrs.get("pads", [0] * 2 * rank)
    assume(all(s * (i - 1) + (k - 1) * d + 1 - b - e > 0 for i, s, k, d, b, e in zip(
        x_sizes, attrs["strides"], attrs["kernel_shape"], dilations, ends[:rank], ends[rank:])))
    inputs = {"x": rand(seed, [2, 2 * group] + x_sizes, F32),
              "w": rand(seed + 1, [2 * group, 3] + attrs["kernel_shape"], F32)}
    if bias:
        inputs["b"] = rand(seed + 2, [3 * group], F32)
    check([N("ConvTranspose", list(inputs), ["y"], group=group, **attrs)], inputs, list(inputs))


# --- pools and normalisations ------------------------------------------------------------------

@covers("MaxPool")
@SETTINGS
@given(window=windows(ceil=True), indices=st.sampled_from(["none", "row", "column"]), seed=seeds)
def test_max_pool(window, indices, seed):
    attrs, dilations, sizes = window
    if "auto_pad" not in attrs or attrs["auto_pad"] == "VALID":   # onnx and onnxruntime size SAME with dilations apart
        attrs["dilations"] = dilations
    outputs = ["y"] if indices == "none" else ["y", "i"]
    if indices == "column":
        attrs["storage_order"] = 1
    check([N("MaxPool", ["x"], outputs, **attrs)], {"x": distinct(seed, [2, 2] + sizes)}, ["x"], outputs=["y"])


@covers("AveragePool")
@SETTINGS
@given(window=windows(ceil=True), include_pad=st.booleans(), seed=seeds)
def test_average_pool(window, include_pad, seed):
    attrs, _, sizes = window
    check([N("AveragePool", ["x"], ["y"], count_include_pad=int(include_pad), **attrs)],
          {"x": rand(seed, [2, 3] + sizes, F32)}, ["x"])


@covers("GlobalAveragePool", "GlobalMaxPool")
@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@FEW
@given(spatial=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=seeds)
def test_global_pools(op, spatial, seed):
    check([N(op, ["x"], ["y"])], {"x": distinct(seed, [2, 3] + spatial, F32)}, ["x"])


@covers("LayerNormalization")
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data(), bias=st.booleans(), seed=seeds)
def test_layer_norm(shape, data, bias, seed):
    shape = [2] + shape
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    normed = shape[axis % len(shape):]
    inputs = {"x": rand(seed, shape), "s": rand(seed + 1, normed)}
    if bias:
        inputs["b"] = rand(seed + 2, normed)
    check([N("LayerNormalization", list(inputs), ["y"], axis=axis)], inputs, list(inputs))


@covers("LayerNormalization", "SimplifiedLayerNormalization")
@pytest.mark.parametrize("op", ["LayerNormalization", "SimplifiedLayerNormalization"])
@FEW
@given(shape=st.lists(st.integers(2, 4), min_size=2, max_size=3), seed=seeds)
def test_norm_statistics_outputs(op, shape, seed):
    """The loss reads the statistics outputs too (float32: onnxruntime keeps them so, and
    SimplifiedLayerNormalization has no float64 kernel)."""
    outputs = ["y", "m", "r"] if op == "LayerNormalization" else ["y", "r"]
    inputs = {"x": rand(seed, shape, F32), "s": rand(seed + 1, shape[-1:], F32)}
    check([N(op, ["x", "s"], outputs, axis=-1, epsilon=0.1)], inputs, ["x", "s"])   # ε bounds rstd's curvature


@covers("BatchNormalization")
@SETTINGS
@given(spatial=st.lists(st.integers(1, 3), max_size=2), training=st.booleans(), seed=seeds)
def test_batch_norm(spatial, training, seed):
    """Inference (the running statistics: their gradients too) and training mode (the batch's;
    the running outputs, which onnxruntime requires there, take none)."""
    shape = [3, 2] + spatial
    inputs = {"x": rand(seed, shape), "s": rand(seed + 1, [2]), "b": rand(seed + 2, [2]),
              "m": rand(seed + 3, [2]), "v": rand(seed + 4, [2], low=0.5, high=2.0)}
    outputs = ["y", "rm", "rv"] if training else ["y"]
    wrt = ["x", "s", "b"] if training else ["x", "s", "b", "m", "v"]
    check([N("BatchNormalization", list(inputs), outputs, training_mode=int(training), epsilon=1e-3)],
          inputs, wrt, outputs=["y"])


@covers("InstanceNormalization")
@FEW
@given(spatial=st.lists(st.integers(2, 4), min_size=1, max_size=2), seed=seeds)
def test_instance_norm(spatial, seed):
    inputs = {"x": rand(seed, [2, 3] + spatial, F32), "s": rand(seed + 1, [3], F32), "b": rand(seed + 2, [3], F32)}
    check([N("InstanceNormalization", list(inputs), ["y"], epsilon=1e-3)], inputs, list(inputs))


@covers("GroupNormalization")
@FEW
@given(spatial=st.lists(st.integers(1, 3), max_size=2), groups=st.sampled_from([1, 2, 4]),
       opset=st.sampled_from([18, 21]), seed=seeds)
def test_group_norm(spatial, groups, opset, seed):
    """Scale and bias per group (opset 18) or per channel (21)."""
    shape = [2, 4] + spatial
    per = groups if opset == 18 else 4
    inputs = {"x": rand(seed, shape), "s": rand(seed + 1, [per]), "b": rand(seed + 2, [per])}
    attrs = {"stash_type": TensorProto.DOUBLE} if opset >= 21 else {}   # (float32 by default)
    check([N("GroupNormalization", list(inputs), ["y"], num_groups=groups, epsilon=1e-3, **attrs)], inputs,
          list(inputs), opset=opset)


@covers("Softmax", "LogSoftmax")
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data(), seed=seeds)
def test_softmax(op, shape, data, seed):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    check([N(op, ["x"], ["y"], axis=axis)], {"x": rand(seed, shape)}, ["x"])


REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceL2", "ReduceLogSum",
          "ReduceLogSumExp", "ReduceSumSquare")


@covers(*REDUCE)
@pytest.mark.parametrize("op", REDUCE)
@SETTINGS
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data(), keepdims=st.booleans(),
       noop=st.booleans(), seed=seeds)
def test_reduce(op, shape, data, keepdims, noop, seed):
    """Axes given (negative ones too), empty (every axis, or none with noop_with_empty_axes)
    or left out."""
    rank = len(shape)
    axes = data.draw(st.one_of(st.none(), st.lists(st.integers(-rank, rank - 1), max_size=rank,
                                                   unique_by=lambda a: a % rank)))
    x = distinct(seed, shape, spacing=0.1)
    if op == "ReduceLogSum":
        x = rand(seed, shape, low=0.3, high=2.0)
    if op == "ReduceL1":
        x = away(seed, shape)
    constants = {} if axes is None else {"axes": np.array(axes, dtype=np.int64)}
    node = N(op, ["x", "axes"] if axes is not None else ["x"], ["y"], keepdims=int(keepdims),
             noop_with_empty_axes=int(noop))
    check([node], {"x": x}, ["x"], initializers=constants)


@covers("CumSum")
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data(), exclusive=st.booleans(),
       reverse=st.booleans(), seed=seeds)
def test_cumsum(shape, data, exclusive, reverse, seed):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    check([N("CumSum", ["x", "axis"], ["y"], exclusive=int(exclusive), reverse=int(reverse))],
          {"x": rand(seed, shape)}, ["x"], initializers={"axis": np.array(axis)})


@covers("TopK")
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data(), largest=st.booleans(), seed=seeds)
def test_top_k(shape, data, largest, seed):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    k = data.draw(st.integers(1, shape[axis]))
    check([N("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=int(largest))], {"x": distinct(seed, shape)}, ["x"],
          initializers={"k": np.array([k])})


# --- shapes --------------------------------------------------------------------------------

@covers("Reshape", "Flatten", "Squeeze", "Unsqueeze")
@SETTINGS
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=4), form=st.sampled_from(
    ["Reshape", "Flatten", "Squeeze", "Unsqueeze"]), data=st.data(), seed=seeds)
def test_reshapes(shape, form, data, seed):
    rank = len(shape)
    constants, inputs = {}, ["x"]
    attrs = {}
    if form == "Reshape":
        constants["s"] = np.array([-1] + shape[-1:] if rank > 1 else [-1])
        inputs.append("s")
    elif form == "Flatten":
        attrs["axis"] = data.draw(st.integers(-rank, rank))
    elif form == "Squeeze":
        ones = [a for a, d in enumerate(shape) if d == 1]
        picked = data.draw(st.lists(st.sampled_from(ones), unique=True)) if ones else []
        if picked:
            constants["a"] = np.array([a - rank for a in picked])
            inputs.append("a")
    else:   # axes of the output (negative ones too), one or two
        count = data.draw(st.integers(1, 2))
        out_rank = rank + count
        picked = data.draw(st.lists(st.integers(-out_rank, out_rank - 1), min_size=count, max_size=count,
                                    unique_by=lambda a: a % out_rank))
        constants["a"] = np.array(picked)
        inputs.append("a")
    check([N(form, inputs, ["y"], **attrs)], {"x": rand(seed, shape)}, ["x"], initializers=constants)


@covers("Transpose")
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data(), seed=seeds)
def test_transpose(shape, data, seed):
    perm = data.draw(st.one_of(st.none(), st.permutations(range(len(shape)))))
    attrs = {} if perm is None else {"perm": list(perm)}
    check([N("Transpose", ["x"], ["y"], **attrs)], {"x": rand(seed, shape)}, ["x"])


@covers("Expand")
@SETTINGS
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3), seed=seeds)
def test_expand(shapes, seed):
    x_shape, to = shapes.input_shapes
    check([N("Expand", ["x", "s"], ["y"])], {"x": rand(seed, x_shape)}, ["x"],
          initializers={"s": np.array(to, dtype=np.int64)})


@covers("Tile")
@SETTINGS
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data(), seed=seeds)
def test_tile(shape, data, seed):
    repeats = data.draw(st.lists(st.integers(1, 3), min_size=len(shape), max_size=len(shape)))
    check([N("Tile", ["x", "r"], ["y"])], {"x": rand(seed, shape)}, ["x"], initializers={"r": np.array(repeats)})


@covers("Concat")
@SETTINGS
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data(), seed=seeds)
def test_concat(shape, data, seed):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    inputs = {}
    for k, size in enumerate(sizes):
        s = list(shape)
        s[axis] = size
        inputs[f"x{k}"] = rand(seed + k, s)
    check([N("Concat", list(inputs), ["y"], axis=axis)], inputs, list(inputs))


@covers("Split")
@SETTINGS
@given(shape=st.lists(st.integers(2, 5), min_size=1, max_size=3), data=st.data(), sizes=st.booleans(), seed=seeds)
def test_split(shape, data, sizes, seed):
    """Split sizes as an input, or num_outputs (the loss reads some of the outputs)."""
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    length = shape[axis]
    if sizes:
        cut = sorted(data.draw(st.sets(st.integers(1, length - 1), min_size=1, max_size=length - 1)))
        parts = np.diff([0] + cut + [length])
        node = N("Split", ["x", "split"], [f"y{k}" for k in range(len(parts))], axis=axis)
        constants = {"split": parts.astype(np.int64)}
    else:
        count = data.draw(st.integers(1, length))
        chunk = -(-length // count)
        assume((count - 1) * chunk < length)   # as many chunks as outputs
        node = N("Split", ["x"], [f"y{k}" for k in range(count)], axis=axis, num_outputs=count)
        constants = {}
    outputs = list(node.output)
    read = data.draw(st.lists(st.sampled_from(outputs), min_size=1, unique=True))
    check([node], {"x": rand(seed, shape)}, ["x"], outputs=read, initializers=constants)


@covers("Slice")
@SETTINGS
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data(), seed=seeds)
def test_slice(shape, data, seed):
    """Negative starts and ends, negative steps, axes given (negative) or not, steps left out."""
    rank = len(shape)
    axes = data.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    starts, ends, steps = [], [], []
    for a in axes:
        step = data.draw(st.sampled_from([1, 2, -1, -2]))
        start = data.draw(st.integers(-shape[a], shape[a] - 1))
        end = data.draw(st.integers(-shape[a] - 1, shape[a]))
        starts.append(start)
        ends.append(end)
        steps.append(step)
    x = rand(seed, shape)
    if np.asarray(x[tuple(slice(None) for _ in shape)]).size == 0:
        return
    picked = [slice(None)] * rank
    for a, s, e, st_ in zip(axes, starts, ends, steps):
        picked[a] = slice(s, e if not (e < -shape[a]) else None, st_)
    if x[tuple(picked)].size == 0:
        return
    form = data.draw(st.sampled_from(["full", "no_steps", "no_axes"]))
    names, constants = ["x", "s", "e"], {"s": np.array(starts), "e": np.array(ends)}
    if form == "no_axes" and axes == list(range(len(axes))) and all(s == 1 for s in steps):
        pass
    elif form == "no_steps" and all(s == 1 for s in steps):
        names.append("a")
        constants["a"] = np.array([a - rank for a in axes])
    else:
        names += ["a", "st"]
        constants["a"] = np.array([a - rank for a in axes])
        constants["st"] = np.array(steps)
    check([N("Slice", names, ["y"])], {"x": x}, ["x"], initializers=constants)


@covers("Pad")
@SETTINGS
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data(), seed=seeds)
def test_pad(shape, data, seed):
    rank = len(shape)
    pads = data.draw(st.lists(st.integers(0, 2), min_size=2 * rank, max_size=2 * rank))
    value = data.draw(st.sampled_from([None, 0.0, 1.5]))
    names, constants = ["x", "p"], {"p": np.array(pads)}
    if value is not None:
        names.append("v")
        constants["v"] = np.array(value)
    check([N("Pad", names, ["y"])], {"x": rand(seed, shape)}, ["x"], initializers=constants)


@covers("Gather")
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data(), seed=seeds)
def test_gather(shape, data, seed):
    """Repeated indices (each row's gradients added), negative ones, any axis."""
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    size = shape[axis]
    index_shape = data.draw(st.lists(st.integers(1, 3), max_size=2))
    indices = np.random.default_rng(seed).integers(-size, size, index_shape)
    check([N("Gather", ["x", "i"], ["y"], axis=axis)], {"x": rand(seed, shape)}, ["x"],
          initializers={"i": indices.astype(np.int64)})


@covers("GatherElements")
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data(), seed=seeds)
def test_gather_elements(shape, data, seed):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    index_shape = list(shape)
    index_shape[axis] = data.draw(st.integers(1, 5))
    indices = np.random.default_rng(seed).integers(0, shape[axis], index_shape)
    check([N("GatherElements", ["x", "i"], ["y"], axis=axis)], {"x": rand(seed, shape)}, ["x"],
          initializers={"i": indices.astype(np.int64)})


@covers("GatherND")
@SETTINGS
@given(shape=st.lists(st.integers(1, 3), min_size=2, max_size=4), data=st.data(), seed=seeds)
def test_gather_nd(shape, data, seed):
    batch = data.draw(st.integers(0, 1))
    depth = data.draw(st.integers(1, len(shape) - batch))
    lookups = data.draw(st.integers(1, 4))
    rng = np.random.default_rng(seed)
    columns = [rng.integers(0, shape[batch + d], [*shape[:batch], lookups]) for d in range(depth)]
    indices = np.stack(columns, axis=-1).astype(np.int64)
    check([N("GatherND", ["x", "i"], ["y"], batch_dims=batch)], {"x": rand(seed, shape)}, ["x"],
          initializers={"i": indices})


@covers("Trilu")
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=3), k=st.one_of(st.none(), st.integers(-2, 2)),
       upper=st.booleans(), seed=seeds)
def test_trilu(shape, k, upper, seed):
    names, constants = (["x"], {}) if k is None else (["x", "k"], {"k": np.array(k)})
    check([N("Trilu", names, ["y"], upper=int(upper))], {"x": rand(seed, shape)}, ["x"], initializers=constants)


@covers("Resize")
@SETTINGS
@given(mode=st.sampled_from(["nearest", "linear", "cubic"]), coordinates=st.sampled_from(
    ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"]), by=st.sampled_from(["scales", "sizes"]),
    factors=st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=2, max_size=2),
    antialias=st.booleans(), seed=seeds)
def test_resize(mode, coordinates, by, factors, antialias, seed):
    shape = [1, 2, 4, 3]
    attrs = {"mode": mode, "coordinate_transformation_mode": coordinates}
    if antialias and mode != "nearest":
        attrs["antialias"] = 1
    if by == "scales":
        names, constants = ["x", "", "sc"], {"sc": np.array([1.0, 1.0] + factors, dtype=np.float32)}
    else:
        sizes = [max(1, int(s * f)) for s, f in zip(shape[2:], factors)]
        names, constants = ["x", "", "", "sz"], {"sz": np.array(shape[:2] + sizes, dtype=np.int64)}
    check([N("Resize", names, ["y"], **attrs)], {"x": rand(seed, shape, F32)}, ["x"], initializers=constants)


# --- com.microsoft ---------------------------------------------------------------------------

@covers("FastGelu", "BiasGelu", "Gelu", "QuickGelu", domain=MS)
@pytest.mark.parametrize("op", ["FastGelu", "BiasGelu", "Gelu", "QuickGelu"])
@FEW
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), bias=st.booleans(), seed=seeds)
def test_microsoft_gelus(op, shape, bias, seed):
    inputs = {"x": rand(seed, shape, F32)}
    if op == "BiasGelu" or (op == "FastGelu" and bias):
        inputs["b"] = rand(seed + 1, shape[-1:], F32)
    attrs = {"alpha": 1.5} if op == "QuickGelu" else {}
    # then a MatMul: onnx's inference does not type the com.microsoft output; autodiff does
    nodes = [N(op, list(inputs), ["g"], domain=MS, **attrs), N("MatMul", ["g", "w"], ["y"])]
    inputs["w"] = rand(seed + 2, [shape[-1], 2], F32)
    check(nodes, inputs, list(inputs))


@covers("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", domain=MS)
@pytest.mark.parametrize("op", ["SkipLayerNormalization", "SkipSimplifiedLayerNormalization"])
@SETTINGS
@given(optional=st.lists(st.booleans(), min_size=2, max_size=2), skip2d=st.booleans(),
       read=st.lists(st.booleans(), min_size=4, max_size=4), seed=seeds)
def test_skip_norms(op, optional, skip2d, read, seed):
    """Beta and bias present or not; skip [S, H] broadcast over the batch; the loss reads any of
    the outputs (the residual sum, the statistics)."""
    shape = [2, 3, 4]
    inputs = {"x": rand(seed, shape, F32), "s": rand(seed + 1, shape[1:] if skip2d else shape, F32),
              "g": rand(seed + 2, [4], F32)}
    names = ["x", "s", "g"]
    optional_names = ["beta", "bias"] if op == "SkipLayerNormalization" else ["bias"]
    for name, present in zip(optional_names, optional):
        names.append(name if present else "")
        if present:
            inputs[name] = rand(seed + len(inputs), [4], F32)
    while names[-1] == "":
        names.pop()
    outputs = ["y", "mean", "rstd", "sum"]
    chosen = [o for o, r in zip(outputs, read) if r] or ["y"]
    if op == "SkipSimplifiedLayerNormalization" and chosen == ["mean"]:
        chosen = ["y"]   # its mean output is zeros: nothing depends on the inputs
    wrt = [k for k in inputs if "y" in chosen or k not in ("g", "beta")]   # gamma, beta: y alone
    node = N(op, names, outputs, domain=MS, epsilon=1e-3)
    check([node], inputs, wrt, outputs=chosen)


# --- the driver --------------------------------------------------------------------------------

def test_every_rule_is_exercised():
    """A rule without a test above fails here (``covers``)."""
    rules = {("", op) for op in registry.ops_with_gradients()} | {(MS, op) for op in registry.ops_with_gradients(MS)}
    assert rules - COVERED == set(), f"gradient rules with no test: {sorted(rules - COVERED)}"


def _model(nodes, inputs: dict, outputs: list, initializers: dict | None = None, opset: int = 18,
           extra_domains=(MS,)) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        n, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype), list(np.shape(v))) for n, v in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)] +
                              [helper.make_opsetid(d, 1) for d in extra_domains])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, data_prop=True)


def _run(model: onnx.ModelProto, found, feeds: dict, names: list) -> list:
    full = onnx.ModelProto()
    full.CopyFrom(model)
    full.graph.node.extend(found.nodes)
    full.graph.initializer.extend(found.constants)
    del full.graph.output[:]
    for name in names:
        full.graph.output.append(helper.make_empty_tensor_value_info(name))
    session = ort.InferenceSession(full.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(names, feeds)


def _loss(x: str) -> list:
    """loss = Σ x (a ReduceSum over every axis)."""
    return [N("ReduceSum", [x], ["loss"], keepdims=0)]


def test_no_rule_names_the_op_and_node(monkeypatch):
    x = {"x": rand(0, [2, 3])}
    model = _model([N("LpNormalization", ["x"], ["n"], name="norm_7"), N("Tanh", ["n"], ["t"])] + _loss("t"), x,
                   ["loss"])
    with pytest.raises(GradientError, match=r"no gradient rule for LpNormalization node 'norm_7'"):
        gradients(model, "loss", ["x"])
    # a com.microsoft operator no inference types (onnxruntime's symbolic one taken away
    # here): its output is taken to carry a gradient, and the error names it, not the
    # ReduceSum after it that finds no shape
    monkeypatch.setitem(sys.modules, "onnxruntime.tools.symbolic_shape_infer", None)
    model = _model([N("Inverse", ["x"], ["n"], domain=MS, name="inv_1")] + _loss("n"), {"x": rand(0, [3, 3])},
                   ["loss"])
    with pytest.raises(GradientError, match=r"no gradient rule for Inverse \(com.microsoft\) node 'inv_1'"):
        gradients(model, "loss", ["x"])


def test_subgraph_reading_the_path_is_an_error():
    """An If whose branches read a weight from the enclosing graph: no rule, so an error
    rather than a gradient that leaves the branch out."""
    branch = lambda op: helper.make_graph([N(op, ["w"], ["o"])], op, [], [helper.make_tensor_value_info(
        "o", TensorProto.DOUBLE, [2])])
    nodes = [N("If", ["c"], ["z"], name="pick", then_branch=branch("Neg"), else_branch=branch("Identity"))]
    model = _model(nodes + _loss("z"), {"w": rand(0, [2]), "c": np.array(True)}, ["loss"])
    with pytest.raises(GradientError, match="If node 'pick'.*w"):
        gradients(model, "loss", ["w"])


def test_integer_and_boolean_paths_carry_no_gradient():
    x = rand(0, [2, 3])
    nodes = [N("Cast", ["x"], ["xi"], to=TensorProto.INT64), N("Cast", ["xi"], ["xf"], to=TensorProto.DOUBLE),
             N("Shape", ["x"], ["shape"]), N("Cast", ["shape"], ["sf"], to=TensorProto.DOUBLE),
             N("ReduceSum", ["sf"], ["ssum"], keepdims=0),
             N("Greater", ["x", "zero"], ["positive"]), N("Cast", ["positive"], ["pf"], to=TensorProto.DOUBLE),
             N("Add", ["xf", "pf"], ["t"]), N("Mul", ["t", "ssum"], ["u"])] + _loss("u")
    model = _model(nodes, {"x": x, "k": np.array([1, 2])}, ["loss"], {"zero": np.array(0.0)})
    found = gradients(model, "loss", ["x", "k"])
    assert found.of == {"x": None, "k": None}
    # the float path beside them carries its gradient alone: d Σ(2x + int(x)) / dx = 2
    nodes = [N("Cast", ["x"], ["xi"], to=TensorProto.INT64), N("Cast", ["xi"], ["xf"], to=TensorProto.DOUBLE),
             N("Mul", ["x", "two"], ["x2"]), N("Add", ["x2", "xf"], ["t"])] + _loss("t")
    model = _model(nodes, {"x": x}, ["loss"], {"two": np.array(2.0)})
    found = gradients(model, "loss", ["x"])
    (grad,) = _run(model, found, {"x": x}, [found.of["x"]])
    np.testing.assert_array_equal(grad, np.full_like(x, 2.0))


def test_tied_weight_gets_the_sum():
    """An embedding table read by Gather and, transposed, by the output MatMul (tied
    embeddings): its gradient is the sum of both, with repeated token ids added."""
    nodes = [N("Gather", ["w", "ids"], ["h"]), N("Transpose", ["w"], ["wt"]), N("MatMul", ["h", "wt"], ["y"])]
    result = check(nodes, {"w": rand(1, [5, 3])}, ["w"], initializers={"ids": np.array([[0, 2, 2], [4, 0, 1]])})
    assert np.all(np.isfinite(result.analytic["w"]))
    model = _model(nodes + _loss("y"), {"w": rand(1, [5, 3])}, ["loss"], {"ids": np.array([[0, 2, 2]])})
    assert any(n.op_type == "Sum" for n in gradients(model, "loss", ["w"]).nodes)


def test_cast_of_a_float16_weight():
    """A float16 weight cast to float32 for its MatMul: a float16 gradient that matches the
    differences (linear in the weight, so a step of 0.1 is exact but for rounding)."""
    nodes = [N("Cast", ["w"], ["w32"], to=TensorProto.FLOAT), N("MatMul", ["x", "w32"], ["y"])]
    inputs = {"w": rand(0, [3, 4], np.float16), "x": rand(1, [2, 3], F32)}
    result = check(nodes, inputs, ["w", "x"], eps=0.125, tol=2e-2)
    assert result.analytic["w"].dtype == np.float16


def test_gradient_of_an_intermediate_tensor_too():
    """Asking for a weight and an activation computed from it: each gets its own gradient."""
    x, w = rand(0, [2, 3]), rand(1, [3, 4])
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Tanh", ["h"], ["t"])] + _loss("t")
    model = _model(nodes, {"x": x, "w": w}, ["loss"])
    found = gradients(model, "loss", ["w", "h"])
    dw, dh = _run(model, found, {"x": x, "w": w}, [found.of["w"], found.of["h"]])
    np.testing.assert_allclose(dh, 1 - np.tanh(x @ w) ** 2)
    np.testing.assert_allclose(dw, x.T @ dh)


def test_unbroadcast_over_a_dim_of_unknown_size():
    """A bias whose first dim the graph does not give: summed where it turns out to be 1."""
    a = rand(0, [2, 3])
    graph = helper.make_graph([N("Add", ["a", "b"], ["y"]), N("Mul", ["y", "y"], ["sq"])] + _loss("sq"), "g",
                              [helper.make_tensor_value_info("a", TensorProto.DOUBLE, [2, 3]),
                               helper.make_tensor_value_info("b", TensorProto.DOUBLE, [None, 3])],
                              [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    found = gradients(model, "loss", ["a", "b"])
    for b in (rand(1, [1, 3]), rand(1, [2, 3])):
        da, db = _run(model, found, {"a": a, "b": b}, [found.of["a"], found.of["b"]])
        np.testing.assert_allclose(da, 2 * (a + b))
        np.testing.assert_allclose(db, (2 * (a + b)).sum(axis=0, keepdims=True) if b.shape[0] == 1 else 2 * (a + b))


@pytest.mark.parametrize("mode", ["constant", "input"])
@pytest.mark.parametrize("ratio", [0.25, None])
def test_dropout_training_scales_by_its_mask(mode, ratio):
    """Training mode: dx = dy·mask/(1 − ratio) (ratio 0.5 where the input is left out), the
    mask the forward run drew; with the mode a graph input, inference gives dy."""
    x = rand(0, [4, 50])
    training = {"t": np.array(True)} if mode == "constant" else {}
    nodes = [N("Dropout", ["x", "r" if ratio else "", "t"], ["y", "mask"], seed=3),
             N("Mul", ["y", "c"], ["z"])] + _loss("z")
    inputs = {"x": x, "c": rand(1, [4, 50])} | ({} if mode == "constant" else {"t": np.array(True)})
    model = _model(nodes, inputs, ["loss"], ({"r": np.array(ratio)} if ratio else {}) | training)
    found = gradients(model, "loss", ["x"])
    for on in ([True] if mode == "constant" else [True, False]):
        feeds = {"x": x, "c": inputs["c"]} | ({} if mode == "constant" else {"t": np.array(on)})
        grad, mask = _run(model, found, feeds, [found.of["x"], "mask"])
        expected = inputs["c"] * mask / (1 - (ratio or 0.5)) if on else inputs["c"]
        np.testing.assert_allclose(grad, expected, rtol=1e-12)
        if on:
            assert 0 < mask.mean() < 1


def test_dropout_training_without_its_mask_is_an_error():
    nodes = [N("Dropout", ["x", "r", "t"], ["y"], name="drop_2")] + _loss("y")
    model = _model(nodes, {"x": rand(0, [3, 4])}, ["loss"], {"r": np.array(0.25), "t": np.array(True)})
    with pytest.raises(GradientError, match="Dropout node 'drop_2'.*mask"):
        gradients(model, "loss", ["x"])


def test_model_without_inferred_shapes():
    """Shape inference not run on the model: the driver types it itself."""
    x, w, b = rand(0, [2, 3]), rand(1, [3, 4]), rand(2, [4])
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["a"]), N("Relu", ["a"], ["r"])] + _loss("r")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, TensorProto.DOUBLE, v.shape)
                                           for k, v in (("x", x), ("w", w), ("b", b))],
                              [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    found = gradients(model, "loss", ["w", "b"])
    dw, db = _run(model, found, {"x": x, "w": w, "b": b}, [found.of["w"], found.of["b"]])
    mask = (x @ w + b > 0).astype(float)
    np.testing.assert_allclose(dw, x.T @ mask)
    np.testing.assert_allclose(db, mask.sum(axis=0))


@covers("ScatterElements", "ScatterND")
@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data(), add=st.booleans(), seed=seeds)
def test_scatter(op, shape, data, add, seed):
    """Reduction none (distinct indices: one write each) or add (repeated indices)."""
    rng = np.random.default_rng(seed)
    rank = len(shape)
    if op == "ScatterElements":
        axis = data.draw(st.integers(-rank, rank - 1))
        index_shape = list(shape)
        count = data.draw(st.integers(1, shape[axis] if not add else 4))
        index_shape[axis] = count
        picks = [rng.choice(shape[axis], count, replace=add) for _ in range(int(np.prod(index_shape)) // count)]
        indices = np.moveaxis(np.array(picks).reshape([*np.delete(index_shape, axis % rank), count]), -1, axis % rank)
        updates_shape, attrs = index_shape, {"axis": axis}
    else:
        depth = data.draw(st.integers(1, rank))
        cells = int(np.prod(shape[:depth]))
        count = data.draw(st.integers(1, cells if not add else 4))
        flat = rng.choice(cells, count, replace=add)
        indices = np.stack(np.unravel_index(flat, shape[:depth]), axis=-1)
        updates_shape, attrs = [count] + shape[depth:], {}
    inputs = {"x": rand(seed, shape), "u": rand(seed + 1, updates_shape)}
    node = N(op, ["x", "i", "u"], ["y"], reduction="add" if add else "none", **attrs)
    check([node], inputs, ["x", "u"], initializers={"i": np.asarray(indices, dtype=np.int64)})


@covers("DepthToSpace", "SpaceToDepth")
@pytest.mark.parametrize("op", ["DCR", "CRD", "SpaceToDepth"])
@FEW
@given(block=st.integers(1, 3), sizes=st.lists(st.integers(1, 3), min_size=3, max_size=3), seed=seeds)
def test_depth_and_space(op, block, sizes, seed):
    c, h, w = sizes
    if op == "SpaceToDepth":
        node, shape = N("SpaceToDepth", ["x"], ["y"], blocksize=block), [2, c, h * block, w * block]
    else:
        node, shape = N("DepthToSpace", ["x"], ["y"], blocksize=block, mode=op), [2, c * block * block, h, w]
    check([node], {"x": rand(seed, shape)}, ["x"])


@covers("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@SETTINGS
@given(extra=st.lists(st.integers(1, 3), max_size=1), classes=st.integers(2, 4),
       reduction=st.sampled_from(["mean", "sum", "none"]), weighted=st.booleans(), ignore=st.booleans(),
       log_prob=st.booleans(), seed=seeds)
def test_class_losses(op, extra, classes, reduction, weighted, ignore, log_prob, seed):
    """Weights or not, an ignore_index some targets take (not all), the log_prob output read."""
    rng = np.random.default_rng(seed)
    shape = [3, classes] + extra
    target = rng.integers(0, classes, [3] + extra)
    attrs = {"reduction": reduction}
    if ignore:
        target.reshape(-1)[0] = -1
        attrs["ignore_index"] = -1
    inputs = {"x": rand(seed, shape)}
    names = ["x", "t"]
    constants = {"t": target.astype(np.int64)}
    if weighted:
        names.append("w")
        constants["w"] = rng.uniform(0.5, 2.0, classes)
    outputs = ["loss", "lp"] if op == "SoftmaxCrossEntropyLoss" and log_prob else ["loss"]
    check([N(op, names, outputs, **attrs)], inputs, ["x"], initializers=constants)


def test_a_weight_applied_at_every_position_gets_one_product():
    """x [batch, seq, K] · W [K, N]: W's gradient is one Gemm over batch × seq rows giving
    [K, N] — no per-batch product of [batch, K, N] summed afterwards (slower per FLOP and a
    tensor the weight's size times the batch) — and equals xᵀ·dy over every position."""
    x, w = rand(0, [4, 3, 5]), rand(1, [5, 6])
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Tanh", ["h"], ["t"])] + _loss("t")
    model = _model(nodes, {"x": x, "w": w}, ["loss"])
    found = gradients(model, "loss", ["w"])
    assert [n.op_type for n in found.nodes if n.op_type in ("MatMul", "Gemm", "ReduceSum")] == ["Gemm"]
    (dw,) = _run(model, found, {"x": x, "w": w}, [found.of["w"]])
    dh = 1 - np.tanh(x @ w) ** 2
    np.testing.assert_allclose(dw, x.reshape(-1, 5).T @ dh.reshape(-1, 6))
