"""``meshplan inputs``: random, valid inputs for a model."""

from __future__ import annotations

from pathlib import Path

import click

from cli.guard import debugging, guard
from cli.options import dim_option, fixed_dims


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@dim_option
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("-o", "--output", "output_path", required=True, type=click.Path(path_type=Path, dir_okay=False), help="Inputs file (.npz).")
@click.pass_context
def inputs(ctx, model, dims, seed, output_path):
    """Write valid inputs for MODEL: token ids inside their embedding table, and for an
    LLM-shaped model an all-ones attention mask, position ids counting from the past and
    zero or empty pasts (it says what it chose); the rest random. A ranged --dim is taken at
    its cost size; dims that follow from the given ones are derived."""
    from meshplan.model.inputs import llm_inputs
    from meshplan.model.load import read_model
    from meshplan.model.sizes import derive_dims, split_dims
    from meshplan.runtime.tensors import write_outputs

    with guard(debugging(ctx)):
        header = read_model(model, load_external_data=False)
        sizes = derive_dims(header, split_dims(fixed_dims(dims)))
        feeds, notes = llm_inputs(header, sizes.resolve({}), seed)
        write_outputs(output_path, feeds)
        for name, form in sizes.derived.items():
            value = form(sizes.resolve({}))
            how = "" if not form.coefs or form.text == name else f" = {form.text}"
            click.echo(f"derived {name}{how} = {value}")
        for note in notes:
            click.echo(note)
        shapes = ", ".join(f"{n} {list(a.shape)} {a.dtype}" for n, a in feeds.items())
        click.echo(f"wrote {output_path}: {shapes}")
