"""``meshplan profile``: measure operator and communication costs for planning.

Registered on the main group with ``main.add_command(profile)``; it can also be invoked
on its own (``python -c "from cli.profile_cmd import profile; profile()"``).
"""

from __future__ import annotations

import contextlib
import re
import sys
import tempfile
import time
from pathlib import Path

import click

from cli.guard import debugging, guard
from cli.options import (batch_dim_option, cluster_from_options, cluster_option, device_option, dim_option, fixed_dims,
                         mesh_option, train_options, train_spec)

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
          "g": 1024**3, "gb": 1024**3, "gib": 1024**3}


def _bytes(ctx, param, value):
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise click.BadParameter(f"expected a size such as 4MiB, 256K or 1048576, got {value!r}", ctx, param)
    size = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if size < 1024:
        raise click.BadParameter(f"the largest message must be at least 1 KiB, got {value!r}", ctx, param)
    return size


def _launched_rank() -> int:
    """This process's rank when an MPI launcher started it (from its environment), else 0."""
    import os

    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class _quiet_unless_rank0:
    """Under mpiexec every rank meets the same user error; only rank 0 reports it."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        from meshplan.errors import MeshplanError

        if isinstance(exc, MeshplanError) and _launched_rank() != 0:
            sys.exit(1)
        return False


class _Bar:
    """A click progress bar on stderr per phase, with an estimate of the time left."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self.phase = None
        self.done = 0
        self.operators_timed = 0

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase == "operators":
            self.operators_timed = done
        if not self.enabled or total <= 0:
            return
        if phase != self.phase:
            self.close()
            self.phase, self.done = phase, 0
            label = "timing operators" if phase == "operators" else "timing collectives"
            self.bar = click.progressbar(length=total, label=label, file=sys.stderr, show_eta=True, show_pos=True)
            self.bar.__enter__()
        if done > self.done:
            self.bar.update(done - self.done)
            self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@mesh_option
@device_option("Device preset the profile is for (link figures without mpiexec). "
               "Default: cpu with the CPU provider, h100-80g with CUDA.")
@cluster_option
@dim_option
@click.option("--microbatches", "microbatch_counts", multiple=True, type=click.IntRange(min=2),
              help="Also profile the shapes a plan with this many microbatches runs (repeatable).")
@batch_dim_option
@click.option("--provider", default="auto", show_default=True, metavar="auto|cuda|cpu",
              help="Execution provider to time on (an unknown one is an error).")
@click.option("--threads", type=click.IntRange(min=1),
              help="onnxruntime threads per operator [default: the host's cores divided among its ranks, as meshplan run].")
@click.option("--cache", "cache_path", type=click.Path(path_type=Path),
              help="Cache file [default: $XDG_CACHE_HOME/meshplan/profile.sqlite or ~/.cache/meshplan/profile.sqlite].")
@click.option("--refresh", is_flag=True, help="Time everything again, ignoring (and overwriting) cached timings.")
@click.option("--budget-ms", default=20.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Timed running per operator measurement, milliseconds.")
@click.option("--comm-max", callback=_bytes, metavar="SIZE",
              help="Largest message for the collectives under mpiexec [default: 64MiB with CUDA, 4MiB on CPU].")
@click.option("--comm-budget-ms", default=30.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Timed running per collective and message size, milliseconds.")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=0), help="Rows of the costliest-operator table.")
@train_options
@click.option("-o", "--output", "out_path", required=True, type=click.Path(path_type=Path, dir_okay=False), help="Profile file to write (JSON).")
@click.pass_context
def profile(ctx, model, mesh, device, cluster_file, dims, microbatch_counts, batch_dim, provider, threads, cache_path, refresh,
            budget_ms, comm_max, comm_budget_ms, top, train, loss_spec, optimizer, frozen, master_weights,
            out_path):
    """Measure what MODEL's operators and the mesh's collectives cost here, for `meshplan plan --profile`.

    Under `mpiexec -n N meshplan profile ...` the ranks share the operator timings and
    the collectives are timed along each mesh axis; alone, communication comes from the
    cluster description's link figures. Timings are cached, so profiling a model again
    costs only what is new.
    """
    from meshplan.cost.cluster import DEFAULT_DEVICE
    from meshplan.model.load import read_model, symbolic_dims
    from meshplan.make_plan import batch_layout, static_batch_rewrite
    from meshplan.profile import ProfileOptions, profile_model, write_profile
    from meshplan.profile.variants import sharded_variants
    from meshplan.profile.errors import FailedElsewhere
    from meshplan.profile.timing import CPU, TimingConfig, resolve_provider
    from meshplan.emit.report import human_seconds

    with guard(debugging(ctx)), _quiet_unless_rank0(), contextlib.ExitStack() as holding:
        cluster = cluster_from_options(mesh, cluster_file, device,
                                       lambda: "cpu" if resolve_provider(provider) == CPU else DEFAULT_DEVICE)
        given = fixed_dims(dims)
        training = train_spec(train, loss_spec, optimizer, frozen, master_weights)
        if training is not None:   # the step's operators, at one microbatch's dims, as the plan has them
            if len(microbatch_counts) > 1:
                raise click.UsageError("--train takes one --microbatches count (the plan's)")
            if microbatch_counts:
                from meshplan.make_plan import training_microbatches

                given, training = training_microbatches(model, given, microbatch_counts[0], training)
            model, training = _training_step(model, training, Path(holding.enter_context(
                tempfile.TemporaryDirectory(prefix="meshplan-profile-step-"))))
            microbatch_counts = ()
        header = read_model(model, load_external_data=False)
        symbolic_dims(header)
        from meshplan.model.sizes import derive_dims, split_dims

        # a range is profiled at its cost size; dims that follow from the given ones are derived
        dims = derive_dims(header, split_dims(given)).resolve({})
        dims_sets = [("model", dict(dims))]
        for count in dict.fromkeys(microbatch_counts):
            batch, program_dims = batch_layout(header, dict(dims), count, tuple(batch_dim))
            dims_sets.append((f"microbatches={count}", program_dims, static_batch_rewrite(batch, count)))
        options = ProfileOptions(
            variants=sharded_variants(cluster),
            provider=provider, threads=threads, cache_path=cache_path, refresh=refresh,
            timing=TimingConfig(budget_seconds=budget_ms / 1000), comm_max_bytes=comm_max,
            comm_budget_seconds=comm_budget_ms / 1000, training=training is not None,
        )
        started = time.perf_counter()
        bar = _Bar(enabled=True)
        try:
            result = profile_model(model, dims_sets, cluster, options, progress=bar)
        except FailedElsewhere:
            sys.exit(1)             # the failing rank has reported it
        except KeyboardInterrupt:
            bar.close()
            click.echo(f"meshplan: interrupted; the {bar.operators_timed} operator timing(s) made so far "
                       "are kept in the cache", err=True)
            sys.exit(130)
        finally:
            bar.close()
        if result is None:          # another rank of an MPI job: rank 0 reports
            return
        if training is not None:
            result.profile.model["training"] = training
        write_profile(result.profile, out_path)
        _report(result, out_path, top, human_seconds)
        click.echo(f"PASSED | {time.perf_counter() - started:.1f} s | meshplan profile")


def _training_step(model: Path, spec, holder: Path) -> tuple[Path, dict]:
    """The model's training step built into ``holder`` as ``plan --train`` builds it (so
    that its operators are the plan's), and what the profile records of it
    (``profile.document.training_record``)."""
    from meshplan.errors import ModelError
    from meshplan.files import file_sha256
    from meshplan.profile.document import training_record
    from meshplan.training.step_model import build_step_model, save_step_model

    if not Path(model).is_file():
        raise ModelError(f"model file not found: {model}")
    step = save_step_model(build_step_model(model, spec), model, holder / "step.onnx")
    return step, training_record(file_sha256(model), spec)


def _report(result, out_path: Path, top: int, human_seconds) -> None:
    profile = result.profile
    if result.cache_moved_aside:
        click.echo(f"warning: the cache was unreadable; moved it to {result.cache_moved_aside} and started a new one",
                   err=True)
    rows = profile.costliest(top)
    if rows:
        total = profile.total_seconds()
        click.echo(f"costliest operators ({profile.provider} on {profile.hardware}, {profile.threads} thread(s)):")
        width = max(len(e.description) for e, _, _ in rows)
        width = min(max(width, 9), 72)
        click.echo(f"  {'operator':<{width}} {'count':>5} {'each':>10} {'total':>10} {'share':>6}")
        for entry, seconds, share in rows:
            text = entry.description
            if len(text) > width:
                text = text[:width - 1] + "…"
            click.echo(f"  {text:<{width}} {entry.count:>5} {human_seconds(entry.seconds):>10} "
                       f"{human_seconds(seconds):>10} {share:>6.1%}")
        click.echo(f"  sum of measured operators per run of the model: {human_seconds(total)}")
    whole = profile.composition
    if "factor" in whole:
        click.echo(f"the model run whole ({whole['label']}): {human_seconds(whole['whole_seconds'])}, "
                   f"{whole['factor']:.2f}x the sum of its operators timed one at a time "
                   f"({human_seconds(whole['operators_seconds'])}); plans count measured operators so")
    elif whole:
        click.echo(f"the model was not run whole ({whole['skipped']}): plans count its operators as timed")
    comm = profile.communication_source
    comm_text = {"measured": f"measured over {profile.ranks} ranks", "cached": f"from the cache ({profile.ranks} ranks)",
                 "cluster": "the cluster description's link figures (run under mpiexec to measure)"}[comm]
    aware = profile.cuda_aware_mpi.get("value")
    aware_text = "unknown" if aware is None else ("yes" if aware else "no")
    click.echo(
        f"{profile.stats['signatures']} operator signature(s): {result.measured} timed, {result.cached} from the cache "
        f"({result.cache_path}), {result.failed} analytic; communication: {comm_text}; CUDA-aware MPI: {aware_text}"
    )
    click.echo(f"wrote {out_path}")
