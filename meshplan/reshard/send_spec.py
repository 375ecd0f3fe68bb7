"""Cross-mesh resharding: the choice of the send spec and of the local all-gather.

With a ``send_spec`` the source ranks first reshard the tensor among themselves
(``CrossMeshTransfer.prepare``, typically over fast intra-host links) into a layout whose
pieces line up better with B, e.g. fewer, larger slices per receiver.
:func:`best_resharding` picks the send spec and whether to use the local all-gather in
B, minimising prepare + makespan + all-gathers.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Sequence

from meshplan.cost.cluster import Cluster
from meshplan.reshard.schedulers import ALGORITHMS, DEFAULT_ALGORITHM, schedule_tasks
from meshplan.reshard.simulator import Schedule, lower_bound
from meshplan.reshard.steps import CollectiveModel, mesh_links, reshard_seconds
from meshplan.reshard.tasks import CrossMeshTransfer, device_box, plan_resharding
from meshplan.sharding import R, S0, S01, S1, LogicalMesh, ShardingSpec


def allgather_seconds(transfer: CrossMeshTransfer, cluster: Cluster) -> float:
    """Time of the intra-B all-gathers on an idle cluster: a ring over each group,
    ``(k - 1)`` steps of ``α + piece/bandwidth``; groups that span hosts share each
    host's inter-host bandwidth among their members on it."""
    total = 0.0
    mesh = transfer.dst_mesh
    for step in transfer.allgathers:
        groups = mesh.axis_groups(step.axis)
        k = len(groups[0])
        piece = prod(b - a for a, b in device_box(step.before, transfer.shape, mesh, groups[0][0])) * transfer.itemsize
        spanning = [g for g in groups if len({cluster.host_of(r) for r in g}) > 1]
        if spanning:
            per_host: dict[int, int] = defaultdict(int)
            for g in spanning:
                for r in g:
                    per_host[cluster.host_of(r)] += 1
            bandwidth = min(cluster.intra_host.bandwidth, cluster.inter_host.bandwidth / max(per_host.values()))
            latency = cluster.inter_host.latency
        else:
            bandwidth, latency = cluster.intra_host.bandwidth, cluster.intra_host.latency
        total += (k - 1) * (latency + piece / bandwidth)
    return total


# --- rearranging inside A first -------------------------------------------------------


def prepare_seconds(transfer: CrossMeshTransfer, cluster: Cluster) -> float:
    """Time of the transfer's rearrangement inside A (``steps.reshard_seconds``,
    alpha-beta per mesh axis with the links of ``steps.mesh_links``)."""
    if not transfer.prepare:
        return 0.0
    model = CollectiveModel(mesh_links(cluster, transfer.src_mesh))
    return reshard_seconds(transfer.src_spec, transfer.send_spec, transfer.shape, transfer.itemsize,
                           transfer.src_mesh, model)


def send_spec_candidates(shape: Sequence[int], src_spec: ShardingSpec | str, mesh: LogicalMesh) -> list[ShardingSpec]:
    """``src_spec`` first, then every other layout a tensor of ``shape`` can take on
    ``mesh`` without partial sums: each mesh axis of size > 1 splits one dimension or
    none (both axes on one dimension: S01), every split dividing evenly. Layouts equal
    to ``src_spec`` (it may split along an axis of size 1) are left out."""
    shape = tuple(int(s) for s in shape)
    src_spec = ShardingSpec.of(src_spec)
    ndim = len(shape)
    out = [src_spec]
    seen = {src_spec.normalised(mesh)}
    choices = [[None, *range(ndim)] if mesh.shape[axis] > 1 else [None] for axis in (0, 1)]
    for d0, d1 in itertools.product(*choices):
        dims = [R] * ndim
        if d0 is not None:
            dims[d0] = S0
        if d1 is not None:
            dims[d1] = S01 if d1 == d0 else S1
        spec = ShardingSpec(tuple(dims))
        if spec not in seen and spec.is_valid_for(shape, mesh):
            seen.add(spec)
            out.append(spec)
    return out


@dataclass(frozen=True)
class ReshardChoice:
    """What :func:`best_resharding` chose: the transfer (with its ``send_spec`` and
    ``prepare``), its schedule, and the estimated time of each part."""

    transfer: CrossMeshTransfer
    schedule: Schedule
    prepare_seconds: float
    allgather_seconds: float
    stats: dict = field(default_factory=dict, compare=False)

    @property
    def makespan(self) -> float:
        return self.schedule.makespan

    @property
    def seconds(self) -> float:
        """Rearrangement in A, then the tasks, then the all-gathers in B."""
        return self.prepare_seconds + self.schedule.makespan + self.allgather_seconds


def best_resharding(shape: Sequence[int], src_spec: ShardingSpec | str, src_mesh: LogicalMesh,
                    dst_spec: ShardingSpec | str, dst_mesh: LogicalMesh, itemsize: int, cluster: Cluster,
                    algorithm: str = DEFAULT_ALGORITHM, *, allgather_axes: Sequence[int] | None = None,
                    local_allgather: bool | None = None, rearrange: bool = True, finalists: int = 2,
                    **schedule_options) -> ReshardChoice:
    """The send spec (and use of the local all-gather in B) that moves the tensor fastest.

    Candidates: every send spec of :func:`send_spec_candidates` (only ``src_spec`` with
    ``rearrange=False``), each with and without the local all-gather
    (``local_allgather=None``; ``True`` / ``False`` fixes it). Every candidate is timed
    as prepare seconds + a ``load_balance`` schedule's makespan + all-gather seconds.
    The candidates without rearrangement, then the ``finalists`` best of the others,
    are scheduled with ``algorithm`` (``schedule_options`` go to
    :func:`schedule_tasks`), each unless its :func:`lower_bound` plus its fixed costs
    cannot beat the best so far; the fastest wins (ties: the earlier one, so no
    rearrangement first). Never slower than the transfer without rearrangement under
    the same scheduler; deterministic whenever the scheduler is. Results are cached:
    treat them as read-only.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown cross-mesh scheduling algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    key = (tuple(int(s) for s in shape), ShardingSpec.of(src_spec), src_mesh, ShardingSpec.of(dst_spec), dst_mesh, int(itemsize),
           cluster, algorithm, None if allgather_axes is None else tuple(allgather_axes), local_allgather,
           bool(rearrange), int(finalists), tuple(sorted(schedule_options.items())))
    return _best_resharding(*key)


def clear_best_resharding_cache() -> None:
    """Forget the cached choices of :func:`best_resharding`."""
    _best_resharding.cache_clear()


@lru_cache(maxsize=1024)
def _best_resharding(shape, src_spec, src_mesh, dst_spec, dst_mesh, itemsize, cluster, algorithm, allgather_axes,
                     local_allgather, rearrange, finalists, options) -> ReshardChoice:
    started = time.perf_counter()
    specs = send_spec_candidates(shape, src_spec, src_mesh) if rearrange else [src_spec]
    gathers = (False, True) if local_allgather is None else (bool(local_allgather),)
    candidates: list[CrossMeshTransfer] = []
    seen = set()
    for spec in specs:
        for gather in gathers:
            transfer = plan_resharding(shape, src_spec, src_mesh, dst_spec, dst_mesh, itemsize,
                                       allow_local_allgather=gather, allgather_axes=allgather_axes, send_spec=spec)
            signature = (transfer.send_spec, transfer.sent_spec)
            if signature not in seen:      # the all-gather plan may find nothing to split
                seen.add(signature)
                candidates.append(transfer)
    fixed = [prepare_seconds(t, cluster) + allgather_seconds(t, cluster) for t in candidates]
    finals = [k for k, t in enumerate(candidates) if t.send_spec == src_spec]   # always scheduled in full
    screened = 0
    quick = []
    for k, t in enumerate(candidates):
        if k not in finals:
            quick.append((fixed[k] + schedule_tasks(t.tasks, cluster, "load_balance").makespan, k))
            screened += 1
    finals += [k for _, k in sorted(quick)[:max(0, finalists)]]
    best: tuple[float, int, Schedule] | None = None
    scheduled = 0
    for k in finals:
        tasks = candidates[k].tasks
        if best is not None and fixed[k] + lower_bound(tasks, cluster) >= best[0]:
            continue                   # cannot beat the best so far
        schedule = schedule_tasks(tasks, cluster, algorithm, **dict(options))
        scheduled += 1
        total = fixed[k] + schedule.makespan
        if best is None or total < best[0]:
            best = (total, k, schedule)
    assert best is not None
    _, k, schedule = best
    stats = {"candidates": len(candidates), "screened": screened, "scheduled": scheduled,
             "seconds": time.perf_counter() - started}
    return ReshardChoice(candidates[k], schedule, prepare_seconds(candidates[k], cluster),
                         allgather_seconds(candidates[k], cluster), stats)
