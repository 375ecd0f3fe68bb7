"""Waiting for MPI requests without taking the core from ranks that compute.

MPI implementations spin inside blocking calls. When ranks share cores (more ranks than
cores, or a CPU execution provider using every core) a spinning rank slows the one it
waits for; so every wait in the runtime posts the non-blocking form of its call and
waits here: first yielding the core for a short while (prompt when the data is about to
arrive), then sleeping with a growing pause.
"""

from __future__ import annotations

import os
import time


def wait_all(requests, MPI) -> None:
    if not requests:
        return
    yield_until = time.perf_counter() + 5e-4
    pause = 2e-6
    while not MPI.Request.Testall(requests):
        if time.perf_counter() < yield_until:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
