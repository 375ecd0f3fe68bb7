"""A meshplan command with a failure put in, for the tests of what a failure inside a job
does: ``mpiexec -n N python failing_command.py FAILURE COMMAND ARGS...`` runs ``meshplan
COMMAND ARGS...`` on every rank (``cli.main``), with, patched into this process before it
starts:

- ``sampler-raises``: a draw of a sampling (non-greedy) ``Sampler`` raises a ValueError, as
  numpy's did on NaN probabilities; from the first draw, or, where the environment names a
  file in ``FAIL_WHEN``, from the first draw once that file exists;
- ``rank-R-raises-at-K``: rank R's K-th call of the job (``Job._run_call``, on the driver
  or a worker) raises inside the call;
- ``rank-R-dies-at-K``: rank R kills itself with SIGKILL at its K-th call;
- ``rank-R-dies-at-part-K``: in a pipelined training job, rank R kills itself with SIGKILL at
  its K-th run of a part (``StageRunner.run``).

The hook lives here alone: the library has no switch for it.
"""

from __future__ import annotations

import os
import signal
import sys

from meshplan.generation.sampling import Sampler
from meshplan.runtime.job import Job


def sampler_raises() -> None:
    draw = Sampler.__call__

    def failing(self, logits):
        flag = os.environ.get("FAIL_WHEN")
        if not self.greedy and (flag is None or os.path.exists(flag)):
            raise ValueError("a draw failed (put in by the test)")
        return draw(self, logits)
    Sampler.__call__ = failing


def call_fails(rank: int, how: str, at: int) -> None:
    call, count = Job._run_call, [0]

    def failing(self, header, feeds, copy=True):
        if self.rank == rank:
            count[0] += 1
            if count[0] == at:
                if how == "dies":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"call {at} failed on rank {rank} (put in by the test)")
        return call(self, header, feeds, copy)
    Job._run_call = failing


def part_fails(rank: int, at: int) -> None:
    from meshplan.runtime.pipeline_stage import StageRunner

    run, count = StageRunner.run, [0]

    def dying(self, phase, mb, links=None):
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == rank:
            count[0] += 1
            if count[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)
        return run(self, phase, mb, links)
    StageRunner.run = dying


failure = sys.argv.pop(1)
if failure == "sampler-raises":
    sampler_raises()
elif "-part-" in failure:
    _, rank, _, _, _, at = failure.split("-")
    part_fails(int(rank), int(at))
else:
    _, rank, how, _, at = failure.split("-")
    call_fails(int(rank), how, int(at))
sys.argv[0] = "meshplan"

from cli.main import main  # noqa: E402  (after the patches)

main()
