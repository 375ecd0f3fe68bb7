"""``meshplan verify --generate``: the same prompts through the plan (every program in
this process) and through onnxruntime on the original model, in one loop.

Both runs are fed the same tokens at every step: the reference's greedy choices. At each
step the plan's logits must be within the dtype's tolerance of the reference's, and the
token the plan would choose (its own argmax) must be the reference's: so the greedy ids
are identical for as long as both are compared, and a difference is found at the step it
first appears.
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


@dataclass
class GenerationComparison:
    steps: list[StepComparison] = field(default_factory=list)
    reference_ids: list[list[int]] = field(default_factory=list)
    plan_ids: list[list[int]] = field(default_factory=list)
    rtol: float = 0.0
    atol: float = 0.0

    @property
    def ok(self) -> bool:
        return all(s.ok and s.same_ids for s in self.steps)

    @property
    def worst(self) -> float:
        return max((s.max_abs for s in self.steps), default=0.0)

    @property
    def first_difference(self) -> int | None:
        return next((s.step for s in self.steps if not s.same_ids), None)


class _Pair:
    """Two steppers fed alike: the reference's logits go on to the loop; the plan's are kept."""

    def __init__(self, reference, candidate):
        self.reference, self.candidate = reference, candidate
        self.windows: list[np.ndarray] = []

    def reset(self) -> None:
        self.reference.reset()
        self.candidate.reset()
        self.windows = []

    def step(self, feeds, last):
        got = self.candidate.step(dict(feeds), last)
        self.windows.append(got)
        return self.reference.step(dict(feeds), last)


def compare_generation(shape: GenerationShape, reference, candidate, prompts: list[list[int]], max_new_tokens: int,
                       pad_id: int = 0, rtol: float | None = None, atol: float | None = None) -> GenerationComparison:
    """Greedy generation of ``prompts`` with both steppers in lockstep (see the module)."""
    from meshplan.runtime.inprocess import allclose, tolerance_for

    pair = _Pair(reference, candidate)
    record: list[StepRecord] = []
    generation = Generation(shape, pair, pad_id)
    sequences, _ = generation.run(prompts, max_new_tokens, Sampler(), (), record=record)
    result = GenerationComparison(reference_ids=[s.ids for s in sequences], plan_ids=[[] for _ in sequences])
    # prefill pieces before the last return windows nobody reads: line the records up with the last calls
    windows = pair.windows[len(pair.windows) - len(record):]
    for index, (step, window) in enumerate(zip(record, windows)):
        rows = len(step.chosen)
        got = np.asarray(window)[np.arange(rows), step.positions]
        r, a = tolerance_for(step.logits.dtype, rtol, atol)
        result.rtol, result.atol = r, a
        diff = float(np.abs(got.astype(np.float64) - step.logits.astype(np.float64)).max()) if got.size else 0.0
        mine = got.argmax(axis=-1)
        for row in range(rows):
            result.plan_ids[row].append(int(mine[row]))
        result.steps.append(StepComparison(index, diff, allclose(got, step.logits, r, a),
                                           bool(np.array_equal(mine, step.chosen))))
    return result


def reference_stepper(plan, shape: GenerationShape, model_path: str | Path | None = None):
    """onnxruntime on the original model (checked against the plan's hash), its cache carried
    by hand."""
    from meshplan.generation.loop import SessionStepper
    from meshplan.runtime.inprocess import checked_model_path
    from meshplan.runtime.sessions import StageSession, providers_for

    session = StageSession(checked_model_path(plan, model_path), providers_for("cpu"), optimization="basic")
    return SessionStepper(shape, session.run)


def plan_stepper(plan, plan_dir: str | Path, shape: GenerationShape):
    """Every program of the plan in this process."""
    from meshplan.generation.loop import SessionStepper
    from meshplan.runtime.inprocess import InProcessPlan

    return SessionStepper(shape, InProcessPlan(plan, Path(plan_dir)).run)
