"""A training plan's step model run whole on onnxruntime, step after step: the oracle that a
partitioned training job (any mesh, in process or under mpiexec) must equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from meshplan.plan_format import read_plan
from meshplan.trainer.data import Batches
from meshplan.trainer.driver import source_weights
from meshplan.training.optimizers import DEFAULTS
from meshplan.trainer.schedule import learning_rate


def run_whole(plan_dir: str | Path, data: str | Path, steps: int, lr: float, hyper: dict | None = None,
              schedule: str = "constant", warmup: int = 0,
              in_process: bool = False) -> tuple[list[float], dict[str, np.ndarray]]:
    """The losses of ``steps`` steps and the state after them (weights and slots by name):
    of the whole step model on onnxruntime, or with ``in_process`` of the plan's
    partitioned programs, every rank in this process (``runtime.inprocess``)."""
    plan_dir = Path(plan_dir)
    plan = read_plan(plan_dir)
    training = plan.training
    if in_process:
        from meshplan.runtime.inprocess import InProcessPlan

        partitioned = InProcessPlan(plan, plan_dir)
        outputs = [spec.name for spec in plan.outputs]

        def run(feeds: dict) -> list[np.ndarray]:
            found = partitioned.run(feeds)
            return [found[name] for name in outputs]
    else:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(plan_dir / "training" / "step.onnx"), options,
                                       providers=["CPUExecutionProvider"])
        outputs = [o.name for o in session.get_outputs()]

        def run(feeds: dict) -> list[np.ndarray]:
            return session.run(outputs, feeds)
    state = {}
    for name, array in source_weights(plan, list(training["weights"]) + list(training.get("statistics", {}))):
        state[name] = array
        if name in training["weights"]:
            for kind in training["slots"]:
                state[f"{name}.{kind}"] = np.zeros_like(array)
    for name in training.get("accumulators", []):
        state[name] = np.zeros((), np.float32)
    values = {**DEFAULTS, **{"train." + k.removeprefix("train."): float(v) for k, v in (hyper or {}).items()}}
    pairs = {entry["output"]: entry["input"] for entry in plan.state}
    batches = Batches(data, plan)
    losses = []
    count = int(training.get("microbatches", 1))
    for k in range(steps):
        batch = batches.next()
        size = len(next(iter(batch.values()))) // count
        for m in range(count):
            feeds = {**{n: v[m * size:(m + 1) * size] for n, v in batch.items()}, **state}
            for name in training["hyperparameters"]:
                value = learning_rate(schedule, lr, k, steps, warmup) if name == "train.lr" else \
                    k + 1 if name == "train.step" else float(m == count - 1) if name == "train.apply" else values[name]
                feeds[name] = np.asarray(value, dtype=np.float32)
            result = dict(zip(outputs, run(feeds)))
            state = {pairs[o]: result[o] for o in pairs}
        losses.append(float(result["train.loss"]))
    return losses, state


def run_step_model(step, weights: dict[str, np.ndarray], batches: list[dict], hyper: dict,
                   lrs: list[float] | None = None) -> tuple[list[float], dict[str, np.ndarray]]:
    """A ``training.step_model.StepModel`` (not planned) run on onnxruntime from ``weights``:
    each batch one step; ``hyper`` by input name (``train.lr`` unless ``lrs`` gives each
    step's); returns the losses and the state after the last step."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(step.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    state = {}
    for name in list(step.manifest["weights"]) + list(step.manifest.get("statistics", {})):
        state[name] = weights[name]
        if name in step.manifest["weights"]:
            for kind in step.manifest["slots"]:
                state[f"{name}.{kind}"] = np.zeros_like(weights[name])
    for name in step.manifest.get("accumulators", []):
        state[name] = np.zeros((), np.float32)
    values = {**DEFAULTS, **hyper}
    outputs = [o.name for o in session.get_outputs()]
    losses = []
    count = int(step.manifest.get("microbatches", 1))
    for k, batch in enumerate(batches):
        size = len(next(iter(batch.values()))) // count
        for m in range(count):
            feeds = {**{n: v[m * size:(m + 1) * size] for n, v in batch.items()}, **state}
            for name in step.manifest["hyperparameters"]:
                value = lrs[k] if name == "train.lr" and lrs is not None else k + 1 if name == "train.step" \
                    else float(m == count - 1) if name == "train.apply" else values[name]
                feeds[name] = np.asarray(value, dtype=np.float32)
            result = dict(zip(outputs, session.run(outputs, feeds)))
            state = {i: result[o] for o, i in step.state.items()}
        losses.append(float(result["train.loss"]))
    return losses, state


def even_stages(step, model_path: str | Path, stages: int) -> dict[str, int]:
    """The stage of each node of the forward model at ``model_path`` (by name, as the step
    ``step`` names it) when its nodes are cut into ``stages`` contiguous runs of (nearly)
    equal length: a pipeline's cut for tests and benchmarks, where no plan chose one."""
    import onnx

    forward = {n.name for n in onnx.load(str(model_path), load_external_data=False).graph.node}
    names = [n.name for n in step.model.graph.node if n.name in forward]
    per = -(-len(names) // stages)
    return {name: i // per for i, name in enumerate(names)}
