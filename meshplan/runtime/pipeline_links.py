"""What a pipelined training step's ranks exchange (the transport of its instruction lists in
``runtime.interpreter``): rank s·R + r is replica r of stage s (R replicas a stage); crossing
i (``PipelineStep.crossings``) goes from replica r of its source stage to replica r of its
destination stage, through host memory (mpi4py's pickled messages, tag i + 1), sends posted
without waiting; a stage's replicas sum what they accumulated once a step (``summed``, an MPI
all-reduce among them)."""

from __future__ import annotations

import numpy as np


class PipelineLinks:
    """This rank's links in ``comm`` (the job's world), ``crossings`` the pipeline's, R
    ``replicas`` a stage."""

    def __init__(self, comm, MPI, crossings, replicas: int):
        self.comm, self.MPI, self.crossings, self.replicas = comm, MPI, crossings, replicas
        self.stage, self.replica = divmod(comm.Get_rank(), replicas)
        self.group = comm.Split(self.stage, self.replica)    # the stage's replicas
        self._posted: list = []

    def post(self, crossing: int, value: np.ndarray) -> None:
        """Send what crossing ``crossing`` carries, without waiting (``finish`` waits)."""
        c = self.crossings[crossing]
        self._posted.append(self.comm.isend(value, dest=c.dst * self.replicas + self.replica, tag=crossing + 1))

    def receive(self, crossing: int) -> np.ndarray:
        """What crossing ``crossing`` brings, waited for."""
        c = self.crossings[crossing]
        return self.comm.recv(source=c.src * self.replicas + self.replica, tag=crossing + 1)

    def summed(self, array) -> np.ndarray:
        """``array`` summed over the stage's replicas."""
        array = np.ascontiguousarray(array)
        out = np.empty_like(array)
        self.group.Allreduce(array, out, op=self.MPI.SUM)
        return out

    def finish(self) -> None:
        """Wait for every send posted (the end of a step)."""
        self.MPI.Request.waitall(self._posted)
        self._posted = []
