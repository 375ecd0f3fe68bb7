"""Cross-mesh resharding: the cost of unit tasks, the simulator, schedules.

A schedule is an order and a sender per task, executed as soon as possible (each rank
runs its tasks in that order). :class:`Simulator` runs one on the cluster model: a task
first pays its latency, then streams its bytes at the rate of the slowest link it
crosses; tasks that leave or enter a host share that host's inter-host bandwidth
(max-min fair). :func:`lower_bound` bounds every schedule's makespan from below.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from meshplan.cost.cluster import Cluster
from meshplan.reshard.tasks import UnitTask

SCHEDULE_VERSION = 1


@dataclass(frozen=True)
class TaskCost:
    latency: float            # seconds before bytes flow
    rate: float               # bytes/s on an idle cluster (slowest link crossed)
    nbytes: int
    nics: tuple[int, ...]     # shared resources: 2*host (egress), 2*host+1 (ingress)

    @property
    def seconds(self) -> float:
        return self.latency + self.nbytes / self.rate


def task_cost(task: UnitTask, sender: int, cluster: Cluster) -> TaskCost:
    """Time of one task sent by ``sender`` on an idle cluster, and the NICs it loads.

    A broadcast is a pipelined chain: sender's host first, then the receivers' hosts in
    order; every host but the last sends the bytes out once, every host but the first
    takes them in once. Latency ``α·⌈log2(group size)⌉`` of the slowest link crossed;
    one receiver is a send/recv (``α + bytes/bandwidth``).
    """
    home = cluster.host_of(sender)
    hosts = [home] + sorted({cluster.host_of(r) for r in task.receivers} - {home})
    link = cluster.intra_host if len(hosts) == 1 else cluster.inter_host
    rate = link.bandwidth if len(hosts) == 1 else min(cluster.inter_host.bandwidth, cluster.intra_host.bandwidth)
    latency = link.latency * max(1, math.ceil(math.log2(1 + len(task.receivers))))
    nics = tuple(2 * h for h in hosts[:-1]) + tuple(2 * h + 1 for h in hosts[1:])
    return TaskCost(latency, rate, task.nbytes, nics)


class Simulator:
    """Costs of every (task, sender) pair on one cluster, and the fluid simulator."""

    def __init__(self, tasks: Sequence[UnitTask], cluster: Cluster):
        self.tasks = list(tasks)
        self.cluster = cluster
        self.nic_bandwidth = cluster.inter_host.bandwidth
        self.cost = [{s: task_cost(t, s, cluster) for s in t.senders} for t in self.tasks]
        self.min_seconds = [min(c.seconds for c in costs.values()) for costs in self.cost]

    def devices(self, i: int, sender: int) -> tuple[int, ...]:
        return (sender,) + self.tasks[i].receivers

    def run(self, senders: Sequence[int], order: Sequence[int]) -> tuple[list[float], list[float]]:
        """Start and end time of every task when each rank runs its tasks in ``order``,
        each starting as soon as all its ranks are free; NICs shared max-min fairly."""
        n = len(self.tasks)
        starts, ends = [0.0] * n, [0.0] * n
        waiting = [0] * n
        successors: list[list[int]] = [[] for _ in range(n)]
        last: dict[int, int] = {}
        for i in order:
            preds = {last[d] for d in self.devices(i, senders[i]) if d in last}
            waiting[i] = len(preds)
            for p in preds:
                successors[p].append(i)
            for d in self.devices(i, senders[i]):
                last[d] = i
        costs = [self.cost[i][senders[i]] for i in range(n)]
        in_latency: dict[int, float] = {}    # task → time its latency ends
        streaming: dict[int, float] = {}     # task → bytes left
        now = 0.0
        finished: list[int] = []

        def start(i: int) -> None:
            starts[i] = now
            if costs[i].latency > 0:
                in_latency[i] = now + costs[i].latency
            elif costs[i].nbytes > 0:
                streaming[i] = float(costs[i].nbytes)
            else:
                finished.append(i)

        for i in order:
            if waiting[i] == 0:
                start(i)
        while True:
            while finished:
                i = finished.pop()
                ends[i] = now
                for j in successors[i]:
                    waiting[j] -= 1
                    if waiting[j] == 0:
                        start(j)
            if not in_latency and not streaming:
                break
            rates = self._rates(streaming, costs)
            horizon = min(in_latency.values(), default=math.inf)
            for i, left in streaming.items():
                horizon = min(horizon, now + left / rates[i])
            tolerance = 1e-12 * max(horizon, 1e-9)
            step = horizon - now
            for i in list(streaming):
                if now + streaming[i] / rates[i] <= horizon + tolerance:
                    del streaming[i]
                    finished.append(i)
                else:
                    streaming[i] -= rates[i] * step
            now = horizon
            for i in [i for i, t in in_latency.items() if t <= horizon + tolerance]:
                del in_latency[i]
                if costs[i].nbytes > 0:
                    streaming[i] = float(costs[i].nbytes)
                else:
                    finished.append(i)
        return starts, ends

    def _rates(self, streaming: dict[int, float], costs: list[TaskCost]) -> dict[int, float]:
        """Max-min fair rates by progressive filling over the NICs, capped per task."""
        rates: dict[int, float] = {}
        pending = []
        users: dict[int, int] = defaultdict(int)
        for i in streaming:
            if costs[i].nics:
                pending.append(i)
                for nic in costs[i].nics:
                    users[nic] += 1
            else:
                rates[i] = costs[i].rate
        left = {nic: self.nic_bandwidth for nic in users}
        while pending:
            shares = {nic: left[nic] / count for nic, count in users.items() if count > 0}
            level = min(min(shares.values()), min(costs[i].rate for i in pending))
            cut = level * (1 + 1e-12)
            frozen = [i for i in pending if costs[i].rate <= cut or any(shares[nic] <= cut for nic in costs[i].nics)]
            for i in frozen:
                rates[i] = level
                for nic in costs[i].nics:
                    left[nic] -= level
                    users[nic] -= 1
            pending = [i for i in pending if i not in rates]
        return rates

    def makespan(self, senders: Sequence[int], order: Sequence[int]) -> float:
        return max(self.run(senders, order)[1], default=0.0)

    def schedule(self, algorithm: str, senders: Sequence[int], order: Sequence[int], stats: dict) -> "Schedule":
        """The :class:`Schedule` of ``senders`` and ``order``, with simulated times."""
        starts, ends = self.run(senders, order)
        entries = tuple(ScheduledTask(i, senders[i], starts[i], ends[i]) for i in order)
        return Schedule(algorithm, tuple(self.tasks), entries, max(ends, default=0.0), stats)


def lower_bound(tasks: Sequence[UnitTask], cluster: Cluster) -> float:
    """A makespan no schedule can beat.

    The largest of: each task's fastest time; per receiving device, the sum of its tasks'
    fastest times (they cannot overlap), and the same per sending device for tasks it
    alone can send; per host, the bytes that must enter it (a receiver there, no sender
    there) or leave it (every sender there, a receiver elsewhere) over its inter-host
    bandwidth, plus the shortest latency among those tasks (no byte flows before it).
    """
    if not tasks:
        return 0.0
    model = Simulator(tasks, cluster)
    device: dict[int, float] = defaultdict(float)
    nic_bytes: dict[tuple[str, int], int] = defaultdict(int)
    nic_start: dict[tuple[str, int], float] = defaultdict(lambda: math.inf)
    for t, costs, seconds in zip(model.tasks, model.cost, model.min_seconds):
        for r in t.receivers:
            device[r] += seconds
        if len(t.senders) == 1:
            device[t.senders[0]] += seconds
        sender_hosts = {cluster.host_of(s) for s in t.senders}
        receiver_hosts = {cluster.host_of(r) for r in t.receivers}
        latency = min(c.latency for c in costs.values())
        needs = [("in", h) for h in receiver_hosts - sender_hosts]
        if len(sender_hosts) == 1 and receiver_hosts - sender_hosts:
            needs.append(("out", next(iter(sender_hosts))))
        for key in needs:
            nic_bytes[key] += t.nbytes
            nic_start[key] = min(nic_start[key], latency)
    nic = max([nic_start[k] + b / cluster.inter_host.bandwidth for k, b in nic_bytes.items()], default=0.0)
    return max(max(model.min_seconds), max(device.values()), nic)


@dataclass(frozen=True)
class ScheduledTask:
    task: int         # index into Schedule.tasks
    sender: int
    start: float      # seconds, simulated
    end: float


@dataclass(frozen=True)
class Schedule:
    """A sender and a start time for every task; ``entries`` are in execution order
    (every rank runs its own tasks in this order). Times are simulated seconds."""

    algorithm: str
    tasks: tuple[UnitTask, ...]
    entries: tuple[ScheduledTask, ...]
    makespan: float
    stats: dict = field(default_factory=dict, compare=False)

    @property
    def senders(self) -> list[int]:
        out = [0] * len(self.tasks)
        for e in self.entries:
            out[e.task] = e.sender
        return out

    @property
    def order(self) -> list[int]:
        return [e.task for e in self.entries]

    def to_dict(self) -> dict:
        return {
            "version": SCHEDULE_VERSION,
            "algorithm": self.algorithm,
            "makespan": self.makespan,
            "tasks": [t.to_dict() for t in self.tasks],
            "entries": [[e.task, e.sender, e.start, e.end] for e in self.entries],
            "stats": dict(self.stats),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Schedule":
        version = data.get("version")
        if version != SCHEDULE_VERSION:
            raise ValueError(f"cross-mesh schedule version {version!r} is not {SCHEDULE_VERSION} (re-run the planner)")
        return cls(data["algorithm"], tuple(UnitTask.from_dict(t) for t in data["tasks"]),
                   tuple(ScheduledTask(int(i), int(s), float(a), float(b)) for i, s, a, b in data["entries"]),
                   float(data["makespan"]), dict(data.get("stats", {})))


def simulate(schedule: Schedule | Sequence[UnitTask], cluster: Cluster, senders: Sequence[int] | None = None,
             order: Sequence[int] | None = None) -> float:
    """Makespan of a schedule on ``cluster`` (see :meth:`Simulator.run`); given tasks instead,
    ``senders`` defaults to each task's first sender and ``order`` to the task order."""
    if isinstance(schedule, Schedule):
        tasks, senders, order = schedule.tasks, schedule.senders, schedule.order
    else:
        tasks = list(schedule)
        senders = list(senders) if senders is not None else [t.senders[0] for t in tasks]
        order = list(order) if order is not None else list(range(len(tasks)))
    if sorted(order) != list(range(len(tasks))) or len(senders) != len(tasks):
        raise ValueError("a schedule needs every task exactly once in its order and one sender per task")
    if any(s not in t.senders for s, t in zip(senders, tasks)):
        raise ValueError("a task's sender must be one of the ranks that hold its slice")
    if not tasks:
        return 0.0
    return Simulator(tasks, cluster).makespan(senders, order)
