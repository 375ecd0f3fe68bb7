"""Waiting for MPI requests without taking the core from ranks that compute.

MPI implementations spin inside blocking calls. When ranks share cores (more ranks than
cores, or a CPU execution provider using every core) a spinning rank slows the one it
waits for; so every wait in the runtime posts the non-blocking form of its call and
waits here: yielding the core (``sched_yield``: another rank runs if one is ready, else
the wait resumes at once), and only after a long wait sleeping with a growing pause.
"""

from __future__ import annotations

import os
import time


# Yield this long before sleeping: sleeps wake late on busy or virtual machines, and a
# pipeline waits for its neighbours for a few milliseconds at most once it runs.
YIELD_SECONDS = 0.05


def wait_all(requests, MPI) -> None:
    if not requests:
        return
    yield_until = time.perf_counter() + YIELD_SECONDS
    pause = 2e-6
    while not MPI.Request.Testall(requests):
        if time.perf_counter() < yield_until:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
