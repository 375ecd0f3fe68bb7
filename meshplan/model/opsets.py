"""The ONNX opset meshplan assumes for a model that names none, and builds its own
models (probes, timing and transfer kernels) with; the IR version every file it writes
carries."""

from __future__ import annotations

import onnx

DEFAULT_OPSET = 17

# onnx 1.23 writes IR 14 by default, newer than onnxruntime 1.31 reads (13). Every file
# meshplan writes carries the least IR version its opsets need, never above this.
MAX_IR_VERSION = 13


def set_ir_version(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give the model the least IR version its opsets need (onnxruntime rejects newer ones),
    at least 4: before IR 4 every initializer had to be a graph input, which the canonical
    model and the programs do not keep up (an old model is upgraded, its weights kept)."""
    used = {node.domain or "" for node in model.graph.node} | {""}
    keep = [op for op in model.opset_import if (op.domain or "") in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    needed = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    model.ir_version = max(min(needed, MAX_IR_VERSION), 4)
    return model
