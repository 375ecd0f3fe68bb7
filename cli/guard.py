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


class rank_guard:
    """Context for a command that is one MPI rank of a job (run, generate, serve): a failure
    another rank reported ends this rank with exit 1; a failure of this rank's job is one
    line, and the whole job is aborted; a library error is one line and exit 1. Anything
    else that reaches it (an interrupt, a bug) ends the whole job too, as a failure (one
    line; ``interrupted`` and 130 for Ctrl-C): a rank that left on its own would leave the
    others waiting on it for ever. With ``debug``, the failure's traceback is printed too,
    and library errors propagate."""

    def __init__(self, debug: bool):
        self.debug = debug

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, (click.exceptions.Exit, click.ClickException, SystemExit)):
            return False
        from meshplan.errors import JobFailure, ReportedElsewhere
        from meshplan.runtime.transport import abort_job, world

        if isinstance(exc, ReportedElsewhere):
            sys.exit(1)
        if isinstance(exc, MeshplanError) and not isinstance(exc, JobFailure):
            if self.debug:
                return False
            click.echo(f"meshplan: error: {exc}", err=True)
            sys.exit(1)
        if isinstance(exc, KeyboardInterrupt):
            click.echo("meshplan: interrupted", err=True)
            abort_job(130)
            sys.exit(130)
        if not isinstance(exc, JobFailure):
            line = str(exc).splitlines()[0] if str(exc) else ""
            failure = JobFailure(f"rank {world()[1].Get_rank()} failed: {type(exc).__name__}"
                                 + (f": {line}" if line else ""))
            failure.__cause__, exc = exc, failure
        click.echo(f"meshplan: error: {exc}", err=True)
        sys.stderr.flush()
        if self.debug:
            import traceback

            traceback.print_exception(exc.__cause__ or exc)
        abort_job(1)
        sys.exit(1)
