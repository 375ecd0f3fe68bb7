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


# --- transparent huge pages for malloc's memory ----------------------------------------------------

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
HEAP_TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "MESHPLAN_HUGE_PAGES"


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), None where
    it has none to say."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _glibc_at_least(major: int, minor: int) -> bool:
    import platform

    name, version = platform.libc_ver()
    if name != "glibc":
        return False
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return found >= (major, minor)


# The commands that start with huge pages unless MESHPLAN_HUGE_PAGES=0: decode-bound, they
# run many steps after one load. The other commands that run models (run, verify, profile:
# often one call after a load) start with them only with MESHPLAN_HUGE_PAGES=1, since a load
# may wait for the kernel to compact memory into free 2 MiB blocks.
HUGE_BY_DEFAULT = frozenset({"generate", "serve"})
HUGE_WHEN_ASKED = frozenset({"run", "verify", "profile"})


def gpu_visible(environ: dict) -> bool:
    """Whether an NVIDIA GPU is there for this process (its driver, a device, not hidden by
    ``CUDA_VISIBLE_DEVICES``): where ``--provider auto`` will be CUDA. Read from the file
    system alone, before anything is imported."""
    import glob
    import os

    if environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1", "none", "NoDevFiles"):
        return False
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def huge_page_environment(environ: dict, mode: str | None = None, command: str | None = "generate",
                          provider: str | None = None) -> dict | None:
    """The environment to start ``command``'s process (default: ``generate``'s) again with,
    so that malloc asks the kernel for transparent huge pages (glibc's
    ``glibc.malloc.hugetlb=1``, read once when a process starts): where the kernel gives
    them only to memory that asks (mode ``madvise``), glibc is 2.35 or later, the setting is
    not there yet, and the command is one of ``HUGE_BY_DEFAULT`` (unless
    ``MESHPLAN_HUGE_PAGES=0``) or of ``HUGE_WHEN_ASKED`` with ``MESHPLAN_HUGE_PAGES=1``.
    None: nothing to do.

    onnxruntime's CPU provider packs each weight of a matrix product into memory it mallocs;
    a decode step streams all of it, and with 4 KiB pages a step's address translations miss
    the TLB every few kilobytes. A GPU's job (``provider``, the command's ``--provider``:
    ``cuda``, or ``auto`` or none where a GPU is visible) keeps its weights on the GPU: it
    starts again only with ``MESHPLAN_HUGE_PAGES=1`` (a second interpreter start, 20-30 ms,
    and a load that may wait for the kernel to compact memory, for nothing)."""
    asked = environ.get(OPT_OUT)
    on_gpu = provider == "cuda" or (provider in (None, "auto") and command in HUGE_BY_DEFAULT
                                    and gpu_visible(environ))
    if command in HUGE_BY_DEFAULT:
        wanted = asked == "1" if on_gpu else asked != "0"
    else:
        wanted = command in HUGE_WHEN_ASKED and asked == "1"
    if not wanted or HEAP_TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":"):
        return None
    if (mode if mode is not None else thp_mode()) != "madvise" or not sys.platform.startswith("linux") \
            or not _glibc_at_least(2, 35):
        return None
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":")
                if t and not t.startswith("glibc.malloc.hugetlb=")]
    return {**environ, "GLIBC_TUNABLES": ":".join([*tunables, HEAP_TUNABLE])}


def heap_huge_pages(environ: dict | None = None) -> str:
    """How ``generate`` and ``serve`` page malloc's memory here, in words (``meshplan doctor``)."""
    import os

    environ = os.environ if environ is None else environ
    mode = thp_mode()
    if mode is None:
        return "no transparent huge pages on this system"
    if mode == "always":
        return "transparent huge pages for all memory (the kernel's mode: always)"
    if mode == "never":
        return "no transparent huge pages (the kernel's mode: never)"
    if environ.get(OPT_OUT) == "0":
        return f"4 KiB pages for malloc's memory ({OPT_OUT}=0)"
    if HEAP_TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":") \
            or huge_page_environment({k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}, mode,
                                     provider="cpu") is not None:
        if environ.get(OPT_OUT) == "1":
            return "transparent huge pages for malloc's memory in every command that runs models (glibc.malloc.hugetlb=1)"
        gpu = " on the CPU (a GPU's job keeps 4 KiB pages: its weights are on the GPU)" if gpu_visible(environ) else ""
        return f"transparent huge pages for malloc's memory in generate and serve{gpu} (glibc.malloc.hugetlb=1)"
    return "4 KiB pages for malloc's memory (this glibc cannot ask for huge pages)"
