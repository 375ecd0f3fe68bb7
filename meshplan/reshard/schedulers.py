"""Cross-mesh resharding: the schedulers that choose a sender and an order for every task.

Tasks that share a sender or a receiver cannot overlap. Algorithms: ``naive``,
``load_balance``, ``dfs`` (exact branch and bound, within a node budget) and
``randomized_greedy`` (the default, within a number of trials and polishing moves).
Work limits decide the result; the wall-clock ``time_limit`` is only a safety stop,
reported in the schedule's stats (``stopped_at_time_limit``) when it fires.
"""

from __future__ import annotations

import random
import time
import warnings
from collections import defaultdict
from typing import Sequence

from meshplan.cost.cluster import Cluster
from meshplan.reshard.simulator import Schedule, Simulator, lower_bound
from meshplan.reshard.tasks import UnitTask

ALGORITHMS = ("naive", "load_balance", "dfs", "randomized_greedy")
DEFAULT_ALGORITHM = "randomized_greedy"


def schedule_tasks(tasks: Sequence[UnitTask], cluster: Cluster, algorithm: str = DEFAULT_ALGORITHM, *,
                   seed: int = 0, trials: int = 64, polish: int = 256, node_budget: int = 50_000,
                   time_limit: float = 60.0) -> Schedule:
    """Choose a sender and an order for every task.

    ``naive``: each task's first sender, task order. ``load_balance``: task order, the
    sender whose device has the least work so far (ties: on a receiver's host, then the
    least-loaded NIC). ``dfs``: branch and bound over orders and senders, pruned by lower
    bounds, started from the two above; exact when ``stats["complete"]``, otherwise the
    best found within ``node_budget`` nodes.
    ``randomized_greedy``: ``trials`` rounds of random task orders, each cut into maximal
    sets of non-conflicting tasks with load-aware senders; the best simulated one is
    kept, then improved by ``polish`` local moves (move a task in the order, or change
    its sender), each kept if it does not lengthen the simulated makespan.

    Deterministic (for a ``seed``): only the work limits decide the result. ``time_limit``
    seconds is a safety stop for a pathological case; when it cuts the search short the
    stats say ``stopped_at_time_limit`` and a warning is issued.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown cross-mesh scheduling algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    model = Simulator(tasks, cluster)
    if not model.tasks:
        return Schedule(algorithm, (), (), 0.0, {})
    if algorithm == "naive":
        return model.schedule(algorithm, [t.senders[0] for t in model.tasks], range(len(model.tasks)), {})
    if algorithm == "load_balance":
        return model.schedule(algorithm, _load_balance(model), range(len(model.tasks)), {})
    stop = _SafetyStop(algorithm, time_limit)
    if algorithm == "dfs":
        return stop.report(_dfs(model, node_budget, stop))
    return stop.report(_randomized_greedy(model, seed, trials, polish, stop))


class _SafetyStop:
    """The wall-clock safety stop of a search: ``expired()`` after ``seconds``."""

    def __init__(self, algorithm: str, seconds: float):
        self.algorithm, self.seconds = algorithm, seconds
        self.deadline = time.monotonic() + seconds
        self.fired = False

    def expired(self) -> bool:
        self.fired = self.fired or time.monotonic() > self.deadline
        return self.fired

    def report(self, schedule: Schedule) -> Schedule:
        if self.fired:
            schedule.stats["stopped_at_time_limit"] = True
            warnings.warn(f"cross-mesh scheduler {self.algorithm} stopped at its {self.seconds:g} s safety time "
                          "limit before its work limit: the schedule depends on this machine's speed", stacklevel=3)
        return schedule


def _load_balance(model: Simulator) -> list[int]:
    cluster = model.cluster
    load: dict[int, float] = defaultdict(float)
    nic_load: dict[int, float] = defaultdict(float)
    senders = []
    for i, t in enumerate(model.tasks):
        hosts = {cluster.host_of(r) for r in t.receivers}

        def key(s, i=i, hosts=hosts):
            c = model.cost[i][s]
            return (load[s] + c.seconds, cluster.host_of(s) not in hosts, max((nic_load[n] for n in c.nics), default=0.0))

        s = min(t.senders, key=key)
        senders.append(s)
        load[s] += model.cost[i][s].seconds
        for n in model.cost[i][s].nics:
            nic_load[n] += model.cost[i][s].nbytes / model.nic_bandwidth
    return senders


def _randomized_greedy(model: Simulator, seed: int, trials: int, polish: int, stop: _SafetyStop) -> Schedule:
    rng = random.Random(seed)
    n = len(model.tasks)
    best: tuple[float, list[int], list[int]] | None = None
    done = 0
    for trial in range(max(1, trials)):
        if trial and stop.expired():
            break
        senders, order = _greedy_rounds(model, rng, explore=0.0 if trial == 0 else 0.25, largest_first=trial == 0)
        span = model.makespan(senders, order)
        done += 1
        if best is None or span < best[0]:
            best = (span, senders, order)
    assert best is not None and len(best[2]) == n
    span, senders, order = best
    steps = 0
    floor = lower_bound(model.tasks, model.cluster) * (1 + 1e-9)
    movable = [i for i, t in enumerate(model.tasks) if len(t.senders) > 1]
    while steps < polish and n > 1 and span > floor and not stop.expired():
        steps += 1
        new_senders, new_order = senders, list(order)
        if movable and rng.random() < 0.3:
            i = rng.choice(movable)
            new_senders = list(senders)
            new_senders[i] = rng.choice(model.tasks[i].senders)
        else:
            new_order.insert(rng.randrange(n), new_order.pop(rng.randrange(n)))
        new_span = model.makespan(new_senders, new_order)
        if new_span <= span:
            span, senders, order = new_span, new_senders, new_order
    return model.schedule("randomized_greedy", senders, order, {"trials": done, "polish": steps, "seed": seed})


def _greedy_rounds(model: Simulator, rng: random.Random, explore: float, largest_first: bool) -> tuple[list[int], list[int]]:
    """One randomized greedy pass: shuffle the remaining tasks, take a maximal set of
    tasks with no rank in common, append it to the order, repeat.

    Each task gets the free sender that would finish it earliest by a running estimate
    in which ranks run their tasks back to back and every NIC streams one task at a time
    (or, with probability ``explore``, a random free sender).
    """
    n = len(model.tasks)
    senders = [0] * n
    order: list[int] = []
    ready: dict[int, float] = defaultdict(float)   # estimated time each rank is free
    nic: dict[int, float] = defaultdict(float)     # estimated time each NIC is free
    bandwidth = model.nic_bandwidth
    remaining = list(range(n))

    def estimate(i: int, s: int) -> tuple[float, float]:
        c = model.cost[i][s]
        begin = max([ready[s], *(ready[r] for r in model.tasks[i].receivers)])
        finish = begin + c.seconds
        for x in c.nics:
            finish = max(finish, max(nic[x], begin + c.latency) + c.nbytes / bandwidth)
        return finish, begin

    while remaining:
        rng.shuffle(remaining)
        if largest_first:
            remaining.sort(key=lambda i: -model.tasks[i].nbytes)
        busy: set[int] = set()
        chosen, rest = [], []
        for i in remaining:
            task = model.tasks[i]
            free = [s for s in task.senders if s not in busy]
            if not free or any(r in busy for r in task.receivers):
                rest.append(i)
                continue
            if explore and rng.random() < explore:
                s = rng.choice(free)
            else:
                rng.shuffle(free)
                s = min(free, key=lambda s, i=i: estimate(i, s)[0])
            finish, begin = estimate(i, s)
            c = model.cost[i][s]
            for d in (s, *task.receivers):
                ready[d] = finish
            for x in c.nics:
                nic[x] = max(nic[x], begin + c.latency) + c.nbytes / bandwidth
            senders[i] = s
            busy.add(s)
            busy.update(task.receivers)
            chosen.append(i)
        order.extend(chosen)
        remaining = rest
    return senders, order


class _OutOfBudget(Exception):
    pass


def _dfs(model: Simulator, node_budget: int, stop: _SafetyStop) -> Schedule:
    """Depth-first branch and bound over (next task, its sender) sequences.

    A prefix is timed at idle-cluster durations, which no real execution beats, so
    ``max(device free time + remaining work that must run there)`` and the static
    :func:`lower_bound` bound every completion; leaves are timed by the simulator. Two
    orders that only swap neighbouring tasks with no rank in common run identically, so
    a task may follow an independent one only if its index is larger; unused senders on
    one host that can send the same tasks are interchangeable, so one of them is tried.
    """
    tasks, cluster = model.tasks, model.cluster
    n = len(tasks)
    incumbents = [([t.senders[0] for t in tasks], list(range(n))), (_load_balance(model), list(range(n)))]
    best_span, best_senders, best_order = min((model.makespan(s, o), s, o) for s, o in incumbents)
    static = lower_bound(tasks, cluster)
    can_send: dict[int, frozenset] = defaultdict(frozenset)
    for i, t in enumerate(tasks):
        for s in t.senders:
            can_send[s] = can_send[s] | {i}
    must = defaultdict(float)               # remaining work that must run on a rank
    for i, t in enumerate(tasks):
        for d in t.receivers + (t.senders if len(t.senders) == 1 else ()):
            must[d] += model.min_seconds[i]
    free: dict[int, float] = defaultdict(float)
    used: dict[int, int] = defaultdict(int)
    remaining = set(range(n))
    senders = [0] * n
    order: list[int] = []
    nodes = 0
    complete = True

    def bound() -> float:
        return max([static, *(free[d] + must[d] for d in must)])

    def visit(last: tuple[int, int] | None) -> None:
        nonlocal nodes, best_span, best_senders, best_order
        nodes += 1
        if nodes > node_budget or (nodes % 256 == 0 and stop.expired()):
            raise _OutOfBudget
        if not remaining:
            span = model.makespan(senders, order)
            if span < best_span * (1 - 1e-12):
                best_span, best_senders, best_order = span, list(senders), list(order)
            return
        last_devices = set(model.devices(*last)) if last else set()
        options = []
        for i in remaining:
            t = tasks[i]
            recv_ready = max(free[r] for r in t.receivers)
            seen = set()
            for s in t.senders:
                devs = (s,) + t.receivers
                if last and i < last[0] and last_devices.isdisjoint(devs):
                    continue
                if used[s] == 0:
                    signature = (cluster.host_of(s), can_send[s])
                    if signature in seen:
                        continue
                    seen.add(signature)
                begin = max(recv_ready, free[s])
                options.append((begin + model.cost[i][s].seconds, begin, i, s))
        options.sort()
        for finish, begin, i, s in options:
            t = tasks[i]
            devs = (s,) + t.receivers
            saved = [(d, free[d]) for d in devs]
            for d in devs:
                free[d] = finish
            share = model.min_seconds[i]
            loaded = t.receivers + (t.senders if len(t.senders) == 1 else ())
            for d in loaded:
                must[d] -= share
            remaining.discard(i)
            used[s] += 1
            senders[i] = s
            order.append(i)
            if bound() < best_span * (1 - 1e-9):
                visit((i, s))
            order.pop()
            used[s] -= 1
            remaining.add(i)
            for d in loaded:
                must[d] += share
            for d, value in saved:
                free[d] = value

    try:
        if best_span > static * (1 + 1e-9):
            visit(None)
    except _OutOfBudget:
        complete = False
    return model.schedule("dfs", best_senders, best_order, {"nodes": nodes, "complete": complete})
