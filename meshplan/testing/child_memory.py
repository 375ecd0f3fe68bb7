"""A ``meshplan`` command run in a child process that reports its own peak RSS.

The child runs the command line in-process and prints, as its last line, a JSON record
``{"peak_rss_bytes": …}`` (VmHWM: the peak of that process image alone). Used by the
tests and benchmarks that hold a command to a memory bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import json, sys
from cli.main import main
from meshplan.process_memory import peak_rss_bytes
try:
    main(sys.argv[1:], standalone_mode=False)
except SystemExit as exc:
    if exc.code:
        raise
print(json.dumps({"peak_rss_bytes": peak_rss_bytes()}))
"""


def run_measured(args: list[str], cwd: str | Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``meshplan ARGS`` in a child process; its stdout ends with the peak-RSS record."""
    return subprocess.run([sys.executable, "-c", _SCRIPT, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def peak_of(done: subprocess.CompletedProcess) -> int | None:
    """The child's peak RSS in bytes, or None when it failed."""
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return None
    return int(json.loads(lines[-1])["peak_rss_bytes"])
