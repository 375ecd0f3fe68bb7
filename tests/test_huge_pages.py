"""Transparent huge pages for malloc's memory: when the ``meshplan`` command starts itself
again with glibc's ``glibc.malloc.hugetlb=1`` (``process_memory.huge_page_environment``),
and that the start really happens, once, in the same process (``cli.launch``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.process_memory import HEAP_TUNABLE, huge_page_environment, thp_mode

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def modern_glibc(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(sys, "platform", "linux")


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
sys.argv = ["meshplan", "doctor", "--json"]
from cli.launch import main
main()
"""


def _probe(env: dict, *extra: str) -> tuple[list, dict]:
    """The probe's lines, and what ``meshplan doctor --json`` found after them."""
    done = subprocess.run([sys.executable, "-c", PROBE, "x", *extra], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)
    assert done.returncode in (0, 1), done.stderr     # (doctor exits 1 where something is missing)
    lines = done.stdout.splitlines()
    probes = [json.loads(line[len("PROBE "):]) for line in lines if line.startswith("PROBE ")]
    report = json.loads("\n".join(line for line in lines if not line.startswith("PROBE ")))
    return probes, report


def test_the_command_starts_again_once_in_the_same_process():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MESHPLAN_HUGE_PAGES")}
    starts, report = _probe(env)
    pages = report["ranks"][0]["pages"]
    if huge_page_environment(env) is not None:
        assert len(starts) == 2 and starts[0][0] == starts[1][0]     # execve: the same process
        assert starts[0][1] == "" and HEAP_TUNABLE in starts[1][1].split(":")
        assert "glibc.malloc.hugetlb=1" in pages
    else:   # this machine's kernel or libc gives nothing to ask for: one start, unchanged
        assert len(starts) == 1 and starts[0][1] == ""
        assert "glibc.malloc.hugetlb=1" not in pages


def test_opted_out_with_meshplan_huge_pages_0():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["MESHPLAN_HUGE_PAGES"] = "0"
    starts, report = _probe(env)
    assert len(starts) == 1 and starts[0][1] == ""
    assert "glibc.malloc.hugetlb=1" not in report["ranks"][0]["pages"]


@pytest.mark.parametrize("argv, command, starts_again", [
    (["meshplan", "--debug", "generate", "plan/"], "generate", True),
    (["meshplan", "run", "plan/", "--inputs", "x.npz"], "run", True),
    (["meshplan", "plan", "model.onnx", "--mesh", "1x2"], "plan", False),
    (["meshplan", "--version"], None, False),
])
def test_only_commands_that_run_models_start_again(argv, command, starts_again):
    from cli.launch import RUNS_MODELS, command_of

    assert command_of(argv) == command
    assert (command in RUNS_MODELS) == starts_again


def test_malloc_memory_in_huge_pages_after_the_start():
    """Where the kernel gives huge pages on request, a large block the started process
    mallocs and touches lies (partly) in them; with 4 KiB pages asked for, in none."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MESHPLAN_HUGE_PAGES")}
    applies = huge_page_environment(env) is not None
    huge = [line[1] for line in _probe(env, "touch")[0] if line[0] == "huge"]
    assert len(huge) == (2 if applies else 1)
    if applies:
        assert huge[-1] >= 2048      # kB: at least one 2 MiB page once glibc asks for them
    off = [line[1] for line in _probe({**env, "MESHPLAN_HUGE_PAGES": "0"}, "touch")[0] if line[0] == "huge"]
    assert off == [0] or not applies
