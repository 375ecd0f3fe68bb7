"""From a model file to a finished plan directory: load → plan → emit → report.

The directory appears complete or not at all: everything is written into a temporary
sibling that is renamed into place at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from meshplan.cost.cluster import Cluster
from meshplan.cost.analytic import CostModel, compute_dtypes
from meshplan.emit.programs import EXTERNAL_THRESHOLD, emit_programs
from meshplan.errors import PlanError
from meshplan.model.graph import build_graph
from meshplan.model.load import canonicalize, read_model, symbolic_dims
from meshplan.ops import SMALL_CONSTANT_ELEMENTS
from meshplan.plan_format import PLAN_FILE, Plan, TensorSpec, write_plan
from meshplan.inter.pipeline import PlanOptions, plan_pipeline
from meshplan.emit.report import TIMELINE_FILE, render_timeline


def batch_layout(model: onnx.ModelProto, dims: dict[str, int], microbatches: int) -> tuple[dict, dict[str, int]]:
    """The batch dimension and the dims the per-device programs are built for.

    With B microbatches the programs run on batch/B samples, so the batch dimension (the
    symbolic dim at axis 0 of the inputs) is fixed to batch/B before folding.
    """
    if microbatches < 1:
        raise PlanError(f"--microbatches must be at least 1, got {microbatches}")
    initializers = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in initializers]
    batch_dim = None
    for value in inputs:
        shape = value.type.tensor_type.shape.dim
        if shape and shape[0].dim_param:
            batch_dim = shape[0].dim_param
            break
    if batch_dim is None or batch_dim not in dims:
        size = 1
        for value in inputs:
            shape = value.type.tensor_type.shape.dim
            if shape and shape[0].HasField("dim_value"):
                size = shape[0].dim_value
                break
        if microbatches > 1:
            raise PlanError(
                "--microbatches needs a symbolic batch dimension at axis 0 of the model's inputs; this model has none",
                hint="use --microbatches 1",
            )
        return {"dim": None, "size": size, "microbatch_size": size, "batched_inputs": []}, dict(dims)
    size = dims[batch_dim]
    if size % microbatches:
        raise PlanError(f"batch dimension {batch_dim!r} = {size} is not divisible by --microbatches {microbatches}")
    if microbatches > 1:
        for value in list(inputs) + list(model.graph.output):
            for axis, dim in enumerate(value.type.tensor_type.shape.dim):
                if dim.dim_param == batch_dim and axis != 0:
                    raise PlanError(f"'{value.name}' has the batch dimension at axis {axis}; microbatching needs axis 0")
        for value in model.graph.output:
            shape = value.type.tensor_type.shape.dim
            if not shape or shape[0].dim_param != batch_dim:
                raise PlanError(
                    f"model output '{value.name}' is not declared with the batch dimension {batch_dim!r} at axis 0",
                    hint="use --microbatches 1",
                )
    program_dims = dict(dims)
    program_dims[batch_dim] = size // microbatches
    batched = [v.name for v in inputs if v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].dim_param == batch_dim]
    layout = {"dim": batch_dim, "size": size, "microbatch_size": size // microbatches, "batched_inputs": batched}
    return layout, program_dims


def _full_specs(model: onnx.ModelProto, graph_tensors, names, batch: dict, microbatches: int) -> list[TensorSpec]:
    specs = []
    for name in names:
        info = graph_tensors[name]
        shape = list(info.shape)
        if batch["dim"] and microbatches > 1 and shape:
            shape[0] *= microbatches
        specs.append(TensorSpec(name, shape, info.dtype.name))
    return specs


def small_constants(model: onnx.ModelProto, limit: int = SMALL_CONSTANT_ELEMENTS) -> dict[str, np.ndarray]:
    """Values of the small initializers stored inline (shape targets, axes, scalars)."""
    found = {}
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL and np.prod(tensor.dims) <= limit:
            found[tensor.name] = numpy_helper.to_array(tensor)
    return found


def plan_model(model_path: str | os.PathLike, cluster: Cluster, dims: dict[str, int], workdir: Path,
               options: PlanOptions = PlanOptions(), cost_model: CostModel | None = None):
    """Load, canonicalise (into ``workdir``) and plan, without writing programs.

    Returns the plan, the strategies of each sharded stage, the canonical model and its graph."""
    model_path = Path(model_path)
    header = read_model(model_path, load_external_data=False)
    batch, program_dims = batch_layout(header, dims, options.microbatches)
    canonical = canonicalize(model_path, program_dims, workdir)
    graph = build_graph(canonical.model)
    model_info = {"path": str(model_path.resolve()), "sha256": canonical.source_sha256, "dims": dict(dims)}
    dtypes = compute_dtypes(graph)
    if dtypes != ["float32"]:                 # recorded where not float32 alone, as the report reads it
        model_info["compute_dtypes"] = dtypes
    plan, shardings = plan_pipeline(
        graph, cluster, options, model_info, batch,
        _full_specs(header, graph.tensors, graph.inputs, batch, options.microbatches),
        _full_specs(header, graph.tensors, graph.outputs, batch, options.microbatches),
        small_constants(canonical.model), cost_model,
    )
    return plan, shardings, canonical, graph


def make_plan(
    model_path: str | os.PathLike, cluster: Cluster, dims: dict[str, int], out_dir: str | os.PathLike,
    options: PlanOptions = PlanOptions(), external_threshold: int = EXTERNAL_THRESHOLD,
    cost_model: CostModel | None = None,
) -> Plan:
    model_path = Path(model_path)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / PLAN_FILE).exists())):
        raise PlanError(f"output {out_dir} exists and is not a plan directory", hint="choose another -o")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    header = read_model(model_path, load_external_data=False)
    symbolic_dims(header)  # reject unnamed dynamic dims early
    batch_layout(header, dims, options.microbatches)  # reject bad batch options before any work
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    os.chmod(staging, 0o755)
    try:
        workdir = staging / ".work"
        workdir.mkdir()
        plan, shardings, canonical, graph = plan_model(model_path, cluster, dims, workdir, options, cost_model)
        emit_programs(plan, canonical.path, staging, graph, shardings, external_threshold)
        shutil.rmtree(workdir)
        (staging / TIMELINE_FILE).write_text(render_timeline(plan))
        write_plan(plan, staging)
        _replace_dir(staging, out_dir)
        return plan
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace_dir(new: Path, target: Path) -> None:
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, target)
