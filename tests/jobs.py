"""MPI jobs started by a test and the processes they leave: every process of a job (the
launcher, its proxy, each rank: MPICH puts ranks in sessions of their own, out of the
launcher's process group) carries a mark in its environment, found in ``/proc``; a job
is gone when no process carries its mark. ``run_marked`` runs one to its end within a
time limit and ends what is left of it (by pid) where it does not end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, meshplan_command, mpiexec_path

MARK = "MESHPLAN_TEST_JOB"
FAILING = REPO / "tests" / "mpi_scripts" / "failing_command.py"


def marked_environment(mark: str, **extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **{MARK: mark}, **extra)


def marked(mark: str) -> list[int]:
    """The pids of the processes that carry ``mark`` (zombies too: not yet reaped)."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:   # gone, or not ours
            pass
    return found


def left_after(mark: str, seconds: float = 10) -> list[int]:
    """The processes of the job still there ``seconds`` from now, or none once they are gone."""
    deadline = time.monotonic() + seconds
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def end(mark: str) -> None:
    """SIGKILL to every process that carries ``mark``, one by one, by its pid."""
    for pid in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def command(ranks: int, *args, failure: str | None = None) -> list[str]:
    """``mpiexec -n RANKS meshplan ARGS``, or with ``failure`` put in (``failing_command.py``)."""
    prefix = [sys.executable, str(FAILING), failure] if failure else meshplan_command()
    return [mpiexec_path(), "-n", str(ranks), *prefix, *map(str, args)]


@dataclass
class Ended:
    returncode: int | None     # None: it did not end within the limit (and was ended)
    stdout: str
    stderr: str
    seconds: float
    left: list[int]            # processes of the job left after it ended (then ended by the test)


def run_marked(ranks: int, *args, failure: str | None = None, timeout: float = 45, **extra) -> Ended:
    mark = uuid.uuid4().hex
    began = time.monotonic()
    process = subprocess.Popen(command(ranks, *args, failure=failure), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=marked_environment(mark, **extra), cwd=REPO,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        end(mark)
        out, err = process.communicate(timeout=30)
        code = None
    seconds = time.monotonic() - began
    left = left_after(mark)
    end(mark)
    return Ended(code, out, err, seconds, left)
