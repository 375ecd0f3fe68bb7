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
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from meshplan.cost.analytic import CostModel
from meshplan.cost.cluster import Cluster
from meshplan.emit.rank_parts import rank_pipeline, same_structure
from meshplan.errors import PlanError
from meshplan.inter.pipeline import PlanOptions
from meshplan.plan_format import local_name
from meshplan.sharding import ShardingSpec
from meshplan.training.pipeline_step import PipelineStep
from meshplan.training.step_model import save_step_model


@dataclass
class StagePrograms:
    devices: list[PipelineStep]     # device j's cut of the step (its parts as models)
    specs: dict[str, str]           # each input's and output's layout on the [1, T] mesh
    step_seconds: float             # the ILP's estimate of one microbatch's whole step on T devices
    memory_bytes: float             # and of a device's memory for the whole step
    data_files: list[Path]          # the programs' weight files, which the parts read


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
    devices, files = [], []
    for program in sorted(plan.programs, key=lambda p: p.rank):
        path = workdir / "plan" / program.file
        devices.append(rank_pipeline(onnx.load(str(path), load_external_data=False), pipeline, inputs, outputs))
        if not same_structure(devices[0], devices[-1]):
            raise PlanError(f"device {program.rank}'s program cuts into other parts than device 0's")
        for entry in program.data_files:
            target = Path(folder) / entry["file"]
            shutil.move(str(workdir / "plan" / entry["file"]), str(target))
            files.append(target)
    memory = max([float(st.memory_bytes) for st in plan.stages] or [0.0])
    return StagePrograms(devices, specs, float(plan.estimate["latency_seconds"]), memory, files)


__all__ = ["StagePrograms", "stage_programs", "tensor_cluster"]
