"""Layer ILPs solved side by side, in worker processes.

A plan over a large mesh solves hundreds of layer ILPs (``IntraOpPass.layer_solution``),
each in one CBC thread. The fastest layouts' ILPs of a view are known before its chain over
the layers asks for them (every layer, every pair of boundary layouts), so ``solve_all``
solves a batch of them at once in ``workers`` processes forked from the planner: each child
has the planner's graph, costs and layering as they are, solves the ILPs it is handed and
sends back each solution; the parent keeps them in the pass's cache, and the chain then
finds every one there. CBC gets the same model in a child as in the parent, so the plan is
the one a serial search makes. The processes of a solver are kept for its next batch (a
pass's solver is a bound method of it: a solve needs nothing the pass learns later) and
let go when another solver comes or the search ends (``close``).

``workers()`` is the count to use: ``MESHPLAN_PLAN_WORKERS`` where set (1: solve in the
planner's process, as before; anything but a whole number from 1 is refused in one line),
else the cores this process may run on, at most ``MAX_WORKERS``. Where processes cannot
be forked (no ``fork`` start method, or MPI already started in this process, which a fork
would copy half-working), everything is solved in the planner's process.
"""

from __future__ import annotations

import os
import sys

WORKERS_VARIABLE = "MESHPLAN_PLAN_WORKERS"
MAX_WORKERS = 16
MIN_BATCH = 2      # fewer ILPs than this are solved in the planner's process (a kept pool costs little)

_solving = None    # the solver a forked child calls (set in the parent just before the fork)
_held: dict = {}   # "pool", "solve", "count": the pool of the last solver, kept for its next batch


def workers() -> int:
    """How many processes solve ILPs side by side (1: the planner's own)."""
    given = os.environ.get(WORKERS_VARIABLE, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            from meshplan.errors import PlanError

            raise PlanError(f"{WORKERS_VARIABLE} must be a whole number of processes, 1 or more; got {given!r}")
        return int(given)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def can_fork() -> bool:
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is None or not mpi.Is_initialized()


def solve_all(solve, jobs: list, count: int | None = None) -> dict:
    """``{job: solve(job)}`` for every job that ``solve`` answers without raising, solved in
    ``count`` (default ``workers()``) forked processes; {} where that is not worth it (fewer
    than ``MIN_BATCH`` jobs, one worker) or not possible: the caller solves those itself."""
    count = workers() if count is None else count
    if min(count, len(jobs)) < 2 or len(jobs) < MIN_BATCH or not can_fork():
        return {}
    found = list(_pool(solve, count).imap_unordered(_solve_one, jobs, chunksize=1))
    return {job: answer for job, answered, answer in found if answered}


def _pool(solve, count: int):
    """A pool of ``count`` processes forked to run ``solve``: the one of the batch before
    where it runs the same solver (its children keep what they worked out, and nothing is
    forked again), else a new one (the old one closed)."""
    global _solving
    if _held.get("solve") == solve and _held.get("count") == count:
        return _held["pool"]
    close()
    import multiprocessing

    _solving = solve
    try:
        pool = multiprocessing.get_context("fork").Pool(count)
    finally:
        _solving = None
    _held.update(pool=pool, solve=solve, count=count)
    return pool


def close() -> None:
    """Let the held pool's processes go (a planner does at the end of its search)."""
    pool = _held.pop("pool", None)
    _held.clear()
    if pool is not None:
        pool.terminate()
        pool.join()


def _solve_one(job):
    """In a child: (job, True, its answer), or (job, False, None) where solving raised (the
    caller meets the error again when it solves that one itself)."""
    try:
        return job, True, _solving(job)
    except Exception:
        return job, False, None
