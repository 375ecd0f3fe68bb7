"""Pipeline stages of a training plan: where the forward graph is cut, what each stage costs
and holds.

The forward model's operators are clustered into layers (``model.layers.cluster_layers``:
balanced cost, little traffic across their boundaries) and the layers cut into S contiguous
stages, stage i on R_i devices, each a data-parallel replica of it. A stage's time t_i is
its layers' forward and backward for one microbatch over its replicas, the backward taken
as twice the forward (the rule Alpa's and Megatron-LM's cost models use). B microbatches
take Alpa's

    T = Σ t_i + (B − 1) · max t_j

and where every stage has as many devices Σ t_i is the whole step's work over them wherever
the cuts fall, so the best cut is the one whose slowest stage is fastest; among the cuts
within 1 % of it, the one with the fewest bytes crossing. Where the stages' devices are
chosen with the cut (``_cut_over_devices``), the fastest slowest stage, then among those
within 1 % the least Σ t_i, then the fewest bytes.

A stage holds its weights, their accumulated gradients and the optimizer's slots, the
activations of the microbatches it keeps in flight (1F1B: stage i of S keeps S − i; GPipe:
all B) and its process; ``stage_memory`` adds them up, and a stage that does not fit its
device is refused with what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from meshplan.errors import PlanError
from meshplan.inter.step_memory import PROCESS_BYTES
from meshplan.model.graph import Graph
from meshplan.model.in_place import written_in_place
from meshplan.model.layers import cluster_layers
from meshplan.replica_shards import held_bytes
from meshplan.stage_ranks import per_stage
from meshplan.training.optimizers import GRAD_ACC, UPDATED
from meshplan.training.pipeline_step import GPIPE, NORM, UPDATE_PHASE, PipelineStep, kept_apart
from meshplan.training.step_model import BACKWARD, FORWARD

BACKWARD_FACTOR = 2.0      # a layer's backward, in forwards
NEAR_BEST = 1.01           # cuts this close to the fastest slowest stage count as equal


@dataclass
class TrainingCut:
    forward_stage: dict[str, int]      # forward node → its stage
    layers: list[list[int]]            # each stage's [first layer, last + 1]
    seconds: list[float]               # each stage's forward and backward of one microbatch
    cut_bytes: list[int]               # bytes the forward sends across each cut
    replicas: list[int] = field(default_factory=list)   # each stage's data-parallel replicas

    def step_seconds(self, microbatches: int) -> float:
        """Alpa's T for ``microbatches`` microbatches."""
        return sum(self.seconds) + (microbatches - 1) * max(self.seconds)


def cut_stages(graph: Graph, node_seconds: list[float], stages: int, num_layers: int | None = None,
               replicas: list[list[int]] | None = None, devices: int = 0) -> TrainingCut:
    """The cut of ``graph`` (the forward model at one microbatch's dims) into ``stages``;
    ``node_seconds``: each node's forward seconds. ``replicas``: the replica counts each
    stage may have (one each: one device a stage), ``devices`` the count they add up to;
    the cut's ``replicas`` are those chosen and its ``seconds`` a replica's."""
    n = len(graph.nodes)
    layering = cluster_layers(graph, node_seconds, num_layers or max(4 * stages, min(32, n)))
    L = layering.num_layers
    if L < stages:
        raise PlanError(f"the model clusters into {L} layer(s): it cannot be cut into {stages} stages",
                        hint=f"ask for at most {L} stages")
    bounds = layering.bounds
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(node_seconds, dtype=np.float64))]) * (1 + BACKWARD_FACTOR)
    layer_seconds = [float(prefix[b] - prefix[a]) for a, b in zip(bounds[:-1], bounds[1:])]
    crossing = [int(layering.cut_bytes[b]) for b in bounds]     # before layer k (k = 0..L)
    choices = replicas or [[1]] * stages
    if all(len(c) == 1 for c in choices) and len({c[0] for c in choices}) == 1:   # every stage alike
        edges, chosen = _cut(layer_seconds, crossing, stages), [choices[0][0]] * stages
    else:
        edges, chosen = _cut_over_devices(layer_seconds, crossing, choices, devices or sum(c[0] for c in choices))
    owner = layering.layer_of_node()
    layer_stage = np.empty(L, dtype=np.int64)
    for stage, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        layer_stage[a:b] = stage
    forward_stage = {node.name: int(layer_stage[owner[i]]) for i, node in enumerate(graph.nodes)}
    return TrainingCut(forward_stage, [[a, b] for a, b in zip(edges[:-1], edges[1:])],
                       [sum(layer_seconds[a:b]) / r for a, b, r in zip(edges[:-1], edges[1:], chosen)],
                       [crossing[e] for e in edges[1:-1]], chosen)


def _cut(seconds: list[float], crossing: list[int], stages: int) -> list[int]:
    """Layer indices [0, c1, ..., L]: the fastest slowest stage, then the fewest bytes."""
    L = len(seconds)
    prefix = np.concatenate([[0.0], np.cumsum(seconds)])
    inf = float("inf")
    # slowest[s][l]: the least slowest stage of the first l layers in s stages
    slowest = [[inf] * (L + 1) for _ in range(stages + 1)]
    slowest[0][0] = 0.0
    for s in range(1, stages + 1):
        for l in range(s, L + 1):
            slowest[s][l] = min(max(slowest[s - 1][k], prefix[l] - prefix[k]) for k in range(s - 1, l))
    cap = slowest[stages][L] * NEAR_BEST + 1e-15
    # fewest bytes across the cuts with every stage within cap
    cost = [[inf] * (L + 1) for _ in range(stages + 1)]
    back = [[-1] * (L + 1) for _ in range(stages + 1)]
    cost[0][0] = 0.0
    for s in range(1, stages + 1):
        for l in range(s, L + 1):
            for k in range(s - 1, l):
                if cost[s - 1][k] == inf or prefix[l] - prefix[k] > cap:
                    continue
                found = cost[s - 1][k] + (crossing[k] if k else 0)
                if found < cost[s][l]:
                    cost[s][l], back[s][l] = found, k
    edges, l = [L], L
    for s in range(stages, 0, -1):
        l = back[s][l]
        edges.append(l)
    return edges[::-1]


def _cut_over_devices(seconds: list[float], crossing: list[int], choices: list[list[int]],
                      devices: int) -> tuple[list[int], list[int]]:
    """Layer indices [0, c1, ..., L] and each stage's replicas (one of its ``choices``,
    adding up to ``devices``): a stage's time is its layers' over its replicas; the fastest
    slowest stage, then among those within 1 % of it the least sum of the stages' times (the
    rest of Alpa's T), then the fewest bytes across the cuts."""
    L, S = len(seconds), len(choices)
    prefix = np.concatenate([[0.0], np.cumsum(seconds)])
    scale = float(prefix[-1]) or 1.0

    def steps(s: int, k: int, d: int):
        """Stage s's (end layer, replicas, time) after k layers and d devices."""
        for r in choices[s]:
            if d + r > devices or (s == S - 1 and d + r != devices):
                continue
            for l in ([L] if s == S - 1 else range(k + 1, L - (S - s - 1) + 1)):
                yield l, r, float(prefix[l] - prefix[k]) / r

    slowest = {(0, 0): 0.0}     # (layers, devices) after s stages → the least slowest stage
    for s in range(S):
        found: dict[tuple[int, int], float] = {}
        for (k, d), worst in slowest.items():
            for l, r, t in steps(s, k, d):
                value = max(worst, t)
                if value < found.get((l, d + r), float("inf")):
                    found[(l, d + r)] = value
        slowest = found
    if (L, devices) not in slowest:
        raise PlanError(f"no way to give {S} stages {devices} devices as replicas of each (choices "
                        f"{choices}) over {L} layer(s)", hint="another number of stages or --stage-devices")
    cap = slowest[(L, devices)] * NEAR_BEST + 1e-15
    best = {(0, 0): ((0.0, 0), [0], [])}    # → ((sum of times, bytes), edges, replicas)
    for s in range(S):
        found = {}
        for (k, d), ((total, sent), edges, chosen) in best.items():
            for l, r, t in steps(s, k, d):
                if t > cap:
                    continue
                key = (round(total + t / scale, 9), sent + (crossing[k] if k else 0))
                if (l, d + r) not in found or key < found[(l, d + r)][0]:
                    found[(l, d + r)] = (key, edges + [l], chosen + [r])
        best = found
    _, edges, chosen = best[(L, devices)]
    return edges, chosen


def in_flight(stage: int, stages: int, microbatches: int, kind: str) -> int:
    """The microbatches stage ``stage`` holds activations of at once."""
    return microbatches if kind == GPIPE else min(stages - stage, microbatches)


def stage_memory(pipeline: PipelineStep, graph: Graph, microbatches: int, kind: str,
                 replicas=1) -> list[dict[str, float]]:
    """Each stage's bytes by kind: ``weights``, ``gradients`` (accumulated), ``optimizer``
    (the slots: a replica's row blocks of them where ``pipeline.sharded``), ``activations``
    (what its backward reads of one microbatch's forward, times the microbatches in flight;
    sizes from ``graph``, the forward model at one microbatch's dims; a replica holds its
    1/``replicas`` of each: one count, or one a stage), ``working`` (the more of: while a
    backward runs, the gradients of one microbatch's activations and weights, and the new
    accumulated gradients not written in place; while the update runs, what the norm made and
    the largest group of the update's new values not written in place: ``_in_place``) and
    ``process``, on each of its devices."""
    manifest = pipeline.step.manifest
    slots = [s for s in manifest["slots"] if s != GRAD_ACC]
    found = []
    counts = per_stage(replicas, pipeline.stages)
    for stage in range(pipeline.stages):
        replicas = counts[stage]
        held = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0, "working": 0.0,
                "process": float(PROCESS_BYTES)}
        for name, info in manifest["weights"].items():
            if pipeline.home.get(name) != stage:
                continue
            size = float(np.prod(info["shape"], dtype=np.int64)) * np.dtype(info["dtype"]).itemsize
            held["weights"] += size
            held["gradients"] += size
            # with the update in row blocks (ZeRO-1), the replica that holds most: replica 0
            own = held_bytes(info["shape"], np.dtype(info["dtype"]).itemsize, replicas) if pipeline.sharded else size
            held["optimizer"] += own * len(slots)
        backward = pipeline.parts.get((stage, BACKWARD))
        forward = pipeline.parts.get((stage, FORWARD))
        if backward is not None and forward is not None:
            kept = set(backward.inputs) & (set(forward.outputs) | set(forward.inputs))
            one = sum(graph.tensors[n].nbytes for n in kept if n in graph.tensors and not graph.tensors[n].is_param)
            held["activations"] = float(one * in_flight(stage, pipeline.stages, microbatches, kind)) / replicas
            # a backward's gradients of one microbatch's activations (and what it computes again)
            again = sum(graph.tensors[n].nbytes for n in pipeline.recomputed.get(stage, ())
                        if n in graph.tensors and not graph.tensors[n].is_param)
            # and the microbatch's gradients of the weights, before they are added into the
            # accumulated ones; and the new accumulated gradients not written over the old
            written = _in_place(pipeline, stage, replicas, BACKWARD)
            beside = sum(_output_bytes(backward, 1, ()).get(n, 0.0) for n in backward.outputs
                         if n.endswith(UPDATED) and n not in written)
            held["working"] = float(one + 2 * again) / replicas + held["gradients"] + beside
        # once a step: the tensors its norm makes and a group of its update's new values
        held["working"] = max(held["working"], _update_bytes(pipeline, stage, replicas))
        found.append(held)
    return found


def _update_bytes(pipeline: PipelineStep, stage: int, replicas: int) -> float:
    """The most bytes stage ``stage``'s norm and update make and hold at once: what the norm
    makes (the mean gradients, their squares) and the largest group's new weights and slots
    of the update, which runs group by group (``pipeline.chunks``); a replica's share of
    them where it updates in row blocks."""
    total = 0.0
    for phase in (NORM, UPDATE_PHASE):
        part = pipeline.parts.get((stage, phase))
        if part is None or not isinstance(part.model, onnx.ModelProto):
            continue
        written = _in_place(pipeline, stage, replicas, phase)
        made = {n: b for n, b in _output_bytes(part, replicas, pipeline.sharded).items() if n not in written}
        groups = pipeline.chunks.get(stage) if phase == UPDATE_PHASE else None
        total += max(sum(made.get(n, 0.0) for n in group) for group in groups) if groups else sum(made.values())
    return total


def _output_bytes(part, replicas: int, sharded) -> dict[str, float]:
    """The bytes of each output of ``part`` of a known shape (a replica's row blocks of those
    in ``sharded``)."""
    made = {}
    if not isinstance(part.model, onnx.ModelProto):
        return made
    for value in part.model.graph.output:
        kind = value.type.tensor_type
        shape = [d.dim_value for d in kind.shape.dim]
        if not shape or not all(shape):
            continue
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type)).itemsize
        made[value.name] = held_bytes(shape, itemsize, replicas if value.name in sharded else 1)
    return made


def _in_place(pipeline: PipelineStep, stage: int, replicas: int, phase: str) -> set[str]:
    """The outputs of stage ``stage``'s ``phase`` that a job writes into the buffers of the
    state they replace (``runtime.pipeline_stage``): not a state another stage borrows, nor a
    weight its replicas update in row blocks and gather whole again."""
    part = pipeline.parts.get((stage, phase))
    if part is None or not isinstance(part.model, onnx.ModelProto):
        return set()
    parts = {p: other for (s, p), other in pipeline.parts.items() if s == stage}
    apart = kept_apart(stage, parts, pipeline.crossings, pipeline.sharded, replicas)
    writable = {n for n, s in pipeline.home.items() if s == stage and n not in apart}
    groups = pipeline.chunks.get(stage) if phase == UPDATE_PHASE else None
    groups = groups if groups and len(groups) > 1 else [list(part.outputs)]
    return {o for pairs in written_in_place(part.model.graph, groups, writable) for o in pairs}


def check_fits(memory: list[dict[str, float]], device_bytes: float) -> None:
    """Refuse a stage that does not fit its device, with what it needs."""
    for stage, held in enumerate(memory):
        total = sum(held.values())
        if total > device_bytes:
            parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in held.items())
            raise PlanError(f"stage {stage} needs {total / 2**30:.2f} GiB ({parts}), more than its device's "
                            f"{device_bytes / 2**30:.2f} GiB",
                            hint="more stages, more microbatches, or --schedule 1f1b")
