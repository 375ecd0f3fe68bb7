"""A plan's idle rank sleeps through the calls it takes no part in, under mpiexec.

Arguments: PLAN_DIR INPUTS.npz (a plan of two ranks that leaves rank 1 idle). Rank 0 makes
calls for about a second; rank 1 waits in ``Job.serve`` and measures the processor time its
process took meanwhile: a rank that yielded the core between tests (as every waiting rank
did) takes most of a core, one that sleeps next to none. Then the statistics and the end,
which the idle rank does take part in, still reach it. Prints ``ok``/``FAIL`` lines (rank 0).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from model_check import print_outputs_check


def main() -> int:
    from meshplan.runtime.job import Job
    from meshplan.runtime.transport import world

    with np.load(sys.argv[2]) as archive:
        inputs = {k: archive[k] for k in archive.files}
    _, comm = world()
    job = Job(sys.argv[1], provider="cpu")
    if not job.is_driver:
        wall, cpu = time.perf_counter(), time.process_time()
        job.serve()
        share = (time.process_time() - cpu) / (time.perf_counter() - wall)
        comm.gather(share, root=0)
        return 0
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < 1.0:
        got = job.run(inputs)
        calls += 1
    stats = job.stats()
    job.close()
    share = comm.gather(0.0, root=0)[1]
    print(f"{'ok' if share < 0.25 else 'FAIL'} the idle rank took {share:.1%} of a core through {calls} calls")
    print(f"{'ok' if len(stats.peak_rss_bytes) == 2 else 'FAIL'} the statistics reach every rank: {stats.peak_rss_bytes}")
    print_outputs_check(job.plan, inputs, got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
