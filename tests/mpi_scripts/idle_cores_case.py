"""A launcher that binds every rank to cores of its own (as Open MPI does by default) leaves
the cores of the plan's idle ranks unused while they sleep: the working ranks of their machine
take them (``threads.with_idle_cores``), unless ``--no-bind-cores`` keeps the launcher's
binding. Under mpiexec.

Arguments: PLAN_DIR INPUTS.npz (a plan of two ranks that leaves rank 1 idle). Each rank binds
itself to one CPU first, as such a launcher would (rank r to the r-th CPU this process may run
on, taken round). Prints ``ok``/``FAIL`` lines (rank 0).
"""

from __future__ import annotations

import os
import sys

import numpy as np
from model_check import print_outputs_check


def main() -> int:
    from meshplan.runtime import threads
    from meshplan.runtime.job import Job
    from meshplan.runtime.transport import world

    with np.load(sys.argv[2]) as archive:
        inputs = {k: archive[k] for k in archive.files}
    _, comm = world()
    cpus = sorted(os.sched_getaffinity(0))
    launcher = {cpus[comm.Get_rank() % len(cpus)]}
    everyone = sorted({cpus[r % len(cpus)] for r in range(comm.Get_size())})
    for binding in (True, False):
        threads.set_binding(binding)
        os.sched_setaffinity(0, launcher)
        job = Job(sys.argv[1], provider="cpu")
        if not job.is_driver:
            job.serve()
            continue
        got = job.run(inputs)
        job.close()
        mine = sorted(os.sched_getaffinity(0))
        want = everyone if binding else sorted(launcher)
        print(f"{'ok' if mine == want and job.threads.threads == len(want) else 'FAIL'} "
              f"{'--bind-cores' if binding else '--no-bind-cores'}: the working rank runs on {mine} "
              f"with {job.threads.threads} thread(s) (expected {want}): {job.threads.describe()}")
        print_outputs_check(job.plan, inputs, got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
