"""meshplan's command line: parse, call the library, print.

User errors (meshplan.errors.MeshplanError) become one line on stderr and exit 1;
malformed options are click usage errors (exit 2). ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from meshplan.cost.cluster import DEVICE_PRESETS, parse_mesh
from meshplan.errors import MeshplanError, ModelError


def _parse_dims(ctx, param, values) -> dict[str, int]:
    dims: dict[str, int] = {}
    for text in values:
        name, sep, value = text.partition("=")
        if not sep or not name.strip():
            raise click.BadParameter(f"expected NAME=INT, got {text!r}", ctx, param)
        try:
            dims[name.strip()] = int(value)
        except ValueError:
            raise click.BadParameter(f"{name.strip()}={value!r} is not an integer", ctx, param) from None
    return dims


def _parse_mesh(ctx, param, value):
    if value is None:
        return None
    try:
        return parse_mesh(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


dim_option = click.option(
    "--dim", "dims", multiple=True, callback=_parse_dims, metavar="NAME=INT",
    help="Fix a symbolic dimension of the model's inputs (repeatable).",
)


def _guard(debug: bool):
    """Context that turns library errors into one line and exit 1."""

    class Guard:
        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            if exc is None or isinstance(exc, (click.exceptions.Exit, click.ClickException, SystemExit)):
                return False
            if debug:
                return False
            if isinstance(exc, MeshplanError):
                click.echo(f"meshplan: error: {exc}", err=True)
                sys.exit(1)
            if isinstance(exc, KeyboardInterrupt):
                click.echo("meshplan: interrupted", err=True)
                sys.exit(130)
            return False

    return Guard()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="meshplan")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx, debug):
    """Plan and run one ONNX model on many devices."""
    ctx.obj = {"debug": debug}


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--mesh", callback=_parse_mesh, metavar="HxD", help="Hosts x devices per host, e.g. 1x4.")
@click.option("--device", default="h100-80g", show_default=True, type=click.Choice(sorted(DEVICE_PRESETS)),
              help="Device preset (memory, peak FLOP/s, bandwidth, links).")
@click.option("--cluster", "cluster_file", type=click.Path(path_type=Path),
              help="Cluster description in TOML (instead of --mesh/--device).")
@dim_option
@click.option("--microbatches", default=1, show_default=True, type=click.IntRange(min=1),
              help="Split the batch into this many pipelined microbatches.")
@click.option("--layers", type=click.IntRange(min=1), help="Number of layers to cluster operators into.")
@click.option("--max-stages", type=click.IntRange(min=1), help="At most this many pipeline stages.")
@click.option("--policy", default="auto", show_default=True, type=click.Choice(["auto", "data", "megatron"]),
              help="Sharding inside stages: automatic (ILP over every strategy), data parallel only, "
                   "or Megatron-style tensor parallel matrix products.")
@click.option("--solver", default="cbc", show_default=True, type=click.Choice(["cbc", "highs"]),
              help="MILP solver for the sharding ILP (python-mip's CBC or HiGHS).")
@click.option("--reshard-scheduler", default="randomized_greedy", show_default=True,
              type=click.Choice(["naive", "load_balance", "dfs", "randomized_greedy"]),
              help="How cross-mesh resharding tasks are ordered and given senders.")
@click.option("--profile", "profile_path", type=click.Path(path_type=Path),
              help="Measured costs from meshplan profile (the analytic model fills the gaps).")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(path_type=Path), help="Plan directory to write.")
@click.pass_context
def plan(ctx, model, mesh, device, cluster_file, dims, microbatches, layers, max_stages, policy, solver,
         reshard_scheduler, profile_path, out_dir):
    """Find a parallel plan for MODEL and write per-device programs to a plan directory."""
    from meshplan.cost.cluster import load_cluster_file, make_cluster
    from meshplan.make_plan import make_plan
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.emit.report import TIMELINE_FILE, text_report

    with _guard(ctx.obj["debug"]):
        if (mesh is None) == (cluster_file is None):
            raise click.UsageError("give exactly one of --mesh and --cluster")
        cluster = load_cluster_file(cluster_file) if cluster_file else make_cluster(mesh, device)
        started = time.perf_counter()
        options = PlanOptions(microbatches=microbatches, num_layers=layers, solver=solver, max_stages=max_stages,
                              policy=policy, reshard_scheduler=reshard_scheduler)
        cost_model = None
        if profile_path:
            from meshplan.files import file_sha256
            from meshplan.profile.document import load_profile
            from meshplan.profile.measured import ProfiledCostModel

            if not Path(model).is_file():
                raise ModelError(f"model file not found: {model}")
            cost_model = ProfiledCostModel(cluster, load_profile(profile_path, file_sha256(model), cluster))
        result = make_plan(model, cluster, dims, out_dir, options, cost_model=cost_model)
        click.echo(text_report(result))
        if cost_model is not None:
            click.echo(f"costs: {cost_model.measured_nodes} operator(s) measured, "
                       f"{cost_model.analytic_nodes} from the analytic model")
        click.echo(f"wrote {out_dir}/plan.json, {len(result.programs)} program(s), {out_dir}/{TIMELINE_FILE}")
        click.echo(f"PASSED | {time.perf_counter() - started:.1f} s | meshplan plan")


@main.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--inputs", "inputs_path", required=True, type=click.Path(path_type=Path), help="Model inputs (.npz).")
@click.option("--output", "output_path", type=click.Path(path_type=Path), help="Write model outputs here (.npz).")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(min=1), help="Run the batch this many times.")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), help="Write a Chrome trace of the last run.")
@click.option("--provider", default="auto", show_default=True, metavar="auto|cuda|cpu",
              help="Execution provider for the programs (an unknown one is an error).")
@click.option("--transfer", default="auto", show_default=True, metavar="auto|host|device",
              help="Where tensors travel between ranks: device memory when the programs run on CUDA and MPI "
                   "is CUDA-aware (auto), always through host memory (host), or as OrtValue buffers (device).")
@click.pass_context
def run(ctx, plan_dir, inputs_path, output_path, repeat, trace_path, provider, transfer):
    """Run a plan: start as `mpiexec -n N meshplan run PLAN_DIR --inputs IN.npz`."""
    from meshplan.emit.report import human_seconds
    from meshplan.runtime.mpi_runner import JobFailure, ReportedElsewhere, abort_job, run_rank, write_trace

    debug = ctx.obj["debug"]
    try:
        report = run_rank(plan_dir, inputs_path, output_path, repeat, provider, transfer)
    except ReportedElsewhere:
        sys.exit(1)
    except JobFailure as exc:
        click.echo(f"meshplan: error: {exc}", err=True)
        sys.stderr.flush()
        if debug:
            import traceback

            traceback.print_exception(exc.__cause__ or exc)
        abort_job(1)
        sys.exit(1)
    except MeshplanError as exc:
        if debug:
            raise
        click.echo(f"meshplan: error: {exc}", err=True)
        sys.exit(1)
    if report is None:
        return
    if trace_path:
        write_trace(trace_path, report.trace_events, report.ranks)
    latency = report.median_latency
    click.echo(f"ran {report.ranks} rank(s) on {report.provider}; transfer path: {report.transfer_path}")
    click.echo(
        f"measured: latency {human_seconds(latency)} per batch of {report.batch_size} "
        f"(median of {len(report.latencies)}), throughput {report.batch_size / latency:.1f} samples/s"
    )
    click.echo(
        f"estimate: latency {human_seconds(report.estimate_seconds)}, "
        f"throughput {report.batch_size / report.estimate_seconds:.1f} samples/s"
    )
    if output_path:
        click.echo(f"wrote {output_path}")
    if trace_path:
        click.echo(f"wrote {trace_path}")


@main.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--inputs", "inputs_path", required=True, type=click.Path(path_type=Path), help="Model inputs (.npz).")
@click.option("--outputs", "outputs_path", type=click.Path(path_type=Path),
              help="Also check these outputs (e.g. from meshplan run) against the original model.")
@click.option("--model", "model_path", type=click.Path(path_type=Path), help="The original model, if it moved.")
@click.option("--rtol", default=1e-3, show_default=True, type=float)
@click.option("--atol", default=1e-4, show_default=True, type=float)
@click.pass_context
def verify(ctx, plan_dir, inputs_path, outputs_path, model_path, rtol, atol):
    """Run all of a plan's programs in one process and compare with onnxruntime on the original model."""
    from meshplan.plan_format import read_plan
    from meshplan.runtime.inprocess import compare_outputs, reference_outputs, run_in_process
    from meshplan.runtime.tensors import read_inputs

    with _guard(ctx.obj["debug"]):
        started = time.perf_counter()
        the_plan = read_plan(plan_dir)
        inputs = read_inputs(inputs_path, the_plan)
        expected = reference_outputs(the_plan, inputs, model_path)
        checks = [("in-process", run_in_process(the_plan, plan_dir, inputs))]
        if outputs_path:
            checks.append((str(outputs_path), _read_outputs(outputs_path)))
        ok = True
        for label, actual in checks:
            for c in compare_outputs(actual, expected, rtol, atol):
                status = "ok" if c.ok else "MISMATCH"
                click.echo(f"{label}: {c.name}: max abs err {c.max_abs:.3g}, max rel err {c.max_rel:.3g} "
                           f"(rtol {rtol:g}, atol {atol:g}) {status}")
                ok &= c.ok
        verdict = "PASSED" if ok else "FAILED"
        click.echo(f"{verdict} | {time.perf_counter() - started:.1f} s | meshplan verify against single-device onnxruntime")
        if not ok:
            sys.exit(1)


def _read_outputs(path: Path):
    import zipfile

    import numpy as np

    from meshplan.errors import RunError

    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise RunError(f"outputs file not found: {path}") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError):
        raise RunError(f"cannot read outputs {path}: not a valid .npz file") from None


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@dim_option
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("-o", "--output", "output_path", required=True, type=click.Path(path_type=Path), help="Inputs file (.npz).")
@click.pass_context
def inputs(ctx, model, dims, seed, output_path):
    """Write random, valid inputs for MODEL (token ids stay inside their embedding table)."""
    from meshplan.model.load import read_model
    from meshplan.model.inputs import random_inputs
    from meshplan.runtime.tensors import write_outputs

    with _guard(ctx.obj["debug"]):
        feeds = random_inputs(read_model(model, load_external_data=False), dims, seed)
        write_outputs(output_path, feeds)
        shapes = ", ".join(f"{n} {list(a.shape)} {a.dtype}" for n, a in feeds.items())
        click.echo(f"wrote {output_path}: {shapes}")


def _register_profile() -> None:
    from cli.profile_cmd import profile

    main.add_command(profile)


_register_profile()

if __name__ == "__main__":
    main()
