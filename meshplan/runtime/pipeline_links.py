"""What a pipelined training step's stages exchange (the transport of its instruction lists
in ``runtime.interpreter``).

``PipelineLinks``, between the ranks of a job: rank s·R + r is replica r of stage s (R
replicas a stage); crossing i (``PipelineStep.crossings``) goes from replica r of its source
stage to replica r of its destination stage, through host memory (mpi4py's pickled messages,
tag i + 1), sends posted without waiting; a stage's replicas sum what they accumulated once a
step (``summed``, an MPI all-reduce among them), or each into its own row blocks of the sum
(``scattered``, a reduce-scatter) with the updated weights gathered whole again
(``gathered``, an all-gather) where they update in row blocks (``meshplan.replica_shards``).

``LocalLinks``, between the stages of one process, each run by a thread of its own
(``runtime.pipeline_inprocess``): a crossing's microbatch is put on a queue by its sender and
taken by its receiver; a stage that fails lets the others stop waiting.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from meshplan import replica_shards


class PipelineLinks:
    """This rank's links in ``comm`` (the job's world), ``crossings`` the pipeline's, R
    ``replicas`` a stage."""

    def __init__(self, comm, MPI, crossings, replicas: int):
        self.comm, self.MPI, self.crossings, self.replicas = comm, MPI, crossings, replicas
        self.stage, self.replica = divmod(comm.Get_rank(), replicas)
        self.group = comm.Split(self.stage, self.replica)    # the stage's replicas
        self._posted: list = []

    def post(self, crossing: int, mb: int, value: np.ndarray) -> None:
        """Send what crossing ``crossing`` carries for microbatch ``mb``, without waiting
        (``finish`` waits); a crossing's microbatches go in the order both lists give."""
        c = self.crossings[crossing]
        self._posted.append(self.comm.isend(value, dest=c.dst * self.replicas + self.replica, tag=crossing + 1))

    def receive(self, crossing: int, mb: int) -> np.ndarray:
        """What crossing ``crossing`` brings for microbatch ``mb``, waited for."""
        c = self.crossings[crossing]
        return self.comm.recv(source=c.src * self.replicas + self.replica, tag=crossing + 1)

    def summed(self, array) -> np.ndarray:
        """``array`` summed over the stage's replicas (of its own shape: a 0-d one stays 0-d)."""
        array = np.asarray(array, order="C")
        out = np.empty_like(array)
        self.group.Allreduce(array, out, op=self.MPI.SUM)
        return out

    def scattered(self, array) -> np.ndarray:
        """``array`` summed over the stage's replicas, this replica's row blocks of the sum
        alone (``meshplan.replica_shards``; a reduce-scatter)."""
        array = np.asarray(array, order="C")
        counts = replica_shards.counts(array.shape, self.replicas)
        out = np.empty(replica_shards.piece_shape(array.shape, self.replicas, self.replica), array.dtype)
        self.group.Reduce_scatter(array.reshape(-1), out.reshape(-1), recvcounts=counts, op=self.MPI.SUM)
        return out

    def gathered(self, block, shape) -> np.ndarray:
        """The whole tensor of ``shape`` from every replica's row blocks (an all-gather)."""
        block = np.asarray(block, order="C")
        out = np.empty(shape, block.dtype)
        self.group.Allgatherv(block.reshape(-1), [out.reshape(-1), replica_shards.counts(shape, self.replicas)])
        return out

    def finish(self) -> None:
        """Wait for every send posted (the end of a step)."""
        self.MPI.Request.waitall(self._posted)
        self._posted = []


class StageStopped(RuntimeError):
    """A stage stopped waiting: another stage of the step failed."""


class LocalLinks:
    """The crossings between the stages of one process: one ``LocalLinks`` a step, shared by
    the stages' threads (one replica a stage: ``summed`` is the array itself)."""

    WAIT = 0.05    # seconds between looks at whether another stage failed

    def __init__(self):
        self._queues: dict[tuple[int, int], queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self.failed = threading.Event()

    def _queue(self, crossing: int, mb: int) -> queue.SimpleQueue:
        with self._lock:
            return self._queues.setdefault((crossing, mb), queue.SimpleQueue())

    def post(self, crossing: int, mb: int, value) -> None:
        self._queue(crossing, mb).put(value)

    def receive(self, crossing: int, mb: int):
        waiting = self._queue(crossing, mb)
        while True:
            try:
                return waiting.get(timeout=self.WAIT)
            except queue.Empty:
                if self.failed.is_set():
                    raise StageStopped("another stage of the step failed") from None

    def summed(self, array):
        return array

    def scattered(self, array):
        return array

    def gathered(self, block, shape):
        return block

    def finish(self) -> None:
        pass

    def unreceived(self) -> list[tuple[int, int]]:
        """The (crossing, microbatch) pairs sent and not received (none after a step)."""
        with self._lock:
            return [key for key, waiting in self._queues.items() if not waiting.empty()]
