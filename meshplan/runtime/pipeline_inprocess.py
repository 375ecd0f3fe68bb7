"""A pipelined training step run in one process: every stage's parts on onnxruntime,
carried out in the order the stages' instruction lists give (``emit.train_schedule.play``).

The check that a pipeline computes what one device computes, and the measure of what each
stage keeps in flight: ``PipelineRunner.step`` returns the step's loss and gradient norm,
and ``peak_kept`` holds, per stage, the most bytes of tensors it held between runs (the
activations its forward made or received and its backward has not read yet, the gradients
received and not used: what 1F1B bounds and GPipe does not), ``peak_in_flight`` the most
microbatches they belonged to.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnxruntime as ort

from meshplan.emit.train_schedule import ONE_F_ONE_B, per_microbatch, play, training_schedule
from meshplan.training.losses import LOSS
from meshplan.training.optimizers import ACC_COUNT, ACC_TOTAL, APPLY, GRAD_NORM, UPDATED
from meshplan.training.pipeline_step import PER_MICROBATCH, STATE, PipelineStep

RESULTS = (LOSS, GRAD_NORM)


class PipelineRunner:
    """``pipeline`` run with ``microbatches`` microbatches a step, scheduled ``kind``, from
    ``weights`` (each trained weight and training statistic by name; slots, accumulated
    gradients and accumulators start at zero)."""

    def __init__(self, pipeline: PipelineStep, microbatches: int, weights: dict[str, np.ndarray],
                 kind: str = ONE_F_ONE_B):
        self.pipeline, self.microbatches, self.kind = pipeline, microbatches, kind
        self.lists = training_schedule(pipeline, microbatches, kind)
        self.order = play(self.lists)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.sessions = {key: ort.InferenceSession(part.model.SerializeToString(), options,
                                                   providers=["CPUExecutionProvider"])
                         for key, part in pipeline.parts.items()}
        manifest = pipeline.step.manifest
        self.state: list[dict[str, np.ndarray]] = [{} for _ in range(pipeline.stages)]
        for name, stage in pipeline.home.items():
            if name in weights:
                value = weights[name]
            elif name in (ACC_TOTAL, ACC_COUNT):
                value = np.zeros((), np.float32)
            else:
                weight, _, kind_ = name.rpartition(".")
                if weight not in weights or kind_ not in manifest["slots"]:
                    raise KeyError(f"no starting value for state '{name}'")
                value = np.zeros_like(weights[weight])
            self.state[stage][name] = value
        # what each stage reads, by phase: when a tensor it holds may go
        self.local_readers: list[dict[str, set[str]]] = [defaultdict(set) for _ in range(pipeline.stages)]
        for (stage, phase), part in pipeline.parts.items():
            for name in part.inputs:
                self.local_readers[stage][name].add(phase)
        self.sends_of: dict[tuple[int, str], list[int]] = defaultdict(list)
        for index, c in enumerate(pipeline.crossings):
            if c.made_in != STATE:
                self.sends_of[(c.src, c.tensor)].append(index)
        self.peak_kept = [0] * pipeline.stages
        self.peak_in_flight = [0] * pipeline.stages   # microbatches with tensors held, at most

    def step(self, batch: dict[str, np.ndarray], controls: dict[str, float]) -> dict[str, float]:
        """One step on ``batch`` (each data input's samples on axis 0, split into the
        microbatches); ``controls``: each hyperparameter's value (``train.apply`` is set here)."""
        B, last_mb = self.microbatches, self.microbatches - 1
        size = len(next(iter(batch.values()))) // B
        slices = [{n: v[m * size:(m + 1) * size] for n, v in batch.items()} for m in range(B)]
        held: list[dict[tuple[str, int], np.ndarray]] = [{} for _ in range(self.pipeline.stages)]
        borrowed: list[dict[str, np.ndarray]] = [{} for _ in range(self.pipeline.stages)]
        ran: list[set[tuple[str, int]]] = [set() for _ in range(self.pipeline.stages)]
        wire: dict[tuple[int, int], np.ndarray] = {}
        sent: set[tuple[int, int]] = set()
        results: dict[str, float] = {}
        crossings = self.pipeline.crossings
        for stage, ins in self.order:
            if ins.op == "send":
                c = crossings[ins.crossing]
                if c.made_in == STATE:
                    wire[(ins.crossing, ins.mb)] = self.state[stage][c.tensor]
                else:
                    wire[(ins.crossing, ins.mb)] = held[stage][(c.tensor, ins.mb)]
                    sent.add((ins.crossing, ins.mb))
                    self._release(stage, held, ran, sent, c.tensor, ins.mb)
                continue
            if ins.op == "receive":
                c = crossings[ins.crossing]
                value = wire.pop((ins.crossing, ins.mb))
                if c.made_in == STATE:
                    borrowed[stage][c.tensor] = value
                else:
                    held[stage][(c.tensor, ins.mb)] = value
                continue
            phase, mb = ins.part, ins.mb
            part = self.pipeline.parts[(stage, phase)]
            feeds = {}
            for name in part.inputs:
                if name in self.state[stage]:
                    feeds[name] = self.state[stage][name]
                elif name in borrowed[stage]:
                    feeds[name] = borrowed[stage][name]
                elif name in slices[mb]:
                    feeds[name] = slices[mb][name]
                elif name == APPLY:
                    feeds[name] = np.asarray(float(mb == last_mb or phase not in PER_MICROBATCH), np.float32)
                elif name in controls:
                    feeds[name] = np.asarray(controls[name], np.float32)
                else:
                    feeds[name] = held[stage][(name, mb)]
            values = self.sessions[(stage, phase)].run(part.outputs, feeds)
            ran[stage].add((phase, mb))
            for name, value in zip(part.outputs, values):
                if name in RESULTS:
                    results[name] = float(value)
                elif name.endswith(UPDATED) and name[:-len(UPDATED)] in self.state[stage]:
                    self.state[stage][name[:-len(UPDATED)]] = value
                else:
                    held[stage][(name, mb)] = value
            for name in part.inputs:
                if (name, mb) in held[stage]:
                    self._release(stage, held, ran, sent, name, mb)
            for name in part.outputs:
                if (name, mb) in held[stage]:
                    self._release(stage, held, ran, sent, name, mb)
            kept = sum(v.nbytes for v in held[stage].values())
            self.peak_kept[stage] = max(self.peak_kept[stage], kept)
            flight = len({m for (_, m) in held[stage]})
            self.peak_in_flight[stage] = max(self.peak_in_flight[stage], flight)
        left = [(s, k) for s in range(self.pipeline.stages) for k in held[s]]
        if left or wire:
            raise RuntimeError(f"a step left tensors behind: {left[:3] or list(wire)[:3]}")
        return results

    def state_values(self) -> dict[str, np.ndarray]:
        """Every stage's state by name: the weights, the optimizer's slots, ..."""
        return {name: value for held in self.state for name, value in held.items()}

    def _release(self, stage: int, held: list, ran: list, sent: set, name: str, mb: int) -> None:
        """Drop ``name`` of microbatch ``mb`` from ``stage`` once no run left reads it there and
        no send of it is still to come."""
        if self._sends_pending(stage, name, mb, sent):
            return
        last_mb = self.microbatches - 1
        for phase in self.local_readers[stage].get(name, ()):
            if phase in PER_MICROBATCH:
                if (phase, mb) not in ran[stage]:
                    return
            elif mb == last_mb and (phase, last_mb) not in ran[stage]:
                return
        held[stage].pop((name, mb), None)

    def _sends_pending(self, stage: int, name: str, mb: int, sent: set) -> bool:
        for index in self.sends_of.get((stage, name), ()):
            c = self.pipeline.crossings[index]
            if (per_microbatch(c) or mb == self.microbatches - 1) and (index, mb) not in sent:
                return True
        return False
