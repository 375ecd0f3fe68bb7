"""``meshplan show``: a plan as a person checks it before running it."""

from __future__ import annotations

from pathlib import Path

import click

from cli.guard import debugging, guard


@click.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--operators", default=3, show_default=True, type=click.IntRange(min=0),
              help="Heaviest operators shown per layer (0: all).")
@click.option("--weights", default=5, show_default=True, type=click.IntRange(min=0),
              help="Heaviest weights shown per stage, with the slice each rank holds (0: all).")
@click.option("--stage", type=click.IntRange(min=0), help="Show this stage only.")
@click.option("--schedule", is_flag=True,
              help="Print each rank's instruction list instead: what it receives, runs, sends and keeps, per microbatch.")
@click.pass_context
def show(ctx, plan_dir, operators, weights, stage, schedule):
    """Print a plan per stage and layer: the sharding of its heaviest operators and weights (R/S
    notation), what each rank holds, and the cost terms that decided."""
    from meshplan.show import show_plan, show_schedule

    with guard(debugging(ctx)):
        click.echo(show_schedule(plan_dir, stage) if schedule else show_plan(plan_dir, operators, weights, stage))
