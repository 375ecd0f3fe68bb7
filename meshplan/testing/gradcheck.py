"""Gradient rules held to central differences (as ``torch.autograd.gradcheck`` holds autograd).

``gradcheck(nodes, inputs, wrt)`` builds a model of ``nodes`` over ``inputs``, reduces its
outputs to one scalar with fixed random weights (Σ_k Σ out_k · r_k), writes the gradients
with ``training.autodiff`` and runs them on onnxruntime; then perturbs each asked-for input
element by ±eps and runs the forward model again. Float64 where the operators run in it,
so the two agree to ~1e-7; the caller picks the dtype (float32, with a larger ``eps`` and a
looser tolerance, where onnxruntime's CPU provider has no float64 kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from meshplan.training.autodiff import gradients

LOSS = "gradcheck_loss"


@dataclass
class GradCheck:
    analytic: dict[str, np.ndarray]
    numeric: dict[str, np.ndarray]     # at the sampled elements only (NaN elsewhere)
    sampled: dict[str, np.ndarray]     # flat indices checked

    def worst(self) -> tuple[str, float]:
        """The input with the largest error relative to its gradient's scale, and that error."""
        found = ("", 0.0)
        for name, idx in self.sampled.items():
            a = self.analytic[name].reshape(-1)[idx]
            n = self.numeric[name].reshape(-1)[idx]
            scale = max(1.0, float(np.abs(n).max(initial=0.0)))
            err = float(np.abs(a - n).max(initial=0.0)) / scale
            if err >= found[1]:
                found = (name, err)
        return found


def _value_info(name: str, array: np.ndarray):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape))


def _model(nodes, inputs: dict, outputs: list[str], initializers: dict, opset: int, out_types: dict):
    """A model of ``nodes``; outputs of a type not given are left untyped (onnxruntime types them)."""
    declared = [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(np.dtype(out_types[o])),
                                              [] if o == LOSS else None) if o in out_types else
                helper.make_empty_tensor_value_info(o) for o in outputs]
    graph = helper.make_graph(
        list(nodes), "gradcheck", [_value_info(n, v) for n, v in inputs.items()], declared,
        [numpy_helper.from_array(np.asarray(v), n) for n, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = max(8, helper.find_min_ir_version_for([helper.make_opsetid("", opset)]))
    return model


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def gradcheck(nodes, inputs: dict[str, np.ndarray], wrt: list[str], outputs: list[str] | None = None,
              initializers: dict | None = None, opset: int = 18, eps: float = 1e-6, samples: int = 40,
              seed: int = 0) -> GradCheck:
    """The analytic and numeric gradients of Σ_k Σ out_k·r_k with respect to ``wrt``: by
    default over the last node's float outputs. The numeric one takes the outputs' central
    differences and forms the sum in float64 (so a float32 check loses no more to rounding
    than the outputs themselves do)."""
    rng = np.random.default_rng(seed)
    initializers = dict(initializers or {})
    probe_outputs = outputs or [o for o in nodes[-1].output if o]
    probe = _session(_model(nodes, inputs, probe_outputs, initializers, opset, {}))
    values = probe.run(probe_outputs, inputs)
    if outputs is None:
        kept = [k for k, v in enumerate(values) if np.asarray(v).dtype.kind == "f"]
        outputs, values = [probe_outputs[k] for k in kept], [values[k] for k in kept]
        probe = _session(_model(nodes, inputs, outputs, initializers, opset, {}))
    weights = {f"gradcheck_r{k}": rng.standard_normal(v.shape).astype(v.dtype) for k, v in enumerate(values)}
    tail, terms = [], []
    for k, out in enumerate(outputs):
        product = f"gradcheck_p{k}"
        tail.append(helper.make_node("Mul", [out, f"gradcheck_r{k}"], [product]))
        initializers[f"gradcheck_axes{k}"] = np.arange(values[k].ndim, dtype=np.int64)
        tail.append(helper.make_node("ReduceSum", [product, f"gradcheck_axes{k}"], [f"gradcheck_s{k}"], keepdims=0))
        terms.append(f"gradcheck_s{k}")
        if values[k].dtype != values[0].dtype:   # statistics outputs in float32 of a float64 op
            tail.append(helper.make_node("Cast", [terms[-1]], [f"gradcheck_c{k}"],
                                         to=helper.np_dtype_to_tensor_dtype(values[0].dtype)))
            terms[-1] = f"gradcheck_c{k}"
    tail.append(helper.make_node("Sum", terms, [LOSS]))
    dtype = values[0].dtype
    forward = _model(list(nodes) + tail, inputs, [LOSS], {**initializers, **weights}, opset, {LOSS: dtype})
    forward = onnx.shape_inference.infer_shapes(forward, data_prop=True)
    found = gradients(forward, LOSS, list(wrt))
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    model.graph.node.extend(found.nodes)
    model.graph.initializer.extend(found.constants)
    grads = [found.of[name] for name in wrt]
    for name, grad in zip(wrt, grads):
        if grad is None:
            raise AssertionError(f"no gradient reached {name}")
        model.graph.output.append(helper.make_tensor_value_info(grad, helper.np_dtype_to_tensor_dtype(
            inputs[name].dtype), None))
    analytic = dict(zip(wrt, _session(model).run(grads, inputs)))
    for name, grad in analytic.items():
        if grad.shape != inputs[name].shape:
            raise AssertionError(f"the gradient of {name} has shape {grad.shape}, not {inputs[name].shape}")

    def loss(feeds) -> float:
        return sum(float(np.sum(np.asarray(v, dtype=np.float64) * weights[f"gradcheck_r{k}"].astype(np.float64)))
                   for k, v in enumerate(probe.run(outputs, feeds)))

    numeric, sampled = {}, {}
    for name in wrt:
        base = inputs[name]
        picks = np.arange(base.size) if base.size <= samples else rng.choice(base.size, samples, replace=False)
        estimate = np.full(base.size, np.nan)
        for flat in picks:
            feeds = dict(inputs)
            plus, minus = base.copy().reshape(-1), base.copy().reshape(-1)
            plus[flat] += eps
            minus[flat] -= eps
            feeds[name] = plus.reshape(base.shape)
            up = loss(feeds)
            feeds[name] = minus.reshape(base.shape)
            down = loss(feeds)
            step = float(plus[flat]) - float(minus[flat])   # the step as the dtype holds it
            estimate[flat] = (up - down) / step
        numeric[name], sampled[name] = estimate.reshape(base.shape), picks
    return GradCheck(analytic, numeric, sampled)
