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
from meshplan.training.pipeline_step import PipelineStep
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
                   options: PlanOptions, cost_model: CostModel | None, workdir: Path, folder: Path) -> StagePrograms:
    """Plan ``step`` (saved at ``step_path``, cut as ``pipeline``) on a [1, ``tensor``] mesh
    and cut each device's program into its parts; the programs' weight files are moved into
    ``folder`` (where the parts are written)."""
    from meshplan.make_plan import make_plan

    workdir.mkdir(parents=True, exist_ok=True)
    copy = save_step_model(step, step_path, workdir / "step.onnx")   # (with the norm's partial sums)
    inner = replace(options, max_stages=1, stages=None, microbatches=1, tensor_parallel=1, recompute=False)
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
            target = Path(folder) / entry["file"]
            shutil.move(str(workdir / "plan" / entry["file"]), str(target))
    return StagePrograms(devices, specs, float(plan.estimate["latency_seconds"]))


def sharded_stages(step, step_path: Path, pipeline, memory: list[dict], costs: dict, cluster: Cluster, dims: dict,
                    options: PlanOptions, cost_model: CostModel | None, workdir: Path, folder: Path):
    """``pipeline`` made the pipeline of each stage's devices sharding its operators
    (``make_stage_programs``: each device's parts, the inputs' layouts); the memory and the
    part seconds as they become: the state each device holds of its stage by the layouts the
    ILP chose, the activations a device's 1/T; each part's seconds scaled by the ILP's
    estimate of the whole step on T devices against one device's."""
    tensor = options.tensor_parallel
    programs = stage_programs(step, step_path, pipeline, cluster, dims, tensor, options, cost_model, workdir, folder)
    first = programs.devices[0]
    pipeline.device_parts = [d.parts for d in programs.devices]
    pipeline.parts, pipeline.crossings, pipeline.loss_count = first.parts, first.crossings, first.loss_count
    pipeline.chunks, pipeline.specs = {}, dict(programs.specs)
    one_device = sum(costs.values())
    scale = programs.step_seconds / one_device if one_device else 1.0 / tensor
    return sharded_memory(memory, pipeline, tensor), {k: v * scale for k, v in costs.items()}


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


def sharded_memory(memory: list[dict], pipeline, tensor: int) -> list[dict]:
    """Each stage's bytes a device (``stage_memory``'s) where T devices shard its operators:
    its weights, accumulated gradients and optimizer slots as the layouts of
    ``pipeline.specs`` hold them on the [1, T] mesh; its activations and working memory 1/T,
    the working memory with the most a part's run holds of its collectives' tensors
    (``run_held_bytes``; ``pipeline.parts``: device 0's, as models)."""
    mesh = LogicalMesh((1, tensor), tuple(range(tensor)))
    manifest = pipeline.step.manifest

    def held(name: str, shape, itemsize: int) -> float:
        text = pipeline.specs.get(name)
        whole = float(np.prod(shape, dtype=np.int64)) * itemsize
        return float(ShardingSpec.parse(text).local_bytes(tuple(shape), itemsize, mesh)) if text else whole

    found = []
    for stage, before in enumerate(memory):
        kinds = dict(before)
        kinds.update(weights=0.0, gradients=0.0, optimizer=0.0)
        for name, info in manifest["weights"].items():
            if pipeline.home.get(name) != stage:
                continue
            itemsize = np.dtype(info["dtype"]).itemsize
            kinds["weights"] += held(name, info["shape"], itemsize)
            kinds["gradients"] += held(slot(name, GRAD_ACC), info["shape"], itemsize)
            kinds["optimizer"] += sum(held(slot(name, k), info["shape"], itemsize)
                                      for k in manifest["slots"] if k != GRAD_ACC)
        kinds["activations"] = before["activations"] / tensor
        # and the largest of what its parts' runs hold of their collectives (a weight gathered whole)
        held_in_runs = [run_held_bytes(part.model) for (s, _), part in pipeline.parts.items()
                        if s == stage and isinstance(part.model, onnx.ModelProto)]
        kinds["working"] = before["working"] / tensor + max(held_in_runs, default=0.0)
        found.append(kinds)
    return found


__all__ = ["StagePrograms", "run_held_bytes", "sharded_memory", "sharded_stages", "stage_programs", "tensor_cluster"]
