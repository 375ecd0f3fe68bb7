"""Communication costs: collectives timed over the mesh axes of an MPI job, or the
cluster description's link figures when there is no job.

The world of H×D ranks is viewed as the cluster's mesh: axis 0 groups the ranks with the
same device index across hosts (size H, between hosts), axis 1 the ranks of one host
(size D). Along axis 1 every submesh width the planner uses (2, 4, …, D) is measured, all
groups at once, as a sharded stage would run them.

Sizes: ``nbytes`` is always the full buffer each rank holds — the array all-reduced,
the gathered result of an all-gather, the input of a reduce-scatter, the whole send
buffer of an all-to-all, the broadcast or sent array. Each size is timed as a quantile
over repeats of the slowest rank's time (lower quartile: see QUANTILE), two passes over the
sizes keeping the better (and up to three more tries for a size slower than a larger
one), and each (collective, axis, group size) is fit
as ``seconds = latency + nbytes / bandwidth`` by least squares on relative error, with
latency ≥ 0 and bandwidth > 0.

Waiting ranks poll with ``sched_yield`` instead of MPI's busy wait, so that ranks that
share cores (more ranks than cores) leave them to the ranks with work.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from meshplan.cost.analytic import ring_fit
from meshplan.cost.cluster import Cluster

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
# One send/recv pair alone on an axis (every other rank idle): the link's own one-way
# latency and bandwidth, which the planner's cluster takes in place of the described ones
# (``profile.measured.with_measured_links``). ``send_recv`` runs every group of the axis
# at once, as a sharded stage would, so ranks of one host share their host's link there.
LINK = "link"
KIB = 1024
# The statistic of the repeats: a low quantile rather than the median, because ranks
# that share cores see bursts of scheduling delay that have nothing to do with the link.
QUANTILE = 0.25
MIB = 1024 * 1024


@dataclass
class CommFit:
    collective: str
    axis: int
    group_size: int
    latency: float                          # seconds
    bandwidth: float                        # bytes per second (nbytes as in the module docstring)
    source: str                             # "measured" | "cluster"
    points: list[list[float]] = field(default_factory=list)   # [[nbytes, seconds], ...]
    max_rel_error: float = 0.0              # of the fit on the measured points

    def seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency + nbytes / self.bandwidth

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CommFit":
        return cls(**data)


def message_sizes(max_bytes: int, min_bytes: int = KIB, factor: int = 4) -> list[int]:
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes or [min_bytes]


def fit_latency_bandwidth(points) -> tuple[float, float, float]:
    """(latency ≥ 0, bandwidth > 0, max relative error) of ``seconds = a + nbytes / bw``."""
    from scipy.optimize import nnls

    x = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    t = np.maximum(t, 1e-9)
    scale = x.max() if x.max() > 0 else 1.0
    # Minimise Σ ((a + b·x − t) / t)²: each row divided by its own time.
    matrix = np.stack([1.0 / t, (x / scale) / t], axis=1)
    (a, b_scaled), _ = nnls(matrix, np.ones_like(t))
    b = b_scaled / scale
    if b <= 0:
        # Flat times: bandwidth is too high to see. Keep it finite, consistent with the data.
        b = max(1e-3 * float(np.min(t / np.maximum(x, 1.0))), 1e-18)
    predicted = a + b * x
    error = float(np.max(np.abs(predicted - t) / t)) if len(t) else 0.0
    return float(a), float(1.0 / b), error


def fit_link(points) -> tuple[float, float, float]:
    """(latency ≥ 0, bandwidth > 0, max relative error) of one link's one-way times.

    A link figure must hold for the large transfers that dominate resharding, so the
    bandwidth is the slope of the times of the largest messages (the half of the sizes
    at the top, at least two), and the latency what is left of the smallest message's
    time. A relative-error fit over all sizes would let the many small messages, which
    a shaped or bursty link delivers faster than its rate, pull the bandwidth up.
    """
    ordered = sorted((float(n), max(float(t), 1e-9)) for n, t in points)
    if len(ordered) < 2:
        return fit_latency_bandwidth(points)
    top = ordered[-max(2, len(ordered) // 2):]
    x = np.array([n for n, _ in top])
    t = np.array([s for _, s in top])
    slope = float(np.polyfit(x, t, 1)[0]) if np.ptp(x) > 0 else 0.0
    if slope <= 0:
        return fit_latency_bandwidth(points)
    latency = max(0.0, ordered[0][1] - ordered[0][0] * slope)
    error = max(abs(latency + n * slope - s) / s for n, s in top)
    return latency, 1.0 / slope, float(error)


def cluster_fits(cluster: Cluster) -> list[CommFit]:
    """Fits from the cluster's link figures (ring algorithms), marked ``source='cluster'``."""
    fits = []
    for axis, sizes in axis_group_sizes(cluster.mesh).items():
        link = cluster.inter_host if axis == 0 else cluster.intra_host
        for size in sizes:
            for collective in COLLECTIVES:
                latency, bandwidth = ring_fit(collective, size, link)
                fits.append(CommFit(collective, axis, size, latency, bandwidth, "cluster"))
    return fits


def axis_group_sizes(mesh: tuple[int, int]) -> dict[int, list[int]]:
    """Group sizes measured per mesh axis: axis 0 → H; axis 1 → 2, 4, … and D."""
    hosts, per_host = mesh
    found: dict[int, list[int]] = {}
    if hosts > 1:
        found[0] = [hosts]
    if per_host > 1:
        widths = []
        width = 2
        while width < per_host:
            widths.append(width)
            width *= 2
        widths.append(per_host)
        found[1] = widths
    return found


def axis_color(rank: int, mesh: tuple[int, int], axis: int, group_size: int) -> tuple[int, int]:
    """(color, key) that splits the world into the groups of ``group_size`` along ``axis``."""
    hosts, per_host = mesh
    host, device = divmod(rank, per_host)
    if axis == 0:
        return device, host
    return host * per_host + device // group_size, device % group_size


# --- MPI ---------------------------------------------------------------------------

def wait(request, patience: float = math.inf) -> None:
    """Complete a request, yielding the core between tests; after ``patience`` seconds, sleep between tests."""
    if request.Test():
        return
    started = time.perf_counter()
    while not request.Test():
        if time.perf_counter() - started < patience:
            os.sched_yield()
        else:
            time.sleep(2e-5)


def yield_barrier(comm) -> None:
    wait(comm.Ibarrier())


def mpi_library_version(MPI) -> str:
    return MPI.Get_library_version().strip().splitlines()[0].strip()


class CommMeasurer:
    """Times the collectives of one axis group size; every rank of the world calls each method."""

    def __init__(self, MPI, world, mesh: tuple[int, int], budget_seconds: float = 0.03,
                 min_repeats: int = 7, max_repeats: int = 200):
        self.MPI = MPI
        self.world = world
        self.mesh = mesh
        self.budget = budget_seconds
        self.min_repeats = min_repeats
        self.max_repeats = max_repeats

    def measure(self, axis: int, group_size: int, sizes: list[int],
                collectives=COLLECTIVES, progress=None) -> list[CommFit]:
        MPI = self.MPI
        color, key = axis_color(self.world.rank, self.mesh, axis, group_size)
        group = self.world.Split(color, key)
        fits = []
        try:
            for collective in collectives:
                # Two passes over the sizes, the better median of each kept: a burst of
                # scheduling noise (ranks sharing cores) rarely hits both.
                best = {}
                for order in (sizes, sizes[::-1]):
                    for nbytes in order:
                        seconds, used = self._time(group, collective, nbytes)
                        if nbytes not in best or seconds < best[nbytes][1]:
                            best[nbytes] = (used, seconds)
                        if progress and order is sizes:
                            progress()
                # A smaller message slower than a larger one is noise: time it again (every rank
                # sees the same slowest-rank times, so all agree on what to re-time).
                for _ in range(3):
                    suspect = [n for i, n in enumerate(sizes)
                               if any(best[n][1] > best[m][1] for m in sizes[i + 1:])]
                    if not suspect:
                        break
                    for nbytes in suspect:
                        used, seconds = best[nbytes][0], self._time(group, collective, nbytes)[0]
                        best[nbytes] = (used, min(seconds, best[nbytes][1]))
                points = [[float(best[n][0]), best[n][1]] for n in sizes]
                latency, bandwidth, error = fit_latency_bandwidth(points)
                fits.append(CommFit(collective, axis, group_size, latency, bandwidth, "measured", points, error))
        finally:
            group.Free()
        del MPI
        return fits

    def measure_link(self, axis: int, sizes: list[int], progress=None) -> CommFit:
        """Time one pair alone along ``axis``: rank 0 and its neighbour on the next host
        (axis 0) or on its own host (axis 1). Every rank of the world calls it."""
        hosts, per_host = self.mesh
        partner = per_host if axis == 0 else 1
        active = self.world.rank in (0, partner)
        group = self.world.Split(0 if active else 1, self.world.rank)
        try:
            best: dict[int, tuple[int, float]] = {}
            for order in (sizes, sizes[::-1]):
                for nbytes in order:
                    seconds, used = self._time(group, "send_recv", nbytes, active)
                    if nbytes not in best or seconds < best[nbytes][1]:
                        best[nbytes] = (used, seconds)
                    if progress and order is sizes:
                        progress()
        finally:
            group.Free()
        points = [[float(best[n][0]), best[n][1]] for n in sizes]
        latency, bandwidth, error = fit_link(points)
        return CommFit(LINK, axis, 2, latency, bandwidth, "measured", points, error)

    def _buffers(self, group, collective: str, nbytes: int):
        p = group.size
        count = max(p, (nbytes // 4) // p * p)       # float32 elements, divisible by the group size
        full = np.ones(count, dtype=np.float32)
        out = np.empty_like(full)
        part = np.empty(count // p, dtype=np.float32)
        return full, out, part, count * 4

    def _start(self, group, collective: str, full, out, part):
        MPI = self.MPI
        if collective == "all_reduce":
            return [group.Iallreduce(full, out, op=MPI.SUM)]
        if collective == "all_gather":
            part[:] = 1.0
            return [group.Iallgather(part, out)]
        if collective == "reduce_scatter":
            return [group.Ireduce_scatter_block(full, part, op=MPI.SUM)]
        if collective == "all_to_all":
            return [group.Ialltoall(full, out)]
        if collective == "broadcast":
            return [group.Ibcast(full, root=0)]
        # send_recv: group rank 0 sends to rank 1 and back; one way is half the round trip.
        return None

    def _once(self, group, collective: str, full, out, part, active: bool = True) -> float:
        MPI = self.MPI
        yield_barrier(self.world)
        started = MPI.Wtime()
        if collective == "send_recv":
            if not active:
                return 0.0
            if group.rank == 0:
                wait(group.Isend(full, dest=1, tag=7))
                wait(group.Irecv(out, source=1, tag=8))
            elif group.rank == 1:
                wait(group.Irecv(out, source=0, tag=7))
                wait(group.Isend(out, dest=0, tag=8))
            else:
                return 0.0
            return (MPI.Wtime() - started) / 2
        for request in self._start(group, collective, full, out, part):
            wait(request)
        return MPI.Wtime() - started

    def _time(self, group, collective: str, nbytes: int, active: bool = True) -> tuple[float, int]:
        MPI = self.MPI
        full, out, part, used = self._buffers(group, collective, nbytes)
        # Warm-up, then agree on a repeat count from the slowest rank's median warm-up time.
        first = np.array([sorted(self._once(group, collective, full, out, part, active) for _ in range(3))[1]])
        slowest = np.empty_like(first)
        wait(self.world.Iallreduce(first, slowest, op=MPI.MAX))
        repeats = int(min(self.max_repeats, max(self.min_repeats, self.budget / max(slowest[0], 1e-7))))
        times = np.array([self._once(group, collective, full, out, part, active) for _ in range(repeats)])
        worst = np.empty_like(times)
        wait(self.world.Iallreduce(times, worst, op=MPI.MAX))
        return float(np.quantile(worst, QUANTILE)), used
