"""How much key/value cache each rank of a plan holds, read from its program.

An attention operator's cache is its present key and value (its registry entry's
``cache_outputs``) (past and present share one
buffer where the model says so; a growing cache's present is the past plus the new
positions). A rank holds the local shapes its program declares for them: a head split
gives each rank its heads' share, and a key/value head held by several ranks (more
ranks than key/value heads) counts on each of them.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import onnx
from onnx import helper

from meshplan.ops import entry
from meshplan.plan_format import Plan


def program_kv_cache_bytes(program: onnx.ModelProto) -> int:
    """The bytes of the present key/value tensors of every attention operator in ``program``."""
    graph = program.graph
    typed = {v.name: v for v in list(graph.value_info) + list(graph.output) + list(graph.input)}
    total = 0
    for node in graph.node:
        for index in entry(node.op_type, node.domain).cache_outputs:
            name = node.output[index] if index < len(node.output) else ""
            value = typed.get(name) if name else None
            if value is None:
                continue
            kind = value.type.tensor_type
            itemsize = helper.tensor_dtype_to_np_dtype(kind.elem_type).itemsize
            total += prod(d.dim_value for d in kind.shape.dim) * itemsize
    return total


def kv_cache_bytes(plan: Plan, plan_dir: str | Path) -> dict[int, int]:
    """Rank → the bytes of key/value cache its program holds."""
    plan_dir = Path(plan_dir)
    return {program.rank: program_kv_cache_bytes(onnx.load(str(plan_dir / program.file), load_external_data=False))
            for program in plan.programs}
