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
stays usable. A rank that fails during a call ends the whole job (one line on stderr,
then ``MPI_Abort``): the others are waiting on it.

State (``plan.state``): a state output is kept by the ranks that make it, in its
planned layout, and is the next call's input on those ranks: it never goes to rank 0 nor
between ranks, unless ``get_state``/``set_state`` ask. An unset state input is created
as zeros at the call's sizes (its free dims that no other input gives at the bottom of
their range: an empty cache). With ``cache_in_place``, a key/value cache of fixed capacity
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

from meshplan.errors import JobFailure, MeshplanError, ReportedElsewhere, RunError
from meshplan.model.sizes import Sizes
from meshplan.runtime.call_sizes import CallSizes, shape_at
from meshplan.process_memory import peak_rss_bytes
from meshplan.plan_format import OUTPUT_COLLECTOR, TensorSpec, local_name, read_plan, require_programs
from meshplan.runtime.buffers import HOST, DeviceBuffers, DeviceTensor
from meshplan.runtime.program import SEGMENT_GRAPHS, ProgramRunner
from meshplan.runtime.sessions import check_program_files, provider_name, providers_for
from meshplan.runtime.state_layout import (assemble, copy_cache_rows, distinct_holders, piece_of, state_mesh,
                                           state_spec)
from meshplan.runtime.tensors import join_microbatches, split_microbatches
from meshplan.runtime.threads import (ThreadChoice, bind_to, may_bind, one_pool, pin_calling_thread, plan_threads,
                                      with_idle_cores)
from meshplan.runtime.transport import Transport, abort_job, agree, choose_buffers, world
from meshplan.runtime.waiting import set_sleeping
from meshplan.sharding import LogicalMesh, ShardingSpec, placement_axes

CLOSE, RUN, RESET, GET_STATE, SET_STATE, STATS, SAVE_STATE, LOAD_STATE, COPY_ROWS = range(9)
END = np.iinfo(np.int64).max      # a slice's stop that means "to the end"
_SHAPE_TAG, _DATA_TAG, _STATE_TAG = 1 << 20, 1 << 21, 1 << 22
_ROWS = 1 << 32     # a call of some rows: header[1] = first row * _ROWS + their count
_SIZED_KEPT = 512   # calls' checked sizes kept (by shapes): a decode loop's few, a prompt's pieces
_KEPT_VIEW_BYTES = 16 << 20   # the largest output whose view ``Job._take_output`` keeps for the next call
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


def _base(name: str) -> str:
    return name.split("@", 1)[0]


@dataclass(frozen=True)
class _Repeat:
    """A call that repeats the call before (a decode step, from its second on): the same
    input names, shapes and dtypes, the same ``outputs`` asked for, the state of the
    shapes it leaves (``values``: the call's sizes, ``Job._tracked`` while nothing reset
    or set the state). Such a call has the header of the one before and needs none of its
    checks: ``Job.run`` sends the header and runs."""

    header: np.ndarray
    values: dict                  # the call's sizes (``Job._check_call``), whose state shapes it leaves
    inputs: tuple                 # (name, shape, dtype) in plan order
    outputs: object               # the ``outputs`` argument (the same object each step)
    seen: object                  # a copy of it as it was (a caller may change its dict)

    def feeds(self, inputs: dict, outputs) -> list | None:
        """The call's feeds in plan order, or None where this call is not a repeat."""
        if outputs is not self.outputs or (outputs is not None and outputs != self.seen) \
                or len(inputs) != len(self.inputs):
            return None
        feeds = []
        for name, shape, dtype in self.inputs:
            array = inputs.get(name)
            if array.__class__ is not np.ndarray or array.shape != shape or array.dtype != dtype \
                    or not array.flags.c_contiguous:
                return None
            feeds.append(array)
        return feeds


class Job:
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
            program = plan.program_of_rank(self.rank)
            session, buffers, path_text, resident = None, HOST, "none: this rank is idle in the plan", None
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
                                        choose=_LOGITS if choose else None)
                # one spinning pool for a rank with cores of its own: its one session's, or the
                # process's shared by its segments (made now, on the cores it is bound to)
                pooled = one_pool(self.threads, session.sessions, shared_pool_threads())
                if not pooled.shared_pool or share_one_pool(pooled.threads):
                    self.threads = pooled
                session.open(providers, self.threads.threads, self.threads.spinning, graphs,
                             self.threads.pool_affinities(), graphs_in_segments=segment_graphs)
                pin_calling_thread(self.threads)   # (onnxruntime pinned its pool threads)
                buffers, path_text = choose_buffers(transfer, session.providers[0], device_id, MPI,
                                                    alone=self.size == 1)
                set_sleeping(session.providers[0] != CUDA)
                on_cuda = session.providers[0] == CUDA
                if on_device or on_device is None and on_cuda:
                    if buffers is HOST:
                        resident = DeviceBuffers("cuda" if on_cuda else "cpu", device_id if on_cuda else 0, providers)
                        session.keep_on(resident)
                        path_text += "; state and activations kept on the " + ("GPU" if on_cuda else "device")
                    elif plan.microbatches == 1:   # device buffers travel as they are: the runs keep
                        # their bindings (and graphs) too; a run of another microbatch would write into the
                        # buffers of the one before while a send of them may still be under way
                        session.keep_on(buffers, staged=False)
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
            self.state_buffers = resident or buffers    # where the state lies (``on_device``)
            self.transfer_path = path_text
            self.provider = session.providers[0] if session is not None else "none"
            self._setup()
            self.transport = Transport(plan, everyone, MPI, buffers, [t.name for t in self.inputs])
        except Exception as exc:
            raise JobFailure(f"rank {self.rank} failed: {_line(exc)}") from exc
        self.closed = False
        self.train_steps, self.grad_norm = 0, None   # a training plan's steps (``train_step``)

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
        self.state_specs = {s["input"]: state_spec(s) for s in plan.state}
        outputs = {t.name: t for t in plan.outputs}
        self._state_output_shapes = [(s["input"], outputs[s["output"]].shape) for s in plan.state]
        # the job owns its state buffers: a program may update them in place (a fixed-capacity cache)
        self.own_state = frozenset(local_name(name, spec) for name, spec in self.state_specs.items()) \
            if self.cache_in_place else frozenset()
        self.header_size = 2 + sum(len(t.shape) for t in self.inputs) + sum(1 + len(t.shape) for t in self.state_entries_specs()) \
            + sum(1 + 2 * len(t.shape) for t in self.outputs) + len(self.state_entries)
        self.state: dict[str, object] = {}      # state input → this rank's local piece (its holders)
        self._spare: dict[tuple, dict] = {}     # device state buffers let go, by shape, then name: to take again
        self._made: dict[str, np.ndarray] = {}  # host state buffers this job made (``_empty_state``)
        self._kept: dict[str, np.ndarray] = {}  # … let go by a reset, to take again
        self.state_shapes: dict[str, tuple | None] = {}   # on rank 0: each state's whole shape, where known
        self._route_cache: dict[frozenset, tuple] = {}     # ``_routes`` by the set of wanted outputs
        self._sized: dict[tuple, tuple] = {}    # ``_check_call``'s sizes by the call's shapes (and the state's)
        self._tracked = None                   # the sizes ``_track_state`` last followed
        self._last_key = None                  # the last call's shapes (``_check_call``)
        self._headers: dict[tuple, np.ndarray] = {}   # RUN headers by shapes and wanted outputs
        self._parsed: dict[bytes, tuple] = {}         # ``_parse_run``: RUN headers read, by their bytes
        self._new_states: dict[tuple, tuple] = {}     # (state, its shape) → (this rank's piece's shape, dtype)
        self._read_wanted = (None, None, None)   # ``_wanted``: the last ``outputs`` dict, a copy, what it asked for
        self._repeat: _Repeat | None = None      # a call repeating the call before needs only its header
        self._taken: dict[str, tuple] = {}       # ``_take_output``: output → (its array, the box, the view)
        self._input_dtypes = [np.dtype(t.dtype) for t in self.inputs]
        self.calls = 0
        self.sent: dict[str, int] = {}
        self.program_seconds = 0.0
        self.trace: list[tuple] = []            # the last call's events (``_event``'s arguments)

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
        header[0], header[1] = op, -1     # [1]: a call's rows (_ROWS), -1: the whole batch
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
            raise JobFailure(f"rank {self.rank} failed: {_line(exc)}") from exc

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
        header[1] = -1 if row is None else row * _ROWS + count
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
            raise JobFailure(f"rank 0 failed: {_line(exc)}") from exc
        self.calls += 1
        return result

    @property
    def row_calls(self) -> bool:
        """Whether ``run(..., row=r)`` works: every state held on the host, whole along its
        batch axis on every rank, no microbatches, and a plan whose batch may be 1."""
        plan = self.plan
        dim = plan.batch.get("dim")
        one = self.sizes is not None and dim is not None and (
            (dim in self.sizes.ranges and self.sizes.ranges[dim].accepts(1)) or self.sizes.fixed.get(dim) == 1)
        return bool(self.state_entries) and plan.microbatches == 1 and self.buffers is HOST and one \
            and all(not placement_axes(spec.dims[0]) for spec in self.state_specs.values() if spec.dims)

    def _check_rows(self, row: int, plain: dict, given_state: dict) -> int:
        """The number of rows a call from ``row`` covers (its inputs' batch), or RunError."""
        if not self.row_calls:
            raise RunError("this plan takes no call of some rows (it needs host buffers, no microbatches, the state "
                           "whole along the batch and a batch that may be 1)")
        if given_state:
            raise RunError("a call of some rows runs on the held state: give no state with it")
        shapes = [self.state_shapes.get(name) for name in self.state_inputs]
        if any(shape is None for shape in shapes):
            raise RunError("a call of some rows needs the state a call of the whole batch made")
        dim = self.plan.batch["dim"]
        counts = {int(np.shape(plain[spec.name])[0]) for spec in self.inputs
                  if spec.shape and spec.shape[0] == dim and spec.name in plain and np.ndim(plain[spec.name])}
        if len(counts) != 1:
            raise RunError(f"a call of some rows needs inputs whose first dim is the batch ({dim})")
        count = counts.pop()
        if not (0 <= row and row + count <= shapes[0][0]):
            raise RunError(f"rows {row} to {row + count - 1} are outside the held state's batch of {shapes[0][0]}")
        return count

    def _wanted(self, outputs) -> dict[str, tuple]:
        """``outputs`` read (names → slices); a caller passing the same dict each step (the
        generation loop's stepper) has it read once."""
        last, seen, wanted = self._read_wanted
        if outputs is last and outputs is not None and outputs == seen:   # (the same dict, unchanged)
            return wanted
        wanted = self._read_outputs(outputs)
        if isinstance(outputs, dict):
            self._read_wanted = (outputs, dict(outputs), wanted)
        return wanted

    def _read_outputs(self, outputs) -> dict[str, tuple]:
        names = [t.name for t in self.outputs]
        if outputs is None:   # the plan's outputs (not the ids a job of one rank may choose)
            return {n: () for n in names if n != self.chosen}
        chosen = outputs if isinstance(outputs, dict) else {n: () for n in outputs}
        wanted = {}
        for name, index in chosen.items():
            if name in self.state_outputs:
                raise RunError(f"output '{name}' is state: read it with get_state")
            if name not in names:
                raise RunError(f"the model has no output {name!r} (outputs: {', '.join(names)})")
            index = index if isinstance(index, tuple) else (index,)
            if not all(isinstance(s, slice) and s.step in (None, 1) for s in index):
                raise RunError(f"output '{name}': ask for slices with step 1 (np.s_[:, -1:]), got {index!r}")
            wanted[name] = index
        return wanted

    def _check_call(self, plain: dict, given_state: dict, rows: int | None = None):
        """The call's feeds in plan order, every dim's size, and the state to create (its whole
        shape) — or RunError, one line, before any rank hears of the call. A call of some
        ``rows`` sees the state as that many rows of it."""
        names = {t.name for t in self.inputs}
        extra = sorted(set(plain) - names)
        if extra:
            raise RunError(f"the model has no input {extra[0]!r} (inputs: {', '.join(sorted(names | set(self.state_inputs)))})")
        feeds = []
        for spec, dtype in zip(self.inputs, self._input_dtypes):
            if spec.name not in plain:
                raise RunError(f"input '{spec.name}' is missing")
            array = plain[spec.name]
            if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
                array = np.asarray(array, order="C")
            if array.dtype != dtype:
                if array.dtype.kind == "U" and dtype == np.dtype(object):
                    array = array.astype(object)
                else:
                    raise RunError(f"input '{spec.name}' has dtype {array.dtype}, the plan expects {spec.dtype}")
            feeds.append(array)
        # a decode step has the shapes of the step before: their sizes were checked then
        key = None if given_state else (rows, tuple(f.shape for f in feeds),
                                        tuple(self.state_shapes.get(n) for n in self.state_inputs))
        self._last_key = key
        found = self._sized.get(key) if key is not None else None
        if found is not None:
            return feeds, found[0], found[1]
        sizes = CallSizes(self.sizes)
        for spec, array in zip(self.inputs, feeds):
            sizes.add(spec, array.shape)
        sizes.check_ranges()
        by_name = {t.name: t for t in self.plan.inputs}
        for name in self.state_inputs:
            shape = np.shape(given_state[name]) if name in given_state else self.state_shapes.get(name)
            if shape is not None and rows is not None:
                shape = (rows, *shape[1:])
            if shape is not None:
                if name in given_state and np.asarray(given_state[name]).dtype != np.dtype(by_name[name].dtype):
                    raise RunError(f"state '{name}' has dtype {np.asarray(given_state[name]).dtype}, "
                                   f"the plan expects {by_name[name].dtype}")
                sizes.add(by_name[name], shape)
        values = sizes.values()
        create = {}
        for name in self.state_inputs:
            if name in given_state or self.state_shapes.get(name) is not None:
                continue
            shape = shape_at(by_name[name].shape, values)
            if shape is None:
                raise RunError(f"state '{name}' is not set and its shape {by_name[name].shape} does not follow "
                               "from the call's sizes", hint="set it with set_state, or pass it as an input")
            create[name] = shape
        if key is not None:
            if len(self._sized) >= _SIZED_KEPT:
                self._sized.clear()
            self._sized[key] = (values, create)
        return feeds, values, create

    def _run_header(self, feeds: list[np.ndarray], create: dict, wanted: dict) -> np.ndarray:
        """A call's header: kept by the call's shapes and wanted outputs (a decode step's is
        the step before's)."""
        key = None
        if self._last_key is not None:   # (the state it creates follows from the same key: ``_sized``)
            key = (self._last_key, tuple((name, tuple((s.start, s.stop) for s in index))
                                         for name, index in wanted.items()))
            found = self._headers.get(key)
            if found is not None:
                return found.copy()
        header = self._header(RUN, lambda h: self._fill_run(h, feeds, create, wanted))
        if key is not None:
            if len(self._headers) >= _SIZED_KEPT:
                self._headers.clear()
            self._headers[key] = header.copy()
        return header

    def _fill_run(self, header: np.ndarray, feeds: list[np.ndarray], create: dict, wanted: dict) -> None:
        k = 2
        for spec, array in zip(self.inputs, feeds):
            header[k:k + len(spec.shape)] = array.shape
            k += len(spec.shape)
        for spec in self.state_entries_specs():
            if spec.name in create:
                header[k] = 1
                header[k + 1:k + 1 + len(spec.shape)] = create[spec.name]
            k += 1 + len(spec.shape)
        for spec in self.outputs:
            if spec.name in wanted:
                header[k] = 1
                box = list(wanted[spec.name]) + [slice(None)] * (len(spec.shape) - len(wanted[spec.name]))
                for d, s in enumerate(box[:len(spec.shape)]):
                    header[k + 1 + 2 * d] = 0 if s.start is None else s.start
                    header[k + 2 + 2 * d] = END if s.stop is None else s.stop
            k += 1 + 2 * len(spec.shape)

    def _track_state(self, values: dict) -> None:
        if values is self._tracked:   # the same sizes as the call before (``_sized``)
            return
        self._tracked = values
        for name, shape in self._state_output_shapes:
            self.state_shapes[name] = shape_at(shape, values)

    # --- state ---------------------------------------------------------------------------------

    def reset_state(self) -> None:
        """Forget every state: the next call starts from empty (driver)."""
        self._require_driver("reset_state")
        self._send_header(self._header(RESET))
        self._drop_state()
        self.state_shapes = {}
        self._tracked = None

    def get_state(self, names=None) -> dict[str, np.ndarray]:
        """The held state, gathered on rank 0, by input name (default: all) (driver)."""
        self._require_driver("get_state")
        chosen = self._state_mask(names)
        self._send_header(self._header(GET_STATE, lambda h: self._fill_mask(h, chosen)))
        try:
            return self._gather_state(chosen)
        except Exception as exc:
            raise JobFailure(f"rank 0 failed: {_line(exc)}") from exc

    def set_state(self, values: dict[str, np.ndarray]) -> None:
        """Replace state inputs by these arrays (each sent to the ranks that hold it, in its
        layout) (driver)."""
        self._require_driver("set_state")
        by_name = {t.name: t for t in self.plan.inputs}
        for name, value in values.items():
            if name not in self.state_inputs:
                raise RunError(f"{name!r} is not a state input (state: {', '.join(self.state_inputs) or 'none'})")
            array = np.asarray(value)
            if array.ndim != len(by_name[name].shape) or array.dtype != np.dtype(by_name[name].dtype):
                raise RunError(f"state '{name}' needs {len(by_name[name].shape)} dims of {by_name[name].dtype}, "
                               f"got {list(array.shape)} {array.dtype}")
            self._check_divides(name, array.shape)
        chosen = [s["input"] in values for s in self.state_entries]

        def fill(header):
            self._fill_mask(header, chosen)
            k = 2 + sum(len(t.shape) for t in self.inputs)
            for spec in self.state_entries_specs():
                if spec.name in values:
                    header[k + 1:k + 1 + len(spec.shape)] = np.shape(values[spec.name])
                k += 1 + len(spec.shape)

        self._send_header(self._header(SET_STATE, fill))
        try:
            self._scatter_state({n: np.asarray(v, order="C") for n, v in values.items()})
        except Exception as exc:
            raise JobFailure(f"rank 0 failed: {_line(exc)}") from exc
        for name, value in values.items():
            self.state_shapes[name] = tuple(np.shape(value))
            self._tracked = None

    def copy_rows(self, source: int, target: int, positions: int) -> None:
        """Copy the first ``positions`` positions of every state's row ``source`` into row
        ``target``, on every rank that holds the state (driver): a prompt prefilled once for
        several sequences, or a prefix another row holds (serving). The positions are a
        cache's (axis 2 of a 4-D state, else the second last). Needs what ``row_calls`` needs
        (the state on the host, whole along its batch axis)."""
        self._require_driver("copy_rows")
        if not self.row_calls or self.state_buffers is not HOST or self.header_size < 5:
            raise RunError("this plan's cache rows cannot be copied (it needs host buffers, no microbatches and the "
                           "state whole along the batch)")
        if not all(name in self.state_shapes for name in self.state_inputs):
            raise RunError("copying cache rows needs the state a call of the whole batch made")
        rows = self.state_shapes[next(iter(self.state_inputs))][0]
        if not (0 <= source < rows and 0 <= target < rows and source != target):
            raise RunError(f"copy_rows: rows {source} and {target} of {rows}")

        def fill(header):
            header[2:5] = source, target, positions
        self._send_header(self._header(COPY_ROWS, fill))
        self._copy_rows(source, target, positions)

    def _copy_rows(self, source: int, target: int, positions: int) -> None:
        for array in self.state.values():
            copy_cache_rows(array, source, target, positions)

    # --- training plans ------------------------------------------------------------------------

    def train_step(self, batch: dict[str, np.ndarray], lr: float, **hyper: float) -> float:
        """One step of a training plan (``meshplan plan --train``) on ``batch`` (the model's
        inputs and the loss's target) at learning rate ``lr`` (driver): the loss before the
        update. ``hyper``: the optimizer's other settings (momentum, weight_decay, beta1,
        beta2, eps, clip_norm; torch's defaults where not given). The first step starts the
        weights from the plan's source model unless ``set_state`` or ``load_state_files``
        gave them. After it, ``grad_norm`` is the gradients' global norm before clipping and
        ``train_steps`` counts the steps (AdamW's bias correction reads it)."""
        from meshplan.model.weights import read_initializers
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
            for name, value in read_initializers(source, starting):
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
                    value = self.train_steps + 1
                elif name in values:
                    value = values[name]
                else:
                    raise RunError(f"train_step: no value for {name}")
                feeds[name] = np.asarray(value, dtype=np.float32)
            out = self.run(feeds, outputs=[TRAIN_LOSS, TRAIN_GRAD_NORM])
        self.train_steps += 1
        self.grad_norm = float(out[TRAIN_GRAD_NORM])
        return float(out[TRAIN_LOSS])

    def save_state_files(self, directory) -> None:
        """Every working rank writes the state pieces it is the first holder of into
        ``directory/rankN.npz`` (``state_files``): no rank gathers the state (driver)."""
        self._require_driver("save_state_files")
        self._send_header(self._header(SAVE_STATE))
        self._state_files(str(directory), save=True)

    def load_state_files(self, directory) -> None:
        """Every working rank reads its state pieces back from what ``save_state_files`` of a
        job of this same plan wrote (driver)."""
        self._require_driver("load_state_files")
        self._send_header(self._header(LOAD_STATE))
        self._state_files(str(directory), save=False)
        self._tracked = None
        for entry in self.state_entries:
            spec = next(s for s in self.state_entries_specs() if s.name == entry["input"])
            self.state_shapes[entry["input"]] = tuple(spec.shape)

    def _state_files(self, directory: str | None, save: bool) -> None:
        """Save or load on every working rank; the first rank's error stops all of them."""
        from meshplan.runtime.state_files import piece_sources, rank_file, read_pieces, write_pieces

        comm = self.transport.headers
        directory = comm.bcast(directory, root=0) if comm.Get_size() > 1 else directory
        error = None
        try:
            mine = [e for e in self.state_entries if self.rank in self.plan.stages[e["stage"]].devices]
            if save:
                first = [e["input"] for e in mine if self.rank in distinct_holders(self.plan, e)]
                for name in first:
                    if name not in self.state:
                        raise RunError(f"state '{name}' is not set")
                write_pieces(rank_file(directory, self.rank),
                             ((n, np.asarray(self.buffers.to_host(self.state[n]), order="C")) for n in first))
            else:
                by_file: dict[int, set] = {}
                for entry in mine:
                    by_file.setdefault(piece_sources(self.plan, entry)[self.rank], set()).add(entry["input"])
                for source, names in by_file.items():
                    for name, piece in read_pieces(rank_file(directory, source), names):
                        self.state[name] = self.state_buffers.from_host(piece)
                        self._made.pop(name, None)
                        self._kept.pop(name, None)
        except Exception as exc:
            error = f"rank {self.rank}: {_line(exc)}"
        errors = comm.gather(error, root=0) if comm.Get_size() > 1 else [error]
        if self.rank == 0 and any(errors):
            raise RunError(next(e for e in errors if e))

    def _drop_state(self) -> None:
        """Let the state go. Buffers to take again (``_empty_state``): the device's, and on the
        host a cache updated in place that is still the array the job made (one per state, a
        state the caller sets lets it go). Where every host state is so kept, the sessions keep
        their bindings too: the next request's cache is the same arrays, bound where they were
        (rebinding them cost 55 µs of a 0.1 ms first token on the CPU)."""
        kept = 0
        for name, tensor in self.state.items():
            if isinstance(tensor, DeviceTensor) and tensor.whole:
                self._spare.setdefault((tensor.shape, tensor.dtype.str), {})[name] = tensor
                kept += 1
            elif tensor is self._made.get(name):
                self._kept[name] = tensor
                kept += 1
        holds = self.state_buffers is HOST and kept == len(self.state) and bool(self._kept)
        self.state.clear()
        self._made.clear()
        if self.session is not None and not holds:
            self.session.release()   # the sessions' kept bindings hold the cache buffers too

    def _check_divides(self, name: str, shape) -> None:
        entry = self.state_inputs[name]
        stage = self.plan.stages[entry["stage"]]
        mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
        spec = self.state_specs[name]
        if not spec.is_valid_for(tuple(shape), mesh):
            raise RunError(f"state '{name}' of shape {list(shape)} cannot be split as the plan holds it ({spec} "
                           f"over {stage.logical_mesh[0]}x{stage.logical_mesh[1]} devices)")

    def _state_mask(self, names) -> list[bool]:
        if names is None:
            return [True] * len(self.state_entries)
        names = [names] if isinstance(names, str) else list(names)
        for name in names:
            if name not in self.state_inputs:
                raise RunError(f"{name!r} is not a state input (state: {', '.join(self.state_inputs) or 'none'})")
        return [s["input"] in names for s in self.state_entries]

    def _fill_mask(self, header: np.ndarray, chosen: list[bool]) -> None:
        header[self.header_size - len(chosen):] = chosen

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
            raise JobFailure(f"rank {self.rank} failed: {_line(exc)}") from exc
        self._free()

    # --- one call on every rank ------------------------------------------------------------------

    def _send(self, tensor: str, nbytes: int) -> None:
        key = _base(tensor)
        self.sent[key] = self.sent.get(key, 0) + int(nbytes)

    def _run_call(self, header: np.ndarray, feeds: list[np.ndarray] | None, copy: bool = True) -> dict[str, np.ndarray]:
        plan, stage, rank = self.plan, self.stage, self.rank
        self.sent = {}
        self.program_seconds = 0.0
        origin = time.perf_counter()
        self.trace = []
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
                    if len(self._new_states) >= _SIZED_KEPT:
                        self._new_states.clear()
                    made = self._new_states[(name, shape)] = (self.state_specs[name].local_shape(shape, self.mesh),
                                                             self._dtype_of(name))
                self.state[name] = self._empty_state(*made, name)
        micro = split_microbatches(received, plan) if received else [dict() for _ in range(plan.microbatches)]
        results = self._microbatches(micro, wanted, origin, int(header[1]), copy)
        return join_microbatches(results, plan) if rank == 0 and results and results[0] else {}

    def _parse_run(self, header: np.ndarray) -> tuple[list, dict, dict]:
        """A RUN header read: each input's shape, the state to create, the outputs wanted
        (name → slices). Kept by the header's bytes: a decode step's is the step before's."""
        key = header.tobytes()
        found = self._parsed.get(key)
        if found is not None:
            return found
        k = 2
        shapes = []
        for spec in self.inputs:
            shapes.append(tuple(int(d) for d in header[k:k + len(spec.shape)]))
            k += len(spec.shape)
        create = {}
        for spec in self.state_entries_specs():
            if header[k]:
                create[spec.name] = tuple(int(d) for d in header[k + 1:k + 1 + len(spec.shape)])
            k += 1 + len(spec.shape)
        wanted = {}
        for spec in self.outputs:
            if header[k]:
                wanted[spec.name] = tuple(slice(int(header[k + 1 + 2 * d]),
                                                None if header[k + 2 + 2 * d] == END else int(header[k + 2 + 2 * d]))
                                          for d in range(len(spec.shape)))
            k += 1 + 2 * len(spec.shape)
        if len(self._parsed) >= _SIZED_KEPT:
            self._parsed.clear()
        found = self._parsed[key] = (shapes, create, wanted)
        return found

    def _empty_state(self, shape, dtype, name: str):
        """A state of zeros, or a buffer of this shape that an earlier state left
        (``_drop_state``), taken again: on the host, the arrays the sessions' bindings hold
        already; on the device, so that its address, which a CUDA graph reads, stays:
        state ``name``'s own where it left one (any other would change the addresses a graph
        of the decode step was captured with: the buffers of two layers swapped at each new
        request, and every other request captured its graph again).
        A cache updated in place keeps what the buffer held (as its positions past a
        sequence's length do: attention never reads them), so a new request copies nothing
        to the device: zeroing a cache of 6 MB from the host took part of an H200's TTFT,
        one of gigabytes would take most of it."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        if self.state_buffers is HOST:   # one buffer kept per state: another shape lets it go
            tensor = self._kept.pop(name, None)
            if tensor is None or tensor.shape != shape or tensor.dtype != dtype:
                tensor = np.zeros(shape, dtype=dtype)
            if self.cache_in_place:
                self._made[name] = tensor
            return tensor
        spare = self._spare.get((shape, dtype.str))
        if spare:
            tensor = spare.pop(name) if name in spare else spare.pop(next(iter(spare)))
            if not self.cache_in_place:
                tensor.value.update_inplace(np.zeros(shape, dtype=dtype))
            return tensor
        return self.state_buffers.from_host(np.zeros(shape, dtype=dtype))

    def _dtype_of(self, name: str) -> str:
        return next(t.dtype for t in self.plan.inputs if t.name == name)

    def _routes(self, wanted: dict) -> tuple:
        """What this rank receives, sends and keeps in a call that brings ``wanted`` to rank
        0: the plan fixes it, so it is worked out once per set of wanted outputs."""
        key = frozenset(wanted)
        found = self._route_cache.get(key)
        if found is not None:
            return found
        plan, stage, rank = self.plan, self.stage, self.rank
        arriving = [(local_name(r.tensor, ShardingSpec.parse(r.dst_spec)), i)
                    for i, r in enumerate(plan.reshardings) if r.dst_stage == stage.index]
        leaving = [(r.tensor, local_name(r.tensor, ShardingSpec.parse(r.src_spec)), i)
                   for i, r in enumerate(plan.reshardings) if r.src_stage == stage.index]
        whole = [(i, t) for i, t in enumerate(plan.transfers) if t.dst_rank == rank and t.dst_stage == stage.index]
        outgoing = [(i, t) for i, t in enumerate(plan.transfers)
                    if t.src_rank == rank and t.dst_rank != rank
                    and (t.dst_stage != OUTPUT_COLLECTOR or t.tensor in wanted)]
        incoming = [(i, t) for i, t in enumerate(plan.transfers)
                    if rank == 0 and t.dst_stage == OUTPUT_COLLECTOR and t.src_rank != 0 and t.tensor in wanted]
        local_outputs = [t.tensor for t in plan.transfers
                         if t.dst_stage == OUTPUT_COLLECTOR and t.src_rank == rank == t.dst_rank and t.tensor in wanted]
        if self.chosen in wanted and rank == 0:
            local_outputs.append(self.chosen)
        # state this stage reads (input, its local name) and makes (input, output's local name)
        reads = [(name, local_name(name, self.state_specs[name])) for name in stage.inputs if name in self.state_inputs]
        makes = [(e["input"], local_name(e["output"], self.state_specs[e["input"]]))
                 for e in self.state_entries if e["stage"] == stage.index]
        # the stage's outputs that only go to rank 0 (not to a later stage, nor state): its
        # programs may take the wanted part of them before their last collective
        # (``run_lockstep``'s ``narrow``); decided alike on every rank of the stage, whichever
        # of them sends the output, since each rank's part of the collective must match
        to_rank0 = {t.tensor for t in plan.transfers
                    if t.src_stage == stage.index and t.dst_stage == OUTPUT_COLLECTOR and t.tensor in wanted}
        if self.chosen in wanted and rank == 0:
            to_rank0.add(self.chosen)
        elsewhere = ({local for _, local, _ in leaving} | {local for _, local in makes}
                     | {t.tensor for t in plan.transfers if t.src_stage == stage.index and t.dst_stage != OUTPUT_COLLECTOR})
        narrowable = tuple(sorted(to_rank0 - elsewhere))
        found = self._route_cache[key] = (arriving, leaving, whole, outgoing, incoming, local_outputs, reads, makes,
                                          narrowable)
        return found

    def _microbatches(self, micro: list[dict], wanted: dict, origin: float, rows: int = -1,
                      copy: bool = True) -> list[dict]:
        """The stage's programs on each microbatch; with ``rows`` >= 0 (``_ROWS``: the first
        row and the count), on those rows of the state (a view of them, updated in place, or
        written back where the program made a copy). ``copy``: rank 0's own outputs are
        copies (else views of the programs' buffers, which the next call overwrites)."""
        window = slice(rows // _ROWS, rows // _ROWS + rows % _ROWS) if rows >= 0 else None
        plan, stage, rank, b, transport = self.plan, self.stage, self.rank, self.buffers, self.transport
        B = plan.microbatches
        arriving, leaving, whole, outgoing, incoming, local_outputs, reads, makes, narrowable = self._routes(wanted)
        shape_tag = len(plan.transfers)
        results = [dict() for _ in range(B)] if rank == 0 else []
        for mb in range(B):
            feeds = {}
            waited = time.perf_counter()
            for local, index in arriving:
                feeds[local] = transport.reshard(index, None)
            # (a program that keeps its tensors on a device copies a host array into a buffer it keeps)
            fed = b if self.session.kept_on is None else HOST
            for i, t in whole:   # from an earlier stage, whole: its shape, then it
                value = transport.recv_with_shape(len(t.shape), t.dtype, t.src_rank, shape_tag + i, i)
                feeds[t.tensor] = fed.from_host(value)
            for name, value in micro[mb].items():
                if name in stage.inputs:
                    feeds[name] = fed.from_host(value)
            for name, local in reads:
                if name not in self.state:
                    raise RunError(f"state '{name}' is not set on rank {rank}")
                feeds[local] = self.state[name] if window is None else self.state[name][window]
            started = time.perf_counter()
            narrow = {name: wanted[name] for name in narrowable if wanted[name]} if narrowable else None
            boxes = dict(narrow) if narrow else {}   # left to take after the run (a narrowed output is its box already)
            outs = self.session.run(feeds, transport.collective, b, observe=self._observe, writable=self.own_state,
                                    narrow=narrow, bound=B == 1)   # (one microbatch: read before the next run)
            if boxes:
                for name in set(boxes) - set(narrow):
                    boxes[name] = ()
            finished = time.perf_counter()
            self.program_seconds += finished - started
            if started - waited > 1e-5:
                self.trace.append(("wait", rank, waited - origin, started - waited, mb))
            self.trace.append((stage.index, rank, started - origin, finished - started, mb))
            for tensor, local, index in leaving:
                value = outs[local]
                transport.reshard(index, value)
                self._send(tensor, _nbytes(b, value))
            for name, local in makes:
                if window is None:
                    self.state[name] = outs[local]
                elif outs[local] is not feeds.get(local_name(name, self.state_specs[name])):
                    self.state[name][window] = np.asarray(b.to_host(outs[local]))
            for i, t in outgoing:
                data = np.asarray(b.to_host(outs[t.tensor]), order="C")
                if t.dst_stage == OUTPUT_COLLECTOR:
                    data = _take(data, boxes.get(t.tensor, wanted[t.tensor]))
                transport.post_with_shape(data, t.dst_rank, shape_tag + i, i)
                self._send(t.tensor, data.nbytes)
            for name in local_outputs:   # a copy: the program's buffer is the next call's
                value = self._take_output(name, outs[name], boxes.get(name, wanted[name]))
                results[mb][name] = np.array(value) if copy or B > 1 else value
        for mb in range(B):
            for i, t in incoming:
                spec = next(o for o in plan.outputs if o.name == t.tensor)
                results[mb][t.tensor] = transport.recv_with_shape(len(spec.shape), t.dtype, t.src_rank, shape_tag + i, i)
        transport.finish_posted()
        return results

    def _take_output(self, name: str, value, box: tuple) -> np.ndarray:
        """``box`` of output ``name`` on the host; on the host path, the view taken of the
        same array the call before is taken again (a repeated run's output is its buffer). Only
        a view of a small output is kept between calls: a box that is not contiguous is a copy,
        which the next run would leave behind, and a prompt's logits are let go. An output kept
        on the device (logits a choice is made from) gives its box alone, copied."""
        if isinstance(value, DeviceTensor):
            found = value.box_numpy(box) if box else None
            return found if found is not None else _take(value.numpy(), box)
        taken = self._taken.pop(name, None)
        if taken is not None and taken[0] is value and taken[1] == box:
            view = taken[2]
        else:
            view = _take(self.buffers.to_host(value), box)
        if self.buffers is HOST and value.nbytes <= _KEPT_VIEW_BYTES and np.may_share_memory(view, value):
            self._taken[name] = (value, box, view)
        return view

    def _observe(self, name: str, value) -> None:
        """A collective inside a program: count the bytes this rank puts in."""
        self._send(name, _nbytes(self.buffers, value))

    # --- state on every rank --------------------------------------------------------------------

    def _gather_state(self, chosen: list[bool]) -> dict[str, np.ndarray]:
        """The chosen states, whole, on rank 0: one rank per distinct piece sends it."""
        found = {}
        for index, (entry, take) in enumerate(zip(self.state_entries, chosen)):
            if not take:
                continue
            name, spec = entry["input"], self.state_specs[entry["input"]]
            holders = distinct_holders(self.plan, entry)
            pieces = {}
            if self.rank in holders:
                if name not in self.state:
                    raise RunError(f"state '{name}' is not set")
                local = np.asarray(self.buffers.to_host(self.state[name]), order="C")
                if self.rank == 0:
                    pieces[0] = local
                else:
                    self.transport.send(np.array(local.shape, dtype=np.int64), 0, _STATE_TAG + 2 * index)
                    self.transport.send(local, 0, _STATE_TAG + 2 * index + 1)
                    self._send(name, local.nbytes)
            if self.rank == 0:
                for r in holders:
                    if r == 0:
                        continue
                    pieces[r] = self.transport.recv_with_shape(len(spec.dims), self._dtype_of(name), r,
                                                               _STATE_TAG + 2 * index, _STATE_TAG + 2 * index + 1)
                found[name] = assemble(pieces, spec, state_mesh(self.plan, entry))
        return found

    def _scatter_state(self, values: dict | None, header: np.ndarray | None = None) -> None:
        k = 2 + sum(len(t.shape) for t in self.inputs)
        shapes = {}
        for spec in self.state_entries_specs():
            if header is not None:
                shapes[spec.name] = tuple(int(d) for d in header[k + 1:k + 1 + len(spec.shape)])
            k += 1 + len(spec.shape)
        chosen = [s["input"] in values for s in self.state_entries] if values is not None else \
            list(header[self.header_size - len(self.state_entries):].astype(bool))
        for index, (entry, take) in enumerate(zip(self.state_entries, chosen)):
            if not take:
                continue
            name, spec = entry["input"], self.state_specs[entry["input"]]
            stage = self.plan.stages[entry["stage"]]
            mesh = state_mesh(self.plan, entry)
            if self.rank == 0:
                whole = values[name]
                for r in stage.devices:
                    piece = piece_of(whole, spec, mesh, r)
                    if r == 0:   # updated in place: a copy, never the caller's array
                        own = np.array(piece, copy=True) if self.cache_in_place else piece
                        self.state[name] = self.state_buffers.from_host(own)
                        self._made.pop(name, None)
                        self._kept.pop(name, None)
                    else:
                        self.transport.send(piece, r, _STATE_TAG + 2 * index)
                        self._send(name, piece.nbytes)
            elif self.rank in stage.devices:
                local = self.transport.recv(spec.local_shape(shapes[name], mesh), self._dtype_of(name), 0,
                                            _STATE_TAG + 2 * index)
                self.state[name] = self.state_buffers.from_host(local)
                self._made.pop(name, None)
                self._kept.pop(name, None)

    def state_bytes(self) -> int:
        """Bytes of the state this rank holds."""
        return sum(_nbytes(self.buffers, v) for v in self.state.values())

    def _gather_stats(self) -> CallStats:
        import json

        mine = json.dumps({"seconds": self.program_seconds, "sent": self.sent,
                           "state_bytes": self.state_bytes(), "trace": [_event(*t) for t in self.trace],
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


def _take(data: np.ndarray, index: tuple) -> np.ndarray:
    """``data[index]`` as a C-contiguous array (a 0-d one stays 0-d)."""
    index = index[:np.ndim(data)]
    return np.asarray(data[index] if index else data, order="C")


def _nbytes(buffers, value) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    shape = buffers.shape(value)
    return math.prod(shape) * np.dtype(value.dtype).itemsize


def _event(name, rank: int, start: float, duration: float, mb: int) -> dict:
    """A trace event (Chrome's format) of what a call recorded: ``name`` is "wait" or the
    stage's index."""
    name = name if isinstance(name, str) else f"stage {name}"
    return {"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": start * 1e6, "dur": duration * 1e6,
            "args": {"microbatch": mb}}


def _line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def as_failure(exc: BaseException) -> JobFailure:
    """``exc`` raised on rank 0 as a failure of the job (``JobFailure`` as it is)."""
    return exc if isinstance(exc, JobFailure) else JobFailure(f"rank 0 failed: {_line(exc)}")


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
    sys.stderr.write(f"meshplan: error: {_line(exc)}\n")
    abort_job(1)


__all__ = ["CallStats", "Job", "JobFailure", "ReportedElsewhere", "as_failure", "driving", "fail"]
