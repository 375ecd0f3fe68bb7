"""How the commands end on a user error: one line on stderr and exit 1."""

from __future__ import annotations

import sys

import click

from meshplan.errors import MeshplanError


def debugging(ctx: click.Context) -> bool:
    """``meshplan --debug``; False for a command invoked on its own, outside the group."""
    return bool((ctx.obj or {}).get("debug"))


class guard:
    """Context that turns library errors (MeshplanError) into ``meshplan: error: …`` and exit 1,
    and Ctrl-C into exit 130; with ``debug`` they propagate (tracebacks)."""

    def __init__(self, debug: bool):
        self.debug = debug

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, (click.exceptions.Exit, click.ClickException, SystemExit)):
            return False
        if self.debug:
            return False
        if isinstance(exc, MeshplanError):
            click.echo(f"meshplan: error: {exc}", err=True)
            sys.exit(1)
        if isinstance(exc, KeyboardInterrupt):
            click.echo("meshplan: interrupted", err=True)
            sys.exit(130)
        return False
