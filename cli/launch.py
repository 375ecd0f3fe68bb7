"""The ``meshplan`` command's entry: ``generate`` and ``serve`` (and ``run``, ``verify``,
``profile`` with ``MESHPLAN_HUGE_PAGES=1``) start their process again, once, with malloc
asking for transparent huge pages where the kernel gives them only on request
(``process_memory.huge_page_environment``), before anything is imported or allocated;
then the click group runs (``cli.main``). Under mpiexec the rank keeps its process and its
environment (``execve``). ``MESHPLAN_HUGE_PAGES=0`` keeps 4 KiB pages; a GPU's job
(``--provider cuda``, or ``auto`` where a GPU is visible) keeps them unless
``MESHPLAN_HUGE_PAGES=1``: its weights are on the GPU."""

from __future__ import annotations

import os
import sys


def command_of(argv: list[str]) -> str | None:
    """The command named on a ``meshplan`` command line (after the group's options)."""
    return next((a for a in argv[1:] if not a.startswith("-")), None)


def provider_of(argv: list[str]) -> str | None:
    """The value of ``--provider`` on a command line (None where it is not given)."""
    for index, arg in enumerate(argv):
        if arg == "--provider" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--provider="):
            return arg.split("=", 1)[1]
    return None


def main():
    from meshplan.process_memory import huge_page_environment

    environ = huge_page_environment(dict(os.environ), command=command_of(sys.argv), provider=provider_of(sys.argv))
    if environ is not None and getattr(sys, "orig_argv", None):
        try:
            os.execve(sys.executable, sys.orig_argv, environ)
        except OSError:
            pass    # this process goes on with 4 KiB pages
    from cli.main import main as group

    return group()
