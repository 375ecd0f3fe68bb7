"""Ranks that the launcher left unbound bind themselves to a share of their machine's
physical cores (``runtime.threads.plan_threads``), under mpiexec.

Arguments: PLAN_DIR INPUTS.npz (a 1x2 plan). The machine's topology is replaced by one of
four physical cores per CPU this process may run on, so that each of the two ranks gets at
least two "cores" even on a 1- or 2-core machine: rank r must then run on CPU r alone (CPU 0
for both where there is one), say so in its thread
choice, and the job must compute what onnxruntime computes on the original model. Prints
``ok``/``FAIL`` lines (rank 0 gathers every rank's affinity).
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

    cpus = sorted(os.sched_getaffinity(0))
    threads.physical_cores = lambda cores: [[c] for c in sorted(cores) for _ in range(4)]
    with np.load(sys.argv[2]) as archive:
        inputs = {k: archive[k] for k in archive.files}
    _, comm = world()
    job = Job(sys.argv[1], provider="cpu")
    everyone = comm.gather((sorted(os.sched_getaffinity(0)), job.threads.self_bound, job.threads.describe()), root=0)
    if not job.is_driver:
        job.serve()
        return 0
    got = job.run(inputs)
    job.close()
    expected = [[cpus[r % len(cpus)]] for r in range(len(everyone))]
    bound = [cores for cores, _, _ in everyone]
    print(f"{'ok' if bound == expected else 'FAIL'} each rank on its own CPU: {bound} (expected {expected})")
    said = all(self_bound and "bound by meshplan" in text for _, self_bound, text in everyone)
    print(f"{'ok' if said else 'FAIL'} thread choices: {[text for _, _, text in everyone]}")
    print_outputs_check(job.plan, inputs, got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
