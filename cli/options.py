"""Click options shared by the commands, one definition each, with their parsers, and
the cluster they describe (``--mesh``/``--device`` or ``--cluster``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import click

from meshplan.cost.cluster import DEVICE_PRESETS, Cluster, load_cluster_file, make_cluster, parse_mesh


def parse_dims(ctx, param, values) -> dict:
    """``--dim NAME=INT`` or ``--dim NAME=LO:HI[:STEP][@SIZE]`` (repeatable) → {NAME: INT or DimRange}.
    The last ``=`` splits, so a name may hold one (exporters write ``past + seq``)."""
    from meshplan.model.sizes import parse_size

    dims: dict = {}
    for text in values:
        name, sep, value = text.rpartition("=")
        if not sep or not name.strip():
            raise click.BadParameter(f"expected NAME=INT or NAME=LO:HI, got {text!r}", ctx, param)
        try:
            dims[name.strip()] = parse_size(value)
        except ValueError as exc:
            raise click.BadParameter(f"{name.strip()}: {exc}", ctx, param) from None
    return dims


def fixed_dims(dims: dict) -> dict[str, int]:
    """Each ranged dim at its cost size (commands that work at one size)."""
    from meshplan.model.sizes import DimRange

    return {name: value.cost_size if isinstance(value, DimRange) else value for name, value in dims.items()}


def parse_mesh_option(ctx, param, value) -> tuple[int, int] | None:
    """``--mesh HxD`` → (H, D)."""
    if value is None:
        return None
    try:
        return parse_mesh(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


dim_option = click.option(
    "--dim", "dims", multiple=True, callback=parse_dims, metavar="NAME=INT|LO:HI[:STEP][@SIZE]",
    help="Fix a symbolic dimension of the model's inputs to a size (0 included), or let it range from LO to HI "
         "(in steps of STEP; costs taken at SIZE, default HI). Dims that follow from the others are derived "
         "(repeatable).",
)

batch_dim_option = click.option(
    "--batch-dim", "batch_dim", multiple=True, metavar="NAME|INPUT:AXIS",
    help="The batch that --microbatches splits: a symbolic dimension's name, or the input and axis that hold a "
         "static batch (repeatable, one per batched input) [default: axis 0 of the inputs].",
)

mesh_option = click.option("--mesh", callback=parse_mesh_option, metavar="HxD", help="Hosts x devices per host, e.g. 1x4.")

cluster_option = click.option(
    "--cluster", "cluster_file", type=click.Path(path_type=Path),
    help="Cluster description in TOML (instead of --mesh/--device).",
)

bind_cores_option = click.option(
    "--bind-cores/--no-bind-cores", "bind_cores", default=True, show_default=True,
    help="Where the launcher bound no rank to cores, each rank binds itself to a share of its machine's physical "
         "cores (two or more each) and runs one onnxruntime thread per core, on one spinning pool; where it bound "
         "each to cores of its own, the working ranks also take the cores of the plan's idle ranks.",
)


def device_option(help: str):
    """``--device PRESET``; no default, so that each command can tell whether it was given."""
    return click.option("--device", type=click.Choice(sorted(DEVICE_PRESETS)), help=help)


def cluster_from_options(mesh: tuple[int, int] | None, cluster_file: Path | None, device: str | None,
                         default_device: Callable[[], str]) -> Cluster:
    """The cluster of exactly one of ``--mesh`` (with ``--device``, else ``default_device()``,
    asked only then) and ``--cluster``; click usage errors for the wrong combinations."""
    if (mesh is None) == (cluster_file is None):
        raise click.UsageError("give exactly one of --mesh and --cluster")
    if cluster_file is not None:
        if device is not None:
            raise click.UsageError("--device goes with --mesh; a cluster file names its device")
        return load_cluster_file(cluster_file)
    return make_cluster(mesh, device or default_device())


def train_options(command: Callable) -> Callable:
    """``--train``, ``--loss``, ``--optimizer``, ``--frozen``: the training step (``plan``
    plans it, ``profile`` times its operators)."""
    for option in reversed((
        click.option("--train", is_flag=True,
                     help="The training step (forward, loss, backward, update) for meshplan train: the trained "
                          "weights and the optimizer's state stay on their ranks between steps."),
        click.option("--loss", "loss_spec", metavar="SPEC",
                     help="With --train: cross_entropy:LOGITS:TARGET, mse:OUTPUT:TARGET or OUTPUT (a scalar the "
                          "model computes); TARGET becomes an input of the step."),
        click.option("--optimizer", default="adamw", show_default=True, type=click.Choice(["sgd", "adamw"]),
                     help="With --train: torch.optim.SGD's or AdamW's update."),
        click.option("--frozen", "frozen", multiple=True, metavar="PATTERN",
                     help="With --train: weights whose names match this glob pattern are not trained (repeatable)."),
        click.option("--master-weights", "master_weights", is_flag=True,
                     help="With --train: hold and update the float16/bfloat16 weights in float32 (mixed precision: "
                          "the forward and backward compute in the model's dtype; meshplan train --loss-scale "
                          "scales the loss's gradient)."),
    )):
        command = option(command)
    return command


def train_spec(train: bool, loss_spec: str | None, optimizer: str, frozen,
               master_weights: bool = False) -> "TrainSpec | None":
    """The ``TrainSpec`` the train options give (None without ``--train``); a usage error
    for ``--loss``, ``--frozen`` or ``--master-weights`` without it, or ``--train`` without
    ``--loss``."""
    from meshplan.training.step_model import TrainSpec

    if not train:
        if loss_spec is not None or frozen or master_weights:
            raise click.UsageError("--loss, --frozen and --master-weights go with --train")
        return None
    if loss_spec is None:
        raise click.UsageError("--train needs --loss")
    return TrainSpec(loss_spec, optimizer, tuple(frozen), master_weights=master_weights)
