"""Which devices each stage of a pipelined training plan has (``meshplan plan --train
--stages S``), checked before anything is planned: the mesh's devices over the stages, given
by ``--stage-devices``, or chosen by the cut among the counts that split a microbatch; with
``--tensor-parallel T`` groups of T that share a host, or one T a stage (``--tensor-parallel
2,1``: R replicas of each, the mesh's devices over the sum of the T). One ``PlanError`` line
where the mesh, the model or the batch does not allow them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.cost.cluster import Cluster
from meshplan.errors import PlanError
from meshplan.inter.pipeline import PlanOptions
from meshplan.stage_ranks import StageRanks
from meshplan.training.pipeline_step import SCHEDULES
from meshplan.training.step_model import TrainSpec, build_step_model


def checked_step(model_path: Path, cluster: Cluster, dims: dict, options: PlanOptions, spec: TrainSpec,
                 microbatches: int, stages: int):
    """The step model for ``stages`` stages and the replica counts each stage may have (one
    each where they are given: the mesh's devices over the stages, or ``--stage-devices``;
    else every count that splits a microbatch, the cut choosing: ``cut_stages``);
    ``PlanError`` where the mesh, the model or the batch does not allow them."""
    if options.schedule not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {options.schedule!r} (choose from {', '.join(SCHEDULES)})")
    N, tensor, given = cluster.num_devices, options.tensor_parallel, options.stage_devices
    if options.stage_tensors:
        return _checked_mixed(model_path, cluster, dims, options, spec, microbatches, stages)
    if given is not None:
        if len(given) != stages or sum(given) != N or min(given) < 1:
            raise PlanError(f"--stage-devices {','.join(map(str, given))} does not give each of the {stages} stages "
                            f"devices adding up to the mesh's {N}", hint=f"{stages} counts that add up to {N}")
    elif N % stages and tensor > 1:
        raise PlanError(f"--stages {stages} does not divide the mesh's {N} devices: with --tensor-parallel each "
                        "stage has the same number of devices", hint=f"a number of stages that divides {N}")
    elif N < stages:
        raise PlanError(f"--stages {stages} needs at least {stages} devices, the mesh has {N}",
                        hint=f"at most {N} stages")
    if tensor > 1 and (N // stages) % tensor:
        raise PlanError(f"--tensor-parallel {tensor} does not divide a stage's {N // stages} "
                        f"device(s) ({N} over {stages} stages)",
                        hint=f"a divisor of {N // stages}")
    if tensor > 1 and (tensor > cluster.devices_per_host or cluster.devices_per_host % tensor):
        raise PlanError(f"--tensor-parallel {tensor} does not divide a host's {cluster.devices_per_host} device(s): "
                        "the devices that shard a stage's operators are on one host",
                        hint=f"a divisor of {cluster.devices_per_host}")
    step = build_step_model(model_path, replace(spec, stages=stages, microbatches=microbatches))
    size = microbatch_size(step, dims)
    equal = N // stages // tensor
    if given is not None:
        choices = [[d // tensor] for d in given]
    elif N % stages == 0 and (tensor > 1 or size % equal == 0):
        choices = [[equal]] * stages
    else:   # the cut gives each stage its devices: counts that split a microbatch
        allowed = [r for r in range(1, N - stages + 2) if size % r == 0]
        if not adds_up(allowed, stages, N):
            each = f"the {equal} replicas of each stage" if N % stages == 0 else \
                f"{stages} stages of {N} devices in any counts"
            raise PlanError(f"a microbatch of {size} sample(s) does not split over {each}",
                            hint="a batch that does, or more stages")
        choices = [allowed] * stages
    most = max(max(c) for c in choices)
    if most > 1 and step.manifest.get("statistics"):
        raise PlanError("a model with running statistics (batch normalization in training mode) trains in a pipeline "
                        f"of one device a stage only: --stages {stages} on {N} devices makes "
                        f"{most} replicas of a stage", hint=f"--stages {N}")
    for stage, allowed in enumerate(choices):
        if len(allowed) == 1 and size % allowed[0]:
            which = "each stage" if len(set(map(tuple, choices))) == 1 else f"stage {stage}"
            raise PlanError(f"a microbatch of {size} sample(s) does not split over the {allowed[0]} replicas of "
                            f"{which}", hint="a batch that does, or more stages")
    return step, choices


def _checked_mixed(model_path: Path, cluster: Cluster, dims: dict, options: PlanOptions, spec: TrainSpec,
                   microbatches: int, stages: int):
    """``checked_step`` where each stage has its own T (``--tensor-parallel T0,T1,...``): R
    replicas of each stage, the mesh's devices over the sum of the T; or, with
    ``--stage-devices D0,D1,...``, D_s / T_s replicas of stage s."""
    tensors, N, devices = list(options.stage_tensors), cluster.num_devices, options.stage_devices
    given = ",".join(map(str, tensors))
    if len(tensors) != stages:
        raise PlanError(f"--tensor-parallel {given} gives {len(tensors)} stages their T, not {stages}")
    if devices is not None:
        if len(devices) != stages or sum(devices) != N or any(d % t for d, t in zip(devices, tensors)):
            raise PlanError(f"--stage-devices {','.join(map(str, devices))} does not give each of the {stages} stages "
                            f"a multiple of its T ({given}), adding up to the mesh's {N}",
                            hint=f"{stages} multiples of {given} that add up to {N}")
        replicas = [d // t for d, t in zip(devices, tensors)]
    elif N % sum(tensors):
        raise PlanError(f"--tensor-parallel {given} needs a multiple of {sum(tensors)} devices (each stage's T, "
                        f"as many replicas of each), the mesh has {N}", hint=f"a mesh of {sum(tensors)} devices, "
                        "or --stage-devices")
    else:
        replicas = [N // sum(tensors)] * stages
    ranks = StageRanks.of(replicas, stages, tensors)
    for s in range(stages):
        for r in range(replicas[s]):
            group = [ranks.rank(s, r, j) for j in range(tensors[s])]
            if cluster.host_of(group[0]) != cluster.host_of(group[-1]):
                raise PlanError(f"--tensor-parallel {given}: stage {s}'s devices {group[0]}-{group[-1]} that shard its "
                                "operators would span two hosts (they share a host)",
                                hint="another order of the stages' T, or hosts of more devices")
    step = build_step_model(model_path, replace(spec, stages=stages, microbatches=microbatches))
    size = microbatch_size(step, dims)
    for s, R in enumerate(replicas):
        if size % R:
            raise PlanError(f"a microbatch of {size} sample(s) does not split over the {R} replicas of stage {s}",
                            hint="a batch that does, or other --stage-devices")
    if max(replicas) > 1 and step.manifest.get("statistics"):
        raise PlanError("a model with running statistics (batch normalization in training mode) trains in a pipeline "
                        f"of one replica a stage only, not {max(replicas)}", hint=f"a mesh of {sum(tensors)} devices")
    return step, [[R] for R in replicas]


def adds_up(counts: list[int], stages: int, total: int) -> bool:
    """Whether ``stages`` of ``counts`` (each may repeat) add up to ``total``."""
    reach = {0}
    for _ in range(stages):
        reach = {r + c for r in reach for c in counts if r + c <= total}
    return total in reach


def leading_dim(step):
    """The leading dim of the model's first data input (its batch), or None."""
    graph = step.model.graph
    initializers = {t.name for t in graph.initializer}
    first = next((v for v in graph.input if v.name not in initializers), None)
    return first.type.tensor_type.shape.dim[0] if first is not None and first.type.tensor_type.shape.dim else None


def microbatch_size(step, dims: dict) -> int:
    """The samples of one microbatch: the leading dim of the model's first data input."""
    dim = leading_dim(step)
    if dim is None:
        return 1
    return int(dim.dim_value) if dim.HasField("dim_value") else int(dims.get(dim.dim_param, 1))


def replica_dims(step, dims: dict, replicas: int) -> dict:
    """One replica's dims of a microbatch: the leading dim of the data inputs 1/R."""
    dim = leading_dim(step)
    if replicas == 1 or dim is None or not dim.dim_param or dim.dim_param not in dims:
        return dict(dims)
    return {**dims, dim.dim_param: int(dims[dim.dim_param]) // replicas}


__all__ = ["adds_up", "checked_step", "leading_dim", "microbatch_size", "replica_dims"]
