"""A failure inside a job of ``meshplan generate`` or ``meshplan run`` never leaves a process
that neither works nor exits: a NaN temperature is one line before any call; a draw that
raises, a call that raises on rank 0 or on a worker, and a rank that dies each end every
rank within seconds, exit non-zero, with one error line and no traceback, and leave no
process of the job behind (``tests.jobs``: every process of the job is found by a mark in
its environment). The failures are put in by ``tests/mpi_scripts/failing_command.py``,
which patches the library in the ranks' own processes before the command runs.
"""

from __future__ import annotations

import json

import pytest

from sample_models import SAMPLES, make_inputs
from tests.conftest import run_cli, save_npz
from tests.jobs import run_marked

pytestmark = [pytest.mark.mpi, pytest.mark.serial]

ENDS_WITHIN = 30          # seconds from the start to every process gone (a start takes ~5 on 2 cores)


@pytest.fixture(scope="module")
def generation(llama_batch4, tmp_path_factory):
    """The Llama planned for 4 sequences (one prompt: the others are copies of it) and a prompt."""
    root = tmp_path_factory.mktemp("failing_generate")
    (root / "ids.json").write_text(json.dumps([[5, 6, 7, 8]]))
    (root / "plan").symlink_to(llama_batch4)
    return root


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The MLP sample split over both ranks (megatron): both work in every call."""
    root = tmp_path_factory.mktemp("failing_run")
    done = run_cli("plan", SAMPLES["mlp"].path, "--mesh", "1x2", "--dim", "batch=8", "--policy", "megatron",
                   "--max-stages", "1", "-o", root / "plan")
    assert done.returncode == 0, done.stdout + done.stderr
    save_npz(root / "in.npz", make_inputs("mlp", {"batch": 8}, seed=0))
    return root


def ended_with_one_line(ended, *fragments, code=None) -> None:
    report = f"exit {ended.returncode} after {ended.seconds:.1f} s\n{ended.stdout}\n{ended.stderr}"
    assert ended.returncode is not None, "it did not end: " + report
    assert ended.returncode != 0 if code is None else ended.returncode == code, report
    assert ended.seconds < ENDS_WITHIN, report
    assert not ended.left, f"processes {ended.left} were left: " + report
    assert "Traceback" not in ended.stderr, report
    ours = [line for line in ended.stderr.splitlines() if line.startswith("meshplan: error:")]
    assert ours, report
    for fragment in fragments:
        assert fragment in ours[0], report


def test_a_nan_temperature_is_one_line(generation):
    """(It passed the check, and numpy's draw raised on rank 0: a traceback, then a hang.) The
    other settings: ``test_serve_requests.test_the_sampler_refuses_what_it_cannot_draw_with``."""
    ended = run_marked(2, "generate", generation / "plan", "--prompt-ids", generation / "ids.json",
                       "--max-new-tokens", "4", "--temperature", "nan")
    ended_with_one_line(ended, "--temperature must be a finite number", code=1)


@pytest.mark.parametrize("failure, says", [
    ("sampler-raises", "rank 0 failed: a draw failed"),
    ("rank-1-raises-at-4", "rank 1 failed: call 4 failed on rank 1"),
    ("rank-1-dies-at-4", None),
])
def test_a_failure_inside_generate_ends_every_rank(generation, failure, says):
    ended = run_marked(2, "generate", generation / "plan", "--prompt-ids", generation / "ids.json",
                       "--max-new-tokens", "20", "--temperature", "1", "--eos", "999", failure=failure)
    if says is None:   # killed: the launcher ends the others, and no line is the rank's own
        report = f"exit {ended.returncode} after {ended.seconds:.1f} s\n{ended.stderr}"
        assert ended.returncode not in (None, 0) and ended.seconds < ENDS_WITHIN and not ended.left, report
    else:
        ended_with_one_line(ended, says)


def test_a_failure_inside_run_ends_every_rank(mlp):
    """A call that fails on rank 0 while rank 1 is inside it (closing the job, as a library
    error does, would send a header rank 1 never reads). A worker's failure: generate's."""
    ended = run_marked(2, "run", mlp / "plan", "--inputs", mlp / "in.npz", "--repeat", "3",
                       failure="rank-0-raises-at-2")
    ended_with_one_line(ended, "rank 0 failed: call 2 failed on rank 0")
