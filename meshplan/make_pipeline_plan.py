"""A pipelined training plan: ``meshplan plan --train --stages S`` (S > 1).

The training step is built with gradients accumulated over the microbatches
(``training.step_model``), the forward model at one microbatch's dims is costed and cut
into S stages (``inter.training_stages``), the step is cut along (``training.
pipeline_step``), each stage's parts are written beside the step model
(``emit.pipeline_parts``) and each stage's instruction list into ``schedule.json``
(``emit.train_schedule``, 1F1B or GPipe). Each stage has the same number of devices R (the
mesh's devices over S), each a data-parallel replica of the stage that takes 1/R of every
microbatch; the replicas sum their accumulated gradients once a step, after the last
microbatch's backward (the lists' ``reduce``). The directory appears complete or not at all.
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
from meshplan.emit.train_schedule import training_schedule, write_training_schedule
from meshplan.errors import ModelError, PlanError
from meshplan.files import file_sha256
from meshplan.inter.pipeline import PlanOptions
from meshplan.inter.training_stages import check_fits, cut_stages, stage_memory
from meshplan.model.graph import build_graph
from meshplan.model.load import canonicalize
from meshplan.plan_format import Plan, Stage, TensorSpec, write_plan
from meshplan.training.pipeline_step import SCHEDULES, split_step
from meshplan.training.step_model import TrainSpec, build_step_model, save_step_model

TRAINING_DIR = "training"


def plan_pipeline_training(model_path: Path, cluster: Cluster, dims: dict, out_dir: Path, options: PlanOptions,
                           spec: TrainSpec, microbatches: int, cost_model: CostModel | None, replace_dir) -> Plan:
    """``dims``: one microbatch's; ``spec`` accumulates over ``microbatches``. ``replace_dir``
    moves the finished directory into place."""
    stages = options.stages
    if options.schedule not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {options.schedule!r} (choose from {', '.join(SCHEDULES)})")
    if cluster.num_devices % stages:
        raise PlanError(f"--stages {stages} does not divide the mesh's {cluster.num_devices} devices: each stage "
                        "has the same number of devices, data-parallel replicas of it, for now",
                        hint=f"a number of stages that divides {cluster.num_devices}")
    replicas = cluster.num_devices // stages
    step = build_step_model(model_path, replace(spec, stages=stages, microbatches=microbatches))
    if replicas > 1 and step.manifest.get("statistics"):
        raise PlanError("a model with running statistics (batch normalization in training mode) trains in a pipeline "
                        f"of one device a stage only: --stages {stages} on {cluster.num_devices} devices makes "
                        f"{replicas} replicas of each", hint=f"--stages {cluster.num_devices}")
    size = _microbatch_size(step, dims)
    if size % replicas:
        raise PlanError(f"a microbatch of {size} sample(s) does not split over the {replicas} replicas of each stage",
                        hint="a batch that does, or more stages")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.train.", dir=out_dir.parent))
    try:
        folder = staging / TRAINING_DIR
        folder.mkdir()
        step_path = save_step_model(step, model_path, folder / "step.onnx")
        canonical = canonicalize(model_path, dims, staging / ".work", None, "absent")
        graph = build_graph(canonical.model)
        shutil.rmtree(staging / ".work")
        seconds = (cost_model or CostModel(cluster)).graph_seconds(graph)
        cut = cut_stages(graph, seconds, stages, options.num_layers)
        pipeline = split_step(step, cut.forward_stage, stages)
        memory = stage_memory(pipeline, graph, microbatches, options.schedule, replicas)
        check_fits(memory, cluster.device.memory_bytes)
        record = write_parts(pipeline, folder, options.schedule, microbatches, replicas)
        plan = _plan(model_path, step, step_path, cluster, dims, microbatches, pipeline, cut, memory, record,
                     replicas)
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


def _microbatch_size(step, dims: dict) -> int:
    """The samples of one microbatch: the leading dim of the model's first data input."""
    graph = step.model.graph
    initializers = {t.name for t in graph.initializer}
    first = next((v for v in graph.input if v.name not in initializers), None)
    dim = first.type.tensor_type.shape.dim[0] if first is not None and first.type.tensor_type.shape.dim else None
    if dim is None:
        return 1
    return int(dim.dim_value) if dim.HasField("dim_value") else int(dims.get(dim.dim_param, 1))


def _allreduce_seconds(cluster: Cluster, devices: list[int], nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``devices`` (their slowest link)."""
    R = len(devices)
    if R < 2:
        return 0.0
    link = cluster.inter_host if len({cluster.host_of(d) for d in devices}) > 1 else cluster.intra_host
    return 2 * (R - 1) * (link.latency + nbytes / R / link.bandwidth)


def _plan(model_path: Path, step, step_path: Path, cluster: Cluster, dims: dict, microbatches: int, pipeline, cut,
          memory: list[dict], record: dict, replicas: int) -> Plan:
    graph = step.model.graph
    inputs = [_spec(v, dims) for v in graph.input if v.name in pipeline.data_inputs]
    batch_dim = next((d.dim_param for v in graph.input if v.name in pipeline.data_inputs
                      for d in v.type.tensor_type.shape.dim[:1] if d.dim_param), None)
    size = inputs[0].shape[0] if inputs and inputs[0].shape else 1
    stages = []
    R = replicas
    per_host = cluster.devices_per_host
    submesh = [1, R] if R <= per_host else [R // per_host, per_host]
    reduce_seconds = []
    for s in range(pipeline.stages):
        into = sorted({c.tensor for c in pipeline.crossings if c.dst == s})
        out = sorted({c.tensor for c in pipeline.crossings if c.src == s})
        devices = list(range(s * R, (s + 1) * R))
        reduce_seconds.append(_allreduce_seconds(cluster, devices, memory[s]["gradients"]))
        stages.append(Stage(s, sorted(n for n, k in cut.forward_stage.items() if k == s), cut.layers[s], devices,
                            submesh, [1, R], into, out, cut.seconds[s] / R, float(sum(memory[s].values()))))
    seconds = [st.seconds for st in stages]
    step_seconds = sum(seconds) + (microbatches - 1) * max(seconds) + max(reduce_seconds)
    estimate = {"latency_seconds": step_seconds, "step_seconds": step_seconds,
                "throughput_per_second": size * microbatches / step_seconds if step_seconds else 0.0,
                "memory_bytes_per_device": [st.memory_bytes for st in stages for _ in st.devices],
                "stage_seconds": seconds, "cut_bytes": cut.cut_bytes, "reduce_seconds": reduce_seconds}
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
