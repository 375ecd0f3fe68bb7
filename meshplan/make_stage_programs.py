"""The programs of a pipelined training plan whose stages shard their operators
(``meshplan plan --train --stages S --tensor-parallel T``).

The step model, cut into stages (``training.pipeline_step``, whose rewrite of the global norm
into one partial sum a stage it carries), is planned as one stage over a [1, T] mesh: the
sharding ILP chooses every operator's layout, the forward's, the backward's and the
update's together, with each weight's gradient, accumulated gradient and optimizer slots
held as the weight's state is (``make_plan``, the single-mesh training planner's path). The
T programs it writes are cut into every stage's parts (``emit.rank_parts``): device j of
each stage runs coordinate j's parts, and a crossing goes from device j of one stage to
device j of the next, in the layout the ILP chose. The ILP sees the whole step on one mesh,
so its memory budget is the mesh's over the S stages (each stage holds about 1/S of it).
``sharded_stages`` makes a pipeline so and gives its stages' memory (``sharded_memory``: the
state by the ILP's layouts, and what the parts' runs hold of their collectives) and its
parts' seconds.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from meshplan.cost.analytic import CostModel
from meshplan.cost.cluster import Cluster
from meshplan.emit.rank_parts import rank_pipeline, same_structure
from meshplan.errors import PlanError
from meshplan.inter.pipeline import PlanOptions
from meshplan.plan_format import COLLECTIVE_DOMAIN, local_name
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.training.optimizers import GRAD_ACC, slot
from meshplan.training.pipeline_step import PER_MICROBATCH, STATE, Crossing, PipelineStep, per_microbatch
from meshplan.training.step_model import BACKWARD
from meshplan.training.step_model import save_step_model


@dataclass
class StagePrograms:
    devices: list[PipelineStep]     # device j's cut of the step (its parts as models)
    specs: dict[str, str]           # each input's and output's layout on the [1, T] mesh
    step_seconds: float             # the ILP's estimate of one microbatch's whole step on T devices


def tensor_cluster(cluster: Cluster, tensor: int, stages: int) -> Cluster:
    """The [1, T] mesh the step is sharded on: T devices of one host (a stage's tensor
    parallelism stays inside a host: ``make_pipeline_plan`` checks it), with S devices'
    memory each."""
    device = replace(cluster.device, memory_bytes=cluster.device.memory_bytes * stages)
    return replace(cluster, hosts=1, devices_per_host=tensor, device=device)


def stage_programs(step, step_path: Path, pipeline: PipelineStep, cluster: Cluster, dims: dict, tensor: int,
                   options: PlanOptions, cost_model: CostModel | None, workdir: Path, folder: Path,
                   prefix: str = "") -> StagePrograms:
    """Plan ``step`` (saved at ``step_path``, cut as ``pipeline``) on a [1, ``tensor``] mesh
    and cut each device's program into its parts; the programs' weight files are moved into
    ``folder`` (where the parts are written), their names after ``prefix``."""
    from meshplan.make_plan import make_plan

    workdir.mkdir(parents=True, exist_ok=True)
    copy = save_step_model(step, step_path, workdir / "step.onnx")   # (with the norm's partial sums)
    inner = replace(options, max_stages=1, stages=None, microbatches=1, tensor_parallel=1, recompute=False,
                    stage_tensors=None)
    plan = make_plan(copy, tensor_cluster(cluster, tensor, pipeline.stages), dims, workdir / "plan", inner,
                     cost_model=cost_model, state=step.state)
    if len(plan.stages) != 1 or len(plan.programs) != tensor:
        raise PlanError(f"the step planned on {tensor} devices did not give one program a device")
    stage = plan.stages[0]
    specs = {**stage.input_specs, **stage.output_specs}
    inputs = {n: local_name(n, ShardingSpec.parse(s)) for n, s in stage.input_specs.items()}
    outputs = {n: local_name(n, ShardingSpec.parse(s)) for n, s in stage.output_specs.items()}
    devices = []
    for program in sorted(plan.programs, key=lambda p: p.rank):
        path = workdir / "plan" / program.file
        devices.append(rank_pipeline(onnx.load(str(path), load_external_data=False), pipeline, inputs, outputs))
        if not same_structure(devices[0], devices[-1]):
            raise PlanError(f"device {program.rank}'s program cuts into other parts than device 0's")
        for entry in program.data_files:
            target = Path(folder) / (prefix + entry["file"])
            shutil.move(str(workdir / "plan" / entry["file"]), str(target))
            if prefix:
                for part in devices[-1].parts.values():
                    _relocated(part.model, entry["file"], target.name)
    return StagePrograms(devices, specs, float(plan.estimate["latency_seconds"]))


def _relocated(model: onnx.ModelProto, old: str, new: str) -> None:
    """``model``'s weights stored in the file ``old`` pointed to ``new`` instead."""
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == old:
                entry.value = new


def sharded_stages(step, step_path: Path, pipeline, memory: list[dict], costs: dict, cluster: Cluster, dims: dict,
                   options: PlanOptions, cost_model: CostModel | None, workdir: Path, folder: Path,
                   replicas: list[int] | None = None):
    """``pipeline`` made the pipeline of each stage's devices sharding its operators
    (``make_stage_programs``: each device's parts, the inputs' layouts); the memory and the
    part seconds as they become: the state each device holds of its stage by the layouts the
    ILP chose, the activations a device's 1/T; each part's seconds scaled by the ILP's
    estimate of the whole step on T devices against one device's (``scaled``). ``dims``: one
    replica's share of a microbatch (``replicas``: each stage's, default one)."""
    tensor = options.tensor_parallel
    programs = stage_programs(step, step_path, pipeline, cluster, dims, tensor, options, cost_model, workdir, folder)
    first = programs.devices[0]
    pipeline.device_parts = [d.parts for d in programs.devices]
    pipeline.parts, pipeline.crossings, pipeline.loss_count = first.parts, first.crossings, first.loss_count
    pipeline.chunks, pipeline.specs = {}, dict(programs.specs)
    replicas = replicas or [1] * pipeline.stages
    return sharded_memory(memory, pipeline), scaled(costs, [programs.step_seconds] * pipeline.stages, replicas,
                                                    [tensor] * pipeline.stages)


def mixed_stages(step, step_path: Path, pipeline, memory: list[dict], costs: dict, cluster: Cluster, dims: dict,
                 replicas: list[int], tensors: list[int], options: PlanOptions, cost_model: CostModel | None,
                 workdir: Path, folder: Path, samples=None, segmented: dict | None = None):
    """``pipeline`` made the pipeline whose stage s has ``replicas[s]`` replicas of
    ``tensors[s]`` devices that shard its operators (``--tensor-parallel 2,1``): the step
    planned on a [1, T] mesh at one replica's share of a microbatch (``dims``: a whole
    microbatch's) for each (T > 1, R) among them (``stage_programs``), each stage's parts cut
    from its own programs (a stage of one device keeps the step's own parts), and each
    crossing between stages of different T or R gone from the sender's layout to the
    receiver's (``joined_crossings``; ``samples``: a tensor's axis of samples, where the
    replica counts differ; ``segmented``: the step's tensors whose dims hold heads in
    segments, ``intra.segments.tensor_segments``); the memory and the part seconds as ``sharded_stages`` gives them,
    each stage by its own."""
    from meshplan.pipeline_devices import replica_dims

    kinds = sorted({(T, R) for T, R in zip(tensors, replicas) if T > 1})
    cuts = {(T, R): stage_programs(step, step_path, pipeline, cluster, replica_dims(step, dims, R), T, options,
                                   cost_model, workdir / f"t{T}r{R}", folder, f"t{T}r{R}." if len(kinds) > 1 else "")
            for T, R in kinds}
    S = pipeline.stages
    device_parts: list[dict] = [{} for _ in range(max(tensors))]
    for s, key in enumerate(zip(tensors, replicas)):
        found = [pipeline.parts] if key[0] == 1 else [d.parts for d in cuts[key].devices]
        for j, parts in enumerate(found):
            device_parts[j].update({k: part for k, part in parts.items() if k[0] == s})
    sides = [pipeline if key[0] == 1 else cuts[key].devices[0] for key in zip(tensors, replicas)]
    specs = [{} if key[0] == 1 else dict(cuts[key].specs) for key in zip(tensors, replicas)]
    pipeline.crossings, pipeline.relayouts, pipeline.rows = joined_crossings(sides, specs, tensors,
                                                                             pipeline.step.manifest, replicas, samples,
                                                                             segmented)
    pipeline.device_parts, pipeline.parts = device_parts, device_parts[0]
    pipeline.loss_count = sides[S - 1].loss_count
    pipeline.chunks = {s: c for s, c in pipeline.chunks.items() if tensors[s] == 1}
    pipeline.tensors, pipeline.stage_specs, pipeline.specs = list(tensors), specs, {}
    seconds = [cuts[key].step_seconds if key[0] > 1 else None for key in zip(tensors, replicas)]
    return sharded_memory(memory, pipeline), scaled(costs, seconds, replicas, tensors)


def scaled(costs: dict, seconds: list, replicas: list[int], tensors: list[int]) -> dict:
    """Each part's seconds (``costs``: a whole microbatch's on one device) where stage s's
    devices shard its operators: times the ILP's estimate of the whole step on its T devices
    at a replica's share of a microbatch (``seconds[s]``; None: a stage of one device, as it
    is) over one device's whole step, its forward and backward times R (the plan's timing
    takes a replica's share of them as 1/R)."""
    one_device = sum(costs.values())
    found = {}
    for (stage, phase), value in costs.items():
        if seconds[stage] is None or tensors[stage] == 1:
            found[(stage, phase)] = value
            continue
        ratio = seconds[stage] / one_device if one_device else 1.0 / tensors[stage]
        found[(stage, phase)] = value * ratio * (replicas[stage] if phase in PER_MICROBATCH else 1)
    return found


def joined_crossings(sides: list[PipelineStep], specs: list[dict], tensors: list[int], manifest: dict,
                     replicas: list[int] | None = None, samples=None, segmented: dict | None = None):
    """The crossings of a pipeline whose stage s has ``replicas[s]`` replicas of
    ``tensors[s]`` devices, cut as ``sides[s]`` (its own programs' device 0 cut, its inputs'
    and outputs' layouts ``specs[s]``): between two stages of the same T and R as that cut
    has them; between others each crossing the receiver's cut has, sent as the sender's cut
    makes it (the same tensor, in its layout there), with its ``Relayout`` (over every device
    of both stages where their replica counts differ: ``_across``). Returns the crossings,
    the relayouts and, for stages of one device each whose replica counts differ, the
    crossings' axes of samples (``samples(tensor, src, dst)``; ``meshplan.stage_ranks``).
    ``PlanError`` where the receiver reads a tensor the sender's cut does not hand on, or one
    whose layout on either side splits heads held in segments (``segmented``: the step's
    ``intra.segments.tensor_segments``), which a relayout's boxes cannot say."""
    from meshplan.crossing_layouts import Relayout, base_name, spec_of_name

    replicas = replicas or [1] * len(sides)
    found, relayouts, rows = [], {}, {}
    pairs = sorted({(c.src, c.dst) for side in sides for c in side.crossings})
    for a, b in pairs:
        received = [c for c in sides[b].crossings if (c.src, c.dst) == (a, b)]
        if tensors[a] == tensors[b] and (replicas[a] == replicas[b] or tensors[a] == 1):
            for c in sides[a].crossings:
                if (c.src, c.dst) == (a, b):
                    axis = samples(c.tensor, a, b) if replicas[a] != replicas[b] and per_microbatch(c) else None
                    if axis is not None:
                        rows[len(found)] = axis
                    found.append(c)
            continue
        sent = [c for c in sides[a].crossings if (c.src, c.dst) == (a, b)]
        for c in received:
            base = base_name(c.tensor, specs[b])
            want = spec_of_name(c.tensor, specs[b])
            matches = [x for x in sent if base_name(x.tensor, specs[a]) == base and x.made_in == c.made_in]
            if not matches:
                raise PlanError(f"stage {b} reads {c.tensor!r} from stage {a}, whose programs on {tensors[a]} "
                                f"device(s) do not hand it on", hint="the same --tensor-parallel for both stages")
            x = next((m for m in matches if spec_of_name(m.tensor, specs[a]) == want), matches[0])
            source = spec_of_name(x.tensor, specs[a])
            shape, dtype, side = _whole(x, source, tensors[a], sides[a], manifest, c, want, tensors[b], sides[b])
            rank = len(shape)
            source, want = source or str(ShardingSpec.replicated(rank)), want or str(ShardingSpec.replicated(rank))
            _check_segments(base, (source, tensors[a]), (want, tensors[b]), (segmented or {}).get(base) or {}, a, b)
            if replicas[a] == replicas[b]:
                relayouts[len(found)] = Relayout(shape, source, want, tensors[a], tensors[b], dtype)
            else:
                axis = samples(base, a, b) if per_microbatch(c) else None
                relayouts[len(found)] = _across(shape, source, want, tensors[a], tensors[b], dtype, replicas[a],
                                                replicas[b], axis, replicas[b] if side else replicas[a],
                                                per_microbatch(c) and c.made_in == BACKWARD)
            found.append(Crossing(x.tensor, a, x.made_in, b, c.read_in, c.tensor if c.tensor != x.tensor else ""))
    return found, relayouts, rows


def _check_segments(name: str, sent: tuple[str, int], read: tuple[str, int], known: dict, src: int, dst: int):
    """``PlanError`` where either side's layout of ``name`` splits a dim whose heads are held
    in segments (``known``: dim → segments), which the boxes of a relayout do not follow."""
    from meshplan.intra.segments import CONFLICT

    for text, devices in (sent, read):
        spec = ShardingSpec.parse(text)
        mesh = LogicalMesh((1, devices), tuple(range(devices)))
        plain = {d: g for d, g in known.items() if g != CONFLICT}
        for dim, segments in known.items():
            split = dim < len(spec.dims) and spec.shards(dim, mesh) > 1
            if split and (segments == CONFLICT or spec.with_segments(plain).segmented(dim, mesh) is not None):
                raise PlanError(f"the tensor {name!r} that stage {src} sends stage {dst} is split by heads held in "
                                f"segments ({text} on {devices} device(s)): stages of different layouts cannot pass "
                                "it on", hint="the same --tensor-parallel for both stages, or other stages")


def _across(shape: tuple, source: str, target: str, senders: int, receivers: int, dtype: str, rows_a: int,
            rows_b: int, axis: int | None, measured: int, summed: bool):
    """The ``Relayout`` over every device of two stages whose replica counts (``rows_a``,
    ``rows_b``) differ, a row of its mesh a replica: a tensor with the samples on ``axis``
    split over the rows too (replica-major: ``shape`` was one replica's share, as ``measured``
    replicas would hold it); a gradient that is a sum over a replica's samples (``summed``)
    held as addends along the rows; anything else alike on every row."""
    from meshplan.crossing_layouts import Relayout
    from meshplan.sharding import placement_axes, placement_of

    def rowed(text: str, devices: int) -> str:
        spec = ShardingSpec.parse(text).normalised(LogicalMesh((1, devices), tuple(range(devices))))
        dims, partial = list(spec.dims), tuple(a for a in spec.partial if a == 1 and devices > 1)
        if axis is not None:
            dims[axis] = placement_of((0,) + placement_axes(dims[axis]))
        elif summed:
            partial = tuple(sorted(set(partial) | {0}))
        return str(ShardingSpec(tuple(dims), partial))

    if axis is not None:
        shape = tuple(d * measured if k == axis else d for k, d in enumerate(shape))
    return Relayout(shape, rowed(source, senders), rowed(target, receivers), senders, receivers, dtype, rows_a, rows_b)


def _whole(crossing, spec: str | None, tensor: int, side: PipelineStep, manifest: dict,
           received=None, received_spec: str | None = None, receivers: int = 1,
           receiver=None) -> tuple[tuple, str, int]:
    """The whole shape and dtype of what ``crossing`` carries: a state's from the manifest,
    else from the sender's part (its piece's shape in layout ``spec`` on [1, ``tensor``]) or,
    where that has dims not fixed (a stage of one device keeps the step's own parts), from
    the part of ``receiver`` (a cut) that reads it as ``received``; and which it took the
    shape from (0: the sender, 1: the receiver)."""
    if crossing.made_in == STATE:
        info = {**manifest.get("weights", {}), **manifest.get("statistics", {})}.get(crossing.tensor)
        if info is None:
            raise PlanError(f"the state {crossing.tensor!r} another stage reads has no record in the step")
        return tuple(int(d) for d in info["shape"]), str(info.get("dtype", "float32")), 0
    looks = [(side.parts[(crossing.src, crossing.made_in)].model.graph.output, crossing.tensor, spec, tensor)]
    if receiver is not None:
        looks += [(receiver.parts[(received.dst, phase)].model.graph.input, received.tensor, received_spec, receivers)
                  for phase in received.read_in if (received.dst, phase) in receiver.parts]
    for side_index, (values, name, layout, devices) in enumerate(looks):
        value = next((v for v in values if v.name == name), None)
        if value is None:
            continue
        kind = value.type.tensor_type
        local = [int(d.dim_value) if d.HasField("dim_value") else 0 for d in kind.shape.dim]
        if 0 in local:
            continue
        mesh = LogicalMesh((1, devices), tuple(range(devices)))
        parsed = ShardingSpec.parse(layout) if layout else ShardingSpec.replicated(len(local))
        shape = tuple(size * parsed.shards(d, mesh) for d, size in enumerate(local))
        return shape, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type)).name, min(side_index, 1)
    raise PlanError(f"the shape of {crossing.tensor!r}, which stage {crossing.src} sends stage {crossing.dst}, is not "
                    "known at one microbatch")


def run_held_bytes(model: onnx.ModelProto) -> float:
    """The most bytes a sharded part's run holds at once of what its collectives take in and
    give out (a weight gathered whole among them): each such tensor from the node that makes
    it to the last that reads it (the run lets each go then: ``ProgramRunner.run(release=
    True)``), or to the run's end where the part hands it on."""
    graph = model.graph
    typed = {v.name: v.type.tensor_type for v in list(graph.value_info) + list(graph.output)}
    inputs, outputs = {v.name for v in graph.input}, {v.name for v in graph.output}
    nodes = list(graph.node)
    names = {name for node in nodes if node.domain == COLLECTIVE_DOMAIN
             for name in list(node.input) + list(node.output) if name and name not in inputs}
    born, dies = {}, {}
    for index, node in enumerate(nodes):
        for name in node.output:
            if name in names:
                born[name] = index
        for name in node.input:
            if name in names:
                dies[name] = index
    held = [0.0] * (len(nodes) + 1)
    for name in names:
        kind = typed.get(name)
        if kind is None or not kind.elem_type or name not in born:
            continue
        size = float(np.prod([d.dim_value for d in kind.shape.dim], dtype=np.int64)) * \
            np.dtype(onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type)).itemsize
        last = len(nodes) if name in outputs else dies.get(name, born[name])
        for index in range(born[name], last + 1):
            held[index] += size
    return max(held)


def sharded_memory(memory: list[dict], pipeline) -> list[dict]:
    """Each stage's bytes a device (``stage_memory``'s) where T devices shard its operators
    (``pipeline.tensor_of``; a stage of one device as it was): its weights, accumulated
    gradients and optimizer slots as the layouts of ``pipeline.specs_of`` it hold them on
    the [1, T] mesh; its activations and working memory 1/T, the working memory with the most
    a part's run holds of its collectives' tensors (``run_held_bytes``; ``pipeline.parts``:
    device 0's, as models)."""
    manifest = pipeline.step.manifest

    def held(name: str, shape, itemsize: int, specs: dict, mesh: LogicalMesh) -> float:
        text = specs.get(name)
        whole = float(np.prod(shape, dtype=np.int64)) * itemsize
        return float(ShardingSpec.parse(text).local_bytes(tuple(shape), itemsize, mesh)) if text else whole

    found = []
    for stage, before in enumerate(memory):
        tensor, specs = pipeline.tensor_of(stage), pipeline.specs_of(stage)
        if tensor == 1:
            found.append(dict(before))
            continue
        mesh = LogicalMesh((1, tensor), tuple(range(tensor)))
        kinds = dict(before)
        kinds.update(weights=0.0, gradients=0.0, optimizer=0.0)
        for name, info in manifest["weights"].items():
            if pipeline.home.get(name) != stage:
                continue
            itemsize = np.dtype(info["dtype"]).itemsize
            kinds["weights"] += held(name, info["shape"], itemsize, specs, mesh)
            kinds["gradients"] += held(slot(name, GRAD_ACC), info["shape"], itemsize, specs, mesh)
            kinds["optimizer"] += sum(held(slot(name, k), info["shape"], itemsize, specs, mesh)
                                      for k in manifest["slots"] if k != GRAD_ACC)
        kinds["activations"] = before["activations"] / tensor
        # and the largest of what its parts' runs hold of their collectives (a weight gathered whole)
        held_in_runs = [run_held_bytes(part.model) for (s, _), part in pipeline.parts.items()
                        if s == stage and isinstance(part.model, onnx.ModelProto)]
        kinds["working"] = before["working"] / tensor + max(held_in_runs, default=0.0)
        found.append(kinds)
    return found


__all__ = ["StagePrograms", "joined_crossings", "mixed_stages", "run_held_bytes", "sharded_memory", "sharded_stages",
           "stage_programs", "tensor_cluster"]
