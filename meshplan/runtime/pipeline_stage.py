"""One stage of a pipelined training step: the runs of its parts, what it holds between them.

A ``StageRunner`` carries out its stage's instructions (``emit.train_schedule``): ``run`` a
part (forward or backward for a microbatch, then norm, clip and update) on onnxruntime,
``take`` what a ``send`` sends (a tensor a run made, or a state another stage reads) and
``give`` what a ``receive`` brought. It holds the stage's state (updated by the runs that
make ``NAME.updated``) and, between runs, the tensors a later run or send of this stage
still needs, dropping each when the last one has used it. Replica r of R of a stage that
updates in row blocks (``replica`` and ``sharded``: ``meshplan.replica_shards``) keeps only
its blocks of the optimizer's slots, feeds its norm and update their blocks of every
weight's tensors, adds the norm's partial sums up over the replicas and gathers the updated
weights whole again (its ``links``: ``runtime.pipeline_links``). The in-process runner
(``runtime.pipeline_inprocess``) drives every stage's runner in one process; a pipelined
training job (``trainer.pipeline_driver``) drives one per rank, the sends and receives over
MPI.

A run whose outputs are the new values of state the stage holds (an update's new weights
and slots, a backward's accumulated gradients) writes each into the old value's buffer where
nothing reads the old value after (``model.in_place``: its readers run before the writer,
no later chunk of the update reads it, no other stage borrows it): the stage then holds one
copy of its state, not an old and a new one per update chunk. The stage owns that state: it
copies what it is given, but for arrays of their own memory, which the caller hands over.

With ``device`` (("cuda", id) for a GPU; ("cpu", 0) runs the same path on OrtValues in host
memory) the stage keeps its tensors where its sessions compute: the state and the tensors
held between runs are OrtValues there, each run's outputs stay where onnxruntime made them,
and only what leaves the stage comes to the host — a send, the sum over the replicas, the
loss and the norm, a checkpoint (``host_state``). Without it every tensor is a numpy array.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx

from meshplan.emit.train_schedule import per_microbatch
from meshplan.errors import TrainError
from meshplan.model.in_place import needed_by, written_in_place
from meshplan.replica_shards import piece
from meshplan.training.losses import COUNT, LOSS
from meshplan.training.optimizers import ACC_COUNT, ACC_TOTAL, APPLY, GRAD_NORM, UPDATED
from meshplan.training.pipeline_step import (NORM, PER_MICROBATCH, STATE, UPDATE_PHASE, Crossing, Part,
                                            kept_apart)
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


def device_piece(value: np.ndarray, spec: str | None, tensor: int, device: int) -> np.ndarray:
    """Device ``device``'s piece of ``value`` held in layout ``spec`` on the [1, ``tensor``]
    mesh of a stage's devices that shard its operators (the whole of it without a spec)."""
    if spec is None or tensor == 1 or np.ndim(value) == 0:
        return value
    from meshplan.runtime.state_layout import piece_of
    from meshplan.sharding import LogicalMesh, ShardingSpec

    mesh = LogicalMesh((1, tensor), tuple(range(tensor)))
    return np.ascontiguousarray(piece_of(np.asarray(value), ShardingSpec.parse(spec), mesh, device))


def whole_of(pieces: list[np.ndarray], spec: str | None) -> np.ndarray:
    """A tensor put together from each device's piece (``device_piece``'s inverse)."""
    if spec is None or len(pieces) == 1 or np.ndim(pieces[0]) == 0:
        return pieces[0]
    from meshplan.runtime.state_layout import assemble
    from meshplan.sharding import LogicalMesh, ShardingSpec

    mesh = LogicalMesh((1, len(pieces)), tuple(range(len(pieces))))
    return assemble(dict(enumerate(pieces)), ShardingSpec.parse(spec), mesh)


def stage_sessions(parts: dict[str, Part], chunks, make, model_of=None) -> dict:
    """Each part's session (``make(model)``), by phase; the update, where ``chunks`` (its
    outputs in groups: ``training.pipeline_step.update_chunks``) has more than one group, a
    list of (session, inputs, outputs), one a group, each cut from the part with the nodes
    its outputs need (``onnx.utils.Extractor``). ``model_of(part)``: the model a part's
    session runs (default: ``part.model``)."""
    found = {}
    for phase, part in parts.items():
        model = part.model if model_of is None else model_of(part)
        if phase != UPDATE_PHASE or not chunks or len(chunks) < 2:
            found[phase] = make(model)
            continue
        if isinstance(model, str):
            model = onnx.load(model)
        found[phase] = [(make(piece), inputs, group) for piece, inputs, group in _cut(model, part.inputs, chunks)]
    return found


def _cut(model, inputs: list[str], groups: list[list[str]]):
    """(model, its inputs, its outputs) of each group of ``model``'s outputs."""
    from onnx.utils import Extractor

    from meshplan.model.opsets import set_ir_version

    extractor = Extractor(model)
    for group in groups:
        _, reads = needed_by(model.graph, group)
        needed = [n for n in inputs if n in reads]
        yield set_ir_version(extractor.extract_model(needed, list(group))), needed, list(group)


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


def _graph_of(model) -> onnx.GraphProto:
    """The graph of a part's model (a ModelProto, or its file's path: read without weights)."""
    return (onnx.load(model, load_external_data=False) if isinstance(model, str) else model).graph


def _run_bound(session, outputs, feeds: dict, pairs: dict[str, str], device) -> list:
    """A run with the outputs of ``pairs`` (output → input) bound to their inputs' buffers;
    every other output made by onnxruntime where the stage keeps its tensors (``device``;
    numpy arrays without one: views of the arena's blocks, not copies)."""
    from onnxruntime import OrtValue

    binding = session.io_binding()
    held = {}
    for name, value in feeds.items():   # (a numpy array wrapped where it lies)
        held[name] = value if isinstance(value, OrtValue) else OrtValue.ortvalue_from_numpy(np.asarray(value, order="C"))
        binding.bind_ortvalue_input(name, held[name])
    kind, index = device or ("cpu", 0)
    for name in outputs:
        if name in pairs:
            binding.bind_ortvalue_output(name, held[pairs[name]])
        else:
            binding.bind_output(name, kind, index)
    session.run_with_iobinding(binding)
    made = binding.get_outputs()
    return [feeds[pairs[name]] if name in pairs else made[i] if device else made[i].numpy()
            for i, name in enumerate(outputs)]


def _bindable(session, feeds: dict) -> bool:
    """Whether a run of ``session`` on ``feeds`` can be bound: numpy's own dtypes in and out
    (onnxruntime wraps no extension dtype, such as ml_dtypes' bfloat16)."""
    from onnxruntime import OrtValue

    if any(o.type == "tensor(bfloat16)" for o in session.get_outputs()):
        return False
    return all(isinstance(v, OrtValue) or isinstance(v, np.ndarray) and v.dtype.isbuiltin == 1 and v.dtype != object
               for v in feeds.values())


class ShardedPart:
    """The session of a part whose stage's devices shard its operators: its segments between
    collectives run by a ``ProgramRunner`` on the host, each collective by the stage's devices
    together (``links.collective``: an MPI communicator of them, or a meeting of threads)."""

    def __init__(self, path, providers: list | None = None, threads: int = 1):
        from pathlib import Path

        from meshplan.runtime.program import ProgramRunner

        self.program = ProgramRunner(Path(path), providers or ["CPUExecutionProvider"], threads)

    def run(self, outputs: list[str], feeds: dict, collective) -> list:
        values = self.program.run(feeds, collective, release=True)
        return [values[name] for name in outputs]


def _host(value) -> np.ndarray:
    """A tensor in host memory: a numpy array as it is, an OrtValue copied out."""
    return value if isinstance(value, np.ndarray) else value.numpy()


def _handed_over(value) -> bool:
    """Whether ``value`` is a numpy array a stage may write into as it is: writable,
    contiguous, owning its memory (not a view of another array or of a file's bytes)."""
    return isinstance(value, np.ndarray) and value.flags.owndata and value.flags.writeable \
        and value.flags.c_contiguous


def _scalar(value) -> float:
    return float(np.asarray(_host(value)).reshape(-1)[0])


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, np.ndarray) else tuple(value.shape())


def _nbytes(value) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    from meshplan.runtime.buffers import ort_dtype

    return int(np.prod(value.shape(), dtype=np.int64)) * ort_dtype(value).itemsize


class StageRunner:
    """Stage ``stage``'s runs: ``parts`` by phase, each with its onnxruntime session in
    ``sessions``; ``state``: the state the stage holds (by name); ``device``: where it keeps
    its tensors (see the module; None: numpy arrays); ``provider``: the sessions' provider;
    ``sum_gradients``: the gradients it sends back every microbatch go as sums over its
    samples, times the loss's count (the last stage where the stages' replica counts differ:
    ``meshplan.stage_ranks``)."""

    def __init__(self, stage: int, parts: dict[str, Part], sessions: dict, crossings: list[Crossing],
                 microbatches: int, state: dict[str, np.ndarray], loss_count: str | None = None,
                 device: tuple[str, int] | None = None, provider: str = "CPUExecutionProvider",
                 replica: tuple[int, int] = (0, 1), sharded=(), sum_gradients: bool = False):
        self.stage, self.parts, self.sessions, self.loss_count = stage, parts, sessions, loss_count
        self.sum_gradients = sum_gradients
        self.counts: dict[int, float] = {}      # microbatch → the loss's count (with ``sum_gradients``)
        self.crossings, self.microbatches, self.device = crossings, microbatches, device
        self.provider = provider      # the sessions' (what a report names)
        self.replica, self.replicas = replica
        mine = {n for part in parts.values() for n in list(part.inputs) + list(part.outputs)}
        self.sharded = set(sharded) & mine if self.replicas > 1 else set()   # (another stage's are not its)
        self.readers: dict[str, set[str]] = defaultdict(set)     # tensor → the phases that read it here
        for phase, part in parts.items():
            for name in part.inputs:
                self.readers[name].add(phase)
        self.sends_of: dict[str, list[int]] = defaultdict(list)  # tensor → the crossings that send it
        lent = set()                                               # state another stage reads
        for index, c in enumerate(crossings):
            if c.src == stage and c.made_in != STATE:
                self.sends_of[c.tensor].append(index)
            elif c.src == stage:
                lent.add(c.tensor)
        # state held in row blocks (the optimizer's slots): no forward or backward reads it
        self.in_blocks = {n for n in state if n in self.sharded and n not in lent
                          and not self.readers.get(n, set()) & set(PER_MICROBATCH)}
        # state a run may write its new value over
        writable = set(state) - kept_apart(stage, parts, crossings, self.sharded, self.replicas)
        self.in_place: dict[tuple[str, int], dict[str, str]] = {}   # (phase, chunk) → output → input
        for phase, part in parts.items():
            session = sessions.get(phase)
            if session is None or isinstance(session, ShardedPart):
                continue
            groups = [list(o) for _, _, o in session] if isinstance(session, list) else [list(part.outputs)]
            for index, pairs in enumerate(written_in_place(_graph_of(part.model), groups, writable)):
                if pairs:
                    self.in_place[(phase, index)] = pairs
        written = {i for pairs in self.in_place.values() for i in pairs.values()}
        state = {n: self._block(v) if n in self.in_blocks else v for n, v in state.items()}
        # (what is written in place is the stage's own: a copy of what it was given, unless that
        # is an array of its own memory, which the caller hands over)
        state = {n: np.array(_host(v), order="C", copy=True) if n in written and not _handed_over(v) else v
                 for n, v in state.items()}
        self.state = {name: self._placed(value) for name, value in state.items()} if device else state
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
        self.blocks: set[tuple[str, int]] = set()   # held tensors that are this replica's row blocks
        self.results: dict[str, float] = {}

    def end_step(self) -> dict[str, float]:
        """The step's results this stage made (the loss, the gradients' norm)."""
        if self.held:
            raise TrainError(f"stage {self.stage} ended a step still holding {sorted(self.held)[:3]}")
        return dict(self.results)

    def run(self, phase: str, mb: int, links=None) -> None:
        """Run ``phase``'s part for microbatch ``mb``. ``links``: the stage's replicas (their
        ``summed`` and ``gathered``), which the norm and update of a sharded stage need. An
        update given as chunks (``chunk_sessions``) runs chunk after chunk, each chunk's new
        weights and slots taking their old values' place before the next chunk runs."""
        part = self.parts[phase]
        in_blocks = bool(self.sharded) and phase in (NORM, UPDATE_PHASE)
        session = self.sessions[phase]
        chunks = session if isinstance(session, list) else [(session, part.inputs, part.outputs)]
        for index, (chunk, inputs, outputs) in enumerate(chunks):
            values = self._run_one(chunk, phase, mb, inputs, outputs, in_blocks, links,
                                   self.in_place.get((phase, index), {}))
            self._keep(phase, mb, outputs, values, in_blocks, links)
            del values
            if len(chunks) > 1:   # what no later chunk, and no run still to come, reads is let go now
                later = {n for _, names, _ in chunks[index + 1:] for n in names}
                for name in inputs:
                    pending = {p for p in self.readers.get(name, ()) if p != phase and (p, mb) not in self.ran}
                    if name not in later and not pending and not self.sends_of.get(name):
                        self.held.pop((name, mb), None)
        self.ran.add((phase, mb))
        for name in list(part.inputs) + list(part.outputs):
            if (name, mb) in self.held:
                self._release(name, mb)
        self.peak_kept = max(self.peak_kept, sum(_nbytes(v) for v in self.held.values()))
        self.peak_in_flight = max(self.peak_in_flight, len({m for _, m in self.held}))

    def _run_one(self, session, phase: str, mb: int, inputs, outputs, in_blocks: bool, links,
                 pairs: dict[str, str]) -> list:
        """One session's run of ``outputs`` on what the stage holds of ``inputs`` (a
        ``ShardedPart``'s collectives with the stage's other devices, through ``links``);
        ``pairs``: the outputs written into the buffers of the state they replace."""
        last_mb = self.microbatches - 1
        feeds = {}
        for name in inputs:
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
            # this replica's row blocks of every weight's tensors
            if in_blocks and name in self.sharded and name not in self.in_blocks and (name, mb) not in self.blocks:
                feeds[name] = self._placed(self._block(feeds[name]))
        if isinstance(session, ShardedPart):
            return session.run(list(outputs), feeds, links.collective)
        pairs = {o: i for o, i in pairs.items() if feeds[i] is self.state[i]}
        if (pairs or self.device is None) and _bindable(session, feeds):
            return _run_bound(session, list(outputs), feeds, pairs, self.device)
        if self.device is None:
            return session.run(list(outputs), feeds)
        from onnxruntime import OrtValue   # (a numpy feed goes in as it is: copied where its node runs)

        return session.run_with_ort_values(
            list(outputs), {n: v if isinstance(v, OrtValue) else OrtValue.ortvalue_from_numpy(np.asarray(v))
                            for n, v in feeds.items()})

    def _keep(self, phase: str, mb: int, outputs, values, in_blocks: bool, links) -> None:
        """A run's ``values``: the step's results, the state's new values, tensors held."""
        for name, value in zip(outputs, values):
            state = name[:-len(UPDATED)] if name.endswith(UPDATED) else None
            if self.sum_gradients and name == COUNT:
                self.counts[mb] = _scalar(value)
            if name in RESULTS:
                self.results[name] = _scalar(value)
            elif state in self.state:
                if in_blocks and name in self.sharded and state not in self.in_blocks:   # gathered whole again
                    value = self._placed(links.gathered(_host(value), _shape(self.state[state])))
                self.state[state] = value
            elif in_blocks and name not in self.sharded:   # a partial sum of the norm: the replicas' added up
                self.held[(name, mb)] = self._placed(links.summed(_host(value)))
            else:
                self.held[(name, mb)] = value
                if in_blocks:
                    self.blocks.add((name, mb))

    def reduce(self, links) -> None:
        """Sum over the stage's replicas (``links.summed``: an array → the sum of every
        replica's) what the last microbatch's backward made for the step's own parts — the
        accumulated gradients, the loss's count — each replica having seen its share of every
        microbatch; a gradient the replicas update in row blocks summed into this replica's
        blocks alone (``links.scattered``); and the loss, as its replicas' losses weighted by
        their counts."""
        last = self.microbatches - 1
        made = set(self.parts[BACKWARD].outputs) if BACKWARD in self.parts else set()
        count = self.held.get((self.loss_count, last)) if LOSS in self.results else None
        for name, mb in sorted(self.held):
            if mb == last and name in made and self._once_a_step(name):
                value = _host(self.held[(name, mb)])
                if name in self.sharded and not self.sends_of.get(name):
                    self.held[(name, mb)] = self._placed(links.scattered(value))
                    self.blocks.add((name, mb))
                else:
                    self.held[(name, mb)] = self._placed(links.summed(value))
        if count is not None:
            total = links.summed(np.asarray(self.results[LOSS] * _scalar(count), np.float64))
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
        if self.sum_gradients and c.made_in == BACKWARD and per_microbatch(c):   # the mean's gradient as a sum's
            value = _host(value)
            return value * np.asarray(self.counts[mb], dtype=value.dtype)
        return _host(value)

    def give(self, index: int, mb: int, value: np.ndarray) -> None:
        """What crossing ``index`` brought for microbatch ``mb``."""
        c = self.crossings[index]
        value = self._placed(value)
        if c.made_in == STATE:
            self.borrowed[c.received] = value
        else:
            self.held[(c.received, mb)] = value

    def host_state(self) -> dict[str, np.ndarray]:
        """The stage's state in host memory (a checkpoint's, the weights trained): those of
        ``in_blocks`` as this replica's row blocks."""
        return {name: _host(value) for name, value in self.state.items()}

    def _block(self, value) -> np.ndarray:
        """This replica's row blocks of ``value`` (``meshplan.replica_shards``), in host memory."""
        return np.ascontiguousarray(piece(_host(value), self.replicas, self.replica))

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
