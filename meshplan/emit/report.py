"""Reports for people: a short text summary of a plan, and its pipeline timeline as SVG.

The SVG is written by hand (no plotting dependency): one row per stage, one box per
microbatch at its estimated start time under fill-drain scheduling, so the pipeline
bubble shows as the empty space at the start and end of each row.
"""

from __future__ import annotations

from html import escape

import numpy as np

from meshplan.plan_format import Plan
from meshplan.stage_ranks import per_stage

TIMELINE_FILE = "timeline.svg"
REPORT_FILE = "report.txt"

_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"


def fill_drain_schedule(stage_seconds: list[float], microbatches: int) -> list[list[tuple[float, float]]]:
    """(start, end) of every microbatch on every stage when each stage starts a microbatch
    as soon as it has finished the previous one and the previous stage has finished this one."""
    rows: list[list[tuple[float, float]]] = []
    for s, seconds in enumerate(stage_seconds):
        row = []
        free = 0.0
        for mb in range(microbatches):
            ready = rows[s - 1][mb][1] if s else 0.0
            start = max(free, ready)
            row.append((start, start + seconds))
            free = start + seconds
        rows.append(row)
    return rows


def device_ranges(devices: list[int]) -> str:
    """``0-7,16-23``: ranks as runs of consecutive numbers (a 512-device stage is one run)."""
    if not all(isinstance(rank, int) for rank in devices):
        return ",".join(str(rank) for rank in devices)
    runs: list[list[int]] = []
    for rank in devices:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)


def model_compute_dtypes(plan: Plan) -> list[str]:
    """The dtypes the planned model computes in; plan.json records them where they are not
    float32 alone (``make_plan.plan_model``)."""
    return list(plan.model.get("compute_dtypes", ["float32"]))


def text_report(plan: Plan) -> str:
    if plan.training.get("pipeline"):
        return pipeline_training_report(plan)
    mesh = plan.cluster["mesh"]
    est = plan.estimate
    lines = [
        f"plan: {len(plan.stages)} stage(s) on a {mesh[0]}x{mesh[1]} mesh of {plan.cluster['device']['name']}"
        f"{' (devices sharing each host)' if plan.cluster.get('host_shares') else ''}, "
        f"computing in {'+'.join(model_compute_dtypes(plan))}, "
        f"{plan.microbatches} microbatch(es) of {plan.batch['microbatch_size']}",
        f"{'stage':>5}  {'devices':<12} {'layers':<9} {'ops':>5}  {'mesh':>5} {'sharded':>7}  {'time/mb':>11}  "
        f"{'memory/dev':>11}",
    ]
    if "rewritten" in plan.batch:
        lines.insert(1, static_batch_line(plan.batch))
    if plan.sizes:
        lines.insert(1, sizes_line(plan))
    if plan.state:
        lines.insert(1, training_lines(plan) if plan.training else state_line(plan))
    for stage in plan.stages:
        devices = device_ranges(stage.devices)
        layers = f"{stage.layers[0]}-{stage.layers[1] - 1}"
        mesh = "x".join(str(n) for n in stage.logical_mesh)
        lines.append(
            f"{stage.index:>5}  {devices:<12} {layers:<9} {len(stage.operators):>5}  {mesh:>5} "
            f"{len(stage.strategies):>7}  {human_seconds(stage.seconds):>11}  {human_bytes(stage.memory_bytes):>11}"
        )
    if plan.idle:
        lines.append(idle_line(plan))
    small = small_stages_line(plan)
    if small:
        lines.append(small)
    if plan.reshardings:
        moved = sum(r.seconds for r in plan.reshardings)
        lines.append(f"between stages: {len(plan.reshardings)} tensor(s) resharded, {human_seconds(moved)} per microbatch")
        shown = sorted(plan.reshardings, key=lambda r: -r.seconds)[:RESHARDINGS_SHOWN]
        lines.extend(f"  {_resharding_line(r)}" for r in shown)
        if len(plan.reshardings) > len(shown):
            lines.append(f"  ... and {len(plan.reshardings) - len(shown)} more (plan.json lists them all)")
    if not plan.programs:
        lines.append("programs: none written (planned without programs; meshplan run needs them)")
    lines.extend(plan.notes)
    if plan.training.get("estimate_only"):
        lines.append(f"estimate: training step {human_seconds(est['latency_seconds'])} for a batch of "
                     f"{plan.batch['size']}, {est['throughput_per_second']:.1f} samples/s, at most "
                     f"{human_bytes(max(est['memory_bytes_per_device']))} per device "
                     f"({est.get('cost_model', 'analytic')} costs)"
                     + _planned_in(plan))
        return "\n".join(lines)
    if plan.training and "step_seconds" in est:   # a step of several calls (``inter.accumulated_step``)
        count = int(plan.training["microbatches"])
        lines.append(
            f"estimate: training step {human_seconds(est['step_seconds'])} for a batch of {plan.batch['size'] * count} "
            f"in {count} calls of {plan.batch['size']} (a call {human_seconds(est['latency_seconds'])}, of it the "
            f"update {human_seconds(max(est['update_seconds']))}, run in the last call alone), "
            f"{est['throughput_per_second']:.1f} samples/s ({est.get('cost_model', 'analytic')} costs)"
            + _planned_in(plan))
        return "\n".join(lines)
    lines.append(
        f"estimate: latency {human_seconds(est['latency_seconds'])} per batch of {plan.batch['size']}, "
        f"throughput {est['throughput_per_second']:.1f} samples/s ({est.get('cost_model', 'analytic')} costs)"
        + _planned_in(plan)
    )
    return "\n".join(lines)


def _planned_in(plan: Plan) -> str:
    """How long planning took (and how many layer ILPs were solved side by side), where known."""
    if "seconds" not in plan.timings:
        return ""
    shared = plan.timings.get("ilps_in_workers", 0)
    return f"; planned in {plan.timings['seconds']:.2f} s" + (
        f" ({shared} of its layer ILPs solved in worker processes)" if shared else "")


def pipeline_training_report(plan: Plan) -> str:
    """A pipelined training plan's report: each stage's device, layers, forward and backward
    time per microbatch, microbatches in flight and memory by kind; the crossings; the step."""
    mesh, t = plan.cluster["mesh"], plan.training
    record = t["pipeline"]
    kind, B, S = record["schedule"], plan.microbatches, len(plan.stages)
    counts = per_stage(record.get("replicas", 1), S)
    R = counts[0] if len(set(counts)) == 1 else 0     # (0: the stages differ)
    share = f"1/{R}" if R else "1/R"
    summed = f"each summing its row blocks of the gradients once a step and keeping and updating {share} of the " \
        "optimizer's state (ZeRO-1)" if record.get("sharded") else "their gradients summed once a step"
    T = int(record.get("tensor", 1))
    each = "one device a stage" if R == 1 else f"{R} devices a stage (data-parallel replicas, each 1/{R} of every " \
        f"microbatch, {summed})" if R else f"stages of {', '.join(map(str, counts[:-1]))} and {counts[-1]} " \
        f"devices (a stage's R devices data-parallel replicas, each 1/R of every microbatch, {summed})"
    if record.get("tensors"):
        tensors = [int(x) for x in record["tensors"]]
        widths = [r * x for r, x in zip(counts, tensors)]
        each = f"{', '.join(map(str, widths[:-1]))} and {widths[-1]} devices (each stage's " \
            f"{', '.join(map(str, tensors))} that shard its operators" \
            + (f", {R} data-parallel replicas of them, their gradients summed once a step" if R > 1 else
               f", {', '.join(map(str, counts))} data-parallel replicas of them" if not R else "") \
            + f"; {len(record.get('relayouts', {}))} crossing(s) laid out again between stages)"
    elif T > 1:
        each = f"{R * T} devices a stage ({T} that shard its operators" \
            + (f", {R} data-parallel replicas of them, their gradients summed once a step)" if R > 1 else ")")
    lines = [f"plan: pipelined training, {S} stages on a {mesh[0]}x{mesh[1]} mesh of "
             f"{plan.cluster['device']['name']}, {each}, {kind.upper() if kind == '1f1b' else 'GPipe'}, "
             f"{B} microbatch(es) of {plan.batch['microbatch_size']}",
             f"training: {t['optimizer']} on {t['loss']}, {len(t['weights'])} weight(s) trained{masters_phrase(t)}",
             f"{'stage':>5}  {'devices':<8} {'layers':<9} {'ops':>5}  {'fwd+bwd/mb':>11}  {'in flight':>9}  "
             f"{'memory':>11}  (weights, gradients, optimizer, activations, working, process)"]
    for stage, held in zip(plan.stages, t.get("memory", [])):
        flight = B if kind == "gpipe" else min(S - stage.index, B)
        parts = ", ".join(human_bytes(held.get(k, 0.0))
                          for k in ("weights", "gradients", "optimizer", "activations", "working", "process"))
        layers = f"{stage.layers[0]}-{stage.layers[1] - 1}"
        lines.append(f"{stage.index:>5}  {device_ranges(stage.devices):<8} {layers:<9} "
                     f"{len(stage.operators):>5}  {human_seconds(stage.seconds):>11}  {flight:>9}  "
                     f"{human_bytes(stage.memory_bytes):>11}  ({parts})")
    crossings = record["crossings"]
    forward = sum(1 for c in crossings if c["made_in"] == "forward" and "forward" in c["read_in"])
    back = sum(1 for c in crossings if c["made_in"] == "backward" and "backward" in c["read_in"])
    state = [c["tensor"] for c in crossings if c["made_in"] == "state"]
    lines.append(f"between stages: {forward} activation(s) forward and {back} gradient(s) back a microbatch, "
                 f"{len(crossings) - forward - back - len(state)} scalar(s) of the update a step"
                 + (f"; {', '.join(sorted(set(state)))} (a weight a later stage reads too) sent once a step and its "
                    "gradient sent back" if state else ""))
    lines.extend(plan.notes)
    est = plan.estimate
    reduce = max(est.get("reduce_seconds") or [0.0])
    update = max(est.get("update_seconds") or [0.0])
    how = ("its schedule played with each part's and send's time" if est.get("timing")
           else "sum of the stages + (B - 1) x the slowest")
    summing = "reduce-scatter and weight all-gather" if record.get("sharded") else "all-reduce"
    lines.append(f"estimate: step {human_seconds(est['step_seconds'])} ({how}"
                 + (f"; the replicas' gradient {summing}, {human_seconds(reduce)}" if max(counts) > 1 else "")
                 + f"; the update, {human_seconds(update)}), "
                 f"{plan.batch['size'] * B / est['step_seconds']:.1f} samples/s "
                 f"({est.get('cost_model', 'analytic')} costs)")
    return "\n".join(lines)


RESHARDINGS_SHOWN = 6
SMALL_STAGE_FRACTION = 0.1    # the planner's rule (inter.pipeline.MIN_STAGE_FRACTION)


def idle_line(plan: Plan) -> str:
    """``idle: devices 2-3 (no work; started with the others): <why>``."""
    ranks = plan.idle_ranks
    return (f"idle: {'device' if len(ranks) == 1 else 'devices'} {device_ranges(ranks)} (no stage, no program; "
            f"started with the others): {plan.idle.get('reason', '')}")


def small_stages_line(plan: Plan) -> str | None:
    """Stages below the small-stage rule's fraction of the slowest: the planner keeps them
    only where no plan without them fits."""
    if len(plan.stages) < 2:
        return None
    slowest = max(s.seconds for s in plan.stages)
    small = [s.index for s in plan.stages if s.seconds < SMALL_STAGE_FRACTION * slowest]
    if not small:
        return None
    return (f"small stage(s) {', '.join(map(str, small))} (under {SMALL_STAGE_FRACTION:.0%} of the slowest stage's time) "
            "kept apart: no plan without them fits")


def sizes_line(plan: Plan) -> str:
    """``sizes: batch 1 to 4 (costed at 4), …; memory at the top of every range; derived: …``."""
    from meshplan.model.sizes import Sizes

    sizes = Sizes.from_dict(plan.sizes)
    text = ", ".join(f"{n} {r.describe()} (costed at {r.cost_size})" for n, r in sizes.ranges.items())
    derived = [f"{n}" if f.text == n else f"{n} = {f.text}" for n, f in sizes.derived.items()]
    return (f"sizes: {text}; memory at the top of every range"
            + (f"; derived: {', '.join(derived)}" if derived else ""))


def state_line(plan: Plan) -> str:
    """``state: 4 output(s) kept on their devices for the next call (present.0.key -> … in RS1RR on stage 0, …)``."""
    shown = ", ".join(f"{s['output']} -> {s['input']} ({s['spec']}, stage {s['stage']})" for s in plan.state[:2])
    more = f", … {len(plan.state) - 2} more" if len(plan.state) > 2 else ""
    return f"state: {len(plan.state)} output(s) kept on their devices for the next call: {shown}{more}"


def training_memory(plan: Plan) -> dict[int, dict[str, float]]:
    """Per rank of a training plan, the estimate's bytes by kind: as recorded at planning
    (``plan.training["memory"]``), or for a plan written before that, split into ``weights`` and
    ``optimizer`` (the state each holds, in its layout), ``gradients`` (taken as the
    weights' local bytes: a gradient is made in its weight's layout or whole and cut) and
    ``activations`` (the rest of the stage's estimate: what backward keeps)."""
    from meshplan.sharding import LogicalMesh, ShardingSpec

    if "memory" in plan.training:   # by liveness over the step (inter.step_memory)
        return {rank: dict(plan.training["memory"]) for stage in plan.stages for rank in stage.devices}
    weights = plan.training["weights"]
    found = {}
    for stage in plan.stages:
        mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
        held = {"weights": 0.0, "optimizer": 0.0}
        for entry in plan.state:
            if entry["stage"] != stage.index:
                continue
            name = entry["input"]
            base = name if name in weights else name.rsplit(".", 1)[0]
            if base not in weights:
                continue
            shape = tuple(weights[base]["shape"])
            local = ShardingSpec.parse(entry["spec"]).local_shape(shape, mesh)
            nbytes = float(np.prod(local, dtype=np.float64)) * np.dtype(weights[base]["dtype"]).itemsize
            held["weights" if name in weights else "optimizer"] += nbytes
        rest = max(0.0, float(stage.memory_bytes) - held["weights"] - held["optimizer"])
        gradients = min(rest, held["weights"])
        for rank in stage.devices:
            found[rank] = {**held, "gradients": gradients, "activations": rest - gradients}
    return found


def training_lines(plan: Plan) -> str:
    """``training: adamw on cross_entropy:logits:target, 70 weight(s) trained, 12 of them split over the
    mesh (…); per device: weights …, optimizer …, gradients …, activations …``."""
    t = plan.training
    split = sum(1 for e in plan.state if e["input"] in t["weights"] and any(c != "R" for c in e["spec"]))
    memory = training_memory(plan)
    first = memory[min(memory)] if memory else {}
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in first.items())
    return (f"training: {t['optimizer']} on {t['loss']}, {len(t['weights'])} weight(s) trained{masters_phrase(t)}, "
            f"{split} of them split over the mesh (the rest whole on every device)"
            + (f"; per device: {parts}" if parts else ""))


def masters_phrase(training: dict) -> str:
    """``, 70 of them float16 held and updated in float32 (master weights)`` (``--master-weights``), or nothing."""
    kinds = sorted({w["model_dtype"] for w in training["weights"].values() if "model_dtype" in w})
    count = sum(1 for w in training["weights"].values() if "model_dtype" in w)
    return f", {count} of them {'/'.join(kinds)} held and updated in float32 (master weights)" if count else ""


def static_batch_line(batch: dict) -> str:
    """``batch: static dimension 8 (axis 0 of input_ids) rewritten to 2 per microbatch, …``."""
    axes = batch["axes"]
    places = ", ".join(f"axis {axes[name]} of {name}" for name in batch["batched_inputs"])
    rewritten = batch["rewritten"]
    what = f"dimension {batch['dim']!r}" if batch["dim"] else "static dimension"
    return (f"batch: {what} {batch['size']} ({places}) rewritten to {batch['microbatch_size']} per microbatch: "
            f"{len(rewritten['shape_constants'])} shape constant(s), {len(rewritten['constants_cut'])} constant(s) "
            "cut to one microbatch")


def _resharding_line(r) -> str:
    """``tensor stage a SPEC -> stage b SPEC: [rearranged to X in stage a,] N tasks[, all-gather in b], time``."""
    t = r.transfer
    steps = []
    if t.get("prepare"):
        steps.append(f"rearranged to {t['send_spec']} in stage {r.src_stage}")
    tasks = t.get("tasks", [])
    broadcasts = sum(1 for task in tasks if len(task["receivers"]) > 1)
    steps.append(f"{len(tasks)} task(s)" + (f", {broadcasts} broadcast" if broadcasts else ""))
    if t.get("allgathers"):
        steps.append(f"all-gather in stage {r.dst_stage}")
    return (f"{r.tensor}: stage {r.src_stage} {r.src_spec} -> stage {r.dst_stage} {r.dst_spec}: "
            f"{'; '.join(steps)}; {human_seconds(r.seconds)}")


def training_timeline(plan: Plan) -> tuple[list[list[tuple[str, int, float, float]]], float]:
    """A pipelined training plan's step as its schedule plays it: per stage, (phase,
    microbatch, start, end) of each forward and backward, and the step's end. A plan with
    programs keeps what its estimate played (``estimate["timing"]``: each part's seconds,
    each send's, ``emit.train_schedule.timed_step``); an estimate without programs has its
    stages' times a microbatch only, split one third forward, two thirds backward, with no
    sends or update drawn."""
    from meshplan.emit.train_schedule import run_order, timed_step

    S, B = len(plan.stages), plan.microbatches
    kind = training_schedule_kind(plan)
    timing = plan.estimate.get("timing")
    if timing:
        took = {(s, p): t for s, p, t in timing["took"]}
        sent = {(s, p): t for s, p, t in timing["sent"]}
        rows, total = timed_step(S, B, kind, took, sent, timing.get("scalar", 0.0))
        return [[r for r in row if r[0] in ("forward", "backward")] for row in rows], total
    orders = [[r for r in run_order(s, S, B, kind) if r[0] in ("forward", "backward")] for s in range(S)]
    took = {(s, "forward"): plan.stages[s].seconds / 3 for s in range(S)}
    took.update({(s, "backward"): plan.stages[s].seconds * 2 / 3 for s in range(S)})
    return timed_step(S, B, kind, took, {}, orders=orders)


def render_training_timeline(plan: Plan) -> str:
    rows, total = training_timeline(plan)
    kind = training_schedule_kind(plan)
    boxes = [[(start, end, mb, phase != "forward", f"{mb}" if phase == "forward" else f"b{mb}",
               f"stage {s}, {phase} of microbatch {mb}") for phase, mb, start, end in row]
             for s, row in enumerate(rows)]
    marks = [(row[-1][3] if row else 0.0, f"stage {s}: norm, clip and update") for s, row in enumerate(rows)]
    title = (f"estimated training step: {len(rows)} stage(s), {kind.upper() if kind == '1f1b' else 'GPipe'}, "
             f"{plan.microbatches} microbatch(es), forward (solid) and backward (pale), then the update; "
             f"{human_seconds(total)}")
    return _timeline_svg(plan, title, boxes, total, marks)


def training_schedule_kind(plan: Plan) -> str:
    """A pipelined training plan's schedule (1f1b or gpipe), or a training estimate's."""
    return plan.training["pipeline"]["schedule"] if plan.training.get("pipeline") else plan.training["schedule"]


def render_timeline(plan: Plan) -> str:
    if plan.training.get("pipeline") or plan.training.get("estimate_only"):
        return render_training_timeline(plan)
    rows = fill_drain_schedule([s.seconds for s in plan.stages], plan.microbatches)
    total = max((row[-1][1] for row in rows), default=0.0)
    boxes = [[(start, end, mb, False, f"{mb}", f"stage {s}, microbatch {mb}") for mb, (start, end) in enumerate(row)]
             for s, row in enumerate(rows)]
    title = (f"estimated pipeline: {len(rows)} stage(s), {plan.microbatches} microbatch(es), "
             f"{human_seconds(total or 1.0)} per batch")
    return _timeline_svg(plan, title, boxes, total)


def _timeline_svg(plan: Plan, title: str, rows: list, total: float, marks: list | None = None) -> str:
    """One row a stage of boxes (start, end, microbatch, pale, label, tooltip) on a time
    axis; ``marks``: a thin bar a row (at, tooltip)."""
    total = total or 1.0
    left, top, row_h, width = 120, 40, 34, 900
    height = top + row_h * len(rows) + 50
    scale = width / total
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="20" font-size="14">{escape(title)}</text>',
    ]
    for s, row in enumerate(rows):
        y = top + s * row_h
        devices = device_ranges(plan.stages[s].devices)
        parts.append(f'<text x="8" y="{y + row_h * 0.6:.1f}">stage {s} [{escape(devices)}]</text>')
        parts.append(f'<rect x="{left}" y="{y + 3}" width="{width}" height="{row_h - 6}" fill="#eeeeee"/>')
        for start, end, mb, pale, label, tip in row:
            x, w = left + start * scale, max((end - start) * scale, 0.5)
            colour = _COLOURS[mb % len(_COLOURS)]
            parts.append(
                f'<rect x="{x:.2f}" y="{y + 3}" width="{w:.2f}" height="{row_h - 6}" fill="{colour}"'
                + (' fill-opacity="0.55"' if pale else "")
                + f' stroke="white"><title>{escape(tip)}: {escape(human_seconds(start))} – '
                f'{escape(human_seconds(end))}</title></rect>')
            if w > 18:
                parts.append(f'<text x="{x + w / 2:.2f}" y="{y + row_h * 0.6:.1f}" text-anchor="middle" '
                             f'fill="white">{label}</text>')
        if marks:
            at, tip = marks[s]
            parts.append(f'<rect x="{left + at * scale:.2f}" y="{y + 3}" width="3" height="{row_h - 6}" '
                         f'fill="black"><title>{escape(tip)}</title></rect>')
    axis_y = top + row_h * len(rows) + 15
    parts.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + width}" y2="{axis_y}" stroke="black"/>')
    for tick in range(6):
        x = left + width * tick / 5
        parts.append(f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle">{escape(human_seconds(total * tick / 5))}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
