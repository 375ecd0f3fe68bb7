"""``meshplan verify --generate``: the same prompts through the plan (every program in
this process) and through onnxruntime on the original model, in one loop.

Both runs are fed the same tokens at every step: the reference's greedy choices. At each
step the plan's logits must be within the dtype's tolerance of the reference's, and the
token the plan would choose (its own argmax) must be the reference's: so the greedy ids
are identical for as long as both are compared, and a difference is found at the step it
first appears.

Where the model quantizes its activations (``runtime.quantization_bound``), a third run
fed the same tokens, the model with float activations, gives each step's quantization
bound: the logits may differ by it too, and the plan may choose another id only where
onnxruntime's logit for that id is within twice the tolerance of its own choice's (a tie
within what the quantization leaves undecided).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.generation.loop import Generation, GenerationShape, StepRecord
from meshplan.generation.sampling import Sampler


@dataclass
class StepComparison:
    step: int
    max_abs: float
    ok: bool
    same_ids: bool
    bound: float = 0.0    # the step's quantization bound (0: the model quantizes no activations)
    tied: bool = False    # ids differ, but only where onnxruntime's top logits are within the bound

    @property
    def ids_ok(self) -> bool:
        return self.same_ids or self.tied


@dataclass
class GenerationComparison:
    steps: list[StepComparison] = field(default_factory=list)
    reference_ids: list[list[int]] = field(default_factory=list)
    plan_ids: list[list[int]] = field(default_factory=list)
    rtol: float = 0.0
    atol: float = 0.0

    @property
    def ok(self) -> bool:
        return all(s.ok and s.ids_ok for s in self.steps)

    @property
    def worst(self) -> float:
        return max((s.max_abs for s in self.steps), default=0.0)

    @property
    def first_difference(self) -> int | None:
        return next((s.step for s in self.steps if not s.same_ids), None)


class _Pair:
    """Steppers fed alike: the reference's logits go on to the loop; the plan's (and the
    float-activation run's, where there is one) are kept."""

    def __init__(self, reference, candidate, bound=None):
        self.reference, self.candidate, self.bound = reference, candidate, bound
        self.windows: list[np.ndarray] = []
        self.bound_windows: list[np.ndarray] = []

    def reset(self) -> None:
        for stepper in (self.reference, self.candidate, self.bound):
            if stepper is not None:
                stepper.reset()
        self.windows, self.bound_windows = [], []

    def step(self, feeds, last):
        self.windows.append(self.candidate.step(dict(feeds), last))
        if self.bound is not None:
            self.bound_windows.append(self.bound.step(dict(feeds), last))
        return self.reference.step(dict(feeds), last)


def compare_generation(shape: GenerationShape, reference, candidate, prompts: list[list[int]], max_new_tokens: int,
                       pad_id: int = 0, rtol: float | None = None, atol: float | None = None,
                       bound=None) -> GenerationComparison:
    """Greedy generation of ``prompts`` with the steppers in lockstep (see the module);
    ``bound``: the float-activation stepper (``bound_stepper``), or None."""
    from meshplan.runtime.inprocess import allclose, tolerance_for
    from meshplan.runtime.quantization_bound import BOUND_FACTOR

    pair = _Pair(reference, candidate, bound)
    record: list[StepRecord] = []
    generation = Generation(shape, pair, pad_id)
    sequences, _ = generation.run(prompts, max_new_tokens, Sampler(), (), record=record)
    result = GenerationComparison(reference_ids=[s.ids for s in sequences], plan_ids=[[] for _ in sequences])
    # prefill pieces before the last return windows nobody reads: line the records up with the last calls
    windows = pair.windows[len(pair.windows) - len(record):]
    bound_windows = pair.bound_windows[len(pair.bound_windows) - len(record):] if bound is not None else []
    for index, (step, window) in enumerate(zip(record, windows)):
        rows = len(step.chosen)
        want = step.logits.astype(np.float64)
        got = np.asarray(window)[np.arange(rows), step.positions]
        r, a = tolerance_for(step.logits.dtype, rtol, atol)
        result.rtol, result.atol = r, a
        step_bound = 0.0
        if bound_windows and got.size:
            floats = np.asarray(bound_windows[index])[np.arange(rows), step.positions].astype(np.float64)
            step_bound = BOUND_FACTOR * float(np.abs(floats - want).max())
        diff = float(np.abs(got.astype(np.float64) - want).max()) if got.size else 0.0
        mine = got.argmax(axis=-1)
        for row in range(rows):
            result.plan_ids[row].append(int(mine[row]))
        same = bool(np.array_equal(mine, step.chosen))
        tied = False
        if not same and step_bound:
            rows_ = np.arange(rows)
            gap = want[rows_, np.asarray(step.chosen)] - want[rows_, mine]
            slack = 2 * (a + r * np.abs(want[rows_, np.asarray(step.chosen)]) + step_bound)
            tied = bool(np.all(gap <= slack))
        result.steps.append(StepComparison(index, diff, allclose(got, step.logits, r, a + step_bound), same,
                                           step_bound, tied))
    return result


def reference_stepper(plan, shape: GenerationShape, model_path: str | Path | None = None, provider: str = "cpu"):
    """onnxruntime on the original model (checked against the plan's hash), its cache carried
    by hand."""
    from meshplan.generation.loop import SessionStepper
    from meshplan.runtime.inprocess import checked_model_path
    from meshplan.runtime.sessions import StageSession, providers_for

    session = StageSession(checked_model_path(plan, model_path), providers_for(provider), optimization="basic")
    return SessionStepper(shape, session.run)


def bound_stepper(plan, shape: GenerationShape, model_path: str | Path | None = None, provider: str = "cpu"):
    """onnxruntime on the original model with float activations (``quantization_bound``), its
    cache carried by hand; None where the model quantizes no activations."""
    from meshplan.generation.loop import SessionStepper
    from meshplan.runtime.inprocess import checked_model_path
    from meshplan.runtime.quantization_bound import QuantizationBound
    from meshplan.runtime.sessions import providers_for

    floats = QuantizationBound(checked_model_path(plan, model_path), providers_for(provider))
    return SessionStepper(shape, floats.run) if floats.active else None


def plan_stepper(plan, plan_dir: str | Path, shape: GenerationShape, provider: str = "cpu"):
    """Every program of the plan in this process."""
    from meshplan.generation.loop import SessionStepper
    from meshplan.runtime.inprocess import InProcessPlan

    return SessionStepper(shape, InProcessPlan(plan, Path(plan_dir), provider).run)
