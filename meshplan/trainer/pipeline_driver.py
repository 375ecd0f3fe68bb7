"""``meshplan train`` on a pipelined training plan: one rank a device, each a driver of the
job's interpreter (``runtime.interpreter``), which carries out its stage's instruction list
(``schedule.json``) with a ``runtime.pipeline_stage.StageRunner``. Stage s has R_s
replicas, its ranks after the stages before it (``meshplan.stage_ranks.StageRanks``):
replica r takes the r-th 1/R_s of every microbatch, exchanges with the replicas of the other
stages that hold the same samples (replica r, where both stages have as many), and sums its
accumulated gradients with its stage's other replicas once a step (``reduce``, an MPI
all-reduce; or a reduce-scatter where the replicas update in row blocks, the updated
weights all-gathered): ``runtime.pipeline_links``. Where each replica is T devices that
shard the stage's operators (``--tensor-parallel T``; every stage then has as many
replicas), device j of replica r runs device j's parts, their collectives with its
replica's other devices, holds its pieces of the stage's state (``device_piece``) and
exchanges with device j of the other stages.

Every rank reads the plan, the schedule and the data (the same batches in the same order,
each taking the inputs its parts read), works out each step's learning rate itself, and
starts from the source model's weights that its stage holds (the slots at zero). Tensors
travel through host memory, pickled by mpi4py. On CUDA (``--provider cuda``, or ``auto`` where a GPU is
usable: rank r on GPU r modulo the machine's GPUs) each stage keeps its state and the
tensors it holds between runs on its GPU (``StageRunner(device=...)``); what it sends, sums
over its replicas or reports comes to the host. After each step the last stage sends the loss and the
gradients' norm to rank 0, which reports. A failure on a rank ends the job (the command's
guard aborts it); what every rank checks before the first step (the plan, the schedule,
the data, the rank count, a checkpoint to resume from) fails on every rank alike, one line.

Checkpoints (``--checkpoint``) are written as a single-stage plan's are
(``trainer.checkpoint``): each stage's first replica writes its stage's state, whole but for
the optimizer's slots that the replicas hold in row blocks (``meshplan.replica_shards``),
of which each replica writes its own (where devices shard the stage, each device of the
first replica writes its pieces, in the layouts the plan records); rank 0 the manifest,
and the folder is renamed into place once all have; ``--resume`` reads each state back by
the layouts of the plan that wrote it, so a checkpoint moves between plans of the same
model, and ``meshplan export`` reads it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from meshplan import replica_shards
from meshplan.emit.pipeline_parts import read_pipeline
from meshplan.emit.schedule import Schedule
from meshplan.emit.train_schedule import read_training_schedule
from meshplan.errors import MeshplanError, PlanError, ReportedElsewhere, TrainError
from meshplan.plan_format import Plan
from meshplan.runtime.interpreter import CallRecord, Interpreter, event
from meshplan.runtime.pipeline_links import PipelineLinks
from meshplan.runtime.pipeline_stage import (ShardedPart, StageRunner, device_piece, part_session, stage_sessions,
                                             starting_state)
from meshplan.runtime.state_files import rank_file, write_pieces
from meshplan.stage_ranks import StageRanks
from meshplan.trainer.checkpoint import Checkpoint, finish_checkpoint, plan_digest, staging_folder
from meshplan.trainer.data import Batches
from meshplan.trainer.driver import (TrainReport, _gather_rss, checkpoint_due, source_weights, state_names,
                                     trained_record)
from meshplan.trainer.schedule import learning_rate
from meshplan.training.optimizers import DEFAULTS

RESULT_TAG = 0     # the loss and the norm, last stage → rank 0; crossing i travels with tag i + 1


def train_pipeline_rank(plan_dir: Path, plan: Plan, options, provider: str, progress=None, transfer: str = "auto",
                        on_device: bool | None = None):
    """Every rank of a pipelined training plan's job; rank 0 returns the ``TrainReport``.
    ``on_device``: each stage keeps its tensors where its sessions compute (None: so on
    CUDA; True on the CPU runs the same path on OrtValues in host memory)."""
    from meshplan.process_memory import peak_rss_bytes
    from meshplan.rank_layout import gather_layout
    from meshplan.runtime.transport import world

    MPI, comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank = gather_layout(comm, MPI).local_rank
    try:
        pipeline, lists, batches, runner, first, resumed = _start(plan_dir, plan, options, provider, rank, size,
                                                                  transfer, local_rank, on_device)
        failure = None
    except MeshplanError as exc:
        failure = exc
    said = comm.allgather(None if failure is None else str(failure))
    if any(said):
        # one line for the job: the first failing rank's, from rank 0
        if rank == 0:
            raise failure if failure is not None else TrainError(next(s for s in said if s))
        raise ReportedElsewhere(str(failure or ""))
    stages = len(lists)
    ranks = _ranks(plan)
    stage, replica, device = ranks.where(rank)
    R, T, specs = ranks.replicas[stage], ranks.devices(stage), pipeline.specs_of(stage)
    record = CallRecord()
    schedule = Schedule(plan.training["pipeline"]["schedule"], plan.microbatches,
                        [lists[ranks.where(r)[0]] for r in range(size)])
    interpreter = Interpreter(plan, rank, schedule, PipelineLinks(comm, MPI, pipeline.crossings, ranks, pipeline.rows,
                                                                  pipeline.relayouts), runner, record=record)
    reads = {n for part in runner.parts.values() for n in part.inputs}
    B = plan.microbatches
    end = first + options.steps
    kept = {"cuda": "; state and activations kept on the GPU", "cpu": "; state and activations kept as OrtValues"}
    report = TrainReport(batch=batches.batch, ranks=size, provider=runner.provider,
                         transfer_path="host (MPI)" + (kept[runner.device[0]] if runner.device else ""),
                         estimate_seconds=float(plan.estimate.get("step_seconds", 0.0))) if rank == 0 else None
    hyper = {**DEFAULTS, **{"train." + k: float(v) for k, v in options.hyper.items()}}
    scaler = options.loss_scale          # (every rank keeps it alike, from each step's norm)
    scaler.resume(resumed.get("loss_scale"))
    optimizer_steps = int(resumed.get("optimizer_steps", first))    # AdamW's t: the steps not skipped
    guarded = bool(plan.training.get("guarded"))
    if report is not None:
        report.first_step = first
    timing = [0.0, 0.0]     # seconds running parts, seconds of the steps (this rank's own lists)
    for k in range(first, end):
        lr = learning_rate(options.schedule, options.lr, k, options.total_steps or end, options.warmup)
        batch = batches.next()
        per = len(next(iter(batch.values()))) // B
        share = per // R       # this replica's part of every microbatch
        slices = [{n: device_piece(v[m * per + replica * share:m * per + (replica + 1) * share],
                                   specs.get(n), T, device)
                   for n, v in batch.items() if n in reads} for m in range(B)]
        started = time.perf_counter()
        scale = scaler.scale
        runner.begin_step(slices, {**hyper, "train.lr": lr, "train.step": float(optimizer_steps + 1),
                                   "train.loss_scale": scale})
        record.start()
        interpreter.step(started)
        results = runner.end_step()
        if k > first or end - first == 1:    # the first of several steps warms up
            timing[0] += record.program_seconds
            timing[1] += time.perf_counter() - started
        reporter = ranks.first(stages - 1)      # the last stage's first rank
        loss = norm = None
        if rank == reporter:
            loss, norm = results["train.loss"], results["train.grad_norm"]
        if guarded:   # every rank learns whether the step updated (a skipped one is not AdamW's), and the scale
            loss, norm = comm.bcast((loss, norm), root=reporter)
        elif rank == reporter and rank != 0:
            comm.send((loss, norm), dest=0, tag=RESULT_TAG)
        elif rank == 0 and reporter != 0:
            loss, norm = comm.recv(source=reporter, tag=RESULT_TAG)
        applied = scaler.after(float(norm)) if guarded else True
        optimizer_steps += int(applied)
        if rank == 0:
            report.add_step(loss, lr, norm, time.perf_counter() - started, k + 1, end, progress,
                            scale if scaler.given else None, not applied)
        if checkpoint_due(options, k + 1, end):
            written = _save(comm, plan_dir, plan, runner.host_state(), options.checkpoint, k + 1, batches,
                            {"optimizer_steps": optimizer_steps, "loss_scale": scaler.state()})
            if report is not None:
                report.checkpoints.append(str(written))
    rss = _gather_rss(comm, peak_rss_bytes())
    timings = comm.gather(timing, root=0)
    traces = comm.gather([event(*t) for t in record.trace] if options.trace else [], root=0)
    if rank != 0:
        return None
    report.trace_events = [e for events in traces for e in events]
    report.peak_rss_bytes = rss
    report.busy_fractions = [b / t if t else 0.0 for b, t in timings]
    report.bubble = (stages - 1) / (B + stages - 1)
    report.memory_estimates = [float(s.memory_bytes) for s in plan.stages for _ in s.devices]
    return report


def _start(plan_dir: Path, plan: Plan, options, provider: str, rank: int, size: int, transfer: str = "auto",
           local_rank: int = 0, on_device: bool | None = None):
    """What every rank reads and checks before the first step: the pipeline, the lists, the
    data, its stage's runner (weights from the source model or the checkpoint, on its
    provider) and the step it starts at."""
    from meshplan.providers import CUDA, cuda_device_count, cuda_usable
    from meshplan.runtime.sessions import provider_name, providers_for

    record = plan.training["pipeline"]
    stages, ranks = int(record["stages"]), _ranks(plan)
    if size != ranks.size:
        each = f"{ranks.width(0)} device(s)" if ranks.uniform else \
            f"{', '.join(str(ranks.width(s)) for s in range(stages))} device(s)"
        raise TrainError(f"the plan has {stages} pipeline stages of {each}: start it with mpiexec -n "
                         f"{ranks.size} (this job has {size} rank(s))")
    device_id = local_rank % cuda_device_count() if provider != "cpu" and cuda_usable() else 0
    providers = providers_for(provider, device_id)
    on_cuda = provider_name(providers[0]) == CUDA
    if transfer not in ("auto", "host"):
        raise TrainError(f"a pipelined training plan's tensors travel through host memory for now, not --transfer "
                         f"{transfer}")
    if options.steps < 1:
        raise TrainError(f"--steps must be at least 1, got {options.steps}")
    pipeline = read_pipeline(plan_dir, plan.training)
    lists = read_training_schedule(plan.to_dict()["checksum"], plan_dir, pipeline, plan.microbatches,
                                   record["schedule"], list(ranks.replicas))
    batches = Batches(options.data, plan, options.shuffle, options.seed)
    stage, replica, device_index = ranks.where(rank)
    R, T = ranks.replicas[stage], ranks.devices(stage)
    found = pipeline.device_parts[device_index] if T > 1 else pipeline.parts
    parts = {phase: part for (s, phase), part in found.items() if s == stage}
    held = [n for n, s in pipeline.home.items() if s == stage]
    starting = [n for n in held if n in plan.training["weights"] or n in plan.training.get("statistics", {})]
    checkpoint = Checkpoint(options.resume) if options.resume is not None else None
    first, resumed = 0, {}
    if checkpoint is None:
        state = starting_state(held, dict(source_weights(plan, starting)), plan.training["slots"])
    else:
        if checkpoint.manifest.get("weights") != trained_record(plan.training):
            raise TrainError(f"{checkpoint.path} is a checkpoint of another model or optimizer (its weights and "
                             "slots differ from the plan's)")
        state = {name: checkpoint.tensor(name) for name in held}
        first, resumed = checkpoint.step, checkpoint.manifest
        if checkpoint.manifest.get("data"):
            batches.set_state(checkpoint.manifest["data"])
    threads = max(1, (os.cpu_count() or 1) // size)
    device = None
    if T > 1:   # each device's piece of its stage's state, its parts with collectives (on the host, for now)
        state = {n: device_piece(v, pipeline.specs_of(stage).get(n), T, device_index) for n, v in state.items()}
        sessions = stage_sessions(parts, None, lambda path: ShardedPart(path, providers, threads))
    else:
        if on_device or on_device is None and on_cuda:
            device = ("cuda", device_id) if on_cuda else ("cpu", 0)
        sessions = stage_sessions(parts, pipeline.chunks.get(stage),
                                  lambda model: part_session(model, threads, providers))
    runner = StageRunner(stage, parts, sessions, pipeline.crossings, plan.microbatches, state, pipeline.loss_count,
                         device, provider_name(providers[0]), (replica, R), pipeline.sharded,
                         sum_gradients=not ranks.uniform and stage == stages - 1)
    return pipeline, lists, batches, runner, first, resumed


def _layouts(plan: Plan) -> dict[str, dict]:
    """Each state whole on the rank of the stage that holds it, or in row blocks on the
    stage's replicas (a slot of a stage that updates in row blocks: ``replica_shards``), as
    ``runtime.state_files`` reads them; where a stage's devices shard its operators, in its
    layouts (``_device_layouts``)."""
    ranks = _ranks(plan)
    if ranks.tensor > 1:
        return _device_layouts(plan, ranks)
    return _replica_layouts(plan, ranks)


def _replica_layouts(plan: Plan, ranks: StageRanks) -> dict[str, dict]:
    """``_layouts`` where no stage's devices shard its operators."""
    training, home = plan.training, plan.training["pipeline"]["home"]
    sharded = set(plan.training["pipeline"].get("sharded", ()))
    shapes = {**{w: info["shape"] for w, info in training["weights"].items()},
              **{n: info["shape"] for n, info in training.get("statistics", {}).items()}}
    found = {}
    for name in state_names(training):
        weight = name if name in shapes else name.rpartition(".")[0]
        stage = int(home[name])
        first, R = ranks.first(stage), ranks.replicas[stage]      # the stage's first replica, its replicas
        found[name] = replica_shards.layout(shapes.get(weight, []), list(range(first, first + R))) \
            if R > 1 and name not in shapes and name in sharded \
            else replica_shards.layout(shapes.get(weight, []), [first])
    return found


def _device_layouts(plan: Plan, ranks: StageRanks) -> dict[str, dict]:
    """Each state as the devices of its stage's first replica hold it, in the layout the plan
    gives it on their [1, T] mesh (each device that holds a distinct piece writes it)."""
    from meshplan.sharding import ShardingSpec

    training = plan.training
    home, specs = training["pipeline"]["home"], training["pipeline"].get("specs", {})
    stage_specs = training["pipeline"].get("stage_specs")
    found = {}
    one_device = _replica_layouts(plan, ranks) if ranks.tensors else {}
    for name in state_names(training):
        stage = int(home[name])
        first, T = ranks.first(stage), ranks.devices(stage)
        if T == 1:   # (a stage of one device among stages that shard)
            found[name] = one_device[name]
            continue
        spec = (stage_specs[stage] if stage_specs else specs).get(name, "()")
        devices = list(range(first, first + T))
        whole = ShardingSpec.parse(spec).is_replicated
        found[name] = {"spec": spec, "segments": None, "logical_mesh": [1, T], "devices": devices,
                       "holders": devices[:1] if whole else devices}
    return found


def _ranks(plan: Plan) -> StageRanks:
    """Whose rank is which in ``plan``'s job (``meshplan.stage_ranks``)."""
    record = plan.training["pipeline"]
    try:
        return StageRanks.of(record.get("replicas", 1), int(record["stages"]),
                             record.get("tensors") or int(record.get("tensor", 1)))
    except ValueError as exc:
        raise PlanError(f"plan.json's pipeline record is malformed ({exc})", hint="re-run meshplan plan") from None


def _save(comm, plan_dir: Path, plan: Plan, state: dict, directory: Path, step: int, batches: Batches,
          counts: dict) -> Path | None:
    """A checkpoint of every stage's state (each stage's first replica writes its own file,
    each other replica its row blocks of the slots); rank 0 returns its path. ``counts``: the
    optimizer's steps and the loss scale's state, into the manifest."""
    staging = comm.bcast(str(staging_folder(directory, step)) if comm.Get_rank() == 0 else None, root=0)
    rank = comm.Get_rank()
    holds = {n for n, entry in _layouts(plan).items() if rank in entry["holders"]}
    if holds & set(state):
        write_pieces(rank_file(staging, rank), ((n, v) for n, v in state.items() if n in holds))
    comm.Barrier()
    if comm.Get_rank() != 0:
        return None
    manifest = {"plan_sha256": plan_digest(plan_dir), "weights": trained_record(plan.training),
                "data": batches.get_state(), "layouts": _layouts(plan), **counts}
    return finish_checkpoint(Path(staging), directory, step, manifest)
