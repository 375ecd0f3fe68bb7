"""One stage of a pipelined training step: the runs of its parts, what it holds between them.

A ``StageRunner`` carries out its stage's instructions (``emit.train_schedule``): ``run`` a
part (forward or backward for a microbatch, then norm, clip and update) on onnxruntime,
``take`` what a ``send`` sends (a tensor a run made, or a state another stage reads) and
``give`` what a ``receive`` brought. It holds the stage's state (updated by the runs that
make ``NAME.updated``) and, between runs, the tensors a later run or send of this stage
still needs, dropping each when the last one has used it. The in-process runner
(``runtime.pipeline_inprocess``) drives every stage's runner in one process; a pipelined
training job (``trainer.pipeline_driver``) drives one per rank, the sends and receives over
MPI.

With ``device`` (("cuda", id) for a GPU; ("cpu", 0) runs the same path on OrtValues in host
memory) the stage keeps its tensors where its sessions compute: the state and the tensors
held between runs are OrtValues there, each run's outputs stay where onnxruntime made them,
and only what leaves the stage comes to the host — a send, the sum over the replicas, the
loss and the norm, a checkpoint (``host_state``). Without it every tensor is a numpy array.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from meshplan.emit.train_schedule import per_microbatch
from meshplan.errors import TrainError
from meshplan.training.losses import LOSS
from meshplan.training.optimizers import ACC_COUNT, ACC_TOTAL, APPLY, GRAD_NORM, UPDATED
from meshplan.training.pipeline_step import PER_MICROBATCH, STATE, Crossing, Part
from meshplan.training.step_model import BACKWARD

RESULTS = (LOSS, GRAD_NORM)


def starting_state(names, weights: dict[str, np.ndarray], slots) -> dict[str, np.ndarray]:
    """The state ``names`` at the first step: each trained weight and training statistic from
    ``weights``, the optimizer's slots and the accumulated gradients zero like their weight,
    the loss's accumulators zero."""
    state = {}
    for name in names:
        if name in weights:
            state[name] = weights[name]
        elif name in (ACC_TOTAL, ACC_COUNT):
            state[name] = np.zeros((), np.float32)
        else:
            weight, _, kind = name.rpartition(".")
            if weight not in weights or kind not in slots:
                raise TrainError(f"no starting value for the state {name!r}")
            state[name] = np.zeros_like(weights[weight])
    return state


def part_session(model, threads: int = 1, providers: list | None = None):
    """A session of a part (a ModelProto, or its file's path) on ``providers`` (default: the
    CPU), its tensors in the
    process's one CPU arena (``providers.session_options``: a rank has a session a part, and
    an arena each would keep every part's peak at once; without an arena every run's tensors
    are fresh pages from the system: a 4 M-parameter GPT's stage ran its backward in 19.1 ms
    instead of 15.8 and its update in 39.9 instead of 21.3), as a training step's: no memory
    pattern, no constant folding (see ``StageSession``)."""
    import onnxruntime as ort

    from meshplan.providers import session_options

    options = session_options(threads, one_arena=True)
    options.enable_mem_pattern = False
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"],
                                disabled_optimizers=["ConstantFolding"])


def _host(value) -> np.ndarray:
    """A tensor in host memory: a numpy array as it is, an OrtValue copied out."""
    return value if isinstance(value, np.ndarray) else value.numpy()


def _scalar(value) -> float:
    return float(np.asarray(_host(value)).reshape(-1)[0])


def _nbytes(value) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    from meshplan.runtime.buffers import ort_dtype

    return int(np.prod(value.shape(), dtype=np.int64)) * ort_dtype(value).itemsize


class StageRunner:
    """Stage ``stage``'s runs: ``parts`` by phase, each with its onnxruntime session in
    ``sessions``; ``state``: the state the stage holds (by name); ``device``: where it keeps
    its tensors (see the module; None: numpy arrays); ``provider``: the sessions' provider."""

    def __init__(self, stage: int, parts: dict[str, Part], sessions: dict, crossings: list[Crossing],
                 microbatches: int, state: dict[str, np.ndarray], loss_count: str | None = None,
                 device: tuple[str, int] | None = None, provider: str = "CPUExecutionProvider"):
        self.stage, self.parts, self.sessions, self.loss_count = stage, parts, sessions, loss_count
        self.crossings, self.microbatches, self.device = crossings, microbatches, device
        self.provider = provider      # the sessions' (what a report names)
        self.state = {name: self._placed(value) for name, value in state.items()} if device else state
        self.readers: dict[str, set[str]] = defaultdict(set)     # tensor → the phases that read it here
        for phase, part in parts.items():
            for name in part.inputs:
                self.readers[name].add(phase)
        self.sends_of: dict[str, list[int]] = defaultdict(list)  # tensor → the crossings that send it
        for index, c in enumerate(crossings):
            if c.src == stage and c.made_in != STATE:
                self.sends_of[c.tensor].append(index)
        self.peak_kept = 0          # bytes held between runs, at most
        self.peak_in_flight = 0     # microbatches with tensors held, at most
        self.begin_step([], {})

    def begin_step(self, slices: list[dict[str, np.ndarray]], controls: dict[str, float]) -> None:
        """A new step: ``slices``, each microbatch's data inputs; ``controls``, each
        hyperparameter's value (``train.apply`` is set here, per run)."""
        self.slices, self.controls = slices, controls
        self.held: dict[tuple[str, int], np.ndarray] = {}
        self.borrowed: dict[str, np.ndarray] = {}   # another stage's state, for this step
        self.ran: set[tuple[str, int]] = set()
        self.sent: set[tuple[int, int]] = set()
        self.results: dict[str, float] = {}

    def end_step(self) -> dict[str, float]:
        """The step's results this stage made (the loss, the gradients' norm)."""
        if self.held:
            raise TrainError(f"stage {self.stage} ended a step still holding {sorted(self.held)[:3]}")
        return dict(self.results)

    def run(self, phase: str, mb: int) -> None:
        part = self.parts[phase]
        last_mb = self.microbatches - 1
        feeds = {}
        for name in part.inputs:
            if name in self.state:
                feeds[name] = self.state[name]
            elif name in self.borrowed:
                feeds[name] = self.borrowed[name]
            elif self.slices and name in self.slices[mb]:
                feeds[name] = self.slices[mb][name]
            elif name == APPLY:
                feeds[name] = np.asarray(float(mb == last_mb or phase not in PER_MICROBATCH), np.float32)
            elif name in self.controls:
                feeds[name] = np.asarray(self.controls[name], np.float32)
            else:
                feeds[name] = self.held[(name, mb)]
        if self.device is None:
            values = self.sessions[phase].run(part.outputs, feeds)
        else:   # (a numpy feed goes in as it is: onnxruntime copies it where its node runs)
            from onnxruntime import OrtValue

            values = self.sessions[phase].run_with_ort_values(
                part.outputs, {n: v if isinstance(v, OrtValue) else OrtValue.ortvalue_from_numpy(np.asarray(v))
                               for n, v in feeds.items()})
        self.ran.add((phase, mb))
        for name, value in zip(part.outputs, values):
            if name in RESULTS:
                self.results[name] = _scalar(value)
            elif name.endswith(UPDATED) and name[:-len(UPDATED)] in self.state:
                self.state[name[:-len(UPDATED)]] = value
            else:
                self.held[(name, mb)] = value
        for name in list(part.inputs) + list(part.outputs):
            if (name, mb) in self.held:
                self._release(name, mb)
        self.peak_kept = max(self.peak_kept, sum(_nbytes(v) for v in self.held.values()))
        self.peak_in_flight = max(self.peak_in_flight, len({m for _, m in self.held}))

    def reduce(self, allreduce) -> None:
        """Sum over the stage's replicas (``allreduce``: an array → the sum of every replica's)
        what the last microbatch's backward made for the step's own parts — the accumulated
        gradients, the loss's count — each replica having seen its share of every microbatch;
        and the loss, as its replicas' losses weighted by their counts."""
        last = self.microbatches - 1
        made = set(self.parts[BACKWARD].outputs) if BACKWARD in self.parts else set()
        count = self.held.get((self.loss_count, last)) if LOSS in self.results else None
        for name, mb in sorted(self.held):
            if mb == last and name in made and self._once_a_step(name):
                self.held[(name, mb)] = self._placed(allreduce(_host(self.held[(name, mb)])))
        if count is not None:
            total = allreduce(np.asarray(self.results[LOSS] * _scalar(count), np.float64))
            self.results[LOSS] = _scalar(total) / _scalar(self.held[(self.loss_count, last)])

    def _once_a_step(self, name: str) -> bool:
        """Whether a step's own parts read ``name`` (here, or sent once a step)."""
        if any(p not in PER_MICROBATCH for p in self.readers.get(name, ())):
            return True
        return any(not per_microbatch(self.crossings[i]) for i in self.sends_of.get(name, ()))

    def take(self, index: int, mb: int) -> np.ndarray:
        """What crossing ``index`` sends for microbatch ``mb``, in host memory."""
        c = self.crossings[index]
        if c.made_in == STATE:
            return _host(self.state[c.tensor])
        value = self.held[(c.tensor, mb)]
        self.sent.add((index, mb))
        self._release(c.tensor, mb)
        return _host(value)

    def give(self, index: int, mb: int, value: np.ndarray) -> None:
        """What crossing ``index`` brought for microbatch ``mb``."""
        c = self.crossings[index]
        value = self._placed(value)
        if c.made_in == STATE:
            self.borrowed[c.tensor] = value
        else:
            self.held[(c.tensor, mb)] = value

    def host_state(self) -> dict[str, np.ndarray]:
        """The stage's state in host memory (a checkpoint's, the weights trained)."""
        return {name: _host(value) for name, value in self.state.items()}

    def _placed(self, value):
        """``value`` where the stage keeps its tensors: an OrtValue on ``device`` (numpy
        without one)."""
        if self.device is None:
            return value
        from onnxruntime import OrtValue

        if isinstance(value, OrtValue):
            return value
        return OrtValue.ortvalue_from_numpy(np.asarray(value, order="C"), *self.device)   # (0-d stays 0-d)

    def _release(self, name: str, mb: int) -> None:
        """Drop ``name`` of microbatch ``mb`` once no run left reads it here and no send of it
        is still to come."""
        last_mb = self.microbatches - 1
        for index in self.sends_of.get(name, ()):
            if (per_microbatch(self.crossings[index]) or mb == last_mb) and (index, mb) not in self.sent:
                return
        for phase in self.readers.get(name, ()):
            if phase in PER_MICROBATCH:
                if (phase, mb) not in self.ran:
                    return
            elif mb == last_mb and (phase, last_mb) not in self.ran:
                return
        self.held.pop((name, mb), None)
