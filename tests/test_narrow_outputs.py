"""Part of an output asked for (``Job.run(outputs={name: box})``): where the output comes
out of a collective the box commutes with (an all-gather the box leaves whole along its dim,
an all-reduce), the box is taken before the collective, so only it crosses the ranks (a
prompt's last logits, not all of them); the values are the box of the whole either way."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.reshard.kinds import kind_of_op
from meshplan.reshard.steps import Step
from meshplan.runtime.program import narrowed_box
from sample_models import SAMPLE_DIR
from tests.conftest import run_cli, run_mpi_script


def _step(op: str, dim=None) -> Step:
    return Step(kind_of_op(op), 0, dim, None)


def test_which_boxes_commute_with_which_collectives():
    last = np.s_[:, -1:]
    assert narrowed_box(_step("AllGather", 2), last, 3) == last            # the vocabulary stays whole
    assert narrowed_box(_step("AllGather", 1), last, 3) is None            # it cuts the gathered dim
    assert narrowed_box(_step("AllGather", 2), np.s_[:, :, :10], 3) is None
    assert narrowed_box(_step("AllGather", 2), np.s_[:, :, 0:], 3) == np.s_[:, :, 0:]
    assert narrowed_box(_step("AllReduce"), np.s_[:, 3:5, 1:2], 3) == np.s_[:, 3:5, 1:2]
    assert narrowed_box(_step("ReduceScatter", 2), last, 3) is None
    assert narrowed_box(_step("AllReduce"), (slice(None),) * 3, 3) is None   # the whole: nothing to narrow
    assert narrowed_box(_step("AllReduce"), (), 3) is None


@pytest.fixture(scope="module")
def llama_1x2(tmp_path_factory):
    out = tmp_path_factory.mktemp("narrow")
    done = run_cli("plan", SAMPLE_DIR / "genai" / "llama_fp32" / "model.onnx", "--mesh", "1x2", "--generate",
                   "--max-length", "64", "--policy", "megatron", "--max-stages", "1", "-o", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["host", "on-device"])
def test_a_box_of_the_logits_crosses_alone(llama_1x2, where):
    lines = run_mpi_script("narrow_outputs_case.py", ranks=2, args=[llama_1x2] + ([where] if where != "host" else []))
    assert len(lines) == 6
