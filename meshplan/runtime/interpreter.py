"""One rank's part of a call or of a training step: its instruction list (``emit.schedule``,
``emit.train_schedule``) carried out. Every job's runtime is this interpreter: ``run``,
``generate`` and ``serve`` (``runtime.job``) and ``train`` (``trainer.driver`` through the
job; ``trainer.pipeline_driver`` for pipelined plans) are drivers of it.

The plan wrote what each rank does and in which order; the interpreter does it. In a call
(the forward schedule: ``Interpreter.run``) it receives what a run needs (a resharding's
part, a whole tensor from an earlier stage), runs the rank's program on a microbatch (fed
also with the call's inputs its stage reads and the state it holds), sends what later
stages and rank 0 need, keeps the state the run made, and on rank 0 takes the call's
outputs. The list is bound once per set of outputs a call asks for (``Interpreter.bound``):
each instruction's names resolved, the sends of outputs nobody asked for left out, so that a
call replays tuples, not the plan.

In a pipelined training step (a 1F1B or GPipe schedule: ``Interpreter.step``) the rank's
stage runner (``runtime.pipeline_stage.StageRunner``) runs a part (a microbatch's forward or
backward, the step's norm, clip and update), takes what a crossing sends and is given what
one brings (through ``runtime.pipeline_links``), and sums its accumulated gradients with its
stage's replicas once, after its last backward (``reduce``).

``CallRecord`` is what a call did on this rank: seconds in the programs, the bytes sent per
tensor (a tensor's name without its layout) and the trace events (Chrome's format).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from meshplan.emit.schedule import FORWARD, Schedule
from meshplan.errors import RunError
from meshplan.plan_format import OUTPUT_COLLECTOR, local_name
from meshplan.runtime.buffers import HOST, DeviceTensor
from meshplan.sharding import ShardingSpec
from meshplan.training.optimizers import APPLY
from meshplan.training.pipeline_step import SCHEDULES as TRAINING_KINDS

ROWS = 1 << 32     # a call of some rows: the first row * ROWS + their count (-1: the whole batch)
_KEPT_VIEW_BYTES = 16 << 20   # the largest output whose view ``_take_output`` keeps for the next call

# the bound instructions' codes
_RESHARD_IN, _TAKE, _RUN, _RESHARD_OUT, _KEEP, _SEND, _OUTPUT, _COLLECT, _SCORE = range(9)


@dataclass
class CallRecord:
    """What this rank did in the last call (see the module)."""

    program_seconds: float = 0.0
    sent: dict = field(default_factory=dict)   # tensor → bytes
    trace: list = field(default_factory=list)  # ``event``'s arguments

    def start(self) -> None:
        self.program_seconds, self.sent, self.trace = 0.0, {}, []

    def count(self, tensor: str, nbytes: int) -> None:
        key = tensor.split("@", 1)[0]
        self.sent[key] = self.sent.get(key, 0) + int(nbytes)


class Interpreter:
    """Rank ``rank``'s instruction list of ``schedule``: a call of a forward schedule run with
    ``run``, a step of a training one with ``step``. The job gives what the list acts on: its
    transport, program runner, buffers and record; the state dict it holds (read and updated
    in place), the state's specs, the state buffers the programs may write in place
    (``own_state``), the greedy ids' output (``chosen``) and the scorer of the logits those
    are chosen from (``scorer``: ``logit_scores.LogitScorer``, whose outputs rank 0 computes
    after the run from the logits where they lie). A training step's driver gives its links
    (``pipeline_links.PipelineLinks``) as the transport and its stage's ``StageRunner`` as
    the program runner."""

    def __init__(self, plan, rank: int, schedule: Schedule, transport, session, buffers=HOST,
                 record: CallRecord | None = None, state: dict | None = None, state_specs: dict | None = None,
                 own_state=frozenset(), chosen: str | None = None, scorer=None):
        if schedule.kind != FORWARD and schedule.kind not in TRAINING_KINDS:
            raise RunError(f"this meshplan runs forward and training schedules, not {schedule.kind!r}")
        self.kind = schedule.kind
        self.plan, self.rank, self.instructions = plan, rank, schedule.ranks[rank]
        self.stage = plan.stage_of_rank(rank) if self.kind == FORWARD else None
        record = CallRecord() if record is None else record
        state, state_specs = {} if state is None else state, {} if state_specs is None else state_specs
        self.transport, self.session, self.buffers, self.record = transport, session, buffers, record
        self.state, self.state_specs, self.own_state, self.chosen = state, state_specs, own_state, chosen
        self.scorer = scorer
        self._bound: dict[frozenset, tuple] = {}
        self._taken: dict[str, tuple] = {}       # ``_take_output``: output → (its array, the box, the view)

    def bound(self, wanted: dict) -> tuple:
        """The list for a call that brings ``wanted`` to rank 0 (kept per set of outputs): the
        bound instructions, and the outputs the programs may narrow to their wanted part."""
        key = frozenset(wanted)
        found = self._bound.get(key)
        if found is not None:
            return found
        plan, stage, rank = self.plan, self.stage, self.rank
        steps = []
        for item in self.instructions:
            if item.op == "run":
                steps.append((_RUN, item.mb))
                if self.chosen in wanted and rank == 0:
                    steps.append((_OUTPUT, item.mb, self.chosen))
                if self.scorer is not None and rank == 0 and any(o in wanted for o in self.scorer.outputs):
                    steps.append((_SCORE, item.mb))
                continue
            if item.op == "keep":
                spec = self.state_specs[item.state]
                entry = next(e for e in plan.state if e["input"] == item.state)
                steps.append((_KEEP, item.mb, item.state, local_name(entry["output"], spec)))
                continue
            if item.resharding is not None:
                r = plan.reshardings[item.resharding]
                if item.op == "receive":
                    steps.append((_RESHARD_IN, item.mb, item.resharding, local_name(r.tensor, ShardingSpec.parse(r.dst_spec))))
                else:
                    steps.append((_RESHARD_OUT, item.mb, item.resharding, r.tensor,
                                  local_name(r.tensor, ShardingSpec.parse(r.src_spec))))
                continue
            t = plan.transfers[item.transfer]
            if t.dst_stage == OUTPUT_COLLECTOR and t.tensor not in wanted:
                continue
            code = {"receive": _TAKE, "send": _SEND, "output": _OUTPUT, "collect": _COLLECT}[item.op]
            if code == _OUTPUT:
                steps.append((_OUTPUT, item.mb, t.tensor))
            elif code == _COLLECT:
                ndim = len(next(o for o in plan.outputs if o.name == t.tensor).shape)
                steps.append((_COLLECT, item.mb, item.transfer, t, ndim))
            else:
                steps.append((code, item.mb, item.transfer, t))
        # state this stage reads: (input, its local name)
        reads = [(name, local_name(name, self.state_specs[name])) for name in stage.inputs if name in self.state_specs]
        # the stage's outputs that only go to rank 0 (not to a later stage, nor state): its
        # programs may take the wanted part of them before their last collective
        # (``run_lockstep``'s ``narrow``); decided alike on every rank of the stage, whichever
        # of them sends the output, since each rank's part of the collective must match
        to_rank0 = {t.tensor for t in plan.transfers
                    if t.src_stage == stage.index and t.dst_stage == OUTPUT_COLLECTOR and t.tensor in wanted}
        if self.chosen in wanted and rank == 0:
            to_rank0.add(self.chosen)
        elsewhere = ({local_name(r.tensor, ShardingSpec.parse(r.src_spec)) for r in plan.reshardings
                      if r.src_stage == stage.index}
                     | {local_name(e["output"], self.state_specs[e["input"]]) for e in plan.state
                        if e["stage"] == stage.index}
                     | {t.tensor for t in plan.transfers if t.src_stage == stage.index and t.dst_stage != OUTPUT_COLLECTOR})
        narrowable = tuple(sorted(to_rank0 - elsewhere))
        found = self._bound[key] = (tuple(steps), reads, narrowable)
        return found

    def run(self, micro: list[dict], wanted: dict, origin: float, rows: int = -1, copy: bool = True) -> list[dict]:
        """The call on this rank: ``micro`` its inputs per microbatch (those this rank read),
        ``wanted`` the outputs rank 0 asked for (name → box). With ``rows`` >= 0 (``ROWS``: the
        first row and the count) the runs read and update those rows of the state (a view of
        them, updated in place, or written back where a program made a copy). ``copy``: rank
        0's own outputs are copies (else views of the programs' buffers, which the next call
        overwrites). Returns, on rank 0, the outputs per microbatch."""
        window = slice(rows // ROWS, rows // ROWS + rows % ROWS) if rows >= 0 else None
        plan, stage, rank, b, transport, record = self.plan, self.stage, self.rank, self.buffers, self.transport, \
            self.record
        B = plan.microbatches
        steps, reads, narrowable = self.bound(wanted)
        shape_tag = len(plan.transfers)
        results = [dict() for _ in range(B)] if rank == 0 else []
        # (a program that keeps its tensors on a device copies a host array into a buffer it keeps)
        fed = b if self.session.kept_on is None else HOST
        feeds: dict[int, dict] = {}
        waited: dict[int, float] = {}
        outs, boxes = {}, {}
        for step in steps:
            code, mb = step[0], step[1]
            if code == _RESHARD_IN or code == _TAKE:
                if mb not in waited:
                    waited[mb] = time.perf_counter()
                if code == _RESHARD_IN:
                    feeds.setdefault(mb, {})[step[3]] = transport.reshard(step[2], None)
                else:
                    t = step[3]
                    value = transport.recv_with_shape(len(t.shape), t.dtype, t.src_rank, shape_tag + step[2], step[2])
                    feeds.setdefault(mb, {})[t.tensor] = fed.from_host(value)
            elif code == _RUN:
                start_wait = waited.pop(mb, None)
                given = feeds.pop(mb, {})
                for name, value in micro[mb].items():
                    if name in stage.inputs:
                        given[name] = fed.from_host(value)
                for name, local in reads:
                    if name not in self.state:
                        raise RunError(f"state '{name}' is not set on rank {rank}")
                    given[local] = self.state[name] if window is None else self.state[name][window]
                started = time.perf_counter()
                narrow = {name: wanted[name] for name in narrowable if wanted[name]} if narrowable else None
                boxes = dict(narrow) if narrow else {}   # left to take after the run (a narrowed output is its box)
                # (one microbatch: read before the next run); a training step lets each tensor go
                # once no later segment reads it (a gradient once it is all-reduced)
                program = self.session
                if B == 1 and program.idle:
                    applies = _applies(given)   # a call of a step of several microbatches: the last one
                    # applies the update, without the masks; one before it runs only what it keeps or sends
                    if applies is not None:
                        program = program.applying() if applies else \
                            program.pruned(_made_for(steps) - set(program.idle))
                outs = program.run(given, transport.collective, b, observe=self._observe,
                                   writable=self.own_state, narrow=narrow, bound=B == 1,
                                   release=bool(self.plan.training))
                if boxes:
                    for name in set(boxes) - set(narrow):
                        boxes[name] = ()
                finished = time.perf_counter()
                record.program_seconds += finished - started
                if start_wait is not None and started - start_wait > 1e-5:
                    record.trace.append(("wait", rank, start_wait - origin, started - start_wait, mb))
                record.trace.append((stage.index, rank, started - origin, finished - started, mb))
                inputs_of_run = given
            elif code == _RESHARD_OUT:
                value = outs[step[4]]
                transport.reshard(step[2], value)
                record.count(step[3], nbytes(b, value))
            elif code == _KEEP:
                name, local = step[2], step[3]
                if local not in outs:   # a call that left it out (``_applies``): the state is as it was
                    continue
                if window is None:
                    self.state[name] = outs[local]
                elif outs[local] is not inputs_of_run.get(local_name(name, self.state_specs[name])):
                    self.state[name][window] = np.asarray(b.to_host(outs[local]))
            elif code == _SEND:
                t = step[3]
                data = np.asarray(b.to_host(outs[t.tensor]), order="C")
                if t.dst_stage == OUTPUT_COLLECTOR:
                    data = take(data, boxes.get(t.tensor, wanted[t.tensor]))
                transport.post_with_shape(data, t.dst_rank, shape_tag + step[2], step[2])
                record.count(t.tensor, data.nbytes)
            elif code == _SCORE:   # the top log-probabilities of the logits, where they lie
                top, ids = self.scorer.outputs
                box = wanted.get(top, wanted.get(ids))
                results[mb][top], results[mb][ids] = self.scorer(outs[self.scorer.source], box)
            elif code == _OUTPUT:   # a copy: the program's buffer is the next call's
                name = step[2]
                value = self._take_output(name, outs[name], boxes.get(name, wanted[name]))
                results[mb][name] = np.array(value) if copy or B > 1 else value
            else:   # _COLLECT
                t = step[3]
                results[mb][t.tensor] = transport.recv_with_shape(step[4], t.dtype, t.src_rank, shape_tag + step[2],
                                                                  step[2])
        transport.finish_posted()
        return results

    def step(self, origin: float) -> None:
        """A pipelined training step on this rank, its runner begun on the step's microbatches
        (``StageRunner.begin_step``): each run timed into the record (``program_seconds``, a
        trace event per run), each send posted without waiting, each receive waited for, the
        posted sends finished at the end."""
        if self.kind == FORWARD:
            raise RunError("a forward schedule runs calls (Interpreter.run), not training steps")
        runner, links, record = self.session, self.transport, self.record
        for ins in self.instructions:
            if ins.op == "send":
                links.post(ins.crossing, ins.mb, runner.take(ins.crossing, ins.mb))
            elif ins.op == "receive":
                runner.give(ins.crossing, ins.mb, links.receive(ins.crossing, ins.mb))
            else:
                started = time.perf_counter()
                if ins.op == "reduce":
                    runner.reduce(links)
                else:
                    runner.run(ins.part, ins.mb, links)
                finished = time.perf_counter()
                record.program_seconds += finished - started
                record.trace.append((ins.part or ins.op, self.rank, started - origin, finished - started, ins.mb))
        links.finish()

    def _take_output(self, name: str, value, box: tuple) -> np.ndarray:
        """``box`` of output ``name`` on the host; on the host path, the view taken of the
        same array the call before is taken again (a repeated run's output is its buffer). Only
        a view of a small output is kept between calls: a box that is not contiguous is a copy,
        which the next run would leave behind, and a prompt's logits are let go. An output kept
        on the device (logits a choice is made from) gives its box alone, copied."""
        if isinstance(value, DeviceTensor):
            found = value.box_numpy(box) if box else None
            return found if found is not None else take(value.numpy(), box)
        taken = self._taken.pop(name, None)
        if taken is not None and taken[0] is value and taken[1] == box:
            view = taken[2]
        else:
            view = take(self.buffers.to_host(value), box)
        if self.buffers is HOST and value.nbytes <= _KEPT_VIEW_BYTES and np.may_share_memory(view, value):
            self._taken[name] = (value, box, view)
        return view

    def _observe(self, name: str, value) -> None:
        """A collective inside a program: count the bytes this rank puts in."""
        self.record.count(name, nbytes(self.buffers, value))


def take(data: np.ndarray, index: tuple) -> np.ndarray:
    """``data[index]`` as a C-contiguous array (a 0-d one stays 0-d)."""
    index = index[:np.ndim(data)]
    return np.asarray(data[index] if index else data, order="C")


def nbytes(buffers, value) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    shape = buffers.shape(value)
    return math.prod(shape) * np.dtype(value.dtype).itemsize


def event(name, rank: int, start: float, duration: float, mb: int) -> dict:
    """A trace event (Chrome's format) of what a call recorded: ``name`` is "wait" or the
    stage's index."""
    name = name if isinstance(name, str) else f"stage {name}"
    return {"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": start * 1e6, "dur": duration * 1e6,
            "args": {"microbatch": mb}}


def _applies(given: dict) -> bool | None:
    """Whether a training step's call applies the update (``train.apply`` 1: the step's last
    microbatch) or only accumulates (0: its weights and slots come back unchanged); None for
    another value (``runtime.accumulating``)."""
    value = given.get(APPLY)
    if not isinstance(value, np.ndarray) or value.size != 1 or float(value.reshape(-1)[0]) not in (0.0, 1.0):
        return None
    return float(value.reshape(-1)[0]) == 1.0


def _made_for(steps) -> set[str]:
    """What a call's steps read of its run's outputs: the state kept, the tensors sent,
    resharded or output."""
    found = set()
    for step in steps:
        if step[0] == _KEEP:
            found.add(step[3])
        elif step[0] == _SEND:
            found.add(step[3].tensor)
        elif step[0] == _RESHARD_OUT:
            found.add(step[4])
        elif step[0] == _OUTPUT:
            found.add(step[2])
    return found
