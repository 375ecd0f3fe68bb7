"""Write one ONNX program per device: each stage's subgraph, cut from the canonical model
with onnx's own extractor, carrying only the weights that stage uses.

Boundary tensors become the program's inputs and outputs. Programs whose weights exceed
``external_threshold`` bytes keep them in an external data file beside the program,
streamed from the canonical model's data file (``program_weights``): large weights are
never read whole.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from meshplan.model.graph import Graph
from meshplan.model.load import set_ir_version
from meshplan.model.ort_schemas import register_onnxruntime_schemas
from meshplan.files import HashRecord, file_sha256
from meshplan.plan_format import Plan, Program
from meshplan.emit.program_weights import load_small, write_program
from meshplan.emit.shard import shard_program
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.intra.segments import CONFLICT, tensor_segments
from meshplan.intra.strategies import Strategy

# Weights beyond this go to a data file beside the program. A program cut at its collectives
# is split into segments when a job starts: weights held inline would be parsed, copied into
# each segment and serialised again (0.8 s of a 264 MB program's 1.6 s start-up); external,
# onnxruntime reads each segment's own straight from the file.
EXTERNAL_THRESHOLD = 16 * 1024 * 1024
SMALL_BYTES = 4096          # external initializers read into the stage program (constants emission computes with)


def program_name(rank: int) -> str:
    return f"rank{rank}.onnx"


def _specs(texts: dict[str, str], graph: Graph) -> dict[str, ShardingSpec]:
    """A stage's boundary specs, with each tensor's segmented dims (a key/value cache held
    by heads, fewer heads than devices: each device holds the heads it reads)."""
    segmented = tensor_segments(graph)
    specs = {}
    for name, text in texts.items():
        spec = ShardingSpec.parse(text)
        segments = {d: segs for d, segs in (segmented.get(name) or {}).items() if segs != CONFLICT}
        specs[name] = spec.with_segments(segments) if segments else spec
    return specs


def emit_programs(plan: Plan, canonical_path: Path, out_dir: Path, graph: Graph,
                  shardings: dict[int, dict[str, Strategy]], external_threshold: int = EXTERNAL_THRESHOLD) -> None:
    """Write every rank's program into ``out_dir`` and record them in ``plan.programs``.

    A one-device stage's program is its subgraph as cut; each device of a larger stage
    gets that subgraph sharded for its coordinate (see ``shard_emit``)."""
    canonical = onnx.load(str(canonical_path), load_external_data=False)
    register_onnxruntime_schemas()   # programs are checked as their model was
    extractor = onnx.utils.Extractor(canonical)
    base_dir = canonical_path.parent
    programs = []
    for stage in plan.stages:
        program = extractor.extract_model(stage.inputs, stage.outputs)
        program.graph.name = f"stage{stage.index}"
        load_small(program, base_dir, SMALL_BYTES)
        set_ir_version(program)
        mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
        for rank in stage.devices:
            local, pending = program, {}
            if len(stage.devices) > 1:
                record = stage.collectives if rank == stage.devices[0] else None
                local = shard_program(program, graph, shardings.get(stage.index, {}), mesh, rank,
                                      _specs(stage.input_specs, graph), _specs(stage.output_specs, graph), record, pending)
            else:
                local = onnx.ModelProto()
                local.CopyFrom(program)
            name = program_name(rank)
            path = out_dir / name
            data_files = write_program(local, pending, base_dir, path, external_threshold)
            onnx.checker.check_model(str(path))
            written = Program(rank=rank, stage=stage.index, file=name, sha256=file_sha256(path), data_files=data_files)
            record = HashRecord(out_dir / written.hash_record)   # a run need not read them again
            for file, digest in written.files:
                record.put(out_dir / file, digest)
            record.save()
            programs.append(written)
    plan.programs = sorted(programs, key=lambda p: p.rank)
