"""Training equal to torch's, step for step: the checked-in references (sample_models/training,
written by torch's autograd and torch.optim from the same exports) against the training step
meshplan builds, run on onnxruntime. Each step's loss within 1e-3 relative of torch's; the
final weights as docs/numerics.md's rule says."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.testing.train_reference import run_step_model
from meshplan.training.master_weights import as_held
from meshplan.training.step_model import TrainSpec, build_step_model
from sample_models.training import CASES, load_case
from tests.training_cases import assert_final_like_torch, batches, hyper


# (gpt_fp16_dynamic's scale changes with the steps' overflows: a job's driver keeps it,
# test_master_weights.py runs it so)
STATIC = [name for name in CASES if load_case(name)["settings"].get("loss_scale") != "dynamic"]


@pytest.mark.parametrize("name,microbatches", [(name, 1) for name in STATIC]
                         + [("gpt_adamw", 4), ("mlp_sgd", 2), ("gpt_fp16_master", 2)])
def test_training_equals_torch(name, microbatches):
    """A step of several microbatches accumulates their gradients: the same step (the
    GPT's targets hold ignored positions, so each microbatch's mean counts differently)."""
    case = load_case(name)
    settings = case["settings"]
    masters = settings.get("master_weights") == "float32"   # (float16 weights, float32 masters, a loss scale)
    step = build_step_model(case["model_path"], TrainSpec(settings["loss"], settings["optimizer"],
                                                          microbatches=microbatches, master_weights=masters))
    assert set(step.manifest["weights"]) | set(step.manifest["tied"]) == set(settings["trainable"])
    initial = dict(as_held(step.manifest["weights"], case["initial"].items()))
    losses, state = run_step_model(step, initial, batches(case), hyper(settings), list(case["lrs"]))
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-3)
    assert_final_like_torch(case, step.manifest["tied"], state)
