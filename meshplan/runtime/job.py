"""A resident job: a plan loaded once on every rank, serving calls driven from rank 0.

Under ``mpiexec`` every rank constructs ``Job(plan_dir)`` (collective): it checks the plan
and its program, loads the program's sessions, and builds every communicator once (mesh
axes, cross-mesh resharding groups, one broadcast group per model input). Then rank 0,
the *driver*, makes calls (``run``, ``reset_state``, ``get_state``, ``set_state``) and
the other ranks, the *workers*, ``serve``: each call starts with a small broadcast header
(an int64 vector whose length the plan fixes: the operation, the call's input shapes, the
state to create, the outputs asked for) and goes on with buffer-based transfers only.
``close`` (or leaving the ``with`` block) sends the header that ends the workers' loop::

    with meshplan.Job("plan/") as job:
        if job is not None:                       # rank 0; the others served inside ``with``
            out = job.run({"input_ids": ids, ...}, outputs={"logits": np.s_[:, -1:]})

Each call has its own sizes (within the plan's ranges, ``plan.sizes``). A call the
driver can check is refused there, with one line, before any rank hears of it: the job
stays usable (``job_calls``: the header and the checks). Then every working rank carries
out its instruction list for the call (``interpreter``; the plan wrote the lists,
``emit.schedule``). A rank that fails during a call ends the whole job (one line on stderr,
then ``MPI_Abort``): the others are waiting on it.

State (``plan.state``, ``job_state``) stays on the ranks that make it and is the next
call's input there. With ``cache_in_place``, a key/value cache of fixed capacity
(onnxruntime-genai's shared past/present buffer) is updated where it lies, as
onnxruntime-genai does, instead of copied whole into a new present buffer on every call;
positions past a sequence's length then keep what they held instead of onnxruntime's
zeros (attention never reads them), and a state kept on the device takes again, without
zeroing it, the buffer the state before it left. ``meshplan generate`` runs so; ``meshplan
run`` does not, so that its state outputs are onnxruntime's to the bit.

A call of fewer sequences than the held state's batch (``run(..., row=r)``, where
``row_calls`` allows it) runs on rows ``r`` to ``r`` + its batch - 1 of the held state, a
view of them updated in place: ``meshplan serve`` prefills a request that joins running
ones in its own row while the other rows keep theirs, and decodes only the rows up to the
last busy one.

Only what rank 0 asks for reaches it: ``run(..., outputs=[names])`` or a dict of names to
slices (``{"logits": np.s_[:, -1:]}``: the source rank cuts the slice before sending).
Every rank counts the bytes it sends per tensor during each call (``moved_bytes``).
A job of one rank made with ``choose`` (on CUDA, ``generate`` and ``serve``) also computes
the greedy token ids next to the logits, an output named ``job.chosen``
(``runtime.greedy_choice``): ``outputs={job.chosen: np.s_[:, -1:]}`` brings the ids, not the
logits.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.emit.schedule import read_schedule
from meshplan.errors import JobFailure, MeshplanError, ReportedElsewhere, RunError
from meshplan.model.sizes import Sizes
from meshplan.process_memory import peak_rss_bytes
from meshplan.plan_format import TensorSpec, local_name, read_plan, require_programs
from meshplan.runtime.buffers import HOST, DeviceBuffers
from meshplan.runtime.interpreter import ROWS, CallRecord, Interpreter, event
from meshplan.runtime.job_calls import (CLOSE, COPY_ROWS, GET_STATE, LOAD_STATE, RESET, RUN, SAVE_STATE, SET_STATE,
                                        SIZED_KEPT, STATS, CallHeaders, _Repeat, first_line)
from meshplan.runtime.job_state import HeldState
from meshplan.runtime.logit_scores import LogitScorer
from meshplan.runtime.program import SEGMENT_GRAPHS, ProgramRunner
from meshplan.runtime.sessions import check_program_files, provider_name, providers_for
from meshplan.runtime.state_layout import state_spec, state_updates as _state_updates
from meshplan.runtime.tensors import join_microbatches, split_microbatches
from meshplan.runtime.threads import (ThreadChoice, bind_to, may_bind, one_pool, pin_calling_thread, plan_threads,
                                      with_idle_cores)
from meshplan.runtime.transport import Transport, abort_job, agree, choose_buffers, world
from meshplan.runtime.waiting import set_sleeping
from meshplan.sharding import LogicalMesh

_LOGITS = "logits"            # the output a greedy choice is made from (``Job(choose=...)``)
# ``MESHPLAN_DEVICE_CHOICE=0`` in the environment: a job on CUDA returns logits and the token is
# chosen on the host (the way to measure what the choice next to the logits saves)
DEVICE_CHOICE = "MESHPLAN_DEVICE_CHOICE"
TRAIN_LOSS, TRAIN_GRAD_NORM = "train.loss", "train.grad_norm"   # a training step's outputs


@dataclass
class CallStats:
    """What one call did on every rank (``Job.stats``): seconds in the programs and bytes
    sent, per tensor (a tensor's name without its layout)."""

    program_seconds: list[float] = field(default_factory=list)     # per rank
    sent_bytes: list[dict[str, int]] = field(default_factory=list)  # per rank: tensor → bytes
    state_bytes: list[int] = field(default_factory=list)            # per rank: bytes of the state it holds
    trace: list[dict] = field(default_factory=list)                 # Chrome trace events of the call
    peak_rss_bytes: list[int] = field(default_factory=list)         # per rank

    def bytes_of(self, names) -> int:
        names = set(names)
        return sum(n for per_rank in self.sent_bytes for t, n in per_rank.items() if t in names)

    @property
    def total_bytes(self) -> int:
        return sum(sum(per_rank.values()) for per_rank in self.sent_bytes)


class Job(CallHeaders, HeldState):
    """See the module's description. Construct on every rank (collective)."""

    def __init__(self, plan_dir: str | Path, provider: str = "auto", transfer: str = "auto", comm=None, check=None,
                 cache_in_place: bool = False, on_device: bool | None = None, graphs: bool = False,
                 choose: bool | None = False):
        """``check(plan)``, when given, runs on rank 0 with the start-up checks: its error
        stops every rank as theirs do. ``cache_in_place``: update a fixed-capacity key/value
        cache in place (see the module). ``on_device``: keep the state, the calls' inputs and
        outputs and what passes between a rank's segments where its provider computes
        (``StageSession.keep_on``), whatever the MPI; None: so on CUDA (with the CPU provider
        they are in host memory anyway; True there runs the same path on host OrtValues).
        ``graphs``: on CUDA, replay a call that repeats its shapes as a CUDA graph.
        ``choose``: let the program of a job of one rank choose the next token greedily next to
        its logits (``ProgramRunner(choose=...)``): ``chosen`` names the output of those ids
        (``outputs={job.chosen: ...}`` brings them instead of the logits; ``outputs=None``
        still brings the plan's outputs alone); None: so on CUDA unless
        ``MESHPLAN_DEVICE_CHOICE=0`` (``DEVICE_CHOICE``), as ``generate`` and ``serve`` ask."""
        from meshplan.rank_layout import gather_affinities, gather_layout, launch_advice, layout_mismatch

        MPI, everyone = world()
        everyone = comm if comm is not None else everyone
        self.MPI = MPI
        self.cache_in_place = cache_in_place
        self.rank, self.size = everyone.Get_rank(), everyone.Get_size()
        layout = gather_layout(everyone, MPI)
        affinities = gather_affinities(everyone)
        self.threads: ThreadChoice | None = None
        error = None
        try:
            plan_dir = Path(plan_dir)
            plan = read_plan(plan_dir)
            require_programs(plan, plan_dir)
            if self.size != plan.num_ranks:
                raise RunError(f"the plan needs {plan.num_ranks} ranks but the job has {self.size}",
                               hint=f"start it as mpiexec -n {plan.num_ranks} ...")
            hosts, per_host = plan.cluster["mesh"]
            mismatch = layout_mismatch(layout, hosts, per_host, working=set(range(self.size)) - set(plan.idle_ranks))
            if mismatch:
                raise RunError(mismatch, hint=launch_advice(per_host))
            if plan.is_idle(0):
                raise RunError("the plan leaves rank 0 idle, but rank 0 drives the job", hint="re-run meshplan plan")
            schedule = read_schedule(plan, plan_dir)
            program = plan.program_of_rank(self.rank)
            session, buffers, path_text, resident = None, HOST, "none: this rank is idle in the plan", None
            providers = None
            if program is not None:
                path = check_program_files(plan, plan_dir, program)
                import os

                from meshplan.providers import CUDA, cuda_device_count, cuda_usable, share_one_pool, shared_pool_threads

                # the cores of a machine go to the ranks that work there (idle ranks only wait):
                # those the launcher bound idle ranks to as well
                machine = [r for r in range(self.size) if layout.machine[r] == layout.machine[self.rank]]
                here = [r for r in machine if not plan.is_idle(r)]
                working, index = [affinities[r] for r in here], here.index(self.rank)
                if may_bind():
                    widened = with_idle_cores(working, [affinities[r] for r in machine if plan.is_idle(r)])
                    if widened[index] != working[index] and bind_to(widened[index]):
                        working = widened
                self.threads, share = plan_threads(working, index, os.cpu_count())
                # before onnxruntime makes its threads: they inherit it; refused, the shared rule
                if share is not None and not bind_to(share):
                    self.threads, _ = plan_threads(working, index, os.cpu_count(), bind=False)
                device_id = layout.local_rank % cuda_device_count() if provider != "cpu" and cuda_usable() else 0
                providers = providers_for(provider, device_id)
                segment_graphs = graphs and os.environ.get(SEGMENT_GRAPHS, "").strip() == "1"
                if choose is None:
                    choose = on_device is not False and provider_name(providers[0]) == CUDA \
                        and os.environ.get(DEVICE_CHOICE, "").strip() != "0"
                choose = choose and self.size == 1 and plan.microbatches == 1 \
                    and any(t.name == _LOGITS for t in plan.outputs)
                session = ProgramRunner(path, providers, lazy=True, remake_integers=segment_graphs,
                                        choose=_LOGITS if choose else None, updates=_state_updates(plan))
                # one spinning pool for a rank with cores of its own: its one session's, or the
                # process's shared by its segments (made now, on the cores it is bound to)
                pooled = one_pool(self.threads, session.sessions, shared_pool_threads())
                if not pooled.shared_pool or share_one_pool(pooled.threads):
                    self.threads = pooled
                session.open(providers, self.threads.threads, self.threads.spinning, graphs,
                             self.threads.pool_affinities(), graphs_in_segments=segment_graphs,
                             training=bool(plan.training))
                pin_calling_thread(self.threads)   # (onnxruntime pinned its pool threads)
                buffers, path_text = choose_buffers(transfer, session.providers[0], device_id, MPI,
                                                    alone=self.size == 1)
                set_sleeping(session.providers[0] != CUDA)
                on_cuda = session.providers[0] == CUDA
                # the state a training step writes anew (weights, optimizer state): kept where it
                # is made, in new buffers each run (a cache is the caller's to write in place)
                kept = {local_name(s["output"], state_spec(s)) for s in plan.state} if plan.training else set()
                if on_device or on_device is None and on_cuda:
                    if buffers is HOST:
                        resident = DeviceBuffers("cuda" if on_cuda else "cpu", device_id if on_cuda else 0, providers)
                        session.keep_on(resident, kept=kept)
                        path_text += "; state and activations kept on the " + ("GPU" if on_cuda else "device")
                    elif plan.microbatches == 1:   # device buffers travel as they are: the runs keep
                        # their bindings (and graphs) too; a run of another microbatch would write into the
                        # buffers of the one before while a send of them may still be under way
                        session.keep_on(buffers, staged=False, kept=kept)
                        path_text += "; every segment's buffers kept bound between calls"
            if check is not None and self.rank == 0:
                check(plan)
        except MeshplanError as exc:
            error = exc
        except Exception as exc:  # must still reach the agreement, or the others wait forever
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            error = RunError(f"rank {self.rank} could not start: {text}")
        agree(everyone, MPI, error)
        try:
            self.plan, self.plan_dir, self.session, self.buffers = plan, plan_dir, session, buffers
            self.chosen = session.chosen if session is not None else None   # the greedy ids' output
            # … and the top log-probabilities of the logits it is chosen from, computed where they lie
            self.scorer = None if self.chosen is None else LogitScorer(
                _LOGITS, providers, next(t for t in plan.outputs if t.name == _LOGITS).shape[-1])
            self.state_buffers = resident or buffers    # where the state lies (``on_device``)
            self.transfer_path = path_text
            self.provider = session.providers[0] if session is not None else "none"
            self._setup()
            self.transport = Transport(plan, everyone, MPI, buffers, [t.name for t in self.inputs])
            # this rank's part of each call: its instruction list, carried out
            self.interpreter = None if self.stage is None else Interpreter(
                plan, self.rank, schedule, self.transport, session, buffers, self.record, self.state,
                self.state_specs, self.own_state, self.chosen, self.scorer)
        except Exception as exc:
            raise JobFailure(f"rank {self.rank} failed: {first_line(exc)}") from exc
        self.closed = False
        self.train_steps, self.grad_norm = 0, None   # a training plan's steps (``train_step``)
        self.optimizer_steps = 0     # of them, those that updated the weights (AdamW's t)

    # --- set-up shared by every rank -------------------------------------------------------

    def _setup(self) -> None:
        plan = self.plan
        self.stage = plan.stage_of_rank(self.rank)     # None on an idle rank: it only joins the broadcasts
        self.mesh = LogicalMesh(tuple(self.stage.logical_mesh), tuple(self.stage.devices)) if self.stage else None
        self.sizes = Sizes.from_dict(plan.sizes) if plan.sizes else None
        self.state_entries = list(plan.state)
        self.state_inputs = {s["input"]: s for s in plan.state}
        self.state_outputs = {s["output"]: s for s in plan.state}
        self.inputs = [t for t in plan.inputs if t.name not in self.state_inputs]
        self.outputs = [t for t in plan.outputs if t.name not in self.state_outputs]
        if self.chosen is not None:   # the token ids chosen next to the logits (a job of one rank)
            logits = next(t for t in plan.outputs if t.name == _LOGITS)
            self.outputs.append(TensorSpec(self.chosen, list(logits.shape[:-1]), "int64"))
            top, ids = self.scorer.outputs    # and the top log-probabilities of those logits
            self.outputs += [TensorSpec(top, list(logits.shape[:-1]) + [self.scorer.count], "float32"),
                             TensorSpec(ids, list(logits.shape[:-1]) + [self.scorer.count], "int64")]
        self.state_specs = {s["input"]: state_spec(s) for s in plan.state}
        outputs = {t.name: t for t in plan.outputs}
        self._state_output_shapes = [(s["input"], outputs[s["output"]].shape) for s in plan.state]
        # the job owns its state buffers: a program may update them in place (a fixed-capacity
        # cache; a training step's weights and slots, where ``model.in_place`` finds it safe)
        self.own_state = frozenset(local_name(name, spec) for name, spec in self.state_specs.items()) \
            if self.cache_in_place or plan.training else frozenset()
        self.header_size = 2 + sum(len(t.shape) for t in self.inputs) + sum(1 + len(t.shape) for t in self.state_entries_specs()) \
            + sum(1 + 2 * len(t.shape) for t in self.outputs) + len(self.state_entries)
        self.state: dict[str, object] = {}      # state input → this rank's local piece (its holders)
        self._spare: dict[tuple, dict] = {}     # device state buffers let go, by shape, then name: to take again
        self._made: dict[str, np.ndarray] = {}  # host state buffers this job made (``_empty_state``)
        self._kept: dict[str, np.ndarray] = {}  # … let go by a reset, to take again
        self.state_shapes: dict[str, tuple | None] = {}   # on rank 0: each state's whole shape, where known
        self._sized: dict[tuple, tuple] = {}    # ``_check_call``'s sizes by the call's shapes (and the state's)
        self._tracked = None                   # the sizes ``_track_state`` last followed
        self._last_key = None                  # the last call's shapes (``_check_call``)
        self._headers: dict[tuple, np.ndarray] = {}   # RUN headers by shapes and wanted outputs
        self._parsed: dict[bytes, tuple] = {}         # ``_parse_run``: RUN headers read, by their bytes
        self._new_states: dict[tuple, tuple] = {}     # (state, its shape) → (this rank's piece's shape, dtype)
        self._read_wanted = (None, None, None)   # ``_wanted``: the last ``outputs`` dict, a copy, what it asked for
        self._repeat: _Repeat | None = None      # a call repeating the call before needs only its header
        self._input_dtypes = [np.dtype(t.dtype) for t in self.inputs]
        self.calls = 0
        self.record = CallRecord()              # what the last call did on this rank

    def state_entries_specs(self):
        by_name = {t.name: t for t in self.plan.inputs}
        return [by_name[s["input"]] for s in self.state_entries]

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def state_names(self) -> dict[str, str]:
        """State output → the input it becomes."""
        return {s["output"]: s["input"] for s in self.state_entries}

    # --- the with-statement idiom (mpi4py's MPICommExecutor) ------------------------------------

    def __enter__(self):
        if self.is_driver:
            return self
        try:
            self.serve()
        except JobFailure as exc:
            fail(exc)
        return None

    def __exit__(self, kind, exc, tb):
        if not self.is_driver:
            return False
        if isinstance(exc, JobFailure):
            fail(exc)
        if not self.closed:
            try:
                self.close()
            except JobFailure as failure:
                fail(failure)
        return False

    # --- the driver -----------------------------------------------------------------------------

    def _header(self, op: int, fill=None) -> np.ndarray:
        header = np.zeros(self.header_size, dtype=np.int64)
        header[0], header[1] = op, -1     # [1]: a call's rows (ROWS), -1: the whole batch
        if fill is not None:
            fill(header)
        return header

    def _send_header(self, header: np.ndarray) -> None:
        # the plan's idle ranks take part in the statistics and the end alone
        self.transport.header(header, everyone=int(header[0]) in (CLOSE, STATS))

    def close(self) -> None:
        """End the workers' loop (driver). The job's communicators are released on every rank."""
        self._require_driver("close")
        if self.closed:
            return
        self._send_header(self._header(CLOSE))
        self._free()

    def _free(self) -> None:
        self.closed = True
        try:
            self.transport.free()
        except Exception as exc:
            raise JobFailure(f"rank {self.rank} failed: {first_line(exc)}") from exc

    def _require_driver(self, what: str) -> None:
        if not self.is_driver:
            raise RunError(f"Job.{what} is for rank 0 (the driver); the other ranks serve")
        if getattr(self, "closed", False):
            raise RunError(f"Job.{what}: the job is closed")

    def run(self, inputs: dict[str, np.ndarray], outputs=None, row: int | None = None,
            copy: bool = True) -> dict[str, np.ndarray]:
        """One call (driver): ``inputs`` maps the model's inputs to arrays (state inputs may be
        left out: the held state is used; given, they replace it). ``outputs``: the names to
        bring to rank 0 (default: every output that is not state), or a dict of names to
        slices. Returns those outputs.

        ``row``: a call of the inputs' batch of sequences on the rows of the held state from
        ``row`` on, which it reads and updates where they lie (``row_calls`` says whether the
        plan allows it): a server prefills one request so while the others' rows stay as they
        are.

        ``copy=False``: the outputs rank 0 computes itself may be views of the job's buffers,
        valid until its next call (a decode loop that reads the logits before the next step
        is spared their copy)."""
        self._require_driver("run")
        repeat = self._repeat
        if repeat is not None and row is None and self._tracked is repeat.values:
            feeds = repeat.feeds(inputs, outputs)
            if feeds is not None:
                return self._call(repeat.header, feeds, copy)
        given_state = {n: v for n, v in inputs.items() if n in self.state_inputs}
        plain = {n: v for n, v in inputs.items() if n not in self.state_inputs}
        count = self._check_rows(row, plain, given_state) if row is not None else None
        wanted = self._wanted(outputs)
        feeds, values, create = self._check_call(plain, given_state, count)
        if given_state:
            self.set_state(given_state)
        header = self._run_header(feeds, create, wanted)
        header[1] = -1 if row is None else row * ROWS + count
        # the state keeps its shapes through this call: the next call of these inputs repeats it
        again = row is None and not given_state and not create and values is self._tracked \
            and (outputs is None or isinstance(outputs, dict))
        self._repeat = None
        result = self._call(header, feeds, copy)
        if row is None:
            self._track_state(values)
        if again:
            self._repeat = _Repeat(header, values, tuple((spec.name, f.shape, f.dtype) for spec, f in
                                                         zip(self.inputs, feeds)),
                                   outputs, None if outputs is None else dict(outputs))
        return result

    def _call(self, header: np.ndarray, feeds: list[np.ndarray], copy: bool) -> dict[str, np.ndarray]:
        self._send_header(header)
        try:
            result = self._run_call(header, feeds, copy)
        except Exception as exc:
            raise JobFailure(f"rank 0 failed: {first_line(exc)}") from exc
        self.calls += 1
        return result

    # --- training plans ------------------------------------------------------------------------

    def train_step(self, batch: dict[str, np.ndarray], lr: float, **hyper: float) -> float:
        """One step of a training plan (``meshplan plan --train``) on ``batch`` (the model's
        inputs and the loss's target) at learning rate ``lr`` (driver): the loss before the
        update. ``hyper``: the optimizer's other settings (momentum, weight_decay, beta1,
        beta2, eps, clip_norm; torch's defaults where not given). The first step starts the
        weights from the plan's source model unless ``set_state`` or ``load_state_files``
        gave them. After it, ``grad_norm`` is the gradients' global norm before clipping,
        ``train_steps`` counts the steps and ``optimizer_steps`` those that updated the weights
        (AdamW's bias correction reads it): a plan with float32 master weights skips the
        update of a step whose gradients are not finite (``loss_scale`` too large), as torch's
        ``GradScaler`` does."""
        from meshplan.model.weights import read_initializers
        from meshplan.training.master_weights import as_held
        from meshplan.training.optimizers import DEFAULTS

        self._require_driver("train_step")
        training = self.plan.training
        if not training:
            raise RunError(f"plan {self.plan_dir} is not a training plan", hint="plan it with meshplan plan --train")
        starting = list(training["weights"]) + list(training.get("statistics", {}))
        if not all(w in self.state_shapes for w in starting):
            source = Path(training["source"]["path"])
            if not source.is_file():
                raise RunError(f"the source model {source} is gone", hint="set the weights, or resume a checkpoint")
            for name, value in as_held(training["weights"], read_initializers(source, starting)):
                self.set_state({name: value})
        values = {**DEFAULTS, **{"train." + k: float(v) for k, v in hyper.items()}}
        count = int(training.get("microbatches", 1))
        parts = [dict(batch)] if count == 1 else _split_batch(batch, count)
        for index, part in enumerate(parts):   # a step of several microbatches: the last one updates
            feeds = dict(part)
            for name in training["hyperparameters"]:
                if name == "train.apply":
                    value = float(index == count - 1)
                elif name == "train.lr":
                    value = lr
                elif name == "train.step":
                    value = self.optimizer_steps + 1
                elif name in values:
                    value = values[name]
                else:
                    raise RunError(f"train_step: no value for {name}")
                feeds[name] = np.asarray(value, dtype=np.float32)
            out = self.run(feeds, outputs=[TRAIN_LOSS] + [TRAIN_GRAD_NORM] * (index == count - 1))   # (the norm: once)
        self.train_steps += 1
        self.grad_norm = float(out[TRAIN_GRAD_NORM])
        if math.isfinite(self.grad_norm) or not training.get("guarded"):
            self.optimizer_steps += 1
        return float(out[TRAIN_LOSS])

    def stats(self) -> CallStats:
        """What the last call did on every rank (driver; collective under the hood)."""
        self._require_driver("stats")
        self._send_header(self._header(STATS))
        return self._gather_stats()

    # --- the workers -----------------------------------------------------------------------------

    def serve(self) -> None:
        """Wait for calls from rank 0 and take part in them until the job closes (workers)."""
        if self.is_driver:
            raise RunError("Job.serve is for the workers; rank 0 drives")
        header = np.empty(self.header_size, dtype=np.int64)
        try:
            while True:
                self.transport.header(header)   # (an idle rank hears only of the statistics and the end)
                op = int(header[0])
                if op == CLOSE:
                    break
                if op == RUN:
                    self._run_call(header, None)
                elif op == RESET:
                    self._drop_state()
                elif op == GET_STATE:
                    self._gather_state(list(header[self.header_size - len(self.state_entries):].astype(bool)))
                elif op == SET_STATE:
                    self._scatter_state(None, header)
                elif op == STATS:
                    self._gather_stats()
                elif op == SAVE_STATE:
                    self._state_files(None, save=True)
                elif op == LOAD_STATE:
                    self._state_files(None, save=False)
                elif op == COPY_ROWS:
                    self._copy_rows(*(int(v) for v in header[2:5]))
        except Exception as exc:
            raise JobFailure(f"rank {self.rank} failed: {first_line(exc)}") from exc
        self._free()

    # --- one call on every rank ------------------------------------------------------------------

    def _send(self, tensor: str, count: int) -> None:
        self.record.count(tensor, count)

    @property
    def sent(self) -> dict[str, int]:
        """Bytes this rank sent in the last call, per tensor."""
        return self.record.sent

    def _run_call(self, header: np.ndarray, feeds: list[np.ndarray] | None, copy: bool = True) -> dict[str, np.ndarray]:
        plan, stage, rank = self.plan, self.stage, self.rank
        self.record.start()
        origin = time.perf_counter()
        if stage is None:   # an idle rank: nothing reaches it, it sends nothing
            return {}
        shapes, create, wanted = self._parse_run(header)
        # the call's inputs, from rank 0 to the ranks that read them
        received: dict[str, np.ndarray] = {}
        for index, spec in enumerate(self.inputs):
            if not self.transport.reads_input(index):
                continue
            array, sent = self.transport.bcast_input(index, feeds[index] if rank == 0 else None, shapes[index],
                                                     spec.dtype)
            if rank == 0 and sent:
                self._send(spec.name, sent)
            received[spec.name] = array
        for name, shape in create.items():
            if name in stage.inputs:
                made = self._new_states.get((name, shape))
                if made is None:
                    if len(self._new_states) >= SIZED_KEPT:
                        self._new_states.clear()
                    made = self._new_states[(name, shape)] = (self.state_specs[name].local_shape(shape, self.mesh),
                                                             self._dtype_of(name))
                self.state[name] = self._empty_state(*made, name)
        micro = split_microbatches(received, plan) if received else [dict() for _ in range(plan.microbatches)]
        results = self.interpreter.run(micro, wanted, origin, int(header[1]), copy)
        return join_microbatches(results, plan) if rank == 0 and results and results[0] else {}

    def _gather_stats(self) -> CallStats:
        import json

        record = self.record
        mine = json.dumps({"seconds": record.program_seconds, "sent": record.sent,
                           "state_bytes": self.state_bytes(), "trace": [event(*t) for t in record.trace],
                           "rss": peak_rss_bytes()}).encode()
        every = self.transport.gather_bytes(mine)
        if every is None:
            return CallStats()
        stats = CallStats()
        for payload in every:
            item = json.loads(payload)
            stats.program_seconds.append(item["seconds"])
            stats.sent_bytes.append(item["sent"])
            stats.state_bytes.append(item["state_bytes"])
            stats.trace.extend(item["trace"])
            stats.peak_rss_bytes.append(item["rss"])
        return stats


def _split_batch(batch: dict[str, np.ndarray], count: int) -> list[dict[str, np.ndarray]]:
    """A step's batch as ``count`` microbatches along the leading axis."""
    sizes = {int(np.shape(v)[0]) for v in batch.values()}
    if len(sizes) != 1 or next(iter(sizes)) % count:
        raise RunError(f"train_step: a batch of {sorted(sizes)} samples does not split into {count} microbatches")
    size = next(iter(sizes)) // count
    return [{n: np.ascontiguousarray(v[k * size:(k + 1) * size]) for n, v in batch.items()} for k in range(count)]


def as_failure(exc: BaseException) -> JobFailure:
    """``exc`` raised on rank 0 as a failure of the job (``JobFailure`` as it is)."""
    return exc if isinstance(exc, JobFailure) else JobFailure(f"rank 0 failed: {first_line(exc)}")


@contextmanager
def driving(job: Job, closed=None):
    """Rank 0's work on a started job (``run``, ``generate`` and ``serve`` drive inside it).
    A library error (a call refused before any rank heard of it) closes the job, so that the
    workers end with it, then runs ``closed()`` (the collective the workers make once the job
    has closed, where they make one), and goes on. A failure of the job (``JobFailure``: the
    workers may be inside a call) and anything else raised (numpy's errors, a bug) leave as
    a ``JobFailure``, which the command's guard ends by aborting the job: closing it would
    wait on workers that never answer, and leaving the process would leave them waiting for
    a header for ever."""
    try:
        yield
    except JobFailure:
        raise
    except MeshplanError:
        if not job.closed:
            job.close()
            if closed is not None:
                closed()
        raise
    except Exception as exc:
        raise as_failure(exc) from exc


def fail(exc: BaseException) -> None:
    """End the whole job after a rank's failure: its one line on stderr, then MPI_Abort (the
    other ranks are waiting on it). The one place the library writes and exits: an MPI job
    has no other way to stop its ranks."""
    sys.stderr.write(f"meshplan: error: {first_line(exc)}\n")
    abort_job(1)


__all__ = ["CallStats", "Job", "JobFailure", "ReportedElsewhere", "as_failure", "driving", "fail"]
