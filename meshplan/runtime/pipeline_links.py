"""What a pipelined training step's stages exchange (the transport of its instruction lists
in ``runtime.interpreter``).

``PipelineLinks``, between the ranks of a job (``meshplan.stage_ranks.StageRanks``: stage
s's R_s replicas after the stages before it); crossing i (``PipelineStep.crossings``) goes
from replica r of its source stage to replica r of its destination stage where both have as
many replicas, else split or shared out among them (``stage_ranks``: each destination
replica's row block put together from the source replicas' pieces); where the two stages'
devices lay it out differently (each its own T, or its own replicas too), by the boxes of
its ``crossing_layouts.Relayout``, device to device; through host memory
(mpi4py's pickled messages, an array's bytes out of band: ``mpi4py.util.pkl5``; tag i + 1),
sends posted without waiting; a stage's replicas sum what they accumulated once a step
(``summed``, an MPI all-reduce among them), or each into its own row blocks of the sum
(``scattered``, a reduce-scatter) with the updated weights gathered whole again
(``gathered``, an all-gather) where they update in row blocks (``meshplan.replica_shards``).

``LocalLinks``, between the stages of one process, each replica of each run by a thread of
its own (``runtime.pipeline_inprocess``): a crossing's microbatch is put on a queue by its
sender and taken by its receiver, a stage's replicas meet at a barrier to sum or gather; a
stage that fails lets the others stop waiting.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from meshplan import replica_shards
from meshplan.stage_ranks import ONE, StageRanks, destinations, joined, kinds, piece_for, sources


class _Routes:
    """Where a crossing's pieces go and come from, between the stages' replicas and, where
    the two stages' devices shard it differently (``relayouts``: crossing index →
    ``crossing_layouts.Relayout``), between their devices."""

    def __init__(self, crossings, ranks: StageRanks, rows: dict[int, int] | None, relayouts: dict | None = None):
        self.crossings, self.ranks, self.rows = crossings, ranks, dict(rows or {})
        self.relayouts = dict(relayouts or {})
        self.kinds = kinds(crossings, ranks, self.rows)

    def outgoing(self, index: int, replica: int, device: int, value) -> list[tuple[int, int, object]]:
        """(destination replica, its device, piece) of what device ``device`` of ``replica``
        of crossing ``index``'s source sends."""
        c, kind = self.crossings[index], self.kinds[index]
        relayout = self.relayouts.get(index)
        if relayout is not None:
            value = np.ones_like(np.asarray(value)) if kind == ONE else np.asarray(value)
            if not relayout.across_replicas:     # replica r to replica r
                return [(replica, j, np.ascontiguousarray(value[cut])) for j, cut in relayout.sends(device)]
            return [(*divmod(j, relayout.receivers), np.ascontiguousarray(value[cut]))
                    for j, cut in relayout.sends(replica * relayout.senders + device)]
        r_src, r_dst = self.ranks.replicas[c.src], self.ranks.replicas[c.dst]
        if r_src == r_dst and kind != ONE:
            return [(replica, device, value)]
        axis = self.rows.get(index)
        return [(d, device, piece_for(kind, value, axis, replica, r_src, d, r_dst))
                for d in destinations(kind, replica, r_src, r_dst)]

    def incoming(self, index: int, replica: int, device: int) -> list[tuple[int, int]]:
        """The (source replica, its device) device ``device`` of ``replica`` of crossing
        ``index``'s destination receives from, in order."""
        c = self.crossings[index]
        relayout = self.relayouts.get(index)
        if relayout is not None and not relayout.across_replicas:
            return [(replica, i) for i in relayout.sources(device)]
        if relayout is not None:
            return [divmod(i, relayout.senders) for i in relayout.sources(replica * relayout.receivers + device)]
        r_src, r_dst = self.ranks.replicas[c.src], self.ranks.replicas[c.dst]
        found = [replica] if r_src == r_dst else sources(self.kinds[index], replica, r_src, r_dst)
        return [(r, device) for r in found]

    def joined(self, index: int, replica: int, device: int, pieces: list):
        relayout = self.relayouts.get(index)
        if relayout is not None:
            return relayout.joined(replica * relayout.receivers + device if relayout.across_replicas else device,
                                   pieces)
        return joined(self.kinds[index], pieces, self.rows.get(index))


class PipelineLinks:
    """This rank's links in ``comm`` (the job's world), ``crossings`` the pipeline's, its
    ``ranks`` (``StageRanks``: device j of replica r of stage s is ``ranks.rank(s, r, j)``),
    ``rows`` each split crossing's axis of samples. Its crossings go to and come from device
    j of the other stage's replicas (``_Routes``); its sums are over its stage's replicas
    (among the devices j alike); its ``collective`` is among the devices of its replica."""

    def __init__(self, comm, MPI, crossings, ranks: StageRanks, rows: dict[int, int] | None = None,
                 relayouts: dict | None = None):
        from mpi4py.util import pkl5

        from meshplan.runtime.collectives import AxisGroup

        self.comm, self.MPI, self.crossings, self.ranks = comm, MPI, crossings, ranks
        self.stage, self.replica, self.device = ranks.where(comm.Get_rank())
        self.replicas = ranks.replicas[self.stage]
        self.routes = _Routes(crossings, ranks, rows, relayouts)
        first = ranks.first(self.stage)
        self.group = comm.Split(first + self.device, self.replica)    # the replicas (a stage's devices j alike)
        # (every rank splits where any stage's devices shard: a split is the whole world's call)
        devices = comm.Split(first + self.replica, self.device) if ranks.tensor > 1 else None
        self.devices = AxisGroup(devices, MPI) if ranks.devices(self.stage) > 1 else None
        # tensors as pickle's out-of-band buffers (mpi4py's pkl5): an array's bytes go as they
        # are, not copied into a pickle (16 MiB between two ranks of a machine: 2.1 ms, against
        # 9.6 ms pickled whole; alike at 256 KiB)
        self.messages = pkl5.Intracomm(comm.Dup())
        self._waitall = pkl5.Request.waitall
        self._posted: list = []

    def post(self, crossing: int, mb: int, value: np.ndarray) -> None:
        """Send what crossing ``crossing`` carries for microbatch ``mb``, without waiting
        (``finish`` waits); a crossing's microbatches go in the order both lists give."""
        c = self.crossings[crossing]
        for replica, device, piece in self.routes.outgoing(crossing, self.replica, self.device, value):
            self._posted.append(self.messages.isend(piece, dest=self.ranks.rank(c.dst, replica, device),
                                                    tag=crossing + 1))

    def receive(self, crossing: int, mb: int) -> np.ndarray:
        """What crossing ``crossing`` brings for microbatch ``mb``, waited for."""
        c = self.crossings[crossing]
        return self.routes.joined(crossing, self.replica, self.device, [
            self.messages.recv(source=self.ranks.rank(c.src, replica, device), tag=crossing + 1)
            for replica, device in self.routes.incoming(crossing, self.replica, self.device)])

    def collective(self, step, x, spare: bool = False):
        """This device's part of a collective of its replica's devices (a part's)."""
        return step.kind.perform(step, x, self.devices, spare)

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
        self._waitall(self._posted)
        self._posted = []


class StageStopped(RuntimeError):
    """A stage stopped waiting: another stage of the step failed."""


class LocalLinks:
    """The crossings between the stages of one process (``crossings``, split where their
    ``rows`` say), and the sums of each stage's replicas (``ranks``: ``StageRanks``): one
    ``LocalLinks`` a step, shared by the threads of the stages' replicas, each of which talks
    through its own view (``of(stage, replica, device)``)."""

    WAIT = 0.05    # seconds between looks at whether another stage failed

    def __init__(self, ranks: StageRanks, crossings=(), rows: dict[int, int] | None = None,
                 relayouts: dict | None = None):
        self.ranks = ranks
        self.routes = _Routes(list(crossings), ranks, rows, relayouts)
        self._queues: dict[tuple, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self.failed = threading.Event()
        # a stage's replicas meet among the devices j alike; a replica's devices among themselves
        S = ranks.stages
        self._meetings = {(s, j): _Meeting(ranks.replicas[s]) for s in range(S) for j in range(ranks.devices(s))}
        self._devices = {(s, r): _Meeting(ranks.devices(s)) for s in range(S) for r in range(ranks.replicas[s])}

    def of(self, stage: int, replica: int = 0, device: int = 0) -> "_ReplicaLinks":
        """The links of device ``device`` of replica ``replica`` of stage ``stage``."""
        return _ReplicaLinks(self, stage, replica, device)

    def stop(self) -> None:
        """A stage failed: every other stops waiting (for a crossing or its replicas)."""
        self.failed.set()
        for meeting in list(self._meetings.values()) + list(self._devices.values()):
            meeting.barrier.abort()

    def _queue(self, crossing: int, mb: int, place: tuple, source: tuple) -> queue.SimpleQueue:
        with self._lock:
            return self._queues.setdefault((crossing, mb, place, source), queue.SimpleQueue())

    def unreceived(self) -> list[tuple[int, int, int, int]]:
        """The (crossing, microbatch, place, source) sent and not received (none after a step)."""
        with self._lock:
            return [key for key, waiting in self._queues.items() if not waiting.empty()]


class _Meeting:
    """Where a stage's replicas (threads) trade their values for a sum or a gather."""

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties)
        self.values: list = [None] * parties

    def trade(self, replica: int, value) -> list:
        """Every replica's ``value``, in replica order, once all have given theirs."""
        self.values[replica] = value
        self._wait()
        found = list(self.values)
        self._wait()    # no replica gives its next value before all have read these
        return found

    def _wait(self) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise StageStopped("another stage of the step failed") from None


class _ReplicaLinks:
    """One device's links in a ``LocalLinks``: its crossings go to and come from the same
    device of the same replica of the other stages; its sums are over its stage's replicas;
    its collectives among its replica's devices."""

    def __init__(self, links: LocalLinks, stage: int, replica: int, device: int = 0):
        self.links, self.replica, self.replicas, self.device = links, replica, links.ranks.replicas[stage], device
        self.tensor = links.ranks.devices(stage)
        self.meeting = links._meetings[(stage, device)]
        self.devices = links._devices[(stage, replica)]

    def collective(self, step, x, spare: bool = False):
        """This device's part of a collective of its replica's devices, computed in memory
        (``apply_steps``) once every device has given its tensor."""
        from meshplan.reshard.steps import apply_steps
        from meshplan.sharding import LogicalMesh

        tensor = self.tensor
        mesh = LogicalMesh((1, tensor), tuple(range(tensor)))
        values = self.devices.trade(self.device, x)
        done = apply_steps({(0, j): v for j, v in enumerate(values)}, [step], mesh)
        return done[(0, self.device)]

    def post(self, crossing: int, mb: int, value) -> None:
        for replica, device, piece in self.links.routes.outgoing(crossing, self.replica, self.device, value):
            self.links._queue(crossing, mb, (replica, device), (self.replica, self.device)).put(piece)

    def receive(self, crossing: int, mb: int):
        routes, place = self.links.routes, (self.replica, self.device)
        return routes.joined(crossing, self.replica, self.device, [
            self._taken(self.links._queue(crossing, mb, place, source))
            for source in routes.incoming(crossing, self.replica, self.device)])

    def _taken(self, waiting: queue.SimpleQueue):
        while True:
            try:
                return waiting.get(timeout=LocalLinks.WAIT)
            except queue.Empty:
                if self.links.failed.is_set():
                    raise StageStopped("another stage of the step failed") from None

    def summed(self, array):
        if self.replicas == 1:
            return array
        values = self.meeting.trade(self.replica, np.asarray(array))
        total = np.array(values[0], copy=True)
        for value in values[1:]:
            total += value
        return total

    def scattered(self, array):
        if self.replicas == 1:
            return array
        return np.ascontiguousarray(replica_shards.piece(self.summed(array), self.replicas, self.replica))

    def gathered(self, block, shape):
        if self.replicas == 1:
            return block
        return np.concatenate(self.meeting.trade(self.replica, np.asarray(block))).reshape(shape)

    def finish(self) -> None:
        pass
