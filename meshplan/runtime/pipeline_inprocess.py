"""A pipelined training step run in one process: each stage's instruction list carried out by
the job's interpreter (``Interpreter.step``) on the stage's ``StageRunner``, each stage in a
thread of its own, the crossings between them on queues (``pipeline_links.LocalLinks``).

The check that a pipeline computes what one device computes, and the measure of what each
stage keeps in flight: ``PipelineRunner.step`` returns the step's loss and gradient norm;
``peak_kept`` holds, per stage, the most bytes of tensors it held between runs (the
activations its forward made or received and its backward has not read yet, the gradients
received and not used: what 1F1B bounds and GPipe does not), ``peak_in_flight`` the most
microbatches they belonged to.
"""

from __future__ import annotations

import numpy as np

import threading
import time

from meshplan.emit.schedule import Schedule
from meshplan.emit.train_schedule import ONE_F_ONE_B, play, training_schedule
from meshplan.runtime.interpreter import CallRecord, Interpreter
from meshplan.runtime.pipeline_links import LocalLinks, StageStopped
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
        play(self.lists)    # (lists that would wait on each other are refused here, not hung on)
        self.records = [CallRecord() for _ in range(pipeline.stages)]   # each stage's last step
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
        links = LocalLinks()
        schedule = Schedule(self.kind, B, self.lists)
        failures: list[BaseException] = []
        origin = time.perf_counter()

        def carry_out(stage: int) -> None:
            try:
                self.records[stage].start()
                Interpreter(None, stage, schedule, links, self.stages[stage], record=self.records[stage]).step(origin)
            except BaseException as exc:   # (the others stop waiting for this stage)
                failures.append(exc)
                links.failed.set()

        threads = [threading.Thread(target=carry_out, args=(s,), name=f"stage {s}") for s in range(len(self.stages))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise next((f for f in failures if not isinstance(f, StageStopped)), failures[0])
        if links.unreceived():
            raise RuntimeError(f"a step left sends unreceived: {links.unreceived()[:3]}")
        results: dict[str, float] = {}
        for runner in self.stages:
            results.update(runner.end_step())
        return results

    def state_values(self) -> dict[str, np.ndarray]:
        """Every stage's state by name: the weights, the optimizer's slots, ..."""
        return {name: value for runner in self.stages for name, value in runner.host_state().items()}
