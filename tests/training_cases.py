"""The checked-in torch references (sample_models/training) as tests read them: a case's
hyperparameters and batches, and the rule its final weights are held to (docs/numerics.md)."""

from __future__ import annotations

import numpy as np


def hyper(settings: dict) -> dict:
    betas = settings.get("betas") or (0.9, 0.999)
    return {"train.momentum": settings.get("momentum") or 0.0, "train.weight_decay": settings.get("weight_decay") or 0.0,
            "train.clip_norm": settings.get("clip_norm") or 0.0, "train.beta1": betas[0], "train.beta2": betas[1],
            "train.eps": settings.get("eps") or 1e-8, "train.loss_scale": _static_scale(settings)}


def _static_scale(settings: dict) -> float:
    """A case's loss scale (a dynamic one's starting value)."""
    given = settings.get("loss_scale") or 1.0
    return float(settings["init_scale"]) if given == "dynamic" else float(given)


def batches(case: dict) -> list[dict]:
    """Step k's batch, as the reference took it."""
    settings = case["settings"]
    count, batch = len(next(iter(case["data"].values()))), settings["batch"]
    found = []
    for k in range(settings["steps"]):
        index = (k * batch + np.arange(batch)) % count
        found.append({n: a[index] for n, a in case["data"].items()})
    return found


def train_in_process(case: dict, runner) -> list[float]:
    """Each of the case's steps on ``runner`` (a ``PipelineRunner``) at the reference's
    learning rates: the losses."""
    from meshplan.training.optimizers import DEFAULTS

    losses = []
    for k, batch in enumerate(batches(case)):
        controls = {**DEFAULTS, **hyper(case["settings"]), "train.lr": case["lrs"][k], "train.step": k + 1}
        losses.append(runner.step(batch, controls)["train.loss"])
    return losses


def assert_final_like_torch(case: dict, tied: dict, state: dict) -> None:
    """The state after the case's steps against torch's final weights: every element within
    1e-4 of the tensor's scale (SGD); AdamW moves an element whose gradient is at rounding
    level by up to lr a step, whichever sign the rounding gave it: there each element within
    that, the median within 1e-5 of the scale, and a tensor with no gradient at all (a key
    bias: softmax ignores it) only the bound. ``tied``: the step's tied copies. A model that
    computes in float16 (its weights float32 masters) rounds each step's gradients at float16's
    ε: the median within ε/4 of the scale, and a gradient within ε of the loudest is
    rounding alone."""
    settings = case["settings"]
    adam = settings["optimizer"] == "adamw"
    lr = max(case["lrs"])
    loudest = max(float(np.abs(g).max()) for g in case["grads"].values())
    narrow = settings.get("dtype", "float32") == "float16"
    median, rounding = (float(np.finfo(np.float16).eps) / 4, float(np.finfo(np.float16).eps)) if narrow \
        else (1e-5, 1e-6)
    for initializer, expected in case["final"].items():
        tie = tied.get(initializer)
        actual = state[initializer] if tie is None else \
            (state[tie["of"]].T if tie["transposed"] else state[tie["of"]])
        scale = float(np.abs(expected).max()) or 1.0
        off = np.abs(actual - expected)
        assert float(off.max()) <= 1e-4 * scale + (lr * settings["steps"] if adam else 0.0), initializer
        silent = float(np.abs(case["grads"][initializer]).max()) <= rounding * loudest
        assert silent or float(np.median(off)) <= median * scale, initializer


def trained_under_mpiexec(ranks: int, plan_dir, case: dict, options: list, folder):
    """``mpiexec -n ranks meshplan train`` for the case's steps with a checkpoint (``folder /
    "ck"``) and a log: each step's loss within 1e-3 of torch's. Returns the logged losses and
    the checkpoint."""
    import json

    from conftest import run_mpi
    from meshplan.trainer.checkpoint import Checkpoint

    done = run_mpi(ranks, "train", plan_dir, "--steps", case["settings"]["steps"], "--checkpoint", folder / "ck",
                   "--log", folder / "log.json", *options)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = json.loads((folder / "log.json").read_text())["losses"]
    np.testing.assert_allclose(losses, case["losses"], rtol=1e-3)
    return losses, Checkpoint(folder / "ck")


def assert_resumes(ranks: int, plan_dir, other_dir, options: list, losses: list, folder) -> None:
    """``mpiexec -n ranks meshplan train`` for half of ``losses``' steps with a checkpoint,
    then the other half resumed from it on ``plan_dir`` (each loss within 1e-6 of one job's
    ``losses``) and on ``other_dir`` (a plan of the same model that holds its state another
    way: within 1e-5)."""
    import json

    from conftest import run_mpi

    half = len(losses) // 2
    first = run_mpi(ranks, "train", plan_dir, "--steps", half, "--checkpoint", folder / "half", "-q", *options)
    assert first.returncode == 0, first.stderr
    for where, log, rtol in ((plan_dir, "resumed.json", 1e-6), (other_dir, "elsewhere.json", 1e-5)):
        done = run_mpi(ranks, "train", where, "--steps", len(losses) - half, "--resume", folder / "half",
                       "--log", folder / log, "-q", *options)
        assert done.returncode == 0, done.stderr
        np.testing.assert_allclose(json.loads((folder / log).read_text())["losses"], losses[half:], rtol=rtol)
