"""``meshplan verify`` stage by stage, for models larger than memory.

For each stage of the plan in order: the original model's subgraph between the stage's
boundary tensors (cut from the canonical model with ``onnx.utils.Extractor``, its weights
left in their files) runs in onnxruntime, fed the reference values of the stages before,
in pieces of bounded weight bytes; the stage's programs run fed the same tensors (each
device its slice, as the stage's input specs say), one segment at a time on every device
in lockstep with the collectives in memory; the stage's outputs are compared, and only
the reference values later stages or the model outputs need are kept. Every session is
dropped once it has run every microbatch, so memory holds one reference piece or one
segment of the stage's programs at a time (the weights a piece or a segment reads), plus
the boundary activations; never the model.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from meshplan.errors import PlanError
from meshplan.model.weights import load_tensor
from meshplan.process_memory import available_memory
from meshplan.plan_format import Plan, local_name
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.runtime.inprocess import Comparison, checked_model_path, compare_outputs, in_memory_exchange
from meshplan.runtime.program import ProgramRunner, run_lockstep
from meshplan.runtime.quantization_bound import bounds_between, use_float_activations
from meshplan.runtime.sessions import StageSession, check_program_files, providers_for
from meshplan.runtime.tensors import join_microbatches, split_microbatches

# Stage by stage when the model's weights exceed this fraction of the memory available.
MEMORY_FRACTION = 0.5


@dataclass
class StageCheck:
    index: int
    devices: list[int]
    weight_bytes: int                       # what the stage's reference subgraph reads
    pieces: int                             # reference runs it took
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)


@dataclass
class StagedVerification:
    stages: list[StageCheck]
    outputs: dict[str, np.ndarray]          # the programs' model outputs (each stage fed the reference)
    reference: dict[str, np.ndarray]        # onnxruntime's model outputs
    bounds: dict[str, float] = field(default_factory=dict)   # the model outputs' quantization bounds


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """An initializer's bytes, from its dims and type (external data is not read)."""
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 1
    return count * itemsize


def model_weight_bytes(path: Path) -> int:
    """The bytes of a model file's initializers (read without their data)."""
    header = onnx.load(str(path), load_external_data=False)
    return sum(tensor_bytes(t) for t in header.graph.initializer)


def needs_stages(plan: Plan, model_path: str | Path | None = None) -> bool:
    """Whether the model's weights exceed ``MEMORY_FRACTION`` of the memory available."""
    available = available_memory()
    if available is None:
        return False
    return model_weight_bytes(checked_model_path(plan, model_path)) > MEMORY_FRACTION * available


def verify_by_stages(plan: Plan, plan_dir: Path, inputs: dict[str, np.ndarray], model_path: str | Path | None = None,
                     provider: str = "cpu", rtol: float | None = None, atol: float | None = None,
                     piece_bytes: int | None = None) -> StagedVerification:
    """Compare every stage's outputs with onnxruntime's on the same inputs (see the module).
    ``piece_bytes``: the most weight bytes one reference run reads (default: the largest
    initializer's; a node reading more runs alone)."""
    from meshplan.make_plan import canonical_for_plan

    path = checked_model_path(plan, model_path)
    providers = providers_for(provider)
    micro = split_microbatches(inputs, plan)
    wanted_later = _wanted_after(plan)
    reference: list[dict[str, np.ndarray]] = [dict(f) for f in micro]   # per microbatch: boundary tensors
    produced: list[dict[str, np.ndarray]] = [dict() for _ in micro]     # the programs' model outputs
    checks = []
    output_bounds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="meshplan-verify-") as work:
        canonical = canonical_for_plan(plan, path, Path(work))
        extractor = onnx.utils.Extractor(canonical.model)
        limit = piece_bytes or max((tensor_bytes(t) for t in canonical.model.graph.initializer), default=1)
        for stage in plan.stages:
            sub = extractor.extract_model(list(stage.inputs), list(stage.outputs))
            weight_bytes = sum(tensor_bytes(t) for t in sub.graph.initializer)
            pieces = _pieces(sub, limit)
            expected = _run_reference(sub, pieces, reference, canonical.path.parent, path.parent, providers)
            bounds: list[dict[str, float]] = [{} for _ in micro]
            if use_float_activations(sub.graph.node):   # the same pieces again, with float activations
                floats = _run_reference(sub, pieces, reference, canonical.path.parent, path.parent, providers)
                bounds = [bounds_between(e, f) for e, f in zip(expected, floats)]
            del sub
            actual = _run_programs(plan, plan_dir, stage, reference, micro, providers)
            check = StageCheck(stage.index, list(stage.devices), weight_bytes, len(pieces))
            check.comparisons = _compare(actual, expected, rtol, atol, bounds)
            model_outputs = {o.name for o in plan.outputs}
            for per_micro in bounds:
                for name, value in per_micro.items():
                    if name in model_outputs:
                        output_bounds[name] = max(output_bounds.get(name, 0.0), value)
            checks.append(check)
            for mb in range(len(micro)):
                reference[mb].update(expected[mb])
                produced[mb].update({n: v for n, v in actual[mb].items() if n in model_outputs})
                for name in list(reference[mb]):
                    if name not in wanted_later[stage.index] and name not in model_outputs and name not in micro[mb]:
                        del reference[mb][name]
    names = [o.name for o in plan.outputs]
    return StagedVerification(
        checks,
        join_microbatches([{n: p[n] for n in names if n in p} for p in produced], plan),
        join_microbatches([{n: r[n] for n in names} for r in reference], plan),
        output_bounds,
    )


def _wanted_after(plan: Plan) -> dict[int, set[str]]:
    """Per stage: the tensors a later stage reads."""
    wanted = {}
    later: set[str] = set()
    for stage in reversed(plan.stages):
        wanted[stage.index] = set(later)
        later.update(stage.inputs)
    return wanted


def _pieces(model: onnx.ModelProto, limit: int) -> list[list[onnx.NodeProto]]:
    """The model's nodes in order, in runs that read at most ``limit`` weight bytes each
    (a node reading more runs alone)."""
    sizes = {t.name: tensor_bytes(t) for t in model.graph.initializer}
    pieces, current, seen, held = [], [], set(), 0
    for node in model.graph.node:
        extra = sum(sizes[i] for i in set(node.input) if i in sizes and i not in seen)
        if current and held + extra > limit:
            pieces.append(current)
            current, seen, held = [], set(), 0
            extra = sum(sizes[i] for i in set(node.input) if i in sizes)
        current.append(node)
        seen.update(i for i in node.input if i in sizes)
        held += extra
    if current or not pieces:
        pieces.append(current)
    return pieces


def _run_reference(model: onnx.ModelProto, pieces, reference: list[dict], canonical_dir: Path, source_dir: Path,
                   providers) -> list[dict[str, np.ndarray]]:
    """The stage's outputs per microbatch, piece by piece; each piece's session is dropped
    once it has run every microbatch."""
    graph = model.graph
    typed = {v.name: v for v in list(graph.input) + list(graph.output) + list(graph.value_info)}
    weights = {t.name: t for t in graph.initializer}
    stage_outputs = [o.name for o in graph.output]
    values = [{n: r[n] for n in (i.name for i in graph.input) if n in r} for r in reference]
    missing = [i.name for i in graph.input if i.name not in values[0]]
    if missing:
        raise PlanError(f"no reference value for stage input '{missing[0]}'")
    later_reads = []
    needed: set[str] = set(stage_outputs)
    for nodes in reversed(pieces):
        later_reads.append(set(needed))
        needed.update(i for n in nodes for i in _reads(n))
    later_reads.reverse()
    for index, nodes in enumerate(pieces):
        made = [o for n in nodes for o in n.output if o]
        made_set = set(made)
        consumed = list(dict.fromkeys(i for n in nodes for i in _reads(n)))
        inputs = [i for i in consumed if i not in weights and i not in made_set and i in values[0]]
        outputs = [o for o in made if o in later_reads[index]]
        if not outputs:
            continue
        used = [_in_source(weights[i], canonical_dir, source_dir) for i in consumed if i in weights]
        wide_in = [i for i in inputs if _half(typed[i]) and values[0][i].dtype == np.float32]
        wide_out = [o for o in outputs if _half(typed[o])]
        casts_in = [helper.make_node("Cast", [i + WIDE], [i], to=typed[i].type.tensor_type.elem_type) for i in wide_in]
        casts_out = [helper.make_node("Cast", [o], [o + WIDE], to=onnx.TensorProto.FLOAT) for o in wide_out]
        sub = helper.make_graph(casts_in + list(nodes) + casts_out, f"{graph.name}/piece{index}",
                                [_widened(typed[i]) if i in wide_in else typed[i] for i in inputs],
                                [_widened(typed[o]) if o in wide_out else typed[o] for o in outputs], used)
        piece = helper.make_model(sub, opset_imports=list(model.opset_import), functions=list(model.functions))
        piece.ir_version = model.ir_version
        session = StageSession(piece.SerializeToString(), providers, weights_dir=source_dir.resolve(),
                               optimization="basic")
        for mb_values in values:
            got = session.run({(n + WIDE if n in wide_in else n): mb_values[n] for n in inputs})
            mb_values.update({(n[:-len(WIDE)] if n.endswith(WIDE) else n): v for n, v in got.items()})
        del session, piece, sub
        for mb_values in values:
            for name in list(mb_values):
                if name not in later_reads[index]:
                    del mb_values[name]
    dtypes = {n: helper.tensor_dtype_to_np_dtype(typed[n].type.tensor_type.elem_type) for n in stage_outputs}
    return [{n: v[n].astype(dtypes[n], copy=False) for n in stage_outputs} for v in values]


# Between two reference pieces a float16 or bfloat16 tensor travels as float32: onnxruntime
# computes those types in float32 on the CPU and rounds only where a session hands a value
# out, so a cut that handed out the rounded value would round where the whole model in one
# session does not (on a 2 GB float16 decoder the logits then differ by an ulp; with the
# float32 hand-over, not at all). Stage outputs are rounded to their type once, at the end.
WIDE = "::float32"


def _half(value: onnx.ValueInfoProto) -> bool:
    return value.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _widened(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in value.type.tensor_type.shape.dim]
    return helper.make_tensor_value_info(value.name + WIDE, onnx.TensorProto.FLOAT, dims)


def _in_source(tensor: onnx.TensorProto, canonical_dir: Path, source_dir: Path) -> onnx.TensorProto:
    """``tensor`` of the canonical model as onnxruntime can read it from the source's
    directory: a weight in the source's external data names that file (the canonical model
    reaches it through a link, which onnxruntime refuses); one the canonicalisation wrote
    (folded, or set aside) comes inline, read by meshplan."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return tensor
    location = next(e.value for e in tensor.external_data if e.key == "location")
    target = (canonical_dir / location).resolve()
    base = source_dir.resolve()
    if base in target.parents:
        moved = onnx.TensorProto()
        moved.CopyFrom(tensor)
        for entry in moved.external_data:
            if entry.key == "location":
                entry.value = target.relative_to(base).as_posix()
        return moved
    return load_tensor(tensor, canonical_dir)


def _reads(node: onnx.NodeProto) -> list[str]:
    """The tensors a node reads, those its subgraphs read from outside included."""
    names = [i for i in node.input if i]
    for attribute in node.attribute:
        for graph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
            inner = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} \
                | {t.name for t in graph.initializer}
            names.extend(i for n in graph.node for i in _reads(n) if i not in inner)
    return names


def _run_programs(plan: Plan, plan_dir: Path, stage, reference: list[dict], micro: list[dict],
                  providers) -> list[dict[str, np.ndarray]]:
    """The stage's programs on the reference inputs, segment by segment on every device in
    lockstep; each segment's sessions are dropped once they have run every microbatch.
    Returns the stage's outputs per microbatch, whole (shards joined, partial sums added)."""
    mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
    runners = {p.rank: ProgramRunner(check_program_files(plan, plan_dir, p), providers, lazy=True)
               for p in plan.programs if p.rank in stage.devices}
    values = [{rank: _feeds(stage, mesh, rank, reference[mb], micro[mb]) for rank in stage.devices}
              for mb in range(len(micro))]

    def around(index: int, rank: int, opening: bool) -> None:   # one segment's weights loaded at a time
        part = runners[rank].segments[index]
        if opening:
            part.open(providers)
        else:
            part.close()

    def after(index: int) -> None:       # keep what later segments or the stage's outputs read
        for rank in stage.devices:
            keep = _read_after(runners[rank].segments, index)
            for mb_values in values:
                for name in list(mb_values[rank]):
                    if name not in keep and name not in stage.outputs and name.rsplit("@", 1)[0] not in stage.outputs:
                        del mb_values[rank][name]

    run_lockstep({rank: runners[rank] for rank in stage.devices}, values, in_memory_exchange(mesh),
                 around=around, after=after)
    return [{name: _whole(stage, mesh, name, values[mb]) for name in stage.outputs} for mb in range(len(micro))]


def _read_after(segments, index: int) -> set[str]:
    """The values the segments after ``index`` (and their collectives) read."""
    names = set()
    for segment in segments[index + 1:]:
        names.update(segment.inputs)
        if segment.collective is not None:
            names.add(segment.collective.input)
    return names


def _feeds(stage, mesh: LogicalMesh, rank: int, reference: dict, micro: dict) -> dict[str, np.ndarray]:
    """What device ``rank`` of ``stage`` is fed: model inputs whole, other stage inputs as
    its slice of the reference value in the spec the stage receives it in."""
    feeds = {}
    coord = mesh.coord(rank)
    for name in stage.inputs:
        if name in micro:
            feeds[name] = micro[name]
            continue
        if name not in reference:
            raise PlanError(f"no reference value for stage {stage.index}'s input '{name}'")
        value = reference[name]
        spec = ShardingSpec.parse(stage.input_specs.get(name, "R" * value.ndim))
        local = value[spec.local_slices(value.shape, mesh, coord)]
        if spec.partial and mesh.position(coord, spec.partial)[0] != 0:
            local = np.zeros_like(local)     # one addend holds the value, the others add nothing
        feeds[local_name(name, spec)] = np.ascontiguousarray(local)
    return feeds


def _whole(stage, mesh: LogicalMesh, name: str, values: dict[int, dict]) -> np.ndarray:
    """Stage output ``name`` whole, from its shards on the stage's devices."""
    text = stage.output_specs.get(name)
    spec = ShardingSpec.parse(text) if text else None
    if spec is None or spec.is_replicated:
        for rank in stage.devices:
            if name in values[rank]:
                return values[rank][name]
        raise PlanError(f"no device of stage {stage.index} computes its output '{name}'")
    pieces: dict[int, np.ndarray] = {}
    shape = None
    for rank in stage.devices:
        coord = mesh.coord(rank)
        local = values[rank][local_name(name, spec)]
        if shape is None:
            shape = tuple(size * spec.shards(d, mesh) for d, size in enumerate(local.shape))
        index = mesh.position(coord, spec.partial)[0] if spec.partial else 0
        if index not in pieces:
            pieces[index] = np.empty(shape, dtype=local.dtype)
        pieces[index][spec.local_slices(shape, mesh, coord)] = local
    total = pieces[0].copy()
    for k in sorted(pieces)[1:]:
        total += pieces[k]
    return total


def _compare(actual: list[dict], expected: list[dict], rtol, atol, bounds: list[dict]) -> list[Comparison]:
    """Per stage output: the worst errors over the microbatches, ok where every one is
    (each microbatch with its own quantization bounds)."""
    merged: dict[str, Comparison] = {}
    for got, want, bound in zip(actual, expected, bounds):
        for c in compare_outputs(got, want, rtol, atol, bound):
            if c.name not in merged:
                merged[c.name] = c
            else:
                merged[c.name] = merged[c.name].merged(c)
    return list(merged.values())
