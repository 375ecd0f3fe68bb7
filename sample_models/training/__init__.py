"""Torch reference runs for training: ONNX exports, data, torch's losses and weights (README.md here).

``load_case(name)`` reads one case with numpy, onnx and json only (never torch); the files
were written by ``python -m sample_models.training.make_references``, which needs torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TRAINING_DIR = Path(__file__).resolve().parent
CASES = ("mlp_sgd", "mlp_sgd_dynamo", "gpt_adamw", "cnn_sgd", "gpt2_tied", "gpt_fp16_master",
         "gpt_fp16_dynamic")


def load_case(name: str, folder: str | Path = TRAINING_DIR) -> dict:
    """One reference case as a dict.

    - ``model_path``: the ONNX forward model (``Path``);
    - ``data``: the training arrays by name (the model's inputs and ``target``);
    - ``settings``: the case's JSON (loss spec, optimizer, schedule, steps, batch, ...);
    - ``losses``: float64, torch's loss of each step before its update;
    - ``lrs``: float64, the learning rate each step used;
    - ``initial``, ``final``, ``grads``: by ONNX initializer name, the trainable
      initializers' values before training, after the last step, and the first step's
      gradient (before clipping), each in the initializer's layout;
    - any other array the reference holds, by its name: ``gpt_fp16_dynamic``'s ``scales``
      (float64, the loss scale each step used) and ``skipped`` (bool, the steps whose scaled
      gradients overflowed and took no update; its ``grads`` are the first applied step's).
    """
    if name not in CASES:
        raise KeyError(f"no training reference {name!r}; the cases are {', '.join(CASES)}")
    folder = Path(folder)
    with np.load(folder / f"{name}.data.npz") as data:
        arrays = {key: data[key] for key in data.files}
    with np.load(folder / f"{name}.reference.npz") as reference:
        case = {"model_path": folder / f"{name}.onnx", "data": arrays,
                "settings": json.loads((folder / f"{name}.json").read_text()),
                "losses": reference["losses"], "lrs": reference["lrs"],
                "initial": {}, "final": {}, "grads": {}}
        for key in reference.files:
            kind, _, initializer = key.partition("/")
            if initializer:
                case[kind][initializer] = reference[key]
            elif key not in case:  # a case's own arrays (gpt_fp16_dynamic's scales, skipped)
                case[key] = reference[key]
    return case


__all__ = ["CASES", "TRAINING_DIR", "load_case"]
