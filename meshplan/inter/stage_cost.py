"""Cost of one pipeline stage (a range of layers) on one submesh under one logical mesh.

``StageCosts.stage_cost`` is the single question the stage DP asks. Today a stage runs
on one device: its time is the sum of its operators' times plus sending its outputs on,
and submeshes of more than one device are infeasible. The intra-operator pass (sharding
a stage over its submesh) answers the same question for larger submeshes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.cost.cluster import Cluster
from meshplan.cost.protocol import CostModelProtocol
from meshplan.model.graph import Graph
from meshplan.intra.intra_op import IntraOpPass
from meshplan.model.layers import Layering, cut_traffic
from meshplan.inter.training_costs import RESHARD_FACTOR, TrainingCosting
from meshplan.training.pipeline_step import GPIPE


@dataclass(frozen=True)
class StageCost:
    seconds: float          # one microbatch through the stage
    param_bytes: float      # bytes per device held for the whole run
    act_bytes: float        # activation bytes per device per microbatch in flight


INFEASIBLE = StageCost(np.inf, np.inf, np.inf)


def submesh_shapes(cluster: Cluster) -> list[tuple[int, int]]:
    """(1,1), (1,2), (1,4) … (1,M), then (2,M) … (N,M): shapes that always tile the mesh."""
    per_host = cluster.devices_per_host
    shapes = []
    width = 1
    while width < per_host:
        shapes.append((1, width))
        width *= 2
    shapes.append((1, per_host))
    shapes.extend((hosts, per_host) for hosts in range(2, cluster.hosts + 1))
    return shapes


def logical_meshes(submesh: tuple[int, int]) -> list[tuple[int, int]]:
    """Views of a physical submesh: as itself and flattened to 1×(n·m). (The n·m×1 view
    costs the same as 1×(n·m) with the axes renamed, so it is not tried separately.)"""
    n, m = submesh
    return list(dict.fromkeys([(n, m), (1, n * m)]))


class StageCosts:
    """Per-layer statistics of a layered graph, and stage costs built from them."""

    def __init__(self, graph: Graph, layering: Layering, node_seconds: list[float], cost_model: CostModelProtocol,
                 intra_op: IntraOpPass | None = None, cluster: Cluster | None = None,
                 training: TrainingCosting | None = None, microbatches: int = 1):
        """``cluster``: where devices share their host (``Cluster.work_scale``), a stage on one
        device takes the cores and bandwidth of the idle ones beside it: its operators' work
        (beyond their fixed overhead) is scaled; larger stages' scaling is the sharding pass's.
        ``training``: cost a training step of ``microbatches`` instead of a forward call
        (``inter.training_costs``; ``intra_op`` should weigh its strategies so too)."""
        self.graph = graph
        self.training = training
        self.microbatches = microbatches
        self.intra_op = intra_op
        self.layering = layering
        self.cost_model = cost_model
        self._work_cache: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._facts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        bounds = np.asarray(layering.bounds)
        self.num_layers = layering.num_layers
        seconds = np.asarray(node_seconds, dtype=np.float64)
        if cluster is not None:
            seconds = cluster.shared_seconds(seconds, 1)
        if training is not None:
            seconds = seconds * training.forwards
        self._seconds_prefix = np.concatenate([[0.0], np.cumsum(seconds)])[bounds]
        self._cut_bytes = layering.cut_bytes[bounds]
        owner = layering.layer_of_node()
        # Parameter use per layer, so that a range's weights count each tensor once.
        params = sorted({p for i in range(len(graph.nodes)) for p in graph.params_of(i)})
        index = {p: k for k, p in enumerate(params)}
        uses = np.zeros((len(params), self.num_layers + 1), dtype=np.int32)
        for i in range(len(graph.nodes)):
            for p in graph.params_of(i):
                uses[index[p], owner[i] + 1] = 1
        self._param_uses = np.cumsum(uses, axis=1)
        self._param_sizes = np.array([graph.tensors[p].nbytes for p in params], dtype=np.float64)
        if training is not None:   # each trained weight with its gradient and optimizer slots
            self._param_sizes *= np.array([training.held_per_weight if p in training.trained else 1 for p in params])
        self._layer_peak = self._peak_activation_per_layer(owner)
        # memory counts a ranged plan's activations at its largest sizes
        self._cut_peak = cut_traffic(graph, peak=True)[bounds] if graph.views else self._cut_bytes
        # a training stage keeps, per microbatch in flight, every activation its backward
        # reads (per layer); recomputing, only what leaves each layer (the next one's input:
        # what enters the stage is counted apart), and one layer's activations at a time
        kept = self._kept_per_layer(owner)
        self._recomputed = np.zeros(self.num_layers)
        if training is not None and training.recompute:
            self._recomputed, kept = kept, self._cut_peak[1:].astype(np.float64)
        self._kept_prefix = np.concatenate([[0.0], np.cumsum(kept)])
        # state (an output that is the next call's input) stays on the devices between calls,
        # at its largest size: held like a weight by the stage that makes it
        state = np.zeros(self.num_layers + 1)
        producers = graph.producers()
        for name in graph.state:
            if name in producers:
                state[owner[producers[name]] + 1] += graph.tensors[name].peak_nbytes
        self._state_prefix = np.cumsum(state)
        # ... and on one stage: the layers that read a state input, make its output or read
        # that output (attention reads the cache it has just extended) stay together, so no
        # cache crosses a stage boundary on any call
        consumers = graph.consumers()
        self._state_spans = []
        for output, name in graph.state.items():
            layers = [int(owner[i]) for i in consumers.get(name, []) + consumers.get(output, [])]
            if output in producers:
                layers.append(int(owner[producers[output]]))
            if layers:
                self._state_spans.append((min(layers), max(layers)))

    def _peak_activation_per_layer(self, owner: np.ndarray) -> np.ndarray:
        """A simple liveness bound per layer: the largest sum of one node's inputs and outputs
        (state is held, and counted so, not an activation)."""
        peak = np.zeros(self.num_layers)
        tensors = self.graph.tensors
        state = set(self.graph.state) | set(self.graph.state.values())
        for i, node in enumerate(self.graph.nodes):
            live = sum(tensors[n].peak_nbytes for n in set(node.inputs) | set(node.outputs)
                       if n and not tensors[n].is_param and n not in state)
            peak[owner[i]] = max(peak[owner[i]], live)
        return peak

    def _kept_per_layer(self, owner: np.ndarray) -> np.ndarray:
        """Bytes of the activations each layer's operators make that a training step keeps
        for the backward (``TrainingCosting.saved``; nothing for a forward call)."""
        kept = np.zeros(self.num_layers)
        if self.training is None:
            return kept
        tensors, saved = self.graph.tensors, self.training.saved
        for i, node in enumerate(self.graph.nodes):
            kept[owner[i]] += sum(tensors[n].peak_nbytes for n in node.outputs
                                  if n and not tensors[n].is_param and (saved is None or n in saved))
        return kept

    def compute_seconds(self, start: int, stop: int) -> float:
        """Seconds of layers start..stop-1 on one device."""
        return float(self._seconds_prefix[stop] - self._seconds_prefix[start])

    def param_bytes(self, start: int, stop: int) -> float:
        used = (self._param_uses[:, stop] - self._param_uses[:, start]) > 0
        return float(self._param_sizes[used].sum())

    def boundary_bytes(self, stop: int) -> float:
        """Activation bytes leaving a stage that ends before layer ``stop``."""
        return float(self._cut_bytes[stop])

    def send_seconds(self, stop: int, across_hosts: bool | None = None) -> float:
        """The DP's estimate of handing on what crosses the cut before layer ``stop``: across
        hosts where the cluster has several (or as ``across_hosts`` says: a plan kept to
        one host of a larger cluster sends inside it)."""
        if stop >= self.num_layers:
            return 0.0
        seconds = self.cost_model.worst_transfer_seconds(self.boundary_bytes(stop), across_hosts)
        return seconds * (RESHARD_FACTOR if self.training is not None else 1.0)   # and the gradient back

    def stage_cost(self, start: int, stop: int, submesh: tuple[int, int], logical: tuple[int, int],
                   memory: float | None = None) -> StageCost:
        """Seconds per microbatch, weights and activations per device, of layers [start, stop)
        on ``submesh`` viewed as ``logical``: one device runs them whole; larger submeshes
        shard them with the intra-operator ILP (its layout chosen for devices of ``memory``
        bytes, default the cluster's)."""
        last = stop - 1
        if any(start <= hi and last >= lo and not (start <= lo and last >= hi) for lo, hi in self._state_spans):
            return INFEASIBLE   # the stage would hold part of a state's readers and makers
        send = self.send_seconds(stop)
        activations = float(self._layer_peak[start:stop].max()) + float(self._cut_peak[start])
        if self.training is not None:
            activations = float(self._kept_prefix[stop] - self._kept_prefix[start]) + float(self._cut_peak[start])
        state = float(self._state_prefix[stop] - self._state_prefix[start])
        recomputed = float(self._recomputed[start:stop].max())   # held once, whatever is in flight
        if submesh == (1, 1):
            return StageCost(self.compute_seconds(start, stop) + send,
                             self.param_bytes(start, stop) + state + recomputed, activations)
        if self.intra_op is None:
            return INFEASIBLE
        sharded = self.intra_op.stage(start, stop, submesh, logical, memory)
        devices = submesh[0] * submesh[1]
        # the sharded stage's held bytes count its state in the layout it is made in
        return StageCost(sharded.seconds + sharded.arrival + send, sharded.param_bytes + recomputed / devices,
                         activations / devices)

    def tables(self, submeshes: list[tuple[int, int]], memory: float | None = None,
               across_hosts: bool | None = None):
        """Arrays (L, L, S, K) of seconds, parameter bytes and activation bytes for the DP.

        Entry [i, j, s, k] is the stage of layers i..j inclusive on submesh s under its
        k-th logical mesh; K is the largest number of views of any submesh (missing views
        are infeasible). The same numbers as ``stage_cost``, from one pass over the layers
        per view with every start layer at once (``IntraOpPass.stage_tables``). ``memory``
        is the device memory that decides between a stage's fastest and memory-lean
        layouts (default the cluster's); ``across_hosts`` as in ``send_seconds``. The work
        of each submesh is kept per memory, so tables that differ only in their sends or
        in which submeshes they list cost one pass per submesh.
        """
        work, params, acts = self._work_tables(tuple(submeshes), memory)
        L = self.num_layers
        send = np.array([self.send_seconds(stop, across_hosts) for stop in range(1, L + 1)])
        if self.training is not None and self.training.schedule == GPIPE:
            # GPipe keeps every microbatch in flight on every stage: held, whatever the count
            params, acts = params + acts * self.microbatches, np.zeros_like(acts)
        return work + send[None, :, None, None], params, acts

    def _work_tables(self, submeshes: tuple[tuple[int, int], ...], memory: float | None):
        """``tables`` without the sends (seconds of each stage's own work), assembled from
        one table per submesh: a region asks for its own submeshes only, and never pays for
        the larger ones it cannot hold."""
        if self.intra_op is not None:   # the fastest layouts' ILPs of every new view, solved side by side
            self.intra_op.prefetch([(submesh, logical) for submesh in submeshes
                                    if submesh != (1, 1) and (submesh, memory) not in self._work_cache
                                    for logical in logical_meshes(submesh)])
        parts = [self._submesh_work(submesh, memory) for submesh in submeshes]
        L = self.num_layers
        shape = (L, L, len(submeshes), max(part[0].shape[2] for part in parts))
        tables = tuple(np.full(shape, np.inf) for _ in range(3))
        for s, part in enumerate(parts):
            for table, values in zip(tables, part):
                table[:, :, s, :values.shape[2]] = values
        return tables

    def _submesh_work(self, submesh: tuple[int, int], memory: float | None):
        """(L, L, K) seconds, parameter bytes and activation bytes of every stage on
        ``submesh`` under each of its K logical meshes, kept per memory."""
        key = (submesh, memory)
        cache = self._work_cache
        if key in cache:
            return cache[key]
        L = self.num_layers
        views = logical_meshes(submesh)
        seconds, params, acts = (np.full((L, L, len(views)), np.inf) for _ in range(3))
        activations, state, feasible = self._range_facts()
        recomputed = self._range_recomputed()
        devices = submesh[0] * submesh[1]
        for k, logical in enumerate(views):
            if submesh == (1, 1):
                work = self._seconds_prefix[None, 1:] - self._seconds_prefix[:L, None]
                seconds[:, :, k] = np.where(feasible, work, np.inf)
                params[:, :, k] = np.where(feasible, self._range_param_bytes() + state + recomputed, np.inf)
                acts[:, :, k] = np.where(feasible, activations, np.inf)
                continue
            if self.intra_op is None:
                continue
            secs, weights = self.intra_op.stage_tables(submesh, logical, memory)
            seconds[:, :, k] = np.where(feasible, secs, np.inf)
            # state counted in the layout it is made in
            params[:, :, k] = np.where(feasible, weights + recomputed / devices, np.inf)
            acts[:, :, k] = np.where(feasible, activations / devices, np.inf)
        cache[key] = (seconds, params, acts)
        return cache[key]

    def _range_facts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[i, j] over the ranges of layers i..j: activation bytes on one device (the
        largest layer peak and what enters), state made, and whether a stage may hold the
        range (all of a state's readers and makers or none)."""
        if self._facts is None:
            L = self.num_layers
            peak = np.full((L, L), -np.inf)                     # [i, j]: largest layer peak of i..j
            for i in range(L):
                peak[i, i:] = np.maximum.accumulate(self._layer_peak[i:])
            activations = peak + self._cut_peak[:L, None]       # + what enters the stage
            if self.training is not None:                      # every activation kept for the backward
                activations = self._kept_prefix[None, 1:] - self._kept_prefix[:L, None] + self._cut_peak[:L, None]
            state = self._state_prefix[None, 1:] - self._state_prefix[:L, None]
            feasible = np.triu(np.ones((L, L), dtype=bool))
            first, last = np.arange(L)[:, None], np.arange(L)[None, :]
            for lo, hi in self._state_spans:
                feasible &= ~((first <= hi) & (last >= lo) & ~((first <= lo) & (last >= hi)))
            self._facts = (activations, state, feasible)
        return self._facts

    def _range_recomputed(self) -> np.ndarray:
        """[i, j]: the most activation bytes one of layers i..j makes for its backward, held
        once by a stage that recomputes them (zeros where nothing is recomputed)."""
        L = self.num_layers
        out = np.zeros((L, L))
        for i in range(L):
            out[i, i:] = np.maximum.accumulate(self._recomputed[i:])
        return out

    def _range_param_bytes(self) -> np.ndarray:
        """[i, j]: ``param_bytes(i, j + 1)`` for every range (each weight counted once)."""
        L = self.num_layers
        out = np.zeros((L, L))
        for i in range(L):
            used = (self._param_uses[:, i + 1:] - self._param_uses[:, i:i + 1]) > 0     # (params, j)
            out[i, i:] = self._param_sizes @ used
        return out
