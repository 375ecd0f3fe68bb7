"""A state held by heads: its pieces, who sends which, and the whole put back together.

Two key/value heads over four devices (each head held by the pair whose query heads read
it) is the case the printed spec alone gets wrong: ``RS1RR`` would cut the head dim into
four contiguous runs of half a head."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.plan_format import Stage, Plan
from meshplan.runtime.state_layout import assemble, distinct_holders, piece_of, state_mesh, state_spec, whole_shape


def _plan(devices, logical, entries) -> Plan:
    stage = Stage(index=0, operators=[], layers=[0, 1], devices=devices, submesh=logical, logical_mesh=logical,
                  inputs=[], outputs=[], seconds=0.0, memory_bytes=0.0)
    return Plan(model={}, cluster={}, microbatches=1, batch={}, inputs=[], outputs=[], stages=[stage], transfers=[],
                programs=[], reshardings=[], estimate={}, solver={}, state=entries)


@pytest.mark.parametrize("heads, logical, spec, expected_holders", [
    (2, [1, 4], "RS1RR", [0, 2]),      # a head per pair of devices
    (4, [1, 4], "RS1RR", [0, 1, 2, 3]),
    (8, [1, 4], "RS1RR", [0, 1, 2, 3]),
    (2, [2, 2], "RS1RR", [0, 1]),       # split on axis 1, replicated on axis 0
    (4, [2, 2], "RS01RR", [0, 1, 2, 3]),
    (2, [2, 2], "RRRR", [0]),
])
def test_a_cache_held_by_heads_splits_and_joins(heads, logical, spec, expected_holders):
    entry = {"input": "past", "output": "present", "stage": 0, "spec": spec}
    if spec != "RRRR":
        entry["segments"] = [[1, [[heads, heads]]]]
    plan = _plan([0, 1, 2, 3], logical, [entry])
    layout, mesh = state_spec(entry), state_mesh(plan, entry)
    whole = np.arange(2 * heads * 5 * 3, dtype=np.float32).reshape(2, heads, 5, 3)
    pieces = {rank: piece_of(whole, layout, mesh, rank) for rank in range(4)}
    shards = 1 if spec == "RRRR" else mesh.axis_size(1) * (mesh.shape[0] if spec == "RS01RR" else 1)
    for rank, piece in pieces.items():
        held = max(1, heads // shards)
        assert piece.shape == (2, held, 5, 3)
        # the heads a rank holds are the ones its query heads read: chunk rank·chunks // shards
        index = mesh.position(mesh.coord(rank), layout.dim_axes(1))[0] if spec != "RRRR" else 0
        first = (index * min(heads, shards) // shards) * held if spec != "RRRR" else 0
        assert np.array_equal(piece, whole[:, first:first + held]), rank
    holders = distinct_holders(plan, entry)
    assert holders == expected_holders
    assert whole_shape(pieces[0].shape, layout, mesh) == whole.shape
    assert np.array_equal(assemble({r: pieces[r] for r in holders}, layout, mesh), whole)


def test_a_state_entry_without_segments_is_the_plain_split():
    entry = {"input": "past", "output": "present", "stage": 0, "spec": "RS1RR"}
    plan = _plan([0, 1], [1, 2], [entry])
    layout, mesh = state_spec(entry), state_mesh(plan, entry)
    whole = np.arange(24, dtype=np.float32).reshape(1, 4, 2, 3)
    assert np.array_equal(piece_of(whole, layout, mesh, 1), whole[:, 2:])
    assert np.array_equal(assemble({r: piece_of(whole, layout, mesh, r) for r in (0, 1)}, layout, mesh), whole)
