"""``meshplan export``: write a trained model."""

from __future__ import annotations

from pathlib import Path

import click

from cli.guard import debugging, guard


@click.command()
@click.argument("plan_dir", type=click.Path(path_type=Path))
@click.option("--checkpoint", "checkpoint_dir", required=True, type=click.Path(path_type=Path),
              help="A checkpoint directory of meshplan train (its newest checkpoint is taken).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path, dir_okay=False), help="The ONNX file to write.")
@click.pass_context
def export(ctx, plan_dir, checkpoint_dir, output):
    """Write the training plan's source model with a checkpoint's trained weights."""
    from meshplan.trainer.export import export_trained

    with guard(debugging(ctx)):
        written = export_trained(plan_dir, checkpoint_dir, output)
    click.echo(f"wrote {written}")
