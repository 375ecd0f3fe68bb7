"""Waiting for MPI requests without taking the core from ranks that compute.

MPI implementations spin inside blocking calls. When ranks share cores (more ranks than
cores, or a CPU execution provider using every core) a spinning rank slows the one it
waits for; so every wait in the runtime posts the non-blocking form of its call and
waits here: yielding the core (``sched_yield``: another rank runs if one is ready, else
the wait resumes at once), and only after a long wait sleeping with a growing pause.

Sleeping has a price: MPI moves a large message in fragments, and only while one of its
calls runs; a rank that sleeps between tests stalls the transfer (a 268 MB gather of
logits took about 400 ms of a 490 ms batch on an H100 host). So ranks whose programs run on a GPU,
which leave the host's cores idle, never sleep: ``set_sleeping(False)`` once at start-up.
A plan's idle ranks, which wait for the few small messages meant for them (``idle=True``),
sleep from the start whatever the rule.
"""

from __future__ import annotations

import os
import time


# Yield this long before sleeping: sleeps wake late on busy or virtual machines, and a
# pipeline waits for its neighbours for a few milliseconds at most once it runs.
YIELD_SECONDS = 0.05

# An idle rank's longest sleep between tests: how late it may hear of the statistics or the end.
# Each wake takes a working rank's core for a moment: on 2 cores, seven idle ranks waking every
# 2 ms made a one-rank plan's 2 ms step 10-20% slower; every 50 ms, nothing measurable.
IDLE_PAUSE = 50e-3


_sleeping = [True]


def set_sleeping(enabled: bool) -> None:
    """Whether long waits may sleep (ranks computing on the host's cores) or only yield
    (ranks computing on a GPU). Set once per process, before the first wait."""
    _sleeping[0] = enabled


def wait_all(requests, MPI, idle: bool = False) -> None:
    """Wait for every request. ``idle``: a rank with no work in the plan waiting for the next
    message meant for it (small, and rare): it sleeps from the start, since every core it
    took by yielding would be a working rank's."""
    if not requests:
        return
    if idle:
        pause = 2e-6
        while not MPI.Request.Testall(requests):
            time.sleep(pause)
            pause = min(pause * 2, IDLE_PAUSE)
        return
    yield_until = time.perf_counter() + YIELD_SECONDS
    pause = 2e-6
    while not MPI.Request.Testall(requests):
        if not _sleeping[0] or time.perf_counter() < yield_until:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
