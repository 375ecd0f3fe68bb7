"""``meshplan train``: train a training plan's model, one rank per device, under mpiexec."""

from __future__ import annotations

import json
from pathlib import Path

import click

from cli.guard import debugging, rank_guard
from cli.options import bind_cores_option


def _floats(text: str, count: int, name: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != count:
        raise click.BadParameter(f"expected {count} comma-separated numbers, got {text!r}", param_hint=name)
    return values


@click.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--data", "data_path", required=True, type=click.Path(path_type=Path),
              help="Training data (.npz): one array per input of the step (the model's inputs and the loss's "
                   "target), samples on the leading axis.")
@click.option("--steps", required=True, type=click.IntRange(min=1), help="Steps to run (in this run).")
@click.option("--lr", default=1e-3, show_default=True, type=float, help="Learning rate (the schedule's peak).")
@click.option("--schedule", default="constant", show_default=True, type=click.Choice(["constant", "cosine"]),
              help="Learning-rate schedule: constant, or cosine decay to 0 at the last step.")
@click.option("--warmup", default=0, show_default=True, type=click.IntRange(min=0),
              help="Steps of linear warm-up before the schedule.")
@click.option("--total-steps", type=click.IntRange(min=1),
              help="The schedule's length [default: the step this run ends at].")
@click.option("--momentum", default=0.0, show_default=True, type=float, help="SGD's momentum.")
@click.option("--weight-decay", default=0.0, show_default=True, type=float,
              help="Weight decay (SGD: added to the gradient; AdamW: decoupled).")
@click.option("--betas", default="0.9,0.999", show_default=True, help="AdamW's β1,β2.")
@click.option("--eps", default=1e-8, show_default=True, type=float, help="AdamW's ε.")
@click.option("--clip-norm", default=0.0, show_default=True, type=float,
              help="Clip the gradients to this global norm (0: no clipping).")
@click.option("--loss-scale", default="1", show_default=True, metavar="S|dynamic[:S]",
              help="A plan with --master-weights: the loss's gradient scaled by S in the backward (float16's "
                   "small gradients kept from zero), each weight's gradient divided by it again in float32; a step "
                   "whose gradients overflow is skipped. dynamic: torch's GradScaler (from S, default 65536: times "
                   "--backoff-factor at each skipped step, times --growth-factor after --growth-interval steps "
                   "without one).")
@click.option("--growth-interval", default=2000, show_default=True, type=int,
              help="With --loss-scale dynamic: steps without an overflow before the scale grows.")
@click.option("--growth-factor", default=2.0, show_default=True, type=float,
              help="With --loss-scale dynamic: what the scale is multiplied by when it grows.")
@click.option("--backoff-factor", default=0.5, show_default=True, type=float,
              help="With --loss-scale dynamic: what the scale is multiplied by at a skipped step.")
@click.option("--shuffle", is_flag=True, help="Draw each pass over the data in a random order.")
@click.option("--seed", default=0, show_default=True, type=int, help="The shuffling's seed.")
@click.option("--log", "log_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Write JSON with each step's loss, lr, grad_norm and step_seconds.")
@click.option("--checkpoint", "checkpoint_dir", type=click.Path(path_type=Path),
              help="Write checkpoints into this directory (at the end, and every --checkpoint-every steps).")
@click.option("--checkpoint-every", default=0, show_default=True, type=click.IntRange(min=0),
              help="Steps between checkpoints (0: only at the end).")
@click.option("--resume", "resume_dir", type=click.Path(path_type=Path),
              help="Continue from the newest checkpoint in this directory.")
@click.option("--provider", default="auto", show_default=True, metavar="auto|cuda|cpu",
              help="Execution provider for the programs.")
@click.option("--transfer", default="auto", show_default=True, metavar="auto|host|device",
              help="Where tensors travel between ranks (as meshplan run's).")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path, dir_okay=False),
              help="Write a Chrome trace of the last step (each rank's runs: a pipeline's forwards, backwards, "
                   "replicas' sum and update).")
@click.option("-q", "--quiet", is_flag=True, help="No line per step.")
@bind_cores_option
@click.pass_context
def train(ctx, plan_dir, data_path, steps, lr, schedule, warmup, total_steps, momentum, weight_decay, betas, eps,
          clip_norm, loss_scale, growth_interval, growth_factor, backoff_factor, shuffle, seed, log_path,
          checkpoint_dir, checkpoint_every, resume_dir, provider, transfer, trace_path, quiet, bind_cores):
    """Train: start as `mpiexec -n N meshplan train PLAN_DIR --data DATA.npz --steps K`."""
    from meshplan.emit.report import human_seconds
    from meshplan.files import atomic_write_bytes
    from meshplan.runtime.threads import set_binding
    from meshplan.trainer.driver import TrainOptions, train_rank
    from meshplan.trainer.loss_scale import LossScale

    beta1, beta2 = _floats(betas, 2, "--betas")
    options = TrainOptions(data_path, steps, lr, schedule, warmup,
                           {"momentum": momentum, "weight_decay": weight_decay, "beta1": beta1, "beta2": beta2,
                            "eps": eps, "clip_norm": clip_norm},
                           shuffle, seed, checkpoint_dir, checkpoint_every, resume_dir, total_steps,
                           trace=trace_path is not None)
    for path, hint in ((log_path, "--log"), (trace_path, "--trace")):
        if path is not None and not path.parent.is_dir():
            raise click.BadParameter(f"directory does not exist: {path.parent}", param_hint=hint)

    def progress(step, end, loss, rate, norm, samples, scale=None, skipped=False):
        if not quiet:
            scaled = "" if scale is None else f"  loss_scale {scale:g}" + ("  skipped (overflow)" if skipped else "")
            click.echo(f"step {step}/{end}  loss {loss:.6g}  lr {rate:.4g}  grad_norm {norm:.4g}{scaled}  "
                       f"{samples:.1f} samples/s")

    given = [f"--{name.replace('_', '-')}" for name in ("growth_interval", "growth_factor", "backoff_factor")
             if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT]
    if given and not loss_scale.strip().startswith("dynamic"):
        raise click.UsageError(f"{' and '.join(given)} {'goes' if len(given) == 1 else 'go'} with --loss-scale dynamic")
    with rank_guard(debugging(ctx)):
        options.loss_scale = LossScale.parse(loss_scale, growth_interval, growth_factor, backoff_factor)
        set_binding(bind_cores, pin=True)
        report = train_rank(plan_dir, options, provider, transfer, progress)
    if report is None:
        return
    if log_path is not None:
        atomic_write_bytes(log_path, (json.dumps(report.log(), indent=1) + "\n").encode())
    if trace_path is not None:
        from meshplan.runtime.mpi_runner import write_trace

        write_trace(trace_path, report.trace_events, report.ranks,
                    [{"rank": r, "peak_rss_bytes": rss} for r, rss in enumerate(report.peak_rss_bytes or [])])
    import statistics

    measured = statistics.median(report.step_seconds[1:] or report.step_seconds)
    click.echo(f"trained {len(report.losses)} step(s) on {report.ranks} rank(s), {report.provider}; transfer path: "
               f"{report.transfer_path}")
    click.echo(f"loss {report.losses[0]:.6g} -> {report.losses[-1]:.6g}; step {human_seconds(measured)} measured "
               f"(median), {human_seconds(report.estimate_seconds)} estimated; "
               f"{report.batch / measured:.1f} samples/s")
    if report.loss_scales:
        click.echo(f"loss scale {report.loss_scales[0]:g} -> {report.loss_scales[-1]:g}; "
                   f"{sum(report.skipped)} of {len(report.skipped)} step(s) skipped (their gradients overflowed)")
    on_gpu = report.provider == "CUDAExecutionProvider"   # (the estimate is of the GPU's memory, not measured)
    for rank, rss in enumerate(report.peak_rss_bytes or []):
        estimate = report.memory_estimates[rank] if rank < len(report.memory_estimates) else 0
        click.echo(f"rank {rank}: peak RSS {rss / 2**20:.1f} MiB" + (" (host memory)" if on_gpu else "")
                   + (f", the plan's estimate {estimate / 2**20:.1f} MiB" + (" of its GPU's memory" if on_gpu else "")
                      if estimate else ""))
    if report.busy_fractions:
        idle = 1 - sum(report.busy_fractions) / len(report.busy_fractions)
        click.echo(f"pipeline: ranks busy {', '.join(f'{b:.2f}' for b in report.busy_fractions)} of their steps "
                   f"(idle {idle:.2f} on average; a pipeline of equal stages idles (S - 1)/(M + S - 1) = "
                   f"{report.bubble:.2f})")
    for path in report.checkpoints[-1:]:
        click.echo(f"wrote checkpoint {path}")
    for path in (log_path, trace_path):
        if path is not None:
            click.echo(f"wrote {path}")
