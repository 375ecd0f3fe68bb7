"""``meshplan export``: the source model of a training plan with a checkpoint's weights.

The result is the original model (its graph as it was, every other initializer as it was)
with each trained weight's values replaced; written atomically, with external data beside
it when large. onnxruntime runs it and ``meshplan plan`` takes it like any model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
from onnx import numpy_helper

from meshplan.errors import TrainError
from meshplan.plan_format import read_plan
from meshplan.trainer.checkpoint import Checkpoint
from meshplan.trainer.driver import require_training

EXTERNAL_THRESHOLD = 1 << 30


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
    model = onnx.load(str(source))
    place = {t.name: i for i, t in enumerate(model.graph.initializer)}
    copies = plan.training.get("tied", {})
    for name in list(weights) + list(plan.training.get("statistics", {})):
        array = checkpoint.tensor(name)
        model.graph.initializer[place[name]].CopyFrom(numpy_helper.from_array(array, name))
        for copy, tie in copies.items():   # an exporter's copy of a tied weight: the trained value again
            if tie["of"] == name:
                value = array.T if tie["transposed"] else array
                model.graph.initializer[place[copy]].CopyFrom(numpy_helper.from_array(value, copy))
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        large = sum(t.ByteSize() for t in model.graph.initializer) > EXTERNAL_THRESHOLD
        onnx.save(model, str(staging / output.name), save_as_external_data=large, all_tensors_to_one_file=True,
                  location=output.name + ".data")
        for item in staging.iterdir():
            os.replace(item, output.parent / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output
