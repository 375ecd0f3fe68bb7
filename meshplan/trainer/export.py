"""``meshplan export``: the source model of a training plan with a checkpoint's weights.

The result is the original model (its graph as it was, every other initializer as it was)
with each trained weight's values replaced; written atomically. One tensor is in memory at
a time: the source is read without its external data, each trained weight comes from the
checkpoint alone, and the source's external data is copied range by range; tensors of
``EXTERNAL_BYTES`` or more go to one data file beside the output (``OUTPUT.data``).
onnxruntime runs it and ``meshplan plan`` takes it like any model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from meshplan.errors import TrainError
from meshplan.model.weights import copy_range, point_to
from meshplan.plan_format import read_plan
from meshplan.trainer.checkpoint import Checkpoint
from meshplan.trainer.driver import require_training

EXTERNAL_BYTES = 1 << 20


def export_trained(plan_dir, checkpoint_dir, output) -> Path:
    plan = read_plan(plan_dir)
    require_training(plan, plan_dir)
    checkpoint = Checkpoint(checkpoint_dir)
    weights = plan.training["weights"]
    if checkpoint.manifest.get("weights", {}).get("weights") != weights:
        raise TrainError(f"{checkpoint.path} is a checkpoint of another model (its weights differ from the plan's)")
    source = Path(plan.training["source"]["path"])
    if not source.is_file():
        raise TrainError(f"the source model {source} is gone")
    output = Path(output)
    if output.suffix != ".onnx":
        raise TrainError(f"output must end in .onnx: {output}")
    if not output.parent.is_dir():
        raise TrainError(f"output directory does not exist: {output.parent}")
    model = onnx.load(str(source), load_external_data=False)
    trained = set(weights) | set(plan.training.get("statistics", {}))
    copies = plan.training.get("tied", {})   # an exporter's copy of a tied weight: the trained value again
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    data_name = output.name + ".data"
    try:
        offset = 0
        with open(staging / data_name, "wb") as out:
            for tensor in model.graph.initializer:
                value = None
                if tensor.name in trained:
                    value = checkpoint.tensor(tensor.name)
                elif tensor.name in copies:
                    array = checkpoint.tensor(copies[tensor.name]["of"])
                    value = array.T if copies[tensor.name]["transposed"] else array
                if value is not None:   # (a float32 master in the model's own dtype, rounded to nearest)
                    stored = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
                    fresh = numpy_helper.from_array(np.ascontiguousarray(value, dtype=stored), tensor.name)
                    if len(fresh.raw_data) < EXTERNAL_BYTES:
                        tensor.CopyFrom(fresh)
                        continue
                    out.write(fresh.raw_data)
                    length = len(fresh.raw_data)
                    fresh.ClearField("raw_data")
                    tensor.CopyFrom(fresh)
                elif tensor.data_location == onnx.TensorProto.EXTERNAL:
                    length = copy_range(tensor, source.parent, out)
                else:
                    continue
                point_to(tensor, data_name, offset, length)
                offset += length
        if not offset:
            (staging / data_name).unlink()
        onnx.save(model, str(staging / output.name))
        for item in staging.iterdir():
            os.replace(item, output.parent / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output
