"""Many planned backend node cases in one mpiexec job: ``backend_cases_case.py MANIFEST``.

MANIFEST is a JSON list of {"name", "plan_dir", "inputs", "expected", "rtol", "atol"} and
optionally "bounds" (output → quantization bound, added to atol: verify's rule) (written by
tests/test_backend_cases.py and tests/test_genai_models.py); every plan needs as many ranks as the job has.
Each case runs as ``meshplan run`` runs it (``run_rank``); rank 0 compares the outputs
with the expected ones and prints ``ok NAME`` or ``FAIL NAME: why``. The exit status is
0 only if every case passed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from meshplan.runtime.mpi_runner import run_rank  # noqa: E402
from tests.backend_cases import close, tolerances  # noqa: E402


def run_case(comm, entry: dict) -> str | None:
    """None when the case passed on every rank, else why it failed."""
    output = Path(entry["plan_dir"]).parent / f"mpi_out_{comm.size}.npz"
    error = None
    try:
        run_rank(entry["plan_dir"], entry["inputs"], output, provider="cpu")
    except Exception as exc:     # noqa: BLE001 - reported as this case's FAIL line
        error = f"rank {comm.rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    errors = [e for e in comm.gather(error, root=0) or [] if e]
    if comm.rank != 0:
        return None
    if errors:
        return errors[0]
    with np.load(output, allow_pickle=True) as got, np.load(entry["expected"], allow_pickle=True) as want:
        for name in want.files:
            expected = want[name]
            rtol, atol = tolerances(expected, entry["rtol"], entry["atol"])
            if name not in got.files or not close(got[name], expected, rtol, atol + entry.get("bounds", {}).get(name, 0.0)):
                return f"output {name!r} differs from the reference"
    return None


if __name__ == "__main__":
    comm = MPI.COMM_WORLD
    cases = json.loads(Path(sys.argv[1]).read_text())
    failed = 0
    for entry in cases:
        why = run_case(comm, entry)
        if comm.rank == 0:
            print(f"ok {entry['name']}" if why is None else f"FAIL {entry['name']}: {why}", flush=True)
            failed += why is not None
    failed = comm.bcast(failed, root=0)
    sys.exit(0 if failed == 0 else 1)
