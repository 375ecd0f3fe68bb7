"""The device path's data movement under mpiexec (4 ranks): OrtValue buffers handed to
MPI through ``__cuda_array_interface__`` (in host memory here, with the CPU provider).

Runs every cross-mesh case of reshard_case.py (prepare steps included) and every
collective of collectives_case.py with ``DeviceBuffers``; each rank compares its result
with the slice its spec names and with the in-memory executor. Rank 0 prints one line
per case; the exit status is 0 only if every case matched on every rank.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mpi4py import MPI  # noqa: E402

from meshplan.providers import CPU  # noqa: E402
from meshplan.runtime.buffers import DeviceBuffers  # noqa: E402
from tests.mpi_scripts.collectives_case import run_steps  # noqa: E402
from tests.mpi_scripts.reshard_case import run_cases  # noqa: E402

if __name__ == "__main__":
    comm = MPI.COMM_WORLD
    buffers = DeviceBuffers("cpu", 0, [CPU])   # results come back as DeviceTensors: to_host fails on anything else
    passed, total = (sum(pair) for pair in zip(run_cases(comm, buffers), run_steps(comm, buffers)))
    if comm.rank == 0:
        print(f"{passed}/{total} cases passed", flush=True)
    sys.exit(0 if passed == total else 1)
