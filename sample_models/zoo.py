"""The ONNX package's own "light" model zoo (onnx/backend/test/data/light/*.onnx).

Their weights are produced by ConstantOfShape nodes that all fill one constant, so a
comparison on them proves little; ``with_varied_weights`` swaps every such weight for a
seeded random initializer of the same name and shape, scaled for its role (He-scaled
convolution and dense weights, positive BatchNormalization variances), so that outputs
depend on every weight.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


def light_model_dir() -> Path:
    import onnx.backend.test

    return Path(onnx.backend.test.__file__).parent / "data" / "light"


def light_models() -> dict[str, Path]:
    """Name (without the 'light_' prefix) → path, sorted by name."""
    return {p.stem.removeprefix("light_"): p for p in sorted(light_model_dir().glob("light_*.onnx"))}


def _role(model: onnx.ModelProto, name: str) -> tuple[str, int]:
    for node in model.graph.node:
        for index, value in enumerate(node.input):
            if value == name:
                return node.op_type, index
    return "", -1


def _values(rng: np.random.Generator, shape: tuple[int, ...], op: str, index: int) -> np.ndarray:
    if op in ("Conv", "Gemm", "MatMul") and index == 1 and len(shape) >= 2:
        fan_in = int(np.prod(shape[1:])) if op == "Conv" else shape[0] if op == "MatMul" else shape[1]
        return rng.standard_normal(shape) * np.sqrt(1.0 / max(fan_in, 1))
    if op == "BatchNormalization" and index == 1:           # scale: small, so residual sums stay bounded
        return rng.uniform(0.2, 0.6, shape)
    if op == "BatchNormalization" and index == 4:           # variance: positive
        return rng.uniform(0.5, 1.5, shape)
    return rng.standard_normal(shape) * 0.1                  # biases, means, other constants


def with_varied_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """A copy whose ConstantOfShape-made weights are seeded random initializers."""
    rng = np.random.default_rng(seed)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    shapes = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    keep_nodes, new_inits, dropped = [], [], set()
    for node in out.graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in shapes:
            shape = tuple(int(d) for d in shapes[node.input[0]])
            value = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "value")
            dtype = helper.tensor_dtype_to_np_dtype(value.data_type)
            op, index = _role(out, node.output[0])
            new_inits.append(numpy_helper.from_array(_values(rng, shape, op, index).astype(dtype), node.output[0]))
            dropped.add(node.input[0])
        else:
            keep_nodes.append(node)
    still_used = {name for node in keep_nodes for name in node.input}
    kept_inits = [t for t in out.graph.initializer if t.name not in dropped or t.name in still_used]
    del out.graph.node[:]
    out.graph.node.extend(keep_nodes)
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept_inits + new_inits)
    graph_inputs = [v for v in out.graph.input if v.name not in dropped or v.name in still_used]
    if out.ir_version < 4:  # before IR 4 every initializer is also a graph input
        graph_inputs += [helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in new_inits]
    del out.graph.input[:]
    out.graph.input.extend(graph_inputs)
    return out
