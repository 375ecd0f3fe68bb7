"""Write one ONNX program per device: each stage's subgraph, cut from the canonical model
with onnx's own extractor, carrying only the weights that stage uses.

Boundary tensors become the program's inputs and outputs. Programs whose weights exceed
``external_threshold`` bytes keep them in an external data file beside the program.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import external_data_helper

from meshplan.model.graph import Graph
from meshplan.model.load import set_ir_version
from meshplan.files import file_sha256
from meshplan.plan_format import Plan, Program
from meshplan.emit.shard import shard_program
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.intra.strategies import Strategy

EXTERNAL_THRESHOLD = 256 * 1024 * 1024


def program_name(rank: int) -> str:
    return f"rank{rank}.onnx"


def _specs(texts: dict[str, str]) -> dict[str, ShardingSpec]:
    return {name: ShardingSpec.parse(text) for name, text in texts.items()}


def emit_programs(plan: Plan, canonical_path: Path, out_dir: Path, graph: Graph,
                  shardings: dict[int, dict[str, Strategy]], external_threshold: int = EXTERNAL_THRESHOLD) -> None:
    """Write every rank's program into ``out_dir`` and record them in ``plan.programs``.

    A one-device stage's program is its subgraph as cut; each device of a larger stage
    gets that subgraph sharded for its coordinate (see ``shard_emit``)."""
    canonical = onnx.load(str(canonical_path), load_external_data=False)
    extractor = onnx.utils.Extractor(canonical)
    base_dir = str(canonical_path.parent)
    programs = []
    for stage in plan.stages:
        program = extractor.extract_model(stage.inputs, stage.outputs)
        program.graph.name = f"stage{stage.index}"
        external_data_helper.load_external_data_for_model(program, base_dir)
        set_ir_version(program)
        mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
        for rank in stage.devices:
            local = program
            if len(stage.devices) > 1:
                record = stage.collectives if rank == stage.devices[0] else None
                local = shard_program(program, graph, shardings.get(stage.index, {}), mesh, rank,
                                      _specs(stage.input_specs), _specs(stage.output_specs), record)
            weight_bytes = sum(len(t.raw_data) for t in local.graph.initializer)
            name = program_name(rank)
            path = out_dir / name
            data_files = []
            if weight_bytes > external_threshold:
                data_name = name + ".data"
                copy = onnx.ModelProto()
                copy.CopyFrom(local)
                onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                                location=data_name, size_threshold=1024)
                data_files.append({"file": data_name, "sha256": file_sha256(out_dir / data_name)})
            else:
                onnx.save_model(local, str(path))
            onnx.checker.check_model(str(path))
            programs.append(Program(rank=rank, stage=stage.index, file=name, sha256=file_sha256(path),
                                    data_files=data_files))
    plan.programs = sorted(programs, key=lambda p: p.rank)
