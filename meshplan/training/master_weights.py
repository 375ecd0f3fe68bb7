"""Float32 master weights for a float16 or bfloat16 model (``meshplan plan --train
--master-weights``), as mixed-precision training keeps them (Megatron-LM's and apex's O2):

- each trained weight stored in float16 or bfloat16 is held as float32 state (its gradient,
  accumulated gradient and optimizer slots with it), and the step reads it through a
  ``Cast`` to the model's dtype (``hold_in_float32``): the forward and the backward compute
  in the model's dtype, its gradient is cast to float32 where it leaves the ``Cast``, and
  the update runs in float32;
- the loss's gradient is seeded with ``train.loss_scale`` (a float32 input of every step,
  1 unless the job sets it: ``meshplan train --loss-scale S``) rather than 1, so that
  float16's small gradients do not flush to zero in the backward, and each master's
  gradient is divided by it again in float32 (``scaled_loss``, ``unscaled``). A step whose
  scaled gradients overflow (an infinite or NaN ``grad_norm``) leaves the weights as they
  were (``optimizers.build_update``'s guard); ``trainer.loss_scale`` keeps a static scale
  or GradScaler's dynamic one.

The source model's values start the masters (``as_held``: widened exactly), and
``meshplan export`` writes the trained masters back in the model's dtype, rounded to nearest.
"""

from __future__ import annotations

import ml_dtypes  # noqa: F401  (numpy knows "bfloat16" by name once it is imported)
import numpy as np
import onnx
from onnx import TensorProto, helper

from meshplan.training.autodiff import WEIGHT

LOSS_SCALE = "train.loss_scale"
NARROW = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def master_name(weight: str) -> str:
    """The tensor the step reads in place of ``weight``: the master cast to the model's dtype."""
    return f"train.master/{weight}"


def hold_in_float32(model: onnx.ModelProto, weights: list[onnx.TensorProto]) -> dict[str, int]:
    """Every node of ``model`` (its subgraphs too) that reads one of ``weights`` stored in
    float16 or bfloat16 reads it through a ``Cast`` of the weight, placed first in the graph:
    the weight itself can then be float32. Returns {weight: its dtype in the model}."""
    narrow = {t.name: t.data_type for t in weights if t.data_type in NARROW}
    if not narrow:
        return {}
    names = {w: master_name(w) for w in narrow}
    _rename_reads(model.graph, names)
    for value in model.graph.output:
        if value.name in names:
            raise ValueError(f"the trained weight {value.name!r} is an output of the model")
    kept = [v for v in model.graph.value_info if v.name not in narrow]   # (an exporter's types of the weights)
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    casts = [helper.make_node("Cast", [w], [names[w]], name=names[w], to=dtype) for w, dtype in narrow.items()]
    nodes = casts + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return narrow


def _rename_reads(graph: onnx.GraphProto, names: dict[str, str]) -> None:
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in names:
                node.input[k] = names[name]
        for attribute in node.attribute:
            for sub in list(attribute.graphs) + ([attribute.g] if attribute.HasField("g") else []):
                _rename_reads(sub, names)


def scaled_loss(seed: str) -> tuple[onnx.NodeProto, str]:
    """The node making the tensor the backward starts from: the loss times the loss scale."""
    name = f"{seed}/scaled"
    return helper.make_node("Mul", [seed, LOSS_SCALE], [name], name=name), name


def unscaled(gradients: dict[str, str], masters) -> tuple[list[onnx.NodeProto], dict[str, str], dict[str, str]]:
    """Each master's float32 gradient divided by the loss scale: the nodes, the gradients by
    weight (the others' as they were), and each node's origin (the weight's, so that a
    pipeline places it with the weight)."""
    nodes, found, origin = [], dict(gradients), {}
    for weight in masters:
        if gradients.get(weight) is None:
            continue
        name = f"{gradients[weight]}/unscaled"
        nodes.append(helper.make_node("Div", [gradients[weight], LOSS_SCALE], [name], name=name))
        found[weight], origin[name] = name, WEIGHT + weight
    return nodes, found, origin


def as_held(weights: dict, pairs):
    """(name, array) of ``pairs`` (a source model's values), a master's (an entry of the
    training record ``weights`` with a ``model_dtype``) widened to float32, exactly."""
    for name, array in pairs:
        entry = weights.get(name)
        if entry is not None and "model_dtype" in entry and array.dtype != np.float32:
            array = np.asarray(array, dtype=np.float32)
        yield name, array


def model_itemsize(entry: dict) -> int:
    """Bytes of an element of a trained weight (a training record's entry) in the model."""
    return np.dtype(entry.get("model_dtype", entry["dtype"])).itemsize


def widening(weights: dict) -> int:
    """A trained weight's state bytes over its bytes in the model: 2 where float16 or
    bfloat16 weights are held as float32 masters, else 1."""
    return max((np.dtype(e["dtype"]).itemsize // model_itemsize(e) for e in weights.values()), default=1)


__all__ = ["LOSS_SCALE", "NARROW", "as_held", "hold_in_float32", "master_name", "model_itemsize", "scaled_loss",
           "unscaled", "widening"]
