"""``profile_model``: from a model file to a Profile, alone or as one rank of an MPI job.

Alone: canonicalise the model for each set of dims, collect its distinct operator
signatures, look them up in the cache, time what is missing, and take the communication
figures from the cluster description.

Under mpiexec (every rank calls ``profile_model``): rank 0 does the collection and the
cache look-up and hands out the missing signatures; the ranks that have cores of their
own (``cpu_count // threads`` per host on CPU, one per GPU with CUDA) time their share
while the others sleep; rank 0 gathers the timings, then every rank takes part in
timing the collectives along each mesh axis. Rank 0 returns the result, the others None.
Payloads between ranks are JSON bytes in numpy buffers, never pickles.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.cost.cluster import Cluster
from meshplan.cost.analytic import CostModel
from meshplan.errors import MeshplanError
from meshplan.model.graph import build_graph
from meshplan.model.load import canonicalize
from meshplan.profile.cache import OpKey, ProfileCache
from meshplan.profile.comm import (
    COLLECTIVES, LINK, MIB, CommFit, CommMeasurer, axis_group_sizes, cluster_fits, message_sizes,
    mpi_library_version, yield_barrier,
)
from meshplan.mpi_support import cuda_aware, load_mpi
from meshplan.rank_layout import RankLayout, gather_layout, launch_advice, layout_mismatch
from meshplan.profile.document import OpEntry, Profile
from meshplan.profile.errors import FailedElsewhere, ProfileError
from meshplan.profile.signatures import Collected, TimingSpec, Variants, collect_signatures, signature_of
from meshplan.profile.timing import (CUDA, TIMING_METHOD, OpTimer, TimingConfig, default_threads, gpu_names, hardware_name,
                                     ort_version, resolve_provider, time_whole_model)

Progress = Callable[[str, int, int], None]     # (phase, done, total); phases "operators", "communication"

_MPI_ENV = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class ProfileOptions:
    provider: str = "auto"
    threads: int | None = None              # default: the host's cores divided among its ranks
    cache_path: str | os.PathLike | None = None   # default: cache.default_cache_path()
    refresh: bool = False                   # re-time everything (and overwrite the cache)
    timing: TimingConfig = TimingConfig()
    comm_max_bytes: int | None = None       # default: 64 MiB with CUDA, 4 MiB on CPU
    comm_budget_seconds: float = 0.03
    variants: Variants | None = None        # extra input shapes per node (sharded shapes)
    training: bool = False                  # the model is a training step: run whole as a job runs one


@dataclass
class ProfileRun:
    profile: Profile
    cache_path: Path
    cache_moved_aside: Path | None
    measured: int
    cached: int
    failed: int
    seconds: float
    extra: dict = field(default_factory=dict)


def launched_by_mpi() -> bool:
    return any(name in os.environ for name in _MPI_ENV)


def _mpi():
    MPI = load_mpi()

    return MPI


# --- byte payloads between ranks ------------------------------------------------------

def _bcast_json(MPI, comm, value=None):
    if comm.rank == 0:
        data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
        length = np.array([len(data)], dtype=np.int64)
    else:
        length = np.zeros(1, dtype=np.int64)
    _sleep_wait(comm.Ibcast(length, root=0))
    if comm.rank != 0:
        data = np.empty(int(length[0]), dtype=np.uint8)
    _sleep_wait(comm.Ibcast(data, root=0))
    return json.loads(data.tobytes()) if comm.rank != 0 else value


def _gather_json(MPI, comm, value):
    payload = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    counts = np.zeros(comm.size, dtype=np.int64)
    comm.Allgather(np.array([len(payload)], dtype=np.int64), counts)
    if comm.rank == 0:
        received = np.empty(int(counts.sum()), dtype=np.uint8)
        comm.Gatherv(payload, [received, counts, MPI.BYTE], root=0)
        values, offset = [], 0
        for count in counts:
            values.append(json.loads(received[offset:offset + count].tobytes()))
            offset += count
        return values
    comm.Gatherv(payload, None, root=0)
    return None


def _sleep_wait(request) -> None:
    """Wait for a request while sleeping: idle ranks leave the cores to ranks that time operators."""
    pause = 2e-5
    while not request.Test():
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)


# --- the job ----------------------------------------------------------------------

@dataclass
class _Job:
    MPI: object = None
    world: object = None
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    hosts: int = 1                      # machines the ranks really run on
    layout: RankLayout | None = None


def _job(cluster: Cluster) -> _Job:
    if not launched_by_mpi():
        return _Job(local_size=cluster.devices_per_host)
    MPI = _mpi()
    world = MPI.COMM_WORLD
    layout = gather_layout(world, MPI)
    job = _Job(MPI, world, world.rank, world.size, layout.local_rank, layout.local_size, layout.machines, layout)
    if job.size == 1:
        job.local_size = cluster.devices_per_host
    return job


def profile_model(
    model_path: str | os.PathLike, dims_sets: list[tuple[str, dict[str, int]]], cluster: Cluster,
    options: ProfileOptions = ProfileOptions(), progress: Progress | None = None,
) -> ProfileRun | None:
    """Profile ``model_path`` for ``cluster``: returns the run on rank 0 (or alone), None on other ranks.

    ``dims_sets`` lists (label, dims) or (label, dims, rewrite): the first is the model as
    given (label "model"); more sets add the signatures of other shapes, e.g. the
    per-microbatch programs (a static batch's with the rewrite ``canonicalize`` applies).
    """
    started = time.perf_counter()
    job = _job(cluster)
    multi = job.size > 1
    error: MeshplanError | None = None
    payload: dict = {}
    state = None
    try:
        if multi and job.size != cluster.num_devices:
            raise ProfileError(
                f"the mesh {cluster.hosts}x{cluster.devices_per_host} needs {cluster.num_devices} ranks but the job has {job.size}",
                hint=f"start it as mpiexec -n {cluster.num_devices} meshplan profile ...",
            )
        mismatch = layout_mismatch(job.layout, cluster.hosts, cluster.devices_per_host) if multi else None
        if mismatch:
            raise ProfileError(mismatch, hint=launch_advice(cluster.devices_per_host))
        if job.rank == 0:
            state = _prepare(model_path, dims_sets, cluster, options, job)
            payload = state.payload
    except MeshplanError as exc:
        error = exc
    except Exception as exc:
        if not multi:
            raise
        error = exc         # re-raised below on rank 0, after the other ranks have been told
    if multi:
        # Agree on the outcome: rank 0's error reaches everyone; any rank's mesh error is the same everywhere.
        payload = _bcast_json(job.MPI, job.world, {"error": str(error) if error else None, **payload})
        if payload.get("error"):
            if job.rank == 0 and error is not None:
                raise error
            raise FailedElsewhere("profiling failed on rank 0")
    elif error is not None:
        raise error

    # --- operators: every worker times its share --------------------------------
    timed = _time_share(payload, job, options, progress, state)
    if multi:
        _sleep_wait(job.world.Ibarrier())
        gathered = _gather_json(job.MPI, job.world, timed)
        if job.rank == 0:
            timed = [item for part in gathered for item in part]
    op_seconds = time.perf_counter() - started

    # --- communication --------------------------------------------------------
    comm_started = time.perf_counter()
    fits: list[CommFit] = []
    if multi and payload["measure_comm"]:
        fits = _measure_comm(job, cluster, payload, options, progress)
    comm_seconds = time.perf_counter() - comm_started
    if job.rank != 0:
        return None
    return _finish(state, timed, fits, job, cluster, op_seconds, comm_seconds, time.perf_counter() - started)


# --- rank 0: collect and look up ------------------------------------------------------

@dataclass
class _State:
    found: dict[str, Collected]
    cache: ProfileCache
    key: OpKey
    model: dict
    cached: dict
    payload: dict
    comm_layout: str
    mpi_library: str
    comm_cached: list[dict]
    refresh: bool
    provider: str
    whole: dict             # the last dims set's model run whole (``time_whole_model``) and its nodes' signatures


def _prepare(model_path, dims_sets, cluster: Cluster, options: ProfileOptions, job: _Job) -> _State:
    provider = resolve_provider(options.provider)
    threads = options.threads or default_threads(job.local_size)
    estimate = CostModel(cluster).node_seconds
    found: dict[str, Collected] = {}
    sha = None
    program_dims = []
    whole: dict = {}
    with tempfile.TemporaryDirectory(prefix="meshplan-profile-") as tmp:
        for index, (label, dims, *rewrite) in enumerate(dims_sets):
            work = Path(tmp) / f"set{index}"
            work.mkdir()
            canonical = canonicalize(model_path, dims, work, *rewrite)
            sha = canonical.source_sha256
            graph = build_graph(canonical.model)
            collect_signatures(graph, canonical.model, canonical.path.parent, label=label,
                               variants=options.variants, into=found, estimate=estimate)
            program_dims.append({"label": label, "dims": dict(dims), "nodes": len(graph.nodes)})
            if index == len(dims_sets) - 1:   # the programs' own shapes: run whole, for the composition
                whole = {"label": label, "nodes": _node_keys(graph, estimate),
                         **time_whole_model(canonical.model, canonical.path, provider, threads, graph.param_bytes,
                                            job.local_rank, options.training)}
    cache = ProfileCache(options.cache_path)
    key = OpKey(hardware_name(provider, job.local_rank), provider, ort_version(), threads, TIMING_METHOD)
    cached = {} if options.refresh else cache.get_ops(key, list(found))
    missing = [k for k in found if k not in cached]
    workers = _workers(job, provider, threads)
    assign = _assign(missing, found, workers)
    sizes = message_sizes(options.comm_max_bytes or (64 * MIB if provider == CUDA else 4 * MIB))
    comm_cached, layout, library = [], "", ""
    measure_comm = False
    if job.size > 1:
        library = mpi_library_version(job.MPI)
        layout = (f"mesh={cluster.hosts}x{cluster.devices_per_host} ranks={job.size} hosts={job.hosts} "
                  f"sizes={sizes[0]}-{sizes[-1]} buffers=host")
        comm_cached = [] if options.refresh else cache.get_comm(key.hardware, library, layout)
        wanted = {(axis, g) for axis, groups in axis_group_sizes(cluster.mesh).items() for g in groups}
        have = {(f["axis"], f["group_size"]) for f in comm_cached if f["collective"] in COLLECTIVES}
        links = {f["axis"] for f in comm_cached if f["collective"] == LINK}
        measure_comm = (bool(wanted - have) or len(comm_cached) < len(wanted) * len(COLLECTIVES)
                        or links != {axis for axis, _ in wanted})
    payload = {
        "provider": provider, "threads": threads,
        "items": [found[k].spec.to_dict() for k in missing], "keys": missing, "assign": assign,
        "measure_comm": measure_comm, "sizes": sizes,
    }
    model = {"path": str(Path(model_path).resolve()), "sha256": sha, "dims": dict(dims_sets[0][1]),
             "program_dims": program_dims}
    return _State(found, cache, key, model, cached, payload, layout, library, comm_cached, options.refresh, provider,
                  whole)


def _node_keys(graph, estimate) -> dict:
    """{signature key: how many of the graph's nodes have it}, and under "" the analytic
    seconds of the nodes without a signature."""
    counts: dict = {"": 0.0}
    for node in graph.nodes:
        signature = signature_of(node, graph)
        if signature is None:
            counts[""] += estimate(node, graph)
        else:
            counts[signature.key] = counts.get(signature.key, 0) + 1
    return counts


def _composition(whole: dict, operators: dict, found: dict) -> dict:
    """The whole model's seconds against the sum of its operators' (``time_whole_model``):
    {"factor", "whole_seconds", "operators_seconds", "label"}, or {"skipped": why}."""
    if "seconds" not in whole:
        return {"skipped": whole.get("skipped", "not run")}
    total = whole["nodes"].get("", 0.0)
    for key, count in whole["nodes"].items():
        if key:
            seconds = operators[key].seconds if key in operators else None
            total += count * (seconds if seconds is not None else found[key].estimate)
    if total <= 0:
        return {"skipped": "its operators took no time"}
    return {"factor": whole["seconds"] / total, "whole_seconds": whole["seconds"], "operators_seconds": total,
            "label": whole["label"]}


def _workers(job: _Job, provider: str, threads: int) -> list[int]:
    """Ranks that time operators: those with cores (or a GPU) of their own on their host."""
    if job.size == 1:
        return [0]
    per_host = job.size // max(job.hosts, 1)
    if provider == CUDA:
        slots = max(1, len(gpu_names()))
    else:
        slots = max(1, (os.cpu_count() or 1) // threads)
    # Ranks are numbered host by host (mpiexec's default block placement).
    return [r for r in range(job.size) if r % max(per_host, 1) < slots]


def _assign(missing: list[str], found: dict[str, Collected], workers: list[int]) -> list[int]:
    """Longest-first to the least-loaded worker (the cost of timing grows with the operator's)."""
    load = {w: 0.0 for w in workers}
    assign = {}
    for key in sorted(missing, key=lambda k: -found[k].estimate):
        worker = min(workers, key=lambda w: (load[w], w))
        assign[key] = worker
        load[worker] += 0.05 + 7 * found[key].estimate
    return [assign[k] for k in missing]


# --- every rank: time a share ------------------------------------------------------

def _time_share(payload: dict, job: _Job, options: ProfileOptions, progress, state) -> list[dict]:
    mine = [i for i, worker in enumerate(payload["assign"]) if worker == job.rank]
    if not mine:
        return []
    provider = payload["provider"]
    device_id = job.local_rank % max(1, len(gpu_names())) if provider == CUDA else 0
    timer = OpTimer(provider, payload["threads"], options.timing, device_id)
    if state is not None:
        cache, key = state.cache, state.key
    else:
        cache = ProfileCache(options.cache_path, check=False)
        key = OpKey(hardware_name(provider, device_id), provider, ort_version(), payload["threads"], TIMING_METHOD)
    results = []
    try:
        if progress and job.rank == 0:
            progress("operators", 0, len(mine))
        for done, index in enumerate(mine, start=1):
            spec = TimingSpec.from_dict(payload["items"][index])
            measurement = timer.time(spec)
            signature = spec.signature
            cache.put_op(key, signature.key, signature.op_type, signature.text, measurement.seconds,
                         measurement.error, measurement.repeats, measurement.spread, measurement.copies)
            results.append({"key": payload["keys"][index], "seconds": measurement.seconds, "error": measurement.error,
                            "repeats": measurement.repeats, "spread": measurement.spread, "copies": measurement.copies})
            if progress and job.rank == 0:
                progress("operators", done, len(mine))
    finally:
        if state is None:
            cache.close()
    return results


def _measure_comm(job: _Job, cluster: Cluster, payload: dict, options: ProfileOptions, progress) -> list[CommFit]:
    measurer = CommMeasurer(job.MPI, job.world, cluster.mesh, options.comm_budget_seconds)
    groups = [(axis, g) for axis, sizes in axis_group_sizes(cluster.mesh).items() for g in sizes]
    sizes = payload["sizes"]
    axes = sorted({axis for axis, _ in groups})
    total = (len(groups) * len(COLLECTIVES) + len(axes)) * len(sizes)
    done = [0]

    def step():
        done[0] += 1
        if progress and job.rank == 0:
            progress("communication", done[0], total)

    fits = []
    yield_barrier(job.world)
    for axis, group_size in groups:
        fits.extend(measurer.measure(axis, group_size, sizes, COLLECTIVES, step))
    for axis in axes:
        fits.append(measurer.measure_link(axis, sizes, step))
    return fits


# --- rank 0: assemble --------------------------------------------------------------

def _finish(state: _State, timed: list[dict], fits: list[CommFit], job: _Job, cluster: Cluster,
            op_seconds: float, comm_seconds: float, total_seconds: float) -> ProfileRun:
    cache, key = state.cache, state.key
    new = {item["key"]: item for item in timed}
    measured = failed = cached = 0
    operators = {}
    for sig_key, entry in state.found.items():
        signature = entry.signature
        if sig_key in new:
            item = new[sig_key]
            if job.size > 1:   # other ranks wrote their own hosts' caches; keep rank 0's complete
                cache.put_op(key, sig_key, signature.op_type, signature.text, item["seconds"], item["error"],
                             item["repeats"], item["spread"], item["copies"])
            seconds, error = item["seconds"], item["error"]
            repeats, spread, copies = item["repeats"], item["spread"], item["copies"]
            source = "measured" if seconds is not None else "failed"
            measured += seconds is not None
        else:
            hit = state.cached[sig_key]
            seconds, error, repeats, spread, copies = hit.seconds, hit.error, hit.repeats, hit.spread, hit.copies
            source = "cache" if seconds is not None else "failed"
            cached += seconds is not None
        failed += seconds is None
        operators[sig_key] = OpEntry(
            key=sig_key, signature=signature.to_dict(), seconds=seconds, count=entry.count, source=source,
            sources=sorted(entry.sources), input_key=signature.input_key, repeats=repeats, spread=spread,
            copies=copies, error=error, nodes=list(entry.nodes),
        )
    if job.size > 1:
        if fits:
            cache.put_comm(key.hardware, state.mpi_library, state.comm_layout, [f.to_dict() for f in fits])
            source = "measured"
        else:
            fits = [CommFit(f["collective"], f["axis"], f["group_size"], f["latency"], f["bandwidth"], "measured",
                            f["points"], f["max_rel_error"]) for f in state.comm_cached]
            source = "cached"
        awareness = cuda_aware(job.MPI)
    else:
        fits = cluster_fits(cluster)
        source = "cluster"
        awareness = {"value": None, "method": "not measured: no MPI job"}
        if job.MPI is not None:
            awareness = cuda_aware(job.MPI)
    profile = Profile(
        model=state.model, mesh=[cluster.hosts, cluster.devices_per_host], device=cluster.device.name,
        hardware=key.hardware, provider=key.provider, onnxruntime=key.ort_version, threads=key.threads,
        ranks=job.size, operators=operators, communication=fits, communication_source=source,
        cuda_aware_mpi=awareness, composition=_composition(state.whole, operators, state.found),
        stats={
            "signatures": len(operators), "measured": measured, "cached": cached, "failed": failed,
            "operator_seconds": op_seconds, "communication_seconds": comm_seconds, "total_seconds": total_seconds,
            "workers": len(set(state.payload["assign"])) if state.payload["assign"] else 0,
            "physical_hosts": job.hosts, "message_sizes": state.payload["sizes"] if job.size > 1 else [],
            "comm_layout": state.comm_layout, "mpi_library": state.mpi_library,
        },
    )
    moved = state.cache.moved_aside
    path = state.cache.path
    state.cache.close()
    return ProfileRun(profile, path, moved, measured, cached, failed, total_seconds)
