"""``meshplan run`` under mpiexec, and what every driver of a job shares.

``run_rank`` is a driver of the resident job (``job.Job``): every rank loads its program
once, then rank 0 makes ``--repeat`` calls on one inputs file and writes the outputs once.
In each call a rank receives its stage's boundary tensors for every microbatch by
cross-mesh resharding, runs them in order (fill-drain), performs the collectives inside
its stage's mesh, and hands its outputs on — all through the job's ``transport``. This
module also holds the run's report, each rank's memory and threads, and the trace writer.

Failure handling: start-up checks (plan, rank count, files, inputs) run on every rank
and the ranks agree on the outcome with one Allreduce, so all of them exit 1 and the
lowest failing rank reports; a failure after that, whatever raised it, aborts the whole
job (``job.driving``).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.errors import RunError
from meshplan.plan_format import Plan
from meshplan.process_memory import peak_rss_bytes
from meshplan.providers import CPU
from meshplan.runtime.job import Job, driving
from meshplan.runtime.tensors import read_inputs, write_outputs
from meshplan.runtime.threads import ThreadChoice
from meshplan.runtime.transport import gather_rows, world


@dataclass
class RunReport:
    ranks: int
    provider: str
    transfer_path: str
    latencies: list[float]
    estimate_seconds: float
    batch_size: int
    trace_events: list[dict] = field(default_factory=list)
    peak_rss_bytes: list[int] = field(default_factory=list)   # per rank: the process's peak resident memory
    program_bytes: list[int] = field(default_factory=list)    # per rank: its program file and weights files
    idle_ranks: list[int] = field(default_factory=list)       # ranks the plan leaves idle (no program)
    threads: list = field(default_factory=list)               # per rank: its ThreadChoice (None: idle)
    memory_estimates: list = field(default_factory=list)      # per rank: the plan's estimate of its memory (bytes)
    # a plan made with ``meshplan plan --shared-host`` could differ: it counts a host's devices
    # as devices of their own and runs one microbatch at a time (``Cluster.costed``)
    shared_host_applies: bool = False

    def split_on_shared_cores(self) -> bool:
        """CPU ranks that work side by side on one machine under a plan that counts them as
        devices of their own, where ``meshplan plan --shared-host`` would plan for them."""
        return (self.provider == CPU and self.shared_host_applies
                and any(t is not None and t.working > 1 for t in self.threads))

    def memory_rows(self) -> list[dict]:
        """Per rank: its peak resident set (host memory) next to its program's bytes."""
        return [{"rank": rank, "peak_rss_bytes": rss, "program_bytes": held, "idle": rank in self.idle_ranks}
                for rank, (rss, held) in enumerate(zip(self.peak_rss_bytes, self.program_bytes))]

    @property
    def median_latency(self) -> float:
        return statistics.median(self.latencies)


def run_rank(plan_dir: str | Path, inputs_path: str | Path, output_path: str | Path | None,
             repeat: int = 1, provider: str = "auto", transfer: str = "auto") -> RunReport | None:
    """``meshplan run``: a driver of the resident job (``job.Job``) that makes ``repeat``
    calls on one inputs file and writes the outputs once. Rank 0 returns the report, the
    others None. State inputs in the file are set before every call (so each repetition is
    the same call); state outputs are gathered and written with the others."""
    plan_dir, inputs_path = Path(plan_dir), Path(inputs_path)
    output_path = Path(output_path) if output_path else None
    held: dict = {}

    def check(plan: Plan) -> None:
        if repeat < 1:
            raise RunError(f"--repeat must be at least 1, got {repeat}")
        held["inputs"] = read_inputs(inputs_path, plan)
        if output_path is not None:
            if output_path.suffix != ".npz":
                raise RunError(f"output file must end in .npz: {output_path}")
            if not output_path.parent.is_dir():
                raise RunError(f"output directory does not exist: {output_path.parent}")

    job = Job(plan_dir, provider, transfer, check=check)
    if not job.is_driver:
        job.serve()
        _gather_memory(job.plan, plan_dir, world()[1], job.threads)
        return None
    plan = job.plan
    inputs = held["inputs"]
    state_given = {n: v for n, v in inputs.items() if n in job.state_inputs}
    latencies, outputs = [], {}
    with driving(job, closed=lambda: _gather_memory(plan, plan_dir, world()[1], job.threads)):
        for _ in range(repeat):
            if state_given:
                job.set_state(state_given)
            started = time.perf_counter()
            outputs = job.run({n: v for n, v in inputs.items() if n not in job.state_inputs})
            latencies.append(time.perf_counter() - started)
        stats = job.stats()
        if job.state_inputs:
            kept = job.get_state()
            outputs.update({entry["output"]: kept[entry["input"]] for entry in plan.state if entry["input"] in kept})
        job.close()
    memory = _gather_memory(plan, plan_dir, world()[1], job.threads)
    if output_path is not None:
        write_outputs(output_path, {spec.name: outputs[spec.name] for spec in plan.outputs if spec.name in outputs})
    return RunReport(
        ranks=job.size, provider=job.provider, transfer_path=job.transfer_path,
        latencies=latencies, estimate_seconds=plan.estimate["latency_seconds"],
        batch_size=_batch_of(plan, inputs), trace_events=stats.trace,
        peak_rss_bytes=[int(m) for m in memory[:, 0]], program_bytes=[int(m) for m in memory[:, 1]],
        idle_ranks=plan.idle_ranks,
        threads=[ThreadChoice.from_row(row[2:]) if row[2] else None for row in memory],
        memory_estimates=[float(plan.stage_of_rank(r).memory_bytes) if plan.stage_of_rank(r) else 0.0
                          for r in range(job.size)],
        shared_host_applies=not plan.cluster.get("host_shares") and plan.microbatches == 1,
    )


def _batch_of(plan: Plan, inputs: dict) -> int:
    """The batch the call ran: the plan's, or in a ranged plan the size of its batch dim."""
    dim = plan.batch.get("dim")
    if plan.is_ranged and dim:
        for spec in plan.inputs:
            if dim in spec.shape and spec.name in inputs:
                return int(np.shape(inputs[spec.name])[spec.shape.index(dim)])
    return plan.batch["size"]


def _gather_memory(plan: Plan, plan_dir: Path, comm, threads=None) -> np.ndarray | None:
    """[peak RSS, program bytes, *its ThreadChoice.row() (zeros on an idle rank)] of every
    rank, on rank 0 (a [ranks, 2 + ThreadChoice.ROW] array; None elsewhere). Collective."""
    program = plan.program_of_rank(comm.rank)   # None on an idle rank
    held = 0 if program is None else sum((plan_dir / f).stat().st_size for f, _ in program.files)
    return gather_rows(comm, np.array([peak_rss_bytes(), held, *(threads.row() if threads is not None else [0] * ThreadChoice.ROW)]))


def write_trace(path: str | Path, events: list[dict], ranks: int, memory: list[dict] | None = None) -> None:
    """Chrome trace format (opens in Perfetto or chrome://tracing); one process per rank,
    its metadata also giving the rank's peak RSS and program bytes where ``memory`` has them
    (``RunReport.memory_rows``)."""
    from meshplan.files import atomic_write_bytes

    extra = {row["rank"]: {k: v for k, v in row.items() if k != "rank"} for row in memory or []}
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}", **extra.get(r, {})}}
            for r in range(ranks)]
    body = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
    atomic_write_bytes(Path(path), json.dumps(body).encode())
