"""A pipelined training step run in one process: each stage's instruction list carried out by
the job's interpreter (``Interpreter.step``) on the stage's ``StageRunner``, each stage (each
of its data-parallel replicas, where it has several) in a thread of its own, the crossings
between them on queues and the replicas' sums at barriers (``pipeline_links.LocalLinks``).

The check that a pipeline computes what one device computes, and the measure of what each
stage keeps in flight: ``PipelineRunner.step`` returns the step's loss and gradient norm;
``peak_kept`` holds, per stage, the most bytes of tensors it held between runs (the
activations its forward made or received and its backward has not read yet, the gradients
received and not used: what 1F1B bounds and GPipe does not), ``peak_in_flight`` the most
microbatches they belonged to.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import onnx

from meshplan.emit.schedule import Schedule
from meshplan.emit.train_schedule import ONE_F_ONE_B, play, training_schedule
from meshplan.runtime.interpreter import CallRecord, Interpreter
from meshplan.runtime.pipeline_links import LocalLinks, StageStopped
from meshplan.runtime.pipeline_stage import (ShardedPart, StageRunner, device_piece, part_session, stage_sessions,
                                             starting_state, whole_of)
from meshplan.stage_ranks import StageRanks
from meshplan.training.pipeline_step import NORM, UPDATE_PHASE, PipelineStep
from meshplan.training.sharded_update import relaxed


class PipelineRunner:
    """``pipeline`` run with ``microbatches`` microbatches a step, scheduled ``kind``, from
    ``weights`` (each trained weight and training statistic by name; slots, accumulated
    gradients and accumulators start at zero); ``device``: where each stage keeps its tensors
    (``StageRunner``); ``replicas``: each stage's data-parallel replicas, each taking its
    share of every microbatch (as a job's ranks do; in row blocks where ``pipeline.sharded``)."""

    def __init__(self, pipeline: PipelineStep, microbatches: int, weights: dict[str, np.ndarray],
                 kind: str = ONE_F_ONE_B, device: tuple[str, int] | None = None, replicas=1):
        self.pipeline, self.microbatches, self.kind = pipeline, microbatches, kind
        # stage s: R_s replicas of T_s devices that shard its operators, after the stages before it
        self.ranks = StageRanks.of(replicas, pipeline.stages, pipeline.tensors or pipeline.tensor)
        self.lists = training_schedule(pipeline, microbatches, kind, list(self.ranks.replicas))
        play(self.lists)    # (lists that would wait on each other are refused here, not hung on)
        self.records = [CallRecord() for _ in range(self.ranks.size)]   # each rank's last step
        slots = pipeline.step.manifest["slots"]
        self.runners = []
        for rank in range(self.ranks.size):
            stage, replica, j = self.ranks.where(rank)
            R, T = self.ranks.replicas[stage], self.ranks.devices(stage)
            names = [n for n, s in pipeline.home.items() if s == stage]
            state = starting_state(names, weights, slots)
            state = {n: np.array(v) if n in weights else v for n, v in state.items()}   # (the stage's own copies)
            if T > 1:
                parts = {phase: part for (s, phase), part in pipeline.device_parts[j].items() if s == stage}
                sessions = stage_sessions(parts, None, self._sharded)
                state = {n: device_piece(v, pipeline.specs_of(stage).get(n), T, j) for n, v in state.items()}
            else:
                parts = {phase: part for (s, phase), part in pipeline.parts.items() if s == stage}
                sessions = stage_sessions(parts, pipeline.chunks.get(stage), part_session, self._loose)
            self.runners.append(StageRunner(stage, parts, sessions, pipeline.crossings, microbatches, state,
                                            pipeline.loss_count, device if T == 1 else None,
                                            replica=(replica, R), sharded=pipeline.sharded,
                                            sum_gradients=self._sums(stage)))

    def _sums(self, stage: int) -> bool:
        """Whether ``stage`` sends its gradients back as sums (``meshplan.stage_ranks``)."""
        return not self.ranks.uniform and stage == self.ranks.stages - 1

    @staticmethod
    def _sharded(model):
        if not isinstance(model, str):
            raise TypeError("a stage that shards its operators runs its parts from a plan's files")
        return ShardedPart(model)

    def _loose(self, part):
        """A part as its session loads it: a norm or update given in memory made to take row
        blocks where the replicas update in them (a plan's files already are)."""
        if max(self.ranks.replicas) > 1 and self.pipeline.sharded and part.phase in (NORM, UPDATE_PHASE) \
                and isinstance(part.model, onnx.ModelProto):
            return relaxed(part.model, self.pipeline.sharded)
        return part.model

    @property
    def stages(self) -> list[StageRunner]:
        """Each stage's first rank."""
        return [self.runners[self.ranks.first(s)] for s in range(self.ranks.stages)]

    @property
    def peak_kept(self) -> list[int]:
        return [s.peak_kept for s in self.stages]

    @property
    def peak_in_flight(self) -> list[int]:
        return [s.peak_in_flight for s in self.stages]

    def step(self, batch: dict[str, np.ndarray], controls: dict[str, float]) -> dict[str, float]:
        """One step on ``batch`` (each data input's samples on axis 0, split into the
        microbatches, each of those into the replicas' shares); ``controls``: each
        hyperparameter's value (``train.apply`` is set here)."""
        B = self.microbatches
        size = len(next(iter(batch.values()))) // B
        for rank, runner in enumerate(self.runners):
            stage, r, j = self.ranks.where(rank)
            share, T, specs = size // self.ranks.replicas[stage], self.ranks.devices(stage), self.pipeline.specs_of(stage)
            runner.begin_step([{n: device_piece(v[m * size + r * share:m * size + (r + 1) * share], specs.get(n), T, j)
                                for n, v in batch.items()} for m in range(B)], controls)
        links = LocalLinks(self.ranks, self.pipeline.crossings, self.pipeline.rows, self.pipeline.relayouts)
        schedule = Schedule(self.kind, B, [self.lists[self.ranks.where(rank)[0]] for rank in range(self.ranks.size)])
        failures: list[BaseException] = []
        origin = time.perf_counter()

        def carry_out(rank: int) -> None:
            try:
                self.records[rank].start()
                Interpreter(None, rank, schedule, links.of(*self.ranks.where(rank)), self.runners[rank],
                            record=self.records[rank]).step(origin)
            except BaseException as exc:   # (the others stop waiting for this stage)
                failures.append(exc)
                links.stop()

        threads = [threading.Thread(target=carry_out, args=(rank,), name=f"stage {self.ranks.where(rank)[0]} "
                                                                           f"rank {rank}")
                   for rank in range(self.ranks.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise next((f for f in failures if not isinstance(f, StageStopped)), failures[0])
        if links.unreceived():
            raise RuntimeError(f"a step left sends unreceived: {links.unreceived()[:3]}")
        results: dict[str, float] = {}
        for runner in self.runners:     # (a stage's replicas end with the same loss and norm)
            results.update(runner.end_step())
        return results

    def state_values(self) -> dict[str, np.ndarray]:
        """Every stage's state by name, whole: the weights, the optimizer's slots (put
        together from the replicas' row blocks), ..."""
        found = {}
        for stage in range(self.ranks.stages):
            first, T = self.ranks.first(stage), self.ranks.devices(stage)
            if T > 1:   # the devices of the first replica, their pieces put together
                held = [runner.host_state() for runner in self.runners[first:first + T]]
                for name in held[0]:
                    found[name] = whole_of([h[name] for h in held], self.pipeline.specs_of(stage).get(name))
                continue
            replicas = self.runners[first:first + self.ranks.replicas[stage]]
            held = [runner.host_state() for runner in replicas]
            for name, value in held[0].items():
                found[name] = np.concatenate([h[name] for h in held]) if name in replicas[0].in_blocks else value
        return found
