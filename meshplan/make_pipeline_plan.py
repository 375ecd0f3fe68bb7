"""A pipelined training plan: ``meshplan plan --train --stages S`` (S > 1).

The training step is built with gradients accumulated over the microbatches
(``training.step_model``), the forward model at one microbatch's dims is costed and cut
into S stages (``inter.training_stages``), the step is cut along (``training.
pipeline_step``), each stage's parts are written beside the step model
(``emit.pipeline_parts``) and each stage's instruction list into ``schedule.json``
(``emit.train_schedule``, 1F1B or GPipe). Each stage has the same number of devices R (the
mesh's devices over S), each a data-parallel replica of the stage that takes 1/R of every
microbatch; the replicas sum their accumulated gradients once a step, after the last
microbatch's backward (the lists' ``reduce``), each into its own row blocks of them where the
update allows (ZeRO-1, ``training.sharded_update``: each replica keeps and updates 1/R of
the optimizer's slots, and the updated weights are gathered whole). With
``--tensor-parallel T``, a stage's devices are replicas of T that shard its operators
(``make_stage_programs``: the sharding ILP over the whole step on a [1, T] mesh, each
device's program cut into its parts); with ``--tensor-parallel T0,T1,...`` each stage has its
own T (``make_stage_programs.mixed_stages``), the devices each stage has checked first
(``pipeline_devices``). The directory appears complete or not at all.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from meshplan.cost.analytic import CostModel
from meshplan.cost.cluster import Cluster
from meshplan.emit.pipeline_parts import write_parts
from meshplan.emit.report import REPORT_FILE, TIMELINE_FILE, render_timeline, text_report
from meshplan.emit.train_schedule import per_microbatch, timed_step, training_schedule, write_training_schedule
from meshplan.errors import MeshplanError, ModelError, PlanError
from meshplan.files import file_sha256
from meshplan.inter.pipeline import PlanOptions
from meshplan.inter.training_stages import check_fits, cut_stages, stage_memory
from meshplan.intra.segments import tensor_segments
from meshplan.model.graph import build_graph
from meshplan.model.load import canonicalize
from meshplan.plan_format import Plan, Stage, TensorSpec, write_plan
from meshplan.stage_ranks import StageRanks
from meshplan.training.pipeline_step import CLIP, NORM, UPDATE_PHASE, split_step
from meshplan.training.sharded_update import update_shards
from meshplan.make_stage_programs import mixed_stages, sharded_stages
from meshplan.pipeline_devices import adds_up, checked_step, leading_dim, replica_dims
from meshplan.training.step_model import BACKWARD, FORWARD, TrainSpec, save_step_model

TRAINING_DIR = "training"
AUTO = 0     # ``PlanOptions.tensor_parallel`` to weigh (``--tensor-parallel auto``)


def plan_pipeline_training(model_path: Path, cluster: Cluster, dims: dict, out_dir: Path, options: PlanOptions,
                           spec: TrainSpec, microbatches: int, cost_model: CostModel | None, replace_dir,
                           notes: list[str] = ()) -> Plan:
    """``dims``: one microbatch's; ``spec`` accumulates over ``microbatches``. ``replace_dir``
    moves the finished directory into place; ``notes``: lines for the report."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if options.tensor_parallel == AUTO:
        trial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tensor.", dir=out_dir.parent))
        try:
            tensor, each, weighed = weigh_tensor(model_path, cluster, dims, options, spec, microbatches, cost_model,
                                                 trial)
        finally:
            shutil.rmtree(trial, ignore_errors=True)
        options, notes = replace(options, tensor_parallel=tensor, stage_tensors=each), list(notes) + weighed
    trial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.devices.", dir=out_dir.parent))
    try:
        options, weighed = weigh_stage_devices(model_path, cluster, dims, options, spec, microbatches, cost_model,
                                               trial)
    finally:
        shutil.rmtree(trial, ignore_errors=True)
    notes = list(notes) + weighed
    options = _stage_tensors(options)
    stages, tensor = options.stages, options.tensor_parallel
    step, choices = checked_step(model_path, cluster, dims, options, spec, microbatches, stages)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.train.", dir=out_dir.parent))
    try:
        folder = staging / TRAINING_DIR
        folder.mkdir()
        step_path = save_step_model(step, model_path, folder / "step.onnx")
        graph = _forward_graph(model_path, dims, staging / ".work")
        pipeline, cut, memory = _design(step, graph, cluster, options, microbatches, choices, cost_model)
        replicas = cut.replicas
        samples = _split_crossings(step, step_path, dims, pipeline, replicas, staging / ".rows")
        step_graph = _step_graph(step_path, dims, staging / ".work")
        costs = _part_seconds(step_graph, cluster, cost_model, pipeline)
        if options.stage_tensors:
            memory, costs = mixed_stages(step, step_path, pipeline, memory, costs, cluster, dims, replicas,
                                         list(options.stage_tensors), options, cost_model, staging / ".tensor",
                                         folder, samples, tensor_segments(step_graph))
            shutil.rmtree(staging / ".tensor", ignore_errors=True)
        elif tensor > 1:
            memory, costs = sharded_stages(step, step_path, pipeline, memory, costs, cluster,
                                           replica_dims(step, dims, replicas[0]), options, cost_model,
                                           staging / ".tensor", folder, replicas)
            shutil.rmtree(staging / ".tensor", ignore_errors=True)
        check_fits(memory, cluster.device.memory_bytes)
        record = write_parts(pipeline, folder, options.schedule, microbatches, replicas)
        plan = _plan(model_path, step, step_path, cluster, dims, microbatches, pipeline, cut, memory, record,
                     replicas, costs)
        plan.estimate.update((cost_model or CostModel(cluster)).summary())   # which costs the estimate took
        plan.training["recompute"] = options.recompute
        if options.stage_tensors:
            each = ", ".join(f"stage {s}: {T}" for s, T in enumerate(options.stage_tensors))
            plan.notes.append(f"each stage's devices shard its operators ({each}; {replicas[0]} data-parallel "
                              "replica(s) of each), the sharding ILP over the whole step on a [1, T] mesh for each T; "
                              f"{len(pipeline.relayouts)} crossing(s) go between stages of different layouts")
        elif tensor > 1:
            plan.notes.append(f"each stage's {tensor * replicas[0]} device(s): {replicas[0]} data-parallel replica(s) "
                              f"of {tensor} that shard its operators (the sharding ILP over the whole step on a "
                              f"[1, {tensor}] mesh)")
        elif len(set(replicas)) > 1:
            plan.notes.append(f"the stages' devices: {', '.join(map(str, replicas))} (each a data-parallel replica "
                              "of its stage)")
        if options.recompute:
            plan.notes.append("activations recomputed: each stage keeps its inputs of a microbatch in flight, and its "
                              "backward runs its forward again")
        plan.notes.extend(notes)
        write_plan(plan, staging)
        write_training_schedule(plan.to_dict()["checksum"], training_schedule(pipeline, microbatches,
                                                                              options.schedule, replicas),
                                options.schedule, microbatches, staging)
        (staging / REPORT_FILE).write_text(text_report(plan) + "\n")
        (staging / TIMELINE_FILE).write_text(render_timeline(plan))
        replace_dir(staging, out_dir)
        return plan
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def pipeline_estimate(model_path: Path, cluster: Cluster, dims: dict, options: PlanOptions, spec: TrainSpec,
                      microbatches: int, cost_model: CostModel | None, workdir: Path) -> tuple[float, float]:
    """The step seconds and the most bytes a device needs of the pipelined plan of
    ``options.stages`` stages, planned but not written. Raises ``PlanError`` where there is
    no such plan (the stages do not divide the mesh, a microbatch does not split, ...)."""
    options = _stage_tensors(options)
    step, choices = checked_step(model_path, cluster, dims, options, spec, microbatches, options.stages)
    tensor = options.tensor_parallel
    workdir.mkdir(parents=True, exist_ok=True)
    step_path = save_step_model(step, model_path, workdir / "step" / "step.onnx")
    graph = _forward_graph(model_path, dims, workdir / "forward")
    pipeline, cut, memory = _design(step, graph, cluster, options, microbatches, choices, cost_model)
    replicas = cut.replicas
    samples = _split_crossings(step, step_path, dims, pipeline, replicas, workdir / "rows")
    step_graph = _step_graph(step_path, dims, workdir / "costs")
    costs = _part_seconds(step_graph, cluster, cost_model, pipeline)
    if options.stage_tensors:
        (workdir / "parts").mkdir(exist_ok=True)
        memory, costs = mixed_stages(step, step_path, pipeline, memory, costs, cluster, dims, replicas,
                                     list(options.stage_tensors), options, cost_model, workdir / "tensor",
                                     workdir / "parts", samples, tensor_segments(step_graph))
    elif tensor > 1:   # the programs too, as the plan would have them (what their runs hold is memory)
        (workdir / "parts").mkdir(exist_ok=True)
        memory, costs = sharded_stages(step, step_path, pipeline, memory, costs, cluster,
                                       replica_dims(step, dims, replicas[0]), options, cost_model,
                                       workdir / "tensor", workdir / "parts", replicas)
    step_seconds = _timing(cut, memory, cluster, replicas, microbatches, pipeline, costs, options.schedule)[1]
    return step_seconds, max(sum(m.values()) for m in memory)


def _stage_tensors(options: PlanOptions) -> PlanOptions:
    """Stages of different devices (``--stage-devices``) that shard their operators over one
    T: planned as stages of each their own T (``mixed_stages``), their replicas D_s / T."""
    given, tensor = options.stage_devices, options.tensor_parallel
    if given is None or tensor <= 1 or options.stage_tensors or len(set(given)) == 1:
        return options
    return replace(options, stage_tensors=(tensor,) * len(given))


def tensor_choices(cluster: Cluster, stages: int) -> list[int]:
    """The T a pipeline of ``stages`` stages may shard each stage's operators over: the
    divisors of a stage's devices that divide a host's (1 alone where the stages do not
    divide the mesh: its stages then have different numbers of replicas)."""
    if cluster.num_devices % stages:
        return [1]
    per = cluster.num_devices // stages
    return [t for t in range(1, per + 1) if per % t == 0 and cluster.devices_per_host % t == 0]


def weigh_tensor(model_path: Path, cluster: Cluster, dims: dict, options: PlanOptions, spec: TrainSpec,
                 microbatches: int, cost_model: CostModel | None,
                 workdir: Path) -> tuple[int, tuple[int, ...] | None, list[str]]:
    """``--tensor-parallel auto`` with ``--stages S``: each T of ``tensor_choices`` estimated
    (``pipeline_estimate``), and the cut's own T for each stage where they differ (one
    replica a stage: ``cut_tensors``); the fastest step that fits its devices (T, and each
    stage's where they differ, else None), and the report's line."""
    weighed, lines = [], []
    choices = [(t, None) for t in tensor_choices(cluster, options.stages)]
    own = cut_tensors(model_path, cluster, dims, options, cost_model, workdir / "cut")
    if own is not None:
        choices.append((max(own), own))
    for tensor, each in choices:
        what = ",".join(map(str, each)) if each else f"{tensor} device(s) that shard" if tensor > 1 else "replicas"
        step = _fitting(what, lines, cluster,
                        lambda: pipeline_estimate(model_path, cluster, dims,
                                                  replace(options, tensor_parallel=tensor, stage_tensors=each),
                                                  spec, microbatches, cost_model,
                                                  workdir / ("-".join(map(str, each)) if each else f"t{tensor}")))
        if step is not None:
            weighed.append((step, tensor, each or ()))
    if not weighed:
        raise PlanError(f"no tensor parallelism of the {options.stages} stages fits the devices (" + "; ".join(lines)
                        + ")", hint="more devices, more stages, or more microbatches")
    _, best, each = min(weighed)
    chosen = ",".join(map(str, each)) if each else str(best)
    return best, each or None, [f"tensor parallelism weighed (--tensor-parallel auto): {'; '.join(lines)}; chosen: "
                                f"T = {chosen}"]


def cut_tensors(model_path: Path, cluster: Cluster, dims: dict, options: PlanOptions, cost_model: CostModel | None,
                workdir: Path) -> tuple[int, ...] | None:
    """Each stage's T as the cut chooses them with its layers, one replica a stage (each
    stage's layers over its devices: Alpa's stage DP over submesh sizes), where they differ
    and each stage's devices share a host; else None."""
    N, S, per_host = cluster.num_devices, options.stages, cluster.devices_per_host
    if N <= S:
        return None
    try:
        graph = _forward_graph(model_path, dims, workdir)
    except MeshplanError:      # (the plan itself says why, in its own words)
        return None
    seconds = (cost_model or CostModel(cluster)).graph_seconds(graph)
    allowed = [t for t in range(1, min(N - S + 1, per_host) + 1)]
    if not adds_up(allowed, S, N):
        return None
    chosen = tuple(cut_stages(graph, seconds, S, options.num_layers, [allowed] * S, N).replicas)
    if len(set(chosen)) == 1:
        return None
    ranks = StageRanks.of(1, S, chosen)
    if any(cluster.host_of(ranks.first(s)) != cluster.host_of(ranks.first(s) + chosen[s] - 1) for s in range(S)):
        return None
    return chosen


def weigh_stage_devices(model_path: Path, cluster: Cluster, dims: dict, options: PlanOptions, spec: TrainSpec,
                        microbatches: int, cost_model: CostModel | None,
                        workdir: Path) -> tuple[PlanOptions, list[str]]:
    """Where ``--stages S`` divides the mesh and no devices are given (nor T > 1): the cut's
    own choice of each stage's devices (its layers over its replicas, counts that split a
    microbatch: Alpa's stage DP over submesh sizes) estimated beside the stages of equal
    devices (``pipeline_estimate``), the faster that fits kept (``options.stage_devices``);
    and the report's line. Unchanged where the cut chooses equal stages itself."""
    N, S = cluster.num_devices, options.stages
    if options.tensor_parallel != 1 or options.stage_devices is not None or N % S or N == S:
        return options, []
    try:
        graph = _forward_graph(model_path, dims, workdir / "forward")
    except MeshplanError:      # (the plan itself says why, in its own words)
        return options, []
    first = graph.tensors[graph.inputs[0]].shape if graph.inputs else ()
    size = int(first[0]) if first else 1       # one microbatch's samples
    allowed = [r for r in range(1, N - S + 2) if size % r == 0]
    equal = [N // S] * S
    if size % equal[0] or not adds_up(allowed, S, N):
        return options, []
    seconds = (cost_model or CostModel(cluster)).graph_seconds(graph)
    chosen = cut_stages(graph, seconds, S, options.num_layers, [allowed] * S, N).replicas
    if chosen == equal:
        return options, []
    weighed, lines = [], []
    for counts in (equal, chosen):
        step = _fitting(", ".join(map(str, counts)), lines, cluster,
                        lambda: pipeline_estimate(model_path, cluster, dims,
                                                  replace(options, stage_devices=tuple(counts)), spec, microbatches,
                                                  cost_model, workdir / "-".join(map(str, counts))))
        if step is not None:
            weighed.append((step, counts != equal, counts))
    if not weighed:
        return options, []      # (the plan of equal stages says why it cannot be)
    best = min(weighed)[2]
    return (replace(options, stage_devices=tuple(best)) if best != equal else options,
            [f"the stages' devices weighed (the cut's own choice against equal stages): {'; '.join(lines)}; chosen: "
             f"{', '.join(map(str, best))}"])


def _fitting(what: str, lines: list[str], cluster: Cluster, estimate) -> float | None:
    """The step seconds of ``estimate()`` (step seconds, the most bytes a device needs) where
    its plan fits a device, else None; the report's words for it appended to ``lines``."""
    try:
        step, need = estimate()
    except PlanError as exc:
        lines.append(f"{what}: no plan ({str(exc).splitlines()[0]})")
        return None
    fits = need <= cluster.device.memory_bytes
    lines.append(f"{what}: step {_ms(step)}, {need / 2**30:.2f} GiB a device" + ("" if fits else " (does not fit)"))
    return step if fits else None


def _split_crossings(step, step_path: Path, dims: dict, pipeline, replicas: list[int], workdir: Path):
    """Where neighbouring stages have different replica counts, each crossing that carries a
    microbatch's samples is split by them (``meshplan.stage_ranks``): ``pipeline.rows``, its
    axis of samples, found by the step's shapes at one microbatch and at two. ``PlanError``
    where a crossing's samples are not one axis of its own. Returns the function that finds
    a tensor's axis of samples so (None where the replica counts are all alike)."""
    pipeline.rows = {}
    if len(set(replicas)) < 2:
        return None
    dim = leading_dim(step)
    if dim is None or not dim.dim_param or dim.dim_param not in dims:
        raise PlanError("stages with different device counts split each microbatch among their replicas: the model's "
                        "batch dim must be a named dim given by --dim",
                        hint="equal stages (--stages dividing the mesh)")
    size = int(dims[dim.dim_param])
    shapes = []
    for k, at in enumerate((dict(dims), {**dims, dim.dim_param: 2 * size})):
        canonical = canonicalize(step_path, at, workdir / str(k), None, "absent")
        shapes.append({n: t.shape for n, t in build_graph(canonical.model).tensors.items()})
        shutil.rmtree(workdir / str(k), ignore_errors=True)

    def axis_of(tensor: str, src: int, dst: int) -> int | None:
        one, two = shapes[0].get(tensor), shapes[1].get(tensor)
        if one is None or two is None or tuple(one) == tuple(two):
            return None    # the same whatever the samples
        grows = [a for a, (x, y) in enumerate(zip(one, two)) if x != y]
        if len(one) != len(two) or len(grows) != 1 or one[grows[0]] != size or two[grows[0]] != 2 * size:
            raise PlanError(f"the tensor {tensor!r} that stage {src} sends stage {dst} holds the samples of a "
                            f"microbatch mixed into other dims ({list(one)} at {size} samples): stages of "
                            f"{replicas[src]} and {replicas[dst]} replicas cannot split it",
                            hint="equal stages (--stages dividing the mesh), or other --stage-devices")
        return grows[0]

    for index, c in enumerate(pipeline.crossings):
        if replicas[c.src] != replicas[c.dst] and per_microbatch(c):
            axis = axis_of(c.tensor, c.src, c.dst)
            if axis is not None:
                pipeline.rows[index] = axis
    return axis_of


def _forward_graph(model_path: Path, dims: dict, workdir: Path):
    """The forward model at one microbatch's dims, as the planner reads it (weights not read)."""
    canonical = canonicalize(model_path, dims, workdir, None, "absent")
    graph = build_graph(canonical.model)
    shutil.rmtree(workdir, ignore_errors=True)
    return graph


def _design(step, graph, cluster: Cluster, options: PlanOptions, microbatches: int, choices: list[list[int]],
            cost_model: CostModel | None):
    """The cut (each stage's replicas among its ``choices``), the step cut along it, and each
    stage's memory."""
    seconds = (cost_model or CostModel(cluster)).graph_seconds(graph)
    if options.stage_tensors:   # (the layers balanced over each stage's devices; its T are not replicas)
        cut = cut_stages(graph, seconds, options.stages, options.num_layers,
                         [[c[0] * T] for c, T in zip(choices, options.stage_tensors)], cluster.num_devices)
        cut.replicas = [c[0] for c in choices]
    else:
        cut = cut_stages(graph, seconds, options.stages, options.num_layers, choices,
                         cluster.num_devices // options.tensor_parallel)
    replicas = cut.replicas
    pipeline = split_step(step, cut.forward_stage, options.stages, options.recompute)
    # (where operators are sharded, the ILP chose the slots' layouts: no row blocks on top)
    pipeline.sharded = update_shards(pipeline, max(replicas)) if options.tensor_parallel == 1 else set()
    if options.stage_tensors:   # the replicas of its stages of one device only
        whole = [T == 1 and R > 1 for T, R in zip(options.stage_tensors, replicas)]
        ours = {n for (s, phase), part in pipeline.parts.items() if whole[s] and phase in (NORM, UPDATE_PHASE)
                for n in list(part.inputs) + list(part.outputs)}
        pipeline.sharded = update_shards(pipeline, max(replicas)) & ours if any(whole) else set()
    return pipeline, cut, stage_memory(pipeline, graph, microbatches, options.schedule, replicas)


def _step_graph(step_path: Path, dims: dict, workdir: Path):
    """The step model at one microbatch's dims, as the planner reads it (weights not read)."""
    canonical = canonicalize(step_path, dims, workdir, None, "absent")
    graph = build_graph(canonical.model)
    shutil.rmtree(workdir, ignore_errors=True)
    return graph


def _part_seconds(graph, cluster: Cluster, cost_model: CostModel | None, pipeline) -> dict[tuple[int, str], float]:
    """Each part's seconds: its nodes' in the step model's ``graph`` at one microbatch's dims,
    costed as the planner costs any model (the nodes every part computes for itself not
    counted)."""
    found: dict[tuple[int, str], float] = {}
    for node, seconds in zip(graph.nodes, (cost_model or CostModel(cluster)).graph_seconds(graph)):
        where = pipeline.placement.get(node.name)
        if where is not None:
            found[where] = found.get(where, 0.0) + seconds
    for stage in pipeline.recomputed:   # its backward runs its forward again
        found[(stage, BACKWARD)] = found.get((stage, BACKWARD), 0.0) + found.get((stage, FORWARD), 0.0)
    return found


def _timing(cut, memory: list[dict], cluster: Cluster, replicas: list[int], microbatches: int, pipeline,
            costs: dict[tuple[int, str], float], kind: str):
    """Each stage's seconds a microbatch: its forward and backward parts' (its replicas share
    them) and its sends, the activations on and the gradients back (the bytes crossing the
    cut over the fewer replicas of the two stages, a message's latency for each tensor); the
    step's, as its ``kind`` schedule plays with those parts and sends (``timed_step``: the
    stages' runs waiting on each other, the replicas' all-reduce before each stage's norm,
    the norm's partials and the clipping factor between the stages, each stage's norm and
    update, which each replica runs on its row blocks of the weights, or whole where the
    plan has none: ``training.sharded_update``; a reduce-scatter and an all-gather cost the
    all-reduce's time); each stage's all-reduce and update; and what the step was played
    with (``timing``: the timeline draws it again)."""
    S = len(cut.seconds)
    ranks = StageRanks.of(replicas, S, pipeline.tensors or pipeline.tensor)
    reduce = [_allreduce_seconds(cluster, ranks.ranks(s)[::ranks.devices(s)], memory[s]["gradients"])
              for s in range(S)]
    seconds, sent = [], {}
    for s in range(S):
        R, sends = replicas[s], 0.0
        for made_in, peer, cut_index in ((FORWARD, s + 1, s), (BACKWARD, s - 1, s - 1)):
            count = sum(1 for c in pipeline.crossings if c.src == s and c.made_in == made_in and per_microbatch(c))
            if count and 0 <= peer < S:
                link = cluster.link(ranks.first(s), ranks.first(peer))
                sent[(s, made_in)] = count * link.latency + \
                    cut.cut_bytes[cut_index] / min(R, replicas[peer]) / link.bandwidth
                sends += sent[(s, made_in)]
        seconds.append((costs.get((s, FORWARD), 0.0) + costs.get((s, BACKWARD), 0.0)) / R + sends)
    # the replicas' row blocks: each updates 1/R of the stage
    shared = [replicas[s] if pipeline.sharded and pipeline.tensor_of(s) == 1 else 1 for s in range(S)]
    update = [costs.get((s, CLIP), 0.0) + sum(costs.get((s, p), 0.0) for p in (NORM, UPDATE_PHASE)) / shared[s]
              for s in range(S)]
    took = {(s, p): costs.get((s, p), 0.0) / replicas[s] for s in range(S) for p in (FORWARD, BACKWARD)}
    took.update({(s, CLIP): costs.get((s, CLIP), 0.0) for s in range(S)})
    took.update({(s, UPDATE_PHASE): costs.get((s, UPDATE_PHASE), 0.0) / shared[s] for s in range(S)})
    took.update({(s, NORM): reduce[s] + costs.get((s, NORM), 0.0) / shared[s] for s in range(S)})
    scalar = max((cluster.link(ranks.first(s), ranks.first(s + 1)).latency for s in range(S - 1)), default=0.0)
    _, step = timed_step(S, microbatches, kind, took, sent, scalar)
    timing = {"took": [[s, p, t] for (s, p), t in sorted(took.items())],
              "sent": [[s, p, t] for (s, p), t in sorted(sent.items())], "scalar": scalar}
    return seconds, step, reduce, update, timing


def choose_training_stages(model_path: Path, cluster: Cluster, dims: dict, out_dir: Path, options: PlanOptions,
                           spec: TrainSpec, microbatches: int, cost_model: CostModel | None, replace_dir,
                           one_stage) -> Plan:
    """``--max-stages N`` for training: the one-stage plan (``one_stage(directory)`` plans it
    there: sharded by the ILP over the whole mesh) and the pipelined plans of every stage
    count up to N (of different sizes where a count does not divide the mesh; with
    ``--tensor-parallel auto``, each with every T of ``tensor_choices`` and the cut's own T
    for each stage where they differ, ``cut_tensors``; else with the T given); the fastest
    estimated step that fits its devices is written, the report says what was weighed."""
    weighed: list[tuple] = []     # (step seconds, stages, what, T, each stage's T where they differ)
    lines: list[str] = []
    trial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stages.", dir=out_dir.parent))

    def one_stage_estimate():
        one = one_stage(trial / "one")
        return one.step_seconds, max([st.memory_bytes for st in one.stages] or [0.0])

    try:
        step = _fitting("1 stage", lines, cluster, one_stage_estimate)
        if step is not None:
            weighed.append((step, 1, "one stage over the mesh", 1, ()))
        for stages in range(2, min(options.max_stages, cluster.num_devices) + 1):
            given = options.tensor_parallel
            if cluster.num_devices % stages and given > 1:    # (stages of different sizes: no T)
                continue
            choices = [(t, ()) for t in (tensor_choices(cluster, stages) if given == AUTO else [given])]
            own = cut_tensors(model_path, cluster, dims, replace(options, stages=stages), cost_model,
                              trial / f"cut{stages}") if given == AUTO else None
            if own is not None:
                choices.append((max(own), own))
            for tensor, each in choices:
                what = f"{stages} stages" + (f" of {','.join(map(str, each))} that shard" if each else
                                             f" of {tensor} that shard" if tensor > 1 else "")
                step = _fitting(what, lines, cluster, lambda: pipeline_estimate(
                    model_path, cluster, dims, replace(options, stages=stages, tensor_parallel=tensor,
                                                       stage_tensors=each or None), spec,
                    microbatches, cost_model, trial / f"work{stages}.{'-'.join(map(str, each)) or tensor}"))
                if step is not None:
                    weighed.append((step, stages, f"{what}" if tensor > 1 else f"{stages} pipeline stages", tensor,
                                    each))
        if not weighed:
            raise PlanError("no plan of at most " f"{options.max_stages} stages fits the devices ("
                            + "; ".join(lines) + ")", hint="more devices, more stages, or more microbatches")
        best = min(weighed)
        notes = [f"stages weighed (--max-stages {options.max_stages}): " + "; ".join(lines)
                 + f"; chosen: {best[2]}"]
        if best[1] == 1:   # planned again where it belongs (a plan names its own directory's files)
            shutil.rmtree(trial, ignore_errors=True)
            one = one_stage(out_dir)
            one.notes.extend(notes)
            (out_dir / REPORT_FILE).write_text(text_report(one) + "\n")
            return one
        return plan_pipeline_training(model_path, cluster, dims, out_dir,
                                      replace(options, stages=best[1], tensor_parallel=best[3],
                                              stage_tensors=best[4] or None), spec,
                                      microbatches, cost_model, replace_dir, notes)
    finally:
        shutil.rmtree(trial, ignore_errors=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _allreduce_seconds(cluster: Cluster, devices: list[int], nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``devices`` (their slowest link)."""
    R = len(devices)
    if R < 2:
        return 0.0
    link = cluster.inter_host if len({cluster.host_of(d) for d in devices}) > 1 else cluster.intra_host
    return 2 * (R - 1) * (link.latency + nbytes / R / link.bandwidth)


def _plan(model_path: Path, step, step_path: Path, cluster: Cluster, dims: dict, microbatches: int, pipeline, cut,
          memory: list[dict], record: dict, replicas: list[int], costs: dict) -> Plan:
    graph = step.model.graph
    inputs = [_spec(v, dims) for v in graph.input if v.name in pipeline.data_inputs]
    batch_dim = next((d.dim_param for v in graph.input if v.name in pipeline.data_inputs
                      for d in v.type.tensor_type.shape.dim[:1] if d.dim_param), None)
    size = inputs[0].shape[0] if inputs and inputs[0].shape else 1
    stages = []
    ranks = StageRanks.of(replicas, pipeline.stages, pipeline.tensors or pipeline.tensor)
    per_host = cluster.devices_per_host
    seconds, step_seconds, reduce_seconds, update_seconds, timing = _timing(
        cut, memory, cluster, ranks.replicas, microbatches, pipeline, costs, record["schedule"])
    for s in range(pipeline.stages):
        into = sorted({c.received for c in pipeline.crossings if c.dst == s})
        out = sorted({c.tensor for c in pipeline.crossings if c.src == s})
        R, width, T = ranks.replicas[s], ranks.width(s), ranks.devices(s)
        submesh = [1, width] if width <= per_host else [width // per_host, per_host]
        stages.append(Stage(s, sorted(n for n, k in cut.forward_stage.items() if k == s), cut.layers[s],
                            ranks.ranks(s), submesh, [R, T] if T > 1 else [1, R], into, out,
                            seconds[s],
                            float(sum(memory[s].values()))))
    estimate = {"latency_seconds": step_seconds, "step_seconds": step_seconds,
                "throughput_per_second": size * microbatches / step_seconds if step_seconds else 0.0,
                "memory_bytes_per_device": [st.memory_bytes for st in stages for _ in st.devices],
                "stage_seconds": seconds, "cut_bytes": cut.cut_bytes, "reduce_seconds": reduce_seconds,
                "update_seconds": update_seconds, "timing": timing}
    training = {**step.manifest, "source": {"path": str(model_path.resolve()), "sha256": file_sha256(model_path)},
                "pipeline": record, "memory": memory}
    return Plan(
        model={"path": str(step_path.resolve()), "sha256": file_sha256(step_path), "dims": dict(dims)},
        cluster=cluster.to_dict(), microbatches=microbatches,
        batch={"dim": batch_dim, "size": size, "microbatch_size": size, "batched_inputs": list(pipeline.data_inputs)},
        inputs=inputs, outputs=[TensorSpec("train.loss", [], "float32"), TensorSpec("train.grad_norm", [], "float32")],
        stages=stages, transfers=[], programs=[], reshardings=[], estimate=estimate,
        solver={"layers": int(cut.layers[-1][1]), "stages": pipeline.stages}, training=training)


def _spec(value: onnx.ValueInfoProto, dims: dict) -> TensorSpec:
    shape = []
    for d in value.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            shape.append(int(d.dim_value))
        elif d.dim_param in dims and isinstance(dims[d.dim_param], int):
            shape.append(int(dims[d.dim_param]))
        else:
            raise ModelError(f"input {value.name!r} has a dim {d.dim_param or '?'} no --dim gives",
                             hint=f"--dim {d.dim_param}=SIZE" if d.dim_param else None)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)).name
    return TensorSpec(value.name, shape, dtype)
