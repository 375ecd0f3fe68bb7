"""Transparent huge pages for malloc's memory: when a ``meshplan`` command starts itself
again with glibc's ``glibc.malloc.hugetlb=1`` (``process_memory.huge_page_environment``:
``generate`` and ``serve`` by default, ``run``/``verify``/``profile`` when asked), and that
the start really happens, once, in the same process (``cli.launch``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan import process_memory
from meshplan.process_memory import HEAP_TUNABLE, huge_page_environment, thp_mode

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def modern_glibc(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(process_memory, "gpu_visible", lambda environ: False)


def test_mode_read_from_the_kernels_file(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert thp_mode(str(path)) == "always"
    assert thp_mode(str(tmp_path / "missing")) is None


def test_asked_for_only_where_the_kernel_gives_them_on_request(modern_glibc):
    env = huge_page_environment({"PATH": "/bin"}, mode="madvise")
    assert env["GLIBC_TUNABLES"] == HEAP_TUNABLE and env["PATH"] == "/bin"
    assert huge_page_environment({}, mode="always") is None     # the kernel gives them anyway
    assert huge_page_environment({}, mode="never") is None


def test_other_tunables_kept_and_a_different_hugetlb_replaced(modern_glibc):
    env = huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"}, mode="madvise")
    assert env["GLIBC_TUNABLES"].split(":") == ["glibc.malloc.arena_max=2", HEAP_TUNABLE]


def test_nothing_to_do_when_set_or_opted_out(modern_glibc):
    assert huge_page_environment({"GLIBC_TUNABLES": f"a=1:{HEAP_TUNABLE}"}, mode="madvise") is None
    assert huge_page_environment({"MESHPLAN_HUGE_PAGES": "0"}, mode="madvise") is None
    assert huge_page_environment({"MESHPLAN_HUGE_PAGES": "1"}, mode="madvise") is not None


def test_old_glibc_or_another_libc_left_alone(monkeypatch):
    import platform

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.31"))
    assert huge_page_environment({}, mode="madvise") is None
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert huge_page_environment({}, mode="madvise") is None


# The launcher in a process of its own: the code given to ``python -c`` runs again after the
# start with huge pages, so it prints each start's process id and setting.
PROBE = """
import os, sys, json
print("PROBE", json.dumps([os.getpid(), os.environ.get("GLIBC_TUNABLES", "")]), flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "touch":
    import ctypes    # (not numpy: it asks for huge pages for its own arrays)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    block = libc.malloc(64 << 20)           # 64 MiB that malloc maps and the probe touches
    ctypes.memset(block, 1, 64 << 20)
    rollup = open("/proc/self/smaps_rollup").read()
    huge = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("AnonHugePages"))
    print("PROBE", json.dumps(["huge", huge]), flush=True)
sys.argv = ["meshplan", "generate", "--help"]
from cli.launch import main
main()
"""


def _probe(env: dict, *extra: str) -> list:
    """The probe's lines (``meshplan generate --help`` runs after them)."""
    done = subprocess.run([sys.executable, "-c", PROBE, "x", *extra], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout        # the command ran after the start
    return [json.loads(line[len("PROBE "):]) for line in done.stdout.splitlines() if line.startswith("PROBE ")]


def test_generate_starts_again_once_in_the_same_process():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MESHPLAN_HUGE_PAGES")}
    starts = _probe(env)
    if huge_page_environment(env) is not None:
        assert len(starts) == 2 and starts[0][0] == starts[1][0]     # execve: the same process
        assert starts[0][1] == "" and HEAP_TUNABLE in starts[1][1].split(":")
    else:   # this machine's kernel or libc gives nothing to ask for: one start, unchanged
        assert len(starts) == 1 and starts[0][1] == ""


def test_opted_out_with_meshplan_huge_pages_0():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["MESHPLAN_HUGE_PAGES"] = "0"
    starts = _probe(env)
    assert len(starts) == 1 and starts[0][1] == ""


@pytest.mark.parametrize("asked, command, starts_again", [
    (None, "generate", True), (None, "serve", True), ("0", "serve", False),
    (None, "run", False), ("1", "run", True), ("1", "verify", True), ("1", "profile", True),
    ("1", "plan", False), ("1", "doctor", False), (None, None, False),
])
def test_which_commands_start_again(modern_glibc, asked, command, starts_again):
    env = {} if asked is None else {"MESHPLAN_HUGE_PAGES": asked}
    assert (huge_page_environment(env, mode="madvise", command=command) is not None) == starts_again


def test_the_command_named_on_a_command_line():
    from cli.launch import command_of

    assert command_of(["meshplan", "--debug", "generate", "plan/"]) == "generate"
    assert command_of(["meshplan", "run", "plan/", "--inputs", "x.npz"]) == "run"
    assert command_of(["meshplan", "--version"]) is None


def test_doctor_says_how_generate_pages_its_memory():
    from meshplan.process_memory import heap_huge_pages

    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MESHPLAN_HUGE_PAGES")}
    said = heap_huge_pages(env)
    if huge_page_environment(env) is not None:
        assert "huge pages for malloc's memory in generate and serve" in said
        assert "every command that runs models" in heap_huge_pages({**env, "MESHPLAN_HUGE_PAGES": "1"})
    assert "4 KiB pages" in heap_huge_pages({**env, "MESHPLAN_HUGE_PAGES": "0"}) or "huge pages" not in said


def test_malloc_memory_in_huge_pages_after_the_start():
    """Where the kernel gives huge pages on request, a large block the started process
    mallocs and touches lies (partly) in them; with 4 KiB pages asked for, in none."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MESHPLAN_HUGE_PAGES")}
    applies = huge_page_environment(env) is not None
    huge = [line[1] for line in _probe(env, "touch") if line[0] == "huge"]
    assert len(huge) == (2 if applies else 1)
    if applies:
        assert huge[-1] >= 2048      # kB: at least one 2 MiB page once glibc asks for them
    off = [line[1] for line in _probe({**env, "MESHPLAN_HUGE_PAGES": "0"}, "touch") if line[0] == "huge"]
    assert off == [0] or not applies


@pytest.mark.parametrize("provider, gpu, asked, starts_again", [
    ("cuda", False, None, False), ("cuda", True, None, False), ("cuda", True, "1", True),
    ("auto", True, None, False), (None, True, None, False), (None, True, "1", True),
    ("cpu", True, None, True), ("auto", False, None, True), (None, False, None, True),
])
def test_a_gpu_job_keeps_its_pages_unless_asked(modern_glibc, monkeypatch, provider, gpu, asked, starts_again):
    """A GPU's job keeps its weights on the GPU: generate and serve start again for it only
    with MESHPLAN_HUGE_PAGES=1."""
    monkeypatch.setattr(process_memory, "gpu_visible", lambda environ: gpu)
    env = {} if asked is None else {"MESHPLAN_HUGE_PAGES": asked}
    for command in ("generate", "serve"):
        found = huge_page_environment(env, mode="madvise", command=command, provider=provider)
        assert (found is not None) == starts_again


def test_gpu_visible_reads_cuda_visible_devices(monkeypatch):
    for hidden in ("", "-1", "NoDevFiles"):
        assert not process_memory.gpu_visible({"CUDA_VISIBLE_DEVICES": hidden})
    import glob
    import os

    monkeypatch.setattr(os.path, "exists", lambda path: path == "/proc/driver/nvidia/version")
    assert process_memory.gpu_visible({}) and process_memory.gpu_visible({"CUDA_VISIBLE_DEVICES": "0"})
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    assert not process_memory.gpu_visible({})


@pytest.mark.parametrize("argv, provider", [
    (["meshplan", "generate", "m", "--provider", "cuda"], "cuda"), (["meshplan", "serve", "--provider=cpu", "m"], "cpu"),
    (["meshplan", "generate", "m"], None), (["meshplan", "generate", "--provider"], None),
])
def test_the_launcher_reads_the_provider(argv, provider):
    from cli.launch import provider_of

    assert provider_of(argv) == provider
