"""Cross-mesh resharding under a real ``mpiexec -n 4``: broadcast, send/recv and
all-gather cases (tests/mpi_scripts/reshard_case.py), each rank checking its slice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, mpiexec_path

SCRIPT = REPO / "tests" / "mpi_scripts" / "reshard_case.py"


@pytest.mark.mpi
def test_reshard_cases_under_mpiexec():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [mpiexec_path(), "-n", "4", sys.executable, str(SCRIPT)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "FAIL" not in done.stdout, report
    lines = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) >= 9, report
    for case in ("1x2->1x2", "1x2->2x1", "1x1->1x3 bcast", "1x1->1x3 local allgather"):
        assert any(case in line for line in lines), report


@pytest.mark.mpi
def test_runtime_collectives_match_in_memory_semantics():
    """AllReduce / AllGather / ReduceScatter / AllToAll over each mesh axis under mpiexec
    equal the in-memory executor the in-process runs use."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    script = REPO / "tests" / "mpi_scripts" / "collectives_case.py"
    done = subprocess.run([mpiexec_path(), "-n", "4", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert len(lines) == 24 and all(line.startswith("ok ") for line in lines), report
