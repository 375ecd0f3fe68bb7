"""A rank with cores of its own whose program is cut at its collectives into several sessions
runs them all on one onnxruntime pool, the process's (``runtime.threads.one_pool``,
``providers.share_one_pool``), where its process is its own (as the commands' are), under
mpiexec.

Arguments: PLAN_DIR INPUTS.npz (a 1x2 plan with collectives). The machine's topology is
replaced by one of four physical cores per CPU this process may run on, so that each of the
two ranks gets four threads even on a 1- or 2-core machine. Each rank counts its process's
threads before and after the job starts: one pool adds its threads less the calling one,
where a pool per session would add that many per session (the libraries may make one
thread of their own at the job's start). Then the job must compute what
onnxruntime computes on the original model, and say what each rank got; a second job in the
same process runs on the same pool. Prints ``ok``/``FAIL`` lines (rank 0 gathers every rank's
facts).
"""

from __future__ import annotations

import os
import sys

import numpy as np
from model_check import print_outputs_check


def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def main() -> int:
    from meshplan.runtime import threads
    from meshplan.runtime.job import Job
    from meshplan.runtime.transport import world

    threads.physical_cores = lambda cores: [[c] for c in sorted(cores) for _ in range(4)]
    threads.set_binding(True, pin=True)   # this process is the rank's own, as a command's is
    with np.load(sys.argv[2]) as archive:
        inputs = {k: archive[k] for k in archive.files}
    _, comm = world()
    before = threads_now()
    job = Job(sys.argv[1], provider="cpu")
    added = threads_now() - before
    facts = comm.gather((job.threads.shared_pool, job.threads.spinning, job.threads.threads, job.session.sessions,
                         added, job.threads.describe()), root=0)
    if not job.is_driver:
        job.serve()
    else:
        got = job.run(inputs)
        job.close()
    # a second job in the same process whose ranks would take 2 threads: the process's pool
    # (onnxruntime sizes it once) is what its sessions run on, and what it says
    threads.physical_cores = lambda cores: [[c] for c in sorted(cores) for _ in range(2)]
    again = Job(sys.argv[1], provider="cpu")
    second = (again.threads.shared_pool, again.threads.spinning, again.threads.threads)
    if not again.is_driver:
        again.serve()
        return 0
    again.run(inputs)
    again.close()
    shared = all(pool and spinning and sessions >= 2 for pool, spinning, _, sessions, _, _ in facts)
    print(f"{'ok' if shared else 'FAIL'} every rank shares one spinning pool between its sessions: "
          f"{[(pool, spinning, sessions) for pool, spinning, _, sessions, _, _ in facts]}")
    # one pool: its threads less the calling one (and at most one thread of the libraries' own);
    # a pool per session: that many per session
    one = all(added <= count and sessions * (count - 1) > count for _, _, count, sessions, added, _ in facts)
    print(f"{'ok' if one else 'FAIL'} each rank made one pool's threads: "
          f"{[(added, count - 1, sessions * (count - 1)) for _, _, count, sessions, added, _ in facts]} "
          "(threads added; one pool's; a pool per session's)")
    said = all("one pool for all its sessions, spinning on" in text for *_, text in facts)
    print(f"{'ok' if said else 'FAIL'} thread choices: {[text for *_, text in facts]}")
    print_outputs_check(job.plan, inputs, got)   # (onnxruntime on the job's pool, where it has one)
    print(f"{'ok' if second == (True, True, facts[0][2]) else 'FAIL'} a second job that would take 2 threads "
          f"says it runs on the process's pool of {facts[0][2]}: {second}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
