"""Each rank's pieces of the job's state in a file of its own: ``rankN.npz`` in a folder,
one array per state piece the rank is the first holder of (``state_layout.distinct_holders``:
a replicated piece is written once), written one tensor at a time.

``Job.save_state_files`` and ``Job.load_state_files`` run this on every working rank, so
that no rank gathers the whole state (a training checkpoint's weights and optimizer
slots); ``read_whole`` puts one state back together from the files, for a job of another
plan or for export, holding one tensor at a time.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from meshplan.errors import RunError
from meshplan.plan_format import Plan
from meshplan.runtime.state_layout import assemble, distinct_holders, state_mesh, state_spec
from meshplan.sharding import LogicalMesh, ShardingSpec


def rank_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.npz"


def piece_sources(plan: Plan, entry: dict) -> dict[int, int]:
    """For each rank holding state ``entry``, the rank whose file has its piece."""
    spec, mesh = state_spec(entry), state_mesh(plan, entry)
    holders = distinct_holders(plan, entry)
    probe = tuple(spec.shards(d, mesh) if spec.segmented(d, mesh) is None else
                  sum(s for s, _ in spec.segmented(d, mesh)) for d in range(len(spec.dims)))

    def key(rank: int):
        return tuple(tuple(np.arange(n)[s].tolist()) if isinstance(s, slice) else tuple(s.tolist())
                     for n, s in zip(probe, spec.local_slices(probe, mesh, mesh.coord(rank))))

    first = {key(h): h for h in holders}
    return {r: first[key(r)] for r in plan.stages[entry["stage"]].devices}


def write_pieces(path: Path, pieces) -> list[str]:
    """``pieces`` yields (state input, local array); returns the names written."""
    names = []
    with zipfile.ZipFile(path, "w", allowZip64=True) as archive:
        for name, array in pieces:
            with archive.open(f"{len(names)}.npy", "w", force_zip64=True) as out:
                # (np.ascontiguousarray would make a scalar state one element long)
                np.lib.format.write_array(out, np.asarray(array, order="C"), allow_pickle=False)
            names.append(name)
    (path.parent / (path.name + ".names")).write_text("\n".join(names) + "\n")
    return names


def read_pieces(path: Path, wanted: set[str] | None = None):
    """(name, array) of the pieces in one rank's file, one at a time."""
    names_file = path.parent / (path.name + ".names")
    if not path.is_file() or not names_file.is_file():
        raise RunError(f"state file {path} is missing")
    names = names_file.read_text().split()
    with zipfile.ZipFile(path) as archive:
        for index, name in enumerate(names):
            if wanted is None or name in wanted:
                with archive.open(f"{index}.npy") as source:
                    yield name, np.lib.format.read_array(source, allow_pickle=False)


def layouts(plan: Plan) -> dict[str, dict]:
    """What ``read_whole`` needs of a plan's state, by input: spec, mesh, the files of its pieces."""
    found = {}
    for entry in plan.state:
        stage = plan.stages[entry["stage"]]
        found[entry["input"]] = {"spec": entry["spec"], "segments": entry.get("segments"),
                                 "logical_mesh": list(stage.logical_mesh), "devices": list(stage.devices),
                                 "holders": distinct_holders(plan, entry)}
    return found


def read_whole(directory: str | Path, layout: dict[str, dict], name: str) -> np.ndarray:
    """State ``name`` whole, from its holders' files (``layout``: ``layouts`` of the plan that wrote them)."""
    entry = layout[name]
    spec = state_spec({"spec": entry["spec"], **({"segments": entry["segments"]} if entry.get("segments") else {})})
    mesh = LogicalMesh(tuple(entry["logical_mesh"]), tuple(entry["devices"]))
    pieces = {}
    for rank in entry["holders"]:
        found = dict(read_pieces(rank_file(directory, rank), {name}))
        if name not in found:
            raise RunError(f"state '{name}' is missing from {rank_file(directory, rank)}")
        pieces[rank] = found[name]
    return assemble(pieces, spec, mesh)


__all__ = ["ShardingSpec", "layouts", "piece_sources", "rank_file", "read_pieces", "read_whole", "write_pieces"]
