"""This machine's and this process's memory, as /proc tells it."""

from __future__ import annotations

import sys


def _proc_field(path: str, key: str) -> int | None:
    """The value of ``key`` (given in kB) in a /proc status-style file, in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set so far: VmHWM where /proc has it (ru_maxrss would
    carry the peak of the process it was forked from across exec), else ru_maxrss."""
    found = _proc_field("/proc/self/status", "VmHWM:")
    if found is not None:
        return found
    import resource

    scale = 1 if sys.platform == "darwin" else 1024     # bytes on macOS, kilobytes elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    return _proc_field("/proc/meminfo", "MemAvailable:")
