"""A pipelined training step run in one process: every stage's ``StageRunner`` on
onnxruntime, carried out in the order the stages' instruction lists give
(``emit.train_schedule.play``).

The check that a pipeline computes what one device computes, and the measure of what each
stage keeps in flight: ``PipelineRunner.step`` returns the step's loss and gradient norm;
``peak_kept`` holds, per stage, the most bytes of tensors it held between runs (the
activations its forward made or received and its backward has not read yet, the gradients
received and not used: what 1F1B bounds and GPipe does not), ``peak_in_flight`` the most
microbatches they belonged to.
"""

from __future__ import annotations

import numpy as np

from meshplan.emit.train_schedule import ONE_F_ONE_B, play, training_schedule
from meshplan.runtime.pipeline_stage import StageRunner, part_session, starting_state
from meshplan.training.pipeline_step import PipelineStep


class PipelineRunner:
    """``pipeline`` run with ``microbatches`` microbatches a step, scheduled ``kind``, from
    ``weights`` (each trained weight and training statistic by name; slots, accumulated
    gradients and accumulators start at zero); ``device``: where each stage keeps its tensors
    (``StageRunner``)."""

    def __init__(self, pipeline: PipelineStep, microbatches: int, weights: dict[str, np.ndarray],
                 kind: str = ONE_F_ONE_B, device: tuple[str, int] | None = None):
        self.pipeline, self.microbatches, self.kind = pipeline, microbatches, kind
        self.lists = training_schedule(pipeline, microbatches, kind)
        self.order = play(self.lists)
        slots = pipeline.step.manifest["slots"]
        self.stages = []
        for stage in range(pipeline.stages):
            parts = {phase: part for (s, phase), part in pipeline.parts.items() if s == stage}
            names = [n for n, s in pipeline.home.items() if s == stage]
            self.stages.append(StageRunner(stage, parts, {p: part_session(part.model) for p, part in parts.items()},
                                           pipeline.crossings, microbatches, starting_state(names, weights, slots),
                                           device=device))

    @property
    def peak_kept(self) -> list[int]:
        return [s.peak_kept for s in self.stages]

    @property
    def peak_in_flight(self) -> list[int]:
        return [s.peak_in_flight for s in self.stages]

    def step(self, batch: dict[str, np.ndarray], controls: dict[str, float]) -> dict[str, float]:
        """One step on ``batch`` (each data input's samples on axis 0, split into the
        microbatches); ``controls``: each hyperparameter's value (``train.apply`` is set here)."""
        B = self.microbatches
        size = len(next(iter(batch.values()))) // B
        slices = [{n: v[m * size:(m + 1) * size] for n, v in batch.items()} for m in range(B)]
        for runner in self.stages:
            runner.begin_step(slices, controls)
        wire: dict[tuple[int, int], np.ndarray] = {}
        for stage, ins in self.order:
            runner = self.stages[stage]
            if ins.op == "send":
                wire[(ins.crossing, ins.mb)] = runner.take(ins.crossing, ins.mb)
            elif ins.op == "receive":
                runner.give(ins.crossing, ins.mb, wire.pop((ins.crossing, ins.mb)))
            else:
                runner.run(ins.part, ins.mb)
        if wire:
            raise RuntimeError(f"a step left sends unreceived: {list(wire)[:3]}")
        results: dict[str, float] = {}
        for runner in self.stages:
            results.update(runner.end_step())
        return results

    def state_values(self) -> dict[str, np.ndarray]:
        """Every stage's state by name: the weights, the optimizer's slots, ..."""
        return {name: value for runner in self.stages for name, value in runner.host_state().items()}
