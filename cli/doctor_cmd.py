"""``meshplan doctor``: what this machine (or every rank of a job) has for meshplan."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from cli.guard import debugging, guard


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON (for scripts).")
@click.option("--plan", "plan_dir", type=click.Path(path_type=Path),
              help="Also check that this job's ranks fit the plan in PLAN_DIR (run under mpiexec).")
@click.pass_context
def doctor(ctx, as_json, plan_dir):
    """Check this machine for meshplan: versions, execution providers that start, the MPI
    library and mpiexec, the ILP solvers, GPUs. Exits 1 with one line per problem when
    something the default path needs is missing. Under `mpiexec -n N meshplan doctor`
    every rank reports its host and GPU (with --plan, whether the ranks fit the plan)."""
    from meshplan.doctor import assign_gpus, assign_threads, diagnose, launched_size, local_facts, plan_needs

    with guard(debugging(ctx)):
        started = time.perf_counter()
        needs = plan_needs(plan_dir) if plan_dir is not None else None
        facts, MPI = local_facts()
        launched = launched_size() is not None or (MPI is not None and MPI.COMM_WORLD.Get_size() > 1)
        if MPI is None:
            assign_gpus([facts], [0])
            assign_threads([facts], [0])
            diagnosis = diagnose([facts], launched, needs)
        else:
            diagnosis = _gathered(facts, MPI, launched, needs)
            if diagnosis is None:   # not rank 0: rank 0 reports for the job
                sys.exit(MPI.COMM_WORLD.bcast(None, root=0))
        if as_json:
            click.echo(json.dumps(diagnosis.to_json(), indent=2))
        else:
            _print(diagnosis)
        for problem in diagnosis.problems:
            click.echo(f"meshplan: error: {problem}", err=True)
        code = 1 if diagnosis.problems else 0
        if MPI is not None and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.bcast(code, root=0)
        if not as_json:
            verdict = "PASSED" if code == 0 else f"FAILED ({len(diagnosis.problems)} problem(s))"
            click.echo(f"{verdict} | {time.perf_counter() - started:.1f} s | meshplan doctor")
        sys.exit(code)


def _gathered(facts, MPI, launched, needs):
    """Every rank's facts on rank 0, with the launch layout (collective); None elsewhere."""
    from meshplan.doctor import assign_gpus, assign_threads, diagnose
    from meshplan.rank_layout import gather_layout, layout_mismatch

    comm = MPI.COMM_WORLD
    layout = gather_layout(comm, MPI)
    every = comm.gather(facts, root=0)
    locals_ = comm.gather(layout.local_rank, root=0)
    if comm.Get_rank() != 0:
        return None
    assign_gpus(every, locals_)
    assign_threads(every, list(layout.machine))
    mismatch = None
    if needs is not None and comm.Get_size() == needs["ranks"]:
        mismatch = layout_mismatch(layout, needs["hosts"], needs["devices_per_host"])
    return diagnose(every, launched, needs, mismatch)


def _print(diagnosis) -> None:
    first = diagnosis.facts[0]
    v = first.versions
    ort = next((f"{name} {v[name]}" for name in ("onnxruntime-gpu", "onnxruntime") if v.get(name)), "onnxruntime: none")
    click.echo(f"meshplan {v.get('meshplan') or '?'} | Python {first.python}")
    click.echo(f"onnx {v.get('onnx') or 'none'} | {ort} | numpy {v.get('numpy') or 'none'} | "
               f"mip {v.get('mip') or 'none'} | mpi4py {v.get('mpi4py') or 'none'}")
    click.echo("execution providers:")
    for name, problem in first.providers.items():
        click.echo(f"  {name:<6} {'ok' if problem is None else 'not usable: ' + problem}")
    click.echo("MPI:")
    mpi = first.mpi
    if "error" in mpi:
        click.echo(f"  library     none: {mpi['error']}")
    else:
        aware = {True: "yes", False: "no", None: "unknown"}[mpi["cuda_aware"]]
        click.echo(f"  library     {mpi['library']} (MPI {mpi['standard']})")
        click.echo(f"  CUDA-aware  {aware} ({mpi['cuda_aware_method']})")
    launcher = first.mpiexec
    click.echo(f"  mpiexec     {launcher['path'] + ' (' + launcher['version'] + ')' if 'path' in launcher else 'none on PATH'}")
    click.echo("ILP solvers:")
    for name, problem in first.solvers.items():
        click.echo(f"  {name.upper() if name == 'cbc' else 'HiGHS':<6} {'ok' if problem is None else problem}")
    click.echo(f"GPUs: {', '.join(f'{i}: {n}' for i, n in enumerate(first.gpus)) if first.gpus else 'none seen'}")
    if diagnosis.launched:
        click.echo(f"ranks ({len(diagnosis.facts)}):")
        click.echo(f"  {'rank':>4}  {'host':<24} {'local':>5}  {'GPU':<24} threads")
        for f in diagnosis.facts:
            gpu = f"{f.gpu}: {f.gpus[f.gpu]}" if f.gpu is not None else "none"
            click.echo(f"  {f.rank:>4}  {f.host[:24]:<24} {f.local_rank:>5}  {gpu[:24]:<24} {f.threads}")
    else:
        click.echo(f"threads: {first.threads} (one rank; under mpiexec each rank's)")
    click.echo(f"memory: {first.pages}")
    if diagnosis.plan is not None:
        p = diagnosis.plan
        shape = f"{p['hosts']} host(s) x {p['devices_per_host']} device(s) = {p['ranks']} rank(s)"
        if not p.get("checked"):
            verdict = "not checked (run under mpiexec)"
        else:
            verdict = "the ranks fit" if p.get("fits") else "the ranks do NOT fit"
        click.echo(f"plan {p['directory']}: {shape}: {verdict}")
    for warning in diagnosis.warnings:
        click.echo(f"warning: {warning}")
