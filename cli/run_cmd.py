"""``meshplan run``: run a plan, one rank per device, under mpiexec."""

from __future__ import annotations

from pathlib import Path

import click

from cli.options import bind_cores_option
from cli.guard import debugging, rank_guard


@click.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--inputs", "inputs_path", required=True, type=click.Path(path_type=Path), help="Model inputs (.npz).")
@click.option("--output", "output_path", type=click.Path(path_type=Path, dir_okay=False), help="Write model outputs here (.npz).")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(min=1), help="Run the batch this many times.")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path, dir_okay=False), help="Write a Chrome trace of the last run.")
@click.option("--provider", default="auto", show_default=True, metavar="auto|cuda|cpu",
              help="Execution provider for the programs (an unknown one is an error).")
@click.option("--transfer", default="auto", show_default=True, metavar="auto|host|device",
              help="Where tensors travel between ranks: device memory when the programs run on CUDA and MPI "
                   "is CUDA-aware (auto), always through host memory (host), or as OrtValue buffers (device).")
@click.option("--deterministic", is_flag=True,
              help="Ask onnxruntime for deterministic kernels in every session (use_deterministic_compute: on CUDA, "
                   "no atomic adds in reductions), so that two runs give the same bits; may be slower.")
@bind_cores_option
@click.pass_context
def run(ctx, plan_dir, inputs_path, output_path, repeat, trace_path, provider, transfer, deterministic, bind_cores):
    """Run a plan: start as `mpiexec -n N meshplan run PLAN_DIR --inputs IN.npz`."""
    from meshplan.emit.report import human_seconds
    from meshplan.runtime.mpi_runner import run_rank, write_trace
    from meshplan.runtime.sessions import set_deterministic
    from meshplan.runtime.threads import set_binding

    with rank_guard(debugging(ctx)):
        set_deterministic(deterministic)
        set_binding(bind_cores, pin=True)
        report = run_rank(plan_dir, inputs_path, output_path, repeat, provider, transfer)
    if report is None:
        return
    if trace_path:
        write_trace(trace_path, report.trace_events, report.ranks, report.memory_rows())
    latency = report.median_latency
    click.echo(f"ran {report.ranks} rank(s) on {report.provider}; transfer path: {report.transfer_path}"
               + ("; deterministic kernels (use_deterministic_compute)" if deterministic else ""))
    click.echo(
        f"measured: latency {human_seconds(latency)} per batch of {report.batch_size} "
        f"(median of {len(report.latencies)}), throughput {report.batch_size / latency:.1f} samples/s"
    )
    click.echo(
        f"estimate: latency {human_seconds(report.estimate_seconds)}, "
        f"throughput {report.batch_size / report.estimate_seconds:.1f} samples/s"
    )
    for row in report.memory_rows():
        rss, held = row["peak_rss_bytes"], row["program_bytes"]
        if row["idle"]:
            click.echo(f"rank {row['rank']}: peak RSS {rss / 2**30:.2f} GiB, idle (no program in the plan)")
            continue
        threads = report.threads[row["rank"]] if row["rank"] < len(report.threads) else None
        estimate = report.memory_estimates[row["rank"]] if row["rank"] < len(report.memory_estimates) else 0
        click.echo(f"rank {row['rank']}: peak RSS {rss / 2**30:.2f} GiB, program {held / 2**30:.2f} GiB"
                   + (f" ({rss / held:.1f}x)" if held >= 2**20 else "")
                   + (f", the plan's estimate {estimate / 2**30:.2f} GiB" if estimate else "")
                   + (f"; {threads.describe()}" if threads is not None else ""))
    crowded = next((t for t in report.threads if t is not None and t.oversubscribed), None)
    if crowded is not None:
        click.echo(f"warning: {crowded.working} working ranks share {crowded.cores} core(s) on one machine: they take "
                   "turns, which a plan for devices of their own does not model"
                   + (" (`meshplan plan --shared-host` plans for ranks that share a machine)"
                      if report.shared_host_applies else ""), err=True)
    elif report.split_on_shared_cores():
        click.echo("note: working ranks share this machine's cores and memory, which the plan counts as devices of "
                   "their own: `meshplan plan --shared-host` plans for that (it leaves devices idle where "
                   "splitting does not pay)", err=True)
    if output_path:
        click.echo(f"wrote {output_path}")
    if trace_path:
        click.echo(f"wrote {trace_path}")
