"""``meshplan inputs``: random, valid inputs for a model."""

from __future__ import annotations

from pathlib import Path

import click

from cli.guard import debugging, guard
from cli.options import dim_option


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@dim_option
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("-o", "--output", "output_path", required=True, type=click.Path(path_type=Path), help="Inputs file (.npz).")
@click.pass_context
def inputs(ctx, model, dims, seed, output_path):
    """Write random, valid inputs for MODEL (token ids stay inside their embedding table)."""
    from meshplan.model.inputs import random_inputs
    from meshplan.model.load import fix_dims, read_model
    from meshplan.runtime.tensors import write_outputs

    with guard(debugging(ctx)):
        header = read_model(model, load_external_data=False)
        fix_dims(header, dims)   # unknown, missing or bad --dim: one line naming it
        feeds = random_inputs(header, dims, seed)
        write_outputs(output_path, feeds)
        shapes = ", ".join(f"{n} {list(a.shape)} {a.dtype}" for n, a in feeds.items())
        click.echo(f"wrote {output_path}: {shapes}")
