"""``meshplan show``: a plan directory as a person checks it before running it.

Per stage: its layers, ranks, mesh, time and memory against the device's; per layer of the
stage, its heaviest operators (by compute seconds) with the strategy chosen, in R/S
notation, and for the sharded ones why: the cost terms of the layer ILP for the chosen
strategy, the replicated one and the best other one (``intra.explain``); the heaviest
weights with the slice each rank holds; and per rank what it holds. The plan comes from
``plan.json``; node names, shapes, layers and costs from ``annotated.onnx`` (without it,
an older plan directory shows its stages and strategies only).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from meshplan.emit.annotate import ANNOTATED_FILE, COSTS_KEY, HINTED_KEY, LAYER_KEY, PLAN_KEY
from meshplan.emit.report import device_ranges, human_bytes, human_seconds
from meshplan.errors import PlanError
from meshplan.onnx_sharding import LayoutProblem, read_metadata
from meshplan.plan_format import Plan, Stage, read_plan
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.stage_ranks import StageRanks, per_stage

OPERATORS_SHOWN = 3
WEIGHTS_SHOWN = 5


@dataclass
class _Op:
    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    layer: int | None = None
    costs: dict = field(default_factory=dict)
    segments: dict = field(default_factory=dict)     # tensor → {axis: segments}
    hinted: bool = False                              # its layouts were pinned by a hint

    @property
    def seconds(self) -> float:
        return float(self.costs.get("compute_s", 0.0))


@dataclass
class _Model:
    ops: dict[str, _Op]
    shapes: dict[str, tuple]      # tensor → shape (dims as ints or names)
    dtypes: dict[str, str]
    weights: set[str]


def _read_annotated(directory: Path, plan: Plan) -> tuple[_Model | None, str | None]:
    path = directory / ANNOTATED_FILE
    if not path.is_file():
        return None, f"no {ANNOTATED_FILE} (a plan from an older meshplan): operators, layers and costs are not shown"
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf and onnx raise several types for a damaged file
        raise PlanError(f"{path} is not an ONNX model ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
    meta = {e.key: e.value for e in model.metadata_props}
    if meta.get(PLAN_KEY) != plan.to_dict()["checksum"]:
        return None, f"{ANNOTATED_FILE} describes another plan than plan.json: operators, layers and costs are not shown"
    shapes, dtypes = {}, {}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        tensor = value.type.tensor_type
        shapes[value.name] = tuple(d.dim_param or d.dim_value for d in tensor.shape.dim)
        dtypes[value.name] = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name if tensor.elem_type else "?"
    for tensor in model.graph.initializer:
        shapes[tensor.name] = tuple(tensor.dims)
        dtypes[tensor.name] = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).name
    ops = {}
    for node in model.graph.node:
        props = {e.key: e.value for e in node.metadata_props}
        layer = int(props[LAYER_KEY]) if LAYER_KEY in props else None
        costs = json.loads(props[COSTS_KEY]) if COSTS_KEY in props else {}
        try:
            _, segments = read_metadata(props)
        except LayoutProblem:
            segments = {}
        ops[node.name] = _Op(node.name, node.op_type, list(node.input), list(node.output), layer, costs,
                             {name: dict(dims) for name, dims in segments.items()}, HINTED_KEY in props)
    return _Model(ops, shapes, dtypes, {t.name for t in model.graph.initializer}), None


def show_plan(directory: str | Path, operators: int = OPERATORS_SHOWN, weights: int = WEIGHTS_SHOWN,
              stage: int | None = None) -> str:
    """The text ``meshplan show`` prints: every stage (or only ``stage``), its heaviest
    ``operators`` per layer and ``weights`` heaviest weights (0: all)."""
    directory = Path(directory)
    plan = read_plan(directory)
    if stage is not None and not 0 <= stage < len(plan.stages):
        raise PlanError(f"the plan has no stage {stage} (it has {len(plan.stages)})")
    if plan.training.get("pipeline"):
        return _pipeline_training_text(plan, directory, stage)
    model, note = _read_annotated(directory, plan)
    est = plan.estimate
    mesh = plan.cluster["mesh"]
    memory = plan.cluster["device"]["memory_bytes"] if "memory_bytes" in plan.cluster["device"] else None
    times = [s.seconds for s in plan.stages]
    slowest = max(times)
    lines = [
        f"plan: {len(plan.stages)} stage(s) on a {mesh[0]}x{mesh[1]} mesh of {plan.cluster['device']['name']}"
        f"{' (devices sharing each host)' if plan.cluster.get('host_shares') else ''}, "
        f"{plan.microbatches} microbatch(es) of {plan.batch['microbatch_size']}",
        f"latency {human_seconds(est['latency_seconds'])} = stages {human_seconds(sum(times))} + "
        f"({plan.microbatches} - 1) x slowest stage {human_seconds(slowest)}",
        "notation: one letter group per tensor dim: R whole, S0/S1 split over mesh axis 0/1, S01 over both; "
        "+P: addends summed over those axes; a strategy is inputs->outputs",
    ]
    if plan.training and "step_seconds" in est:   # a step of several calls (``inter.accumulated_step``)
        count = int(plan.training["microbatches"])
        lines.insert(2, f"training step {human_seconds(est['step_seconds'])} = {count} calls x "
                        f"{human_seconds(est['latency_seconds'])} - {count - 1} x the update "
                        f"{human_seconds(max(est['update_seconds']))} (run in the last call alone)")
    if note:
        lines.append(f"note: {note}")
    for s in plan.stages:
        if stage is None or s.index == stage:
            lines.extend(_stage_lines(plan, s, model, memory, slowest, operators, weights))
            lines.extend(_rank_lines(plan, s, directory))
    return "\n".join(lines)


def show_schedule(directory: str | Path, stage: int | None = None) -> str:
    """The text ``meshplan show --schedule`` prints: each working rank's instruction list (or
    those of ``stage``'s ranks), one instruction a line (``emit.schedule``)."""
    from meshplan.emit.schedule import SCHEDULE_FILE, read_schedule

    directory = Path(directory)
    plan = read_plan(directory)
    if stage is not None and not 0 <= stage < len(plan.stages):
        raise PlanError(f"the plan has no stage {stage} (it has {len(plan.stages)})")
    if plan.training.get("pipeline"):
        return _training_schedule_text(plan, directory, stage)
    if plan.training.get("estimate_only"):
        raise PlanError(f"plan {directory} is a training estimate (planned with --no-programs): it has no "
                        "instruction lists", hint="plan again without --no-programs to get them")
    schedule = read_schedule(plan, directory)
    source = SCHEDULE_FILE if (directory / SCHEDULE_FILE).is_file() else \
        f"built from plan.json (the directory has no {SCHEDULE_FILE})"
    lines = [f"schedule: {schedule.kind}, {schedule.microbatches} microbatch(es), {plan.num_ranks} rank(s) "
             f"({source})"]
    for rank, instructions in enumerate(schedule.ranks):
        if plan.is_idle(rank):
            continue
        here = plan.stage_of_rank(rank)
        if stage is not None and here.index != stage:
            continue
        lines.append(f"rank {rank} (stage {here.index}): {len(instructions)} instruction(s)")
        lines.extend(f"  {i:3d}  {item.text(plan)}" for i, item in enumerate(instructions))
    if plan.idle_ranks and stage is None:
        lines.append(f"idle ranks (no instructions): {device_ranges(plan.idle_ranks)}")
    return "\n".join(lines)


def _training_schedule_text(plan: Plan, directory: Path, stage: int | None) -> str:
    """A pipelined training plan's lists: each stage's runs, sends and receives of a step."""
    from meshplan.emit.pipeline_parts import read_pipeline
    from meshplan.emit.train_schedule import read_training_schedule

    record = plan.training["pipeline"]
    pipeline = read_pipeline(directory, plan.training, check=False)
    ranks = StageRanks.of(record.get("replicas", 1), pipeline.stages, pipeline.tensors or pipeline.tensor)
    lists = read_training_schedule(plan.to_dict()["checksum"], directory, pipeline, plan.microbatches,
                                   record["schedule"], list(ranks.replicas))
    R = ranks.replicas[0]
    each = "one rank" if ranks.size == pipeline.stages else f"{R} ranks (data-parallel replicas running one list)"
    if not ranks.uniform:
        each = f"{', '.join(str(ranks.width(s)) for s in range(pipeline.stages))} ranks (data-parallel replicas " \
            "running one list)"
    if pipeline.tensors:
        each = f"{', '.join(str(ranks.width(s)) for s in range(pipeline.stages))} ranks (each stage's " \
            f"{', '.join(map(str, pipeline.tensors))} that shard its operators, each running its own parts of one list)"
    elif pipeline.tensor > 1:
        each = f"{ranks.width(0)} ranks ({pipeline.tensor} that shard its operators, each running its own parts of " \
            "one list)"
    lines = [f"schedule: {record['schedule']}, {plan.microbatches} microbatch(es), {len(lists)} stage(s) of {each}, "
             "a step (schedule.json)"]
    for s, items in enumerate(lists):
        if stage is not None and s != stage:
            continue
        first, width = ranks.first(s), ranks.width(s)
        lines.append((f"rank {first}" if width == 1 else f"ranks {first}-{first + width - 1}")
                     + f" (stage {s}): {len(items)} instruction(s)")
        for i, item in enumerate(items):
            if item.op == "run":
                text = f"run {item.part}" + (f" mb {item.mb}" if item.part in ("forward", "backward") else "")
            elif item.op == "reduce":
                text = ("reduce-scatter the accumulated gradients over the replicas (each updates its row blocks)"
                        if pipeline.sharded else "all-reduce the accumulated gradients over the replicas")
            else:
                c = pipeline.crossings[item.crossing]
                peer = f"to stage {c.dst}" if item.op == "send" else f"from stage {c.src}"
                when = f"mb {item.mb}" if _per_mb(c) else "once a step"
                text = f"{item.op} {c.tensor} {when} {peer} ({c.made_in} -> {'/'.join(c.read_in)})"
                relayout = pipeline.relayouts.get(item.crossing)
                if relayout is not None:
                    text += (f", {relayout.source} on {relayout.senders} device(s) -> "
                             f"{c.received} {relayout.target} on {relayout.receivers}")
            lines.append(f"  {i:3d}  {text}")
    return "\n".join(lines)


def _pipeline_training_text(plan: Plan, directory: Path, stage: int | None) -> str:
    """A pipelined training plan: its report, then each stage's (or only ``stage``'s) ranks,
    the state it holds and its parts (programs a person can open)."""
    from meshplan.emit.pipeline_parts import read_pipeline
    from meshplan.emit.report import pipeline_training_report
    from meshplan.training.pipeline_step import PHASES

    pipeline = read_pipeline(directory, plan.training, check=False)
    record = plan.training["pipeline"]
    counts = per_stage(record.get("replicas", 1), pipeline.stages)
    shapes = {w: (info["shape"], info["dtype"]) for w, info in plan.training["weights"].items()}
    lines = [pipeline_training_report(plan), "", "`show --schedule` prints each stage's instruction list."]
    files = {(int(p["stage"]), p["phase"]): p["file"] for p in record["parts"] if int(p.get("device", 0)) == 0}
    for s in plan.stages:
        if stage is not None and s.index != stage:
            continue
        held = sorted(w for w, home in pipeline.home.items() if home == s.index and w in shapes)
        T = pipeline.tensor_of(s.index)
        nbytes = sum(int(np.prod(shapes[w][0], dtype=np.int64)) * np.dtype(shapes[w][1]).itemsize for w in held)
        lines.append("")
        lines.append(f"stage {s.index}: layers {s.layers[0]}-{s.layers[1] - 1}, rank(s) {device_ranges(s.devices)}"
                     + (f" ({counts[s.index]} data-parallel replicas)" if counts[s.index] > 1 else "")
                     + (f"; {T} that shard its operators, each its own parts (.d0 ... .d{T - 1})" if T > 1 else ""))
        lines.append(f"  holds {len(held)} trained weight(s), {human_bytes(nbytes)}"
                     + ("; each replica its row blocks of their optimizer slots"
                        if pipeline.sharded and counts[s.index] > 1 else "")
                     + ("; each device its pieces of them, in the layouts the ILP chose" if T > 1 else ""))
        for phase in PHASES:
            part = pipeline.parts.get((s.index, phase))
            if part is None:
                continue
            groups = pipeline.chunks.get(s.index) if phase == "update" else None
            lines.append(f"  {phase:<8} {files[(s.index, phase)]}: {len(part.inputs)} input(s), "
                         f"{len(part.outputs)} output(s)"
                         + (f", run in {len(groups)} groups of weights" if groups and len(groups) > 1 else ""))
    return "\n".join(lines)


def _per_mb(crossing) -> bool:
    from meshplan.emit.train_schedule import per_microbatch

    return per_microbatch(crossing)


def _rank_lines(plan: Plan, stage: Stage, directory: Path) -> list[str]:
    """What each rank of the stage holds: the estimate, and its program's bytes on disk."""
    lines = ["  ranks:"]
    estimate = plan.estimate.get("memory_bytes_per_device", [])
    programs = {p.rank: p for p in plan.programs}
    for rank in stage.devices:
        text = f"    rank {rank}: {human_bytes(estimate[rank]) if rank < len(estimate) else '?'} estimated "
        text += "(weights, state and activations in flight)"
        program = programs.get(rank)
        if program is not None:
            size = sum((directory / f).stat().st_size for f, _ in program.files if (directory / f).is_file())
            text += f"; program {program.file}: {human_bytes(size)}"
        lines.append(text)
    return lines


def _stage_lines(plan: Plan, stage: Stage, model: _Model | None, memory, slowest: float, operators: int,
                 weights: int) -> list[str]:
    layers = f"{stage.layers[0]}-{stage.layers[1] - 1}"
    view = "x".join(map(str, stage.logical_mesh))
    held = f"{human_bytes(stage.memory_bytes)} per device"
    if memory:
        held += f" of {human_bytes(memory)} ({100 * stage.memory_bytes / memory:.0f}%)"
    pace = " (the slowest: it sets the pace)" if stage.seconds == slowest and len(plan.stages) > 1 else ""
    lines = ["", f"stage {stage.index}: layers {layers}, {len(stage.operators)} operators on rank(s) "
                 f"{device_ranges(stage.devices)} (submesh {stage.submesh[0]}x{stage.submesh[1]} viewed as {view})",
             f"  {human_seconds(stage.seconds)} per microbatch{pace}; {held}"]
    if len(stage.devices) > 1:
        lines.append(f"  {len(stage.strategies)} of {len(stage.operators)} operators sharded; "
                     + (f"inputs arrive as {_specs(stage.input_specs)}" if stage.input_specs else "no inputs"))
    if model is None:
        for name, strategy in list(stage.strategies.items())[:operators or None]:
            lines.append(f"    {name}: {strategy}")
        return lines
    mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
    by_layer: dict[int | None, list[_Op]] = {}
    for name in stage.operators:
        op = model.ops.get(name)
        if op is not None:
            by_layer.setdefault(op.layer, []).append(op)
    for layer, ops in sorted(by_layer.items(), key=lambda item: (item[0] is None, item[0] or 0)):
        total = sum(op.seconds for op in ops)
        shown = sorted(ops, key=lambda op: -op.seconds)[:operators or None]
        head = f"  layer {layer}: {len(ops)} operator(s), {human_seconds(total)} of compute"
        if len(stage.devices) == 1:     # nothing is split: one line per layer
            lines.append(head + "; heaviest: " + ", ".join(f"{op.name} ({op.op_type}) {human_seconds(op.seconds)}"
                                                          for op in shown))
            continue
        lines.append(head)
        for op in shown:
            lines.extend(_operator_lines(op, stage))
    lines.extend(_weight_lines(stage, model, mesh, weights))
    return lines


def _specs(specs: dict) -> str:
    kinds = sorted(set(specs.values()))
    return ", ".join(kinds[:4]) + (", …" if len(kinds) > 4 else "")


def _operator_lines(op: _Op, stage: Stage) -> list[str]:
    strategy = stage.strategies.get(op.name, "replicated")
    lines = [f"    {op.name} ({op.op_type}): {strategy}, {human_seconds(op.seconds)}"]
    chosen = op.costs.get("chosen")
    pinned = "a hint pins its layouts (plan --hints)"
    if op.hinted and not chosen:
        lines.append(f"      why: {pinned}")
    if chosen:
        why = [f"why: {pinned + '; ' if op.hinted else ''}chosen {_terms(chosen)}"]
        for label, key in (("next best", "alternative"), ("replicated", "replicated")):
            other = op.costs.get(key)
            if other is None or (key == "replicated" and other["strategy"] == chosen["strategy"]):
                continue
            text = f"{label} {other['strategy']}: {_terms(other)}"
            if not op.hinted:      # where a hint decided, its terms alone
                text += _verdict(other, chosen)
            why.append(text)
        lines.extend(f"      {text}" for text in why)
    return lines


def _verdict(other: dict, chosen: dict) -> str:
    """Why ``other`` lost to ``chosen`` where its own terms do not say it."""
    if _total(other) < _total(chosen):
        return (" — faster alone but holds more weights: the stage's memory decided"
                if other["weight_bytes"] > chosen["weight_bytes"] else
                " — faster alone; the layer's whole ILP decided (its neighbours' layouts change with it)")
    if math.isclose(_total(other), _total(chosen), rel_tol=1e-6) and other["weight_bytes"] > chosen["weight_bytes"]:
        return " — as fast, but holds more weights per device"
    return ""


def _total(terms: dict) -> float:
    return terms["compute_s"] + terms["reshard_in_s"] + terms["reshard_out_s"]


def _terms(terms: dict) -> str:
    if _total(terms) == float("inf"):
        return "not possible with its neighbours' layouts (whole tensors where they take addends)"
    return (f"{human_seconds(_total(terms))} = compute {human_seconds(terms['compute_s'])} + resharding in "
            f"{human_seconds(terms['reshard_in_s'])} + out {human_seconds(terms['reshard_out_s'])}; "
            f"weights {human_bytes(terms['weight_bytes'])}/device")


def _weight_lines(stage: Stage, model: _Model, mesh: LogicalMesh, limit: int) -> list[str]:
    """The stage's heaviest weights: the layout each reader takes, and per rank its slice."""
    found: dict[str, dict[str, str]] = {}        # weight → {spec: reader}
    for name in stage.operators:
        op = model.ops.get(name)
        if op is None:
            continue
        specs = _input_specs(stage.strategies.get(name))
        for k, tensor in enumerate(op.inputs):
            if tensor in model.weights and len(model.shapes.get(tensor, ())) > 0:
                spec = specs[k] if specs and k < len(specs) and specs[k] != "_" else "R" * len(model.shapes[tensor])
                found.setdefault(tensor, {}).setdefault(spec, (name, op.segments.get(tensor)))
    if not found:
        return []

    def size(tensor: str) -> int:
        total = 1
        for d in model.shapes[tensor]:
            total *= d if isinstance(d, int) else 1
        return total

    ranked = sorted(found, key=lambda t: -size(t))
    shown = ranked[:limit or None]
    if len(stage.devices) == 1:
        return [f"  heaviest weights ({len(shown)} of {len(found)}), whole on rank {stage.devices[0]}: "
                + ", ".join(f"{t} {list(model.shapes[t])} {model.dtypes.get(t, '')}" for t in shown)]
    lines = [f"  heaviest weights ({len(shown)} of {len(found)}), as each rank holds them:"]
    for tensor in shown:
        shape = model.shapes[tensor]
        for text, (reader, segments) in found[tensor].items():
            lines.append(f"    {tensor} {list(shape)} {model.dtypes.get(tensor, '')} as {text} (read by {reader})")
            try:
                spec = ShardingSpec.parse(text)
            except ValueError:
                continue
            if segments:
                spec = spec.with_segments(segments)
            if spec.is_replicated or len(stage.devices) == 1:
                continue
            parts = []
            for rank in stage.devices:
                index = spec.local_slices(tuple(shape), mesh, mesh.coord(rank))
                parts.append(f"rank {rank} [{', '.join(_slice(s, d) for s, d in zip(index, shape))}]")
            lines.append(f"      {'; '.join(parts)}")
    return lines


def _input_specs(strategy: str | None) -> list[str] | None:
    if not strategy:
        return None
    return strategy.split("->")[0].split(",")


def _slice(index, size) -> str:
    if isinstance(index, slice):
        start, stop = index.start or 0, size if index.stop is None else index.stop
        return ":" if (start, stop) == (0, size) else f"{start}:{stop}"
    values = list(index)
    runs, first = [], values[0]
    for a, b in zip(values, values[1:] + [None]):
        if b != a + 1:
            runs.append(f"{first}:{a + 1}")
            first = b
    return "+".join(runs)
