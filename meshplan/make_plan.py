"""From a model file to a finished plan directory: load → plan → emit → report.

The directory appears complete or not at all: everything is written into a temporary
sibling that is renamed into place at the end.
"""

from __future__ import annotations

import os
from dataclasses import replace
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from meshplan.cost.cluster import Cluster
from meshplan.cost.analytic import CostModel, compute_dtypes
from meshplan.emit.programs import EXTERNAL_THRESHOLD, emit_programs
from meshplan.errors import HintError, ModelError, PlanError
from meshplan.inter.accumulated_step import accumulated_step
from meshplan.inter.hints import resolve_hints
from meshplan.model.hints import Hints, has_annotations, read_hints, strip_annotations
from meshplan.model.graph import build_graph
from meshplan.model.load import Rewrite, canonicalize, read_model, symbolic_dims
from meshplan.model.sizes import Sizes, derive_dims, split_dims
from meshplan.model.views import canonicalize_ranged
from meshplan.ops import SMALL_CONSTANT_ELEMENTS
from meshplan.static_batch import rewrite_static_batch
from meshplan.plan_format import PLAN_FILE, Plan, TensorSpec, write_plan
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.inter.pipeline import PlanOptions, plan_pipeline
from meshplan.intra.ilp import check_solver
from meshplan.emit.annotate import ANNOTATED_FILE, write_annotated
from meshplan.intra.explain import explain_plan
from meshplan.inter.training_costs import TrainingOperatorCosts
from meshplan.emit.schedule import write_schedule
from meshplan.emit.report import REPORT_FILE, TIMELINE_FILE, render_timeline, text_report


def batch_layout(model: onnx.ModelProto, dims: dict[str, int], microbatches: int,
                 batch_dim: tuple[str, ...] = ()) -> tuple[dict, dict[str, int]]:
    """The batch dimension and the dims the per-device programs are built for.

    With B microbatches the programs run on batch/B samples. A symbolic batch dimension
    (the symbolic dim at axis 0 of the inputs, or the one ``batch_dim`` names) is fixed to
    batch/B before folding when it is at axis 0 of its inputs and of every output. A static
    one (axis 0 of the inputs whose axis 0 has the first input's size, or the
    ``INPUT:AXIS`` places ``batch_dim`` names), or a symbolic one elsewhere, is rewritten to
    batch/B after folding (``static_batch``); its layout lists the batched inputs' axes
    under ``"axes"``, to which ``plan_model`` adds the outputs'.
    """
    if microbatches < 1:
        raise PlanError(f"--microbatches must be at least 1, got {microbatches}")
    initializers = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in initializers]
    batch_dim, static = _batch_place(inputs, tuple(batch_dim))
    if batch_dim is None and static:
        return _static_layout(inputs, static, microbatches), dict(dims)
    if batch_dim is not None and batch_dim not in dims and microbatches > 1:
        raise ModelError(f"the batch dimension {batch_dim!r} is unknown", hint=f"fix it with --dim {batch_dim}=INT")
    if batch_dim is None or batch_dim not in dims:
        size = 1
        for value in inputs:
            shape = value.type.tensor_type.shape.dim
            if shape and shape[0].HasField("dim_value"):
                size = shape[0].dim_value
                break
        if microbatches > 1:
            raise PlanError(
                "--microbatches needs a batch dimension at axis 0 of the model's inputs; this model has none",
                hint="use --microbatches 1, or name the batch with --batch-dim",
            )
        return {"dim": None, "size": size, "microbatch_size": size, "batched_inputs": []}, dict(dims)
    size = dims[batch_dim]
    if size % microbatches:
        raise PlanError(f"batch dimension {batch_dim!r} = {size} is not divisible by --microbatches {microbatches}")
    if microbatches > 1 and not _all_at_axis_0(inputs, model.graph.output, batch_dim):
        # Somewhere else than axis 0, or not declared on an output: rewritten as a static
        # batch, which finds where each output carries it.
        places = {v.name: (axis, size) for v in inputs for axis, d in enumerate(v.type.tensor_type.shape.dim)
                  if d.dim_param == batch_dim}
        return dict(_static_layout(inputs, places, microbatches), dim=batch_dim), dict(dims)
    program_dims = dict(dims)
    program_dims[batch_dim] = size // microbatches
    batched = [v.name for v in inputs if v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].dim_param == batch_dim]
    layout = {"dim": batch_dim, "size": size, "microbatch_size": size // microbatches, "batched_inputs": batched}
    return layout, program_dims


def _all_at_axis_0(inputs: list, outputs, batch_dim: str) -> bool:
    """Whether every input has the symbolic ``batch_dim`` at axis 0 or not at all, and every
    output has it at axis 0."""
    for value in list(inputs) + list(outputs):
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param == batch_dim and axis != 0:
                return False
    return all(v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].dim_param == batch_dim for v in outputs)


def _shape_text(value: onnx.ValueInfoProto) -> str:
    return "[" + ", ".join(d.dim_param or str(d.dim_value) for d in value.type.tensor_type.shape.dim) + "]"


def _batch_place(inputs: list, batch_dim: tuple[str, ...]) -> tuple[str | None, dict[str, tuple[int, int]]]:
    """The symbolic batch dim's name, or the static batch: {input: (axis, size)}.

    Without ``batch_dim``: the symbolic dim at axis 0 of the first input that has one,
    else axis 0 of every input whose axis 0 has the first input's size. ``batch_dim`` is a
    symbolic dim's name, or ``INPUT:AXIS`` places (repeatable)."""
    by_name = {v.name: v for v in inputs}
    listing = ", ".join(f"{v.name} {_shape_text(v)}" for v in inputs) or "none"
    if not batch_dim:
        for value in inputs:
            shape = value.type.tensor_type.shape.dim
            if shape and shape[0].dim_param:
                return shape[0].dim_param, {}
        sized = [v for v in inputs if v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].dim_value]
        if not sized:
            return None, {}
        size = sized[0].type.tensor_type.shape.dim[0].dim_value
        return None, {v.name: (0, size) for v in sized if v.type.tensor_type.shape.dim[0].dim_value == size}
    symbolic = {d.dim_param for v in inputs for d in v.type.tensor_type.shape.dim if d.dim_param}
    places: dict[str, tuple[int, int]] = {}
    names: set[str] = set()
    for text in batch_dim:
        place = _input_axis(text, by_name)
        if place is None:
            if text in symbolic:
                names.add(text)
                continue
            raise PlanError(f"--batch-dim {text!r} is neither a symbolic dimension nor INPUT:AXIS of the model's inputs"
                            f" (inputs: {listing})")
        name, axis = place
        dim = by_name[name].type.tensor_type.shape.dim[axis]
        if dim.dim_param:
            names.add(dim.dim_param)
        else:
            places[name] = (axis, dim.dim_value)
    if names and places or len(names) > 1:
        raise PlanError(f"--batch-dim names more than one batch dimension ({', '.join(batch_dim)})")
    if names:
        return names.pop(), {}
    sizes = {size for _, size in places.values()}
    if len(sizes) > 1:
        found = ", ".join(f"{name}:{axis} is {size}" for name, (axis, size) in places.items())
        raise PlanError(f"--batch-dim places have different sizes ({found})")
    return None, places


def _input_axis(text: str, inputs: dict) -> tuple[str, int] | None:
    """``INPUT:AXIS`` → (input, axis ≥ 0); None when ``text`` has no such form; PlanError
    for an unknown input or an axis out of range."""
    name, sep, axis_text = text.rpartition(":")
    try:
        axis = int(axis_text)
    except ValueError:
        return None
    if not sep or not name:
        return None
    if name not in inputs:
        listing = ", ".join(f"{v.name} {_shape_text(v)}" for v in inputs.values()) or "none"
        raise PlanError(f"--batch-dim {text}: the model has no input {name!r} (inputs: {listing})")
    rank = len(inputs[name].type.tensor_type.shape.dim)
    if not -rank <= axis < rank:
        raise PlanError(f"--batch-dim {text}: input '{name}' {_shape_text(inputs[name])} has no axis {axis}")
    return name, axis % rank


def _static_layout(inputs: list, places: dict[str, tuple[int, int]], microbatches: int) -> dict:
    """The layout of a static batch (rewritten after folding when ``microbatches`` > 1)."""
    first, (axis, size) = next(iter(places.items()))
    batched = [v.name for v in inputs if v.name in places]
    if microbatches == 1:
        return {"dim": None, "size": size, "microbatch_size": size, "batched_inputs": []}
    if size % microbatches:
        raise PlanError(f"the static batch (axis {axis} of input '{first}') = {size} is not divisible by"
                        f" --microbatches {microbatches}")
    return {"dim": None, "size": size, "microbatch_size": size // microbatches, "batched_inputs": batched,
            "axes": {name: places[name][0] for name in batched}}


def static_batch_rewrite(batch: dict, microbatches: int) -> Rewrite | None:
    """What ``canonicalize`` applies to a static batch of layout ``batch`` (None for any
    other): the rewrite to the microbatch size, which records in ``batch`` the outputs'
    batch axes and the constants it changed."""
    if batch.get("axes") is None:
        return None
    inputs = dict(batch["axes"])

    def rewrite(model: onnx.ModelProto, read) -> None:
        done = rewrite_static_batch(model, read, inputs, microbatches)
        batch["axes"] = done.axes
        batch["rewritten"] = {"shape_constants": done.shape_constants, "constants_cut": done.constants_cut}

    return rewrite


def _full_specs(model: onnx.ModelProto, graph_tensors, names, batch: dict, microbatches: int) -> list[TensorSpec]:
    specs = []
    axes = batch.get("axes")
    for name in names:
        info = graph_tensors[name]
        shape = list(info.shape)
        if axes is not None and name in axes:
            shape[axes[name]] *= microbatches
        elif axes is None and batch["dim"] and microbatches > 1 and shape:
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


def state_pairs(header: onnx.ModelProto, given: dict[str, str] | None) -> dict[str, str]:
    """State output → the input it becomes: ``given`` (``--state OUT=IN``; an empty dict turns
    state off), else the pairs found by name (``present.N.key`` → ``past_key_values.N.key``,
    ``present…`` → ``past…``) with the same element type and rank."""
    initializers = {t.name for t in header.graph.initializer}
    inputs = {v.name: v for v in header.graph.input if v.name not in initializers}
    outputs = {v.name: v for v in header.graph.output}
    if given is not None:
        for out, name in given.items():
            if out not in outputs:
                raise PlanError(f"--state {out}={name}: the model has no output {out!r}")
            if name not in inputs:
                raise PlanError(f"--state {out}={name}: the model has no input {name!r}")
            a, b = outputs[out].type.tensor_type, inputs[name].type.tensor_type
            if a.elem_type != b.elem_type or len(a.shape.dim) != len(b.shape.dim):
                raise PlanError(f"--state {out}={name}: the output and the input differ in element type or rank")
        if len(set(given.values())) != len(given):
            raise PlanError("--state names one input for two outputs")
        return dict(given)
    found = {}
    for out, value in outputs.items():
        candidates = []
        if out.startswith("present."):
            candidates.append("past_key_values." + out[len("present."):])
        if out.startswith("present"):
            candidates.append("past" + out[len("present"):])
        for name in candidates:
            if name in inputs and name not in found.values():
                a, b = value.type.tensor_type, inputs[name].type.tensor_type
                if a.elem_type == b.elem_type and len(a.shape.dim) == len(b.shape.dim):
                    found[out] = name
                    break
    return found


DEFAULT_PREFILL_CHUNK = 128


def generation_plan_dims(model_path: str | os.PathLike, batch: int = 1, max_length: int | None = None,
                         chunk: int | None = None, given: dict | None = None,
                         state: dict[str, str] | None = None) -> tuple[dict, dict]:
    """The sizes of a plan for generation (``meshplan plan --generate``): ``batch`` sequences,
    a context of ``max_length`` positions (default: the model folder's context length), prompts
    fed in pieces of up to ``chunk`` positions; every call costed at a decode step with the
    cache at its longest, which memory counts. ``given`` dims (``--dim``) take precedence.
    Returns the dims and what was chosen (for the report)."""
    from meshplan.model.llm import LlmLayout, ModelFolder, generation_dims

    header = read_model(Path(model_path), load_external_data=False)
    folder = ModelFolder.read(model_path)
    layout = LlmLayout.read(header, state_pairs(header, state), folder)
    if batch < 1:
        raise PlanError(f"--batch must be at least 1, got {batch}")
    if max_length is None:
        max_length = folder.context_length
        if max_length is None:
            raise PlanError("the model's folder says no context length (no genai_config.json, config.json or "
                            "generation_config.json with one)", hint="give --max-length")
    chunk = min(chunk or DEFAULT_PREFILL_CHUNK, max_length)
    dims = generation_dims(layout, batch, max_length, chunk)
    dims.update(given or {})
    if batch > 1 and isinstance(layout.dims["batch"], str) and layout.dims["batch"] not in (given or {}):
        # 1 to ``batch`` sequences where the model's other dims still follow from its sizes (a
        # dynamo export's fit of its mask's length may need the batch fixed: then it is)
        from meshplan.model.sizes import derive_dims, split_dims

        try:
            derive_dims(header, split_dims(dims))
        except ModelError:
            dims[layout.dims["batch"]] = batch
    ranged = not isinstance(dims.get(layout.dims["batch"], batch), int)
    chosen = {"batch": batch, "max_length": max_length, "prefill_chunk": chunk, "cache": layout.cache,
              "padding": layout.padding_side,
              "batch_text": f"1 to {batch} sequences (costed at {batch})" if ranged else f"batch {batch}"}
    return dims, chosen


def _ranged_specs(header: onnx.ModelProto, graph_tensors, names, fixed: dict[str, int]) -> list[TensorSpec]:
    """Full specs of a ranged plan's inputs or outputs: a dim that follows the sizes is its
    name in the model (a free or derived dim), or -1 where the model names none."""
    declared = {v.name: v for v in list(header.graph.input) + list(header.graph.output)}
    specs = []
    for name in names:
        info = graph_tensors[name]
        shape = list(info.shape)
        value = declared.get(name)
        dims = value.type.tensor_type.shape.dim if value is not None else []
        for axis in info.ranged:
            param = dims[axis].dim_param if axis < len(dims) else ""
            shape[axis] = param if param and param not in fixed else -1
        for axis in info.dynamic:
            shape[axis] = -1
        specs.append(TensorSpec(name, shape, info.dtype.name))
    return specs


def _plan_ranged(model_path: Path, header, cluster: Cluster, sizes: Sizes, workdir: Path, options: PlanOptions,
                 cost_model, state: dict[str, str], weights: str = "read", hints=None, model_hints: bool = True):
    if options.microbatches > 1:
        raise PlanError("--microbatches needs fixed sizes; a plan for ranges of sizes runs one batch at a time",
                        hint="use --microbatches 1, or fix the dims with --dim NAME=INT")
    canonical, views = canonicalize_ranged(model_path, sizes, workdir, weights)
    found = _read_hints(canonical, hints, model_hints, cluster.num_devices)
    graph = build_graph(canonical.model, views)
    graph.state = dict(state)
    cost = sizes.point("cost")
    batch_dim, _ = _batch_place([v for v in header.graph.input if v.name in set(graph.inputs)], ())
    size = cost.get(batch_dim, 1) if batch_dim else 1
    batch = {"dim": batch_dim, "size": size, "microbatch_size": size, "batched_inputs": []}
    model_info = {"path": str(model_path.resolve()), "sha256": canonical.source_sha256, "dims": dict(sizes.fixed)}
    dtypes = compute_dtypes(graph)
    if dtypes != ["float32"]:
        model_info["compute_dtypes"] = dtypes
    constants = small_constants(canonical.model)
    plan, shardings = _plan_holding(found, graph, cluster, constants, options, lambda held: plan_pipeline(
        graph, cluster, options, model_info, batch,
        _ranged_specs(header, graph.tensors, graph.inputs, sizes.fixed),
        _ranged_specs(header, graph.tensors, graph.outputs, sizes.fixed),
        constants, cost_model, held,
    ))
    plan.sizes = sizes.to_dict()
    return plan, shardings, canonical, graph


def _record_state(plan: Plan, state: dict[str, str], graph) -> None:
    """Each state's stage and layout; where the layout splits a dim of heads held in
    segments (key/value heads fewer than the devices), the segments too: the runtime cuts
    and joins the state by them."""
    from meshplan.intra.segments import CONFLICT, tensor_segments

    segmented = tensor_segments(graph)
    for output, name in state.items():
        holder = next((s for s in plan.stages if name in s.inputs), None)
        maker = next((s for s in plan.stages if output in s.outputs), None)
        stage = holder or maker
        spec = ShardingSpec.parse(stage.input_specs.get(name) or stage.output_specs.get(output))
        record = {"output": output, "input": name, "stage": stage.index, "spec": str(spec)}
        mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
        known = {d: segs for d, segs in (segmented.get(name) or segmented.get(output) or {}).items() if segs != CONFLICT}
        # only where they change what a device holds (a plain split of whole heads needs none)
        segments = {d: segs for d, segs in known.items() if spec.with_segments(known).segmented(d, mesh) is not None}
        if segments:
            record["segments"] = [[d, [list(seg) for seg in segs]] for d, segs in sorted(segments.items())]
        plan.state.append(record)


def _read_hints(canonical, hints, model_hints: bool, num_devices: int) -> Hints | None:
    """The hints to hold: those of the file (or plan directory) ``hints``, else, with
    ``model_hints``, the annotations the model carries. The canonical model (and its file,
    which the programs are cut from) loses the model's annotations either way."""
    own = has_annotations(canonical.model)
    found = None
    if hints is not None:
        path = Path(hints)
        if path.is_dir():
            path = path / ANNOTATED_FILE
        found = read_hints(read_model(path, load_external_data=False), str(hints), num_devices)
        if found is None:
            raise HintError(f"{hints} has no multi-device annotations to read as hints")
    elif own and model_hints:
        found = read_hints(canonical.model, f"the annotations of {canonical.source.name}", num_devices)
    if own:
        strip_annotations(canonical.model)
        onnx.save_model(canonical.model, str(canonical.path))
    return found


def _plan_holding(hints: Hints | None, graph, cluster: Cluster, constants, options: PlanOptions, run):
    """``run(None)`` (the free search) when it keeps every hint — then it is also the best
    plan that does, and re-planning with a plan's own annotations gives that plan again —
    else ``run(constraints)``, the search with the hinted strategies pinned and the hinted
    stages forced. The hints are checked before any search."""
    if hints is None:
        return run(None)
    held = resolve_hints(hints, graph, cluster, constants, options.policy)
    pinned = len(held.pins.pins)
    plan, shardings = run(None)
    if held.violations(plan, shardings):
        try:
            plan, shardings = run(held)
        except PlanError as exc:
            raise HintError(f"no plan holds the hints of {hints.origin}: {exc}") from None
        problems = held.violations(plan, shardings)
        if problems:
            raise HintError(f"the plan does not hold the hints of {hints.origin}: {problems[0]}")
        how = "planned around them"
        plan.hinted = [graph.nodes[i].name for i in sorted(held.pins.pins)]
    else:
        how = "the free plan keeps them"
    stages = len(held.groups)
    plan.notes.append(f"hints: {hints.origin}: {pinned} operator layout(s) and {stages} stage(s) held; {how}")
    plan.notes.extend(held.placement_notes(plan))
    return plan, shardings


def plan_model(model_path: str | os.PathLike, cluster: Cluster, dims: dict, workdir: Path,
               options: PlanOptions = PlanOptions(), cost_model: CostModel | None = None,
               state: dict[str, str] | None = None, weights: str = "read", hints=None, model_hints: bool = True):
    """Load, canonicalise (into ``workdir``) and plan, without writing programs. ``dims``
    maps each named dim to a size or a ``DimRange``; the model's other dims are derived
    from them. ``state``: see ``state_pairs``. ``weights`` is ``canonicalize``'s: ``"read"``
    when programs will be emitted from the canonical model, ``"unread"`` or ``"absent"``
    for a plan alone. ``hints``: an annotated model (or a plan directory) whose
    annotations the plan must keep (``inter.hints``); without it, the model's own
    annotations, unless ``model_hints`` is False.

    Returns the plan, the strategies of each sharded stage, the canonical model and its graph."""
    model_path = Path(model_path)
    header = read_model(model_path, load_external_data=False)
    sizes = derive_dims(header, split_dims(dims))
    pairs = state_pairs(header, state)
    if pairs and options.microbatches > 1:
        raise PlanError("state (" + ", ".join(f"{o}={i}" for o, i in pairs.items()) + ") needs --microbatches 1",
                        hint="or turn state off with --no-state")
    if sizes.is_ranged:
        plan, shardings, canonical, graph = _plan_ranged(model_path, header, cluster, sizes, workdir, options,
                                                         cost_model, pairs, weights, hints, model_hints)
        _record_state(plan, pairs, graph)
        return plan, shardings, canonical, graph
    given = dict(dims)
    dims = sizes.resolve({})
    batch, program_dims = batch_layout(header, dims, options.microbatches, options.batch_dim)
    canonical = canonicalize(model_path, program_dims, workdir, static_batch_rewrite(batch, options.microbatches),
                             weights)
    found = _read_hints(canonical, hints, model_hints, cluster.num_devices)
    graph = build_graph(canonical.model)
    graph.state = dict(pairs)
    # where the batch enters (--policy data follows it through the graph)
    graph.memo["batch_inputs"] = {name: (batch.get("axes") or {}).get(name, 0) for name in batch["batched_inputs"]}
    model_info = {"path": str(model_path.resolve()), "sha256": canonical.source_sha256, "dims": given}
    if sizes.derived:
        model_info["dims"] = dims
    dtypes = compute_dtypes(graph)
    if dtypes != ["float32"]:                 # recorded where not float32 alone, as the report reads it
        model_info["compute_dtypes"] = dtypes
    constants = small_constants(canonical.model)
    plan, shardings = _plan_holding(found, graph, cluster, constants, options, lambda held: plan_pipeline(
        graph, cluster, options, model_info, batch,
        _full_specs(header, graph.tensors, graph.inputs, batch, options.microbatches),
        _full_specs(header, graph.tensors, graph.outputs, batch, options.microbatches),
        constants, cost_model, held,
    ))
    _record_state(plan, pairs, graph)
    return plan, shardings, canonical, graph


def canonical_for_plan(plan: Plan, model_path: str | os.PathLike, workdir: Path):
    """The canonical model a plan was made from, canonicalised again into ``workdir`` from
    ``model_path`` (the planned model; its weights stay in their files): the same dims,
    batch layout and microbatch size as planning used, so its tensor names and shapes are
    the plan's."""
    if plan.is_ranged:
        raise PlanError("meshplan verify --stages runs plans for one size; this plan is for ranges of sizes",
                        hint="use --whole-model")
    header = read_model(Path(model_path), load_external_data=False)
    batch = plan.batch
    if batch.get("dim"):
        batch_dim = (batch["dim"],)
    elif batch.get("axes"):
        batch_dim = tuple(f"{name}:{axis}" for name, axis in batch["axes"].items() if name in batch["batched_inputs"])
    else:
        batch_dim = ()
    layout, program_dims = batch_layout(header, plan.model.get("dims", {}), plan.microbatches, batch_dim)
    del header
    return canonicalize(model_path, program_dims, workdir, static_batch_rewrite(layout, plan.microbatches))


def make_plan(
    model_path: str | os.PathLike, cluster: Cluster, dims: dict[str, int], out_dir: str | os.PathLike,
    options: PlanOptions = PlanOptions(), external_threshold: int = EXTERNAL_THRESHOLD,
    cost_model: CostModel | None = None, state: dict[str, str] | None = None,
    programs: bool = True, shapes_only: bool = False, hints=None, model_hints: bool = True,
    training=None, _record=None,
) -> Plan:
    """Plan ``model_path`` and write the plan directory ``out_dir``: plan.json, the timeline
    and, unless ``programs`` is False, one program per device. Without programs no weight
    byte is read (the external data files are only checked to be there and long enough,
    so sparse ones do); ``shapes_only`` (which implies no programs) does not even look for
    them. ``training`` (a ``training.step_model.TrainSpec``): plan the model's training step
    instead (``_training_step``)."""
    if shapes_only:
        programs = False
    if training is not None:
        return _plan_training(model_path, cluster, dims, out_dir, options, external_threshold, cost_model,
                              programs, shapes_only, training)
    weights = "read" if programs else "absent" if shapes_only else "unread"
    model_path = Path(model_path)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / PLAN_FILE).exists())):
        raise PlanError(f"output {out_dir} exists and is not a plan directory", hint="choose another -o")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    header = read_model(model_path, load_external_data=False)
    symbolic_dims(header)  # reject unnamed dynamic dims early
    if not split_dims(dims).is_ranged:   # reject bad batch options before any work
        batch_layout(header, derive_dims(header, split_dims(dims)).resolve({}), options.microbatches, options.batch_dim)
    check_solver(options.solver)  # and a solver that does not load here
    if hints is not None and not Path(hints).exists():
        raise HintError(f"hints file not found: {hints}")
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    os.chmod(staging, 0o755)
    try:
        workdir = staging / ".work"
        workdir.mkdir()
        plan, shardings, canonical, graph = plan_model(model_path, cluster, dims, workdir, options, cost_model, state,
                                                       weights, hints, model_hints)
        if _record is not None:   # what a caller adds to plan.json (a training plan's section)
            _record(plan, graph, shardings)
        if programs:
            emit_programs(plan, canonical.path, staging, graph, shardings, external_threshold)
        constants = small_constants(canonical.model)
        costed = cluster.costed(options.microbatches)
        costing = cost_model or CostModel(costed)
        training_costs = None if options.training is None else TrainingOperatorCosts(
            graph, costing, costed, constants, options.training, options.microbatches)
        explanations = explain_plan(plan, shardings, graph, costing, costed, constants, options.policy,
                                    training_costs)
        _accumulated_estimate(plan, canonical.model.graph, graph.state, explanations)
        write_annotated(plan, shardings, graph, canonical, staging, constants, explanations)
        shutil.rmtree(workdir)
        (staging / TIMELINE_FILE).write_text(render_timeline(plan))
        (staging / REPORT_FILE).write_text(text_report(plan) + "\n")
        write_plan(plan, staging)
        if not plan.training.get("estimate_only"):   # a training estimate has no lists to run
            write_schedule(plan, staging)
        _replace_dir(staging, out_dir)
        return plan
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


TRAINING_STEP = Path("training") / "step.onnx"


def _plan_training(model_path, cluster: Cluster, dims, out_dir, options: PlanOptions, external_threshold: int,
                   cost_model, programs: bool, shapes_only: bool, spec) -> Plan:
    """Plan the training step of ``model_path`` (``training.step_model``): one stage spanning
    the mesh, one microbatch, the trained weights and optimizer slots as state; the step
    model is kept in the plan directory (``TRAINING_STEP``), the source model's path and
    digest in ``plan.training``. ``--stages S`` > 1 makes a pipelined plan instead, and
    ``--max-stages N`` weighs the two (``make_pipeline_plan``). Without programs, either
    makes a training estimate at any scale (``make_training_estimate``)."""
    from meshplan.files import file_sha256
    from meshplan.training.step_model import build_step_model, save_step_model

    model_path, out_dir = Path(model_path), Path(out_dir)
    if not model_path.is_file():
        raise ModelError(f"model file not found: {model_path}")
    if options.recompute and (options.stages in (None, 1) if programs else
                              options.stages is None and options.max_stages is None):
        raise PlanError("--recompute goes with pipeline stages: --stages S (S > 1), or a training estimate "
                        "(--no-programs with --stages or --max-stages)")
    if not programs and (options.stages is not None or options.max_stages is not None):
        from meshplan.make_training_estimate import plan_training_estimate

        return plan_training_estimate(model_path, cluster, dims, out_dir, options, spec, cost_model, shapes_only,
                                      make_plan)
    if options.max_stages not in (None, 1):   # the stage count weighed: one stage, or a pipeline
        from meshplan.make_pipeline_plan import choose_training_stages

        one_dims, one_spec = training_microbatches(model_path, dims, options.microbatches, spec) \
            if options.microbatches > 1 else (dims, spec)
        out_dir.parent.mkdir(parents=True, exist_ok=True)

        def one_stage(target: Path) -> Plan:
            return _plan_training(model_path, cluster, dims, target, replace(options, max_stages=None),
                                  external_threshold, cost_model, programs, shapes_only, spec)

        return choose_training_stages(model_path, cluster, one_dims, out_dir, options, one_spec,
                                      max(one_spec.microbatches, 1), cost_model, _replace_dir, one_stage)
    if options.microbatches > 1:   # a call per microbatch, the gradients accumulated: planned at one microbatch
        dims, spec = training_microbatches(model_path, dims, options.microbatches, spec)
        options = replace(options, microbatches=1)
    if options.stages not in (None, 1):
        from meshplan.make_pipeline_plan import plan_pipeline_training

        return plan_pipeline_training(model_path, cluster, dims, out_dir, options, spec,
                                      max(spec.microbatches, 1), cost_model, _replace_dir)
    step = build_step_model(model_path, spec)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.step.", dir=out_dir.parent))
    try:
        step_path = save_step_model(step, model_path, holder / TRAINING_STEP.name)
        plan_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.train.", dir=out_dir.parent))
        shutil.rmtree(plan_dir)
        source = {"path": str(model_path.resolve()), "sha256": file_sha256(model_path)}

        def record(plan: Plan, graph, shardings) -> None:
            plan.model["path"] = str((out_dir / TRAINING_STEP).resolve())
            plan.training = {**step.manifest, "source": source}
            _training_memory(plan, graph, shardings)

        plan = make_plan(step_path, cluster, dims, plan_dir, replace(options, max_stages=1, stages=None),
                         external_threshold,
                         cost_model, step.state, programs, shapes_only, _record=record)
        try:
            target = plan_dir / TRAINING_STEP
            target.parent.mkdir()
            for item in holder.iterdir():
                shutil.move(str(item), str(target.parent / item.name))
            _replace_dir(plan_dir, out_dir)
        except BaseException:
            shutil.rmtree(plan_dir, ignore_errors=True)
            raise
        return plan
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def _accumulated_estimate(plan: Plan, program: onnx.GraphProto, state: dict, explanations: dict) -> None:
    """A one-stage training plan of several microbatches a step: the step's estimate as a job
    runs it, the update on the last call alone (``inter.accumulated_step``), in
    ``plan.estimate`` (``step_seconds``, ``update_seconds``; its throughput the step's)."""
    count = int(plan.training.get("microbatches", 1))
    if count < 2 or plan.training.get("estimate_only") or len(plan.stages) != 1:
        return
    seconds = {name: float(found.get("compute_s", 0.0)) for name, found in explanations.items()}
    step, update = accumulated_step(float(plan.estimate["latency_seconds"]), count, seconds, program, state)
    plan.estimate.update(step_seconds=step, update_seconds=[update],
                         throughput_per_second=plan.batch["size"] * count / step if step else 0.0)


def _training_memory(plan: Plan, graph, shardings) -> None:
    """A training plan's memory per device by liveness over the step (``inter.step_memory``):
    recorded by kind in ``plan.training["memory"]``, and as the stage's and plan's estimate."""
    from meshplan.inter.step_memory import step_memory
    from meshplan.sharding import LogicalMesh, ShardingSpec

    stage = plan.stages[0]
    mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
    specs = {entry["input"]: ShardingSpec.parse(entry["spec"]) for entry in plan.state if entry["stage"] == 0}
    found = step_memory(graph, shardings.get(0, {}), specs, mesh, set(plan.training["weights"]))
    plan.training["memory"] = found
    stage.memory_bytes = float(sum(found.values()))
    per_device = plan.estimate.get("memory_bytes_per_device")
    if isinstance(per_device, list):
        for rank in stage.devices:
            per_device[rank] = stage.memory_bytes


def training_microbatches(model_path: Path, dims: dict, count: int, spec):
    """The dims of one microbatch of a training step of ``count`` (the leading dim of the
    model's first input divided), and the spec that accumulates over them."""
    header = read_model(model_path, load_external_data=False)
    initializers = {t.name for t in header.graph.initializer}
    first = next((v for v in header.graph.input if v.name not in initializers), None)
    shape = first.type.tensor_type.shape.dim if first is not None else []
    name = shape[0].dim_param if len(shape) else ""
    if not name:
        raise PlanError("--microbatches in a training plan needs a named batch dim (the leading dim of the model's "
                        "inputs)", hint="export the model with a dynamic batch dim")
    size = dims.get(name)
    if not isinstance(size, int):
        raise PlanError(f"--microbatches in a training plan needs --dim {name}=SIZE (one size)")
    if size % count:
        raise PlanError(f"--microbatches {count} does not divide the batch ({name}={size})")
    return {**dims, name: size // count}, replace(spec, microbatches=count)


def _replace_dir(new: Path, target: Path) -> None:
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, target)
