"""The onnxruntime threads of a rank (``runtime.threads``): alone on a machine it takes every
core it may run on and spins; ranks sharing a machine's cores divide them and do not spin;
ranks the launcher bound to cores of their own keep those cores and spin. A job says what
each rank got (``meshplan run``, ``generate``, ``doctor``)."""

from __future__ import annotations

import json

import pytest

from meshplan.runtime.threads import ThreadChoice, choose_threads
from tests.conftest import run_cli, run_mpi


def test_alone_takes_its_cores_and_spins():
    choice = choose_threads(1, cores={0, 1, 2, 3}, machine_cores=16)
    assert (choice.threads, choice.spinning) == (4, True)
    assert "alone on its 4 core(s)" in choice.describe()


def test_shared_cores_are_divided_without_spinning():
    choice = choose_threads(4, cores=set(range(16)), machine_cores=16, others=[set(range(16))] * 3)
    assert (choice.threads, choice.spinning) == (4, False)
    assert choice.why == "16 core(s) shared by 4 working ranks"
    assert choose_threads(3, cores={0, 1}, machine_cores=2).threads == 1   # never below one thread
    # more working ranks than cores: they take turns (meshplan run warns)
    assert choose_threads(4, cores={0, 1}, machine_cores=2).oversubscribed
    assert not choose_threads(2, cores={0, 1}, machine_cores=2).oversubscribed


def test_own_cores_from_the_launcher_keep_spinning():
    choice = choose_threads(2, cores={0, 1, 2, 3}, machine_cores=8, others=[{4, 5, 6, 7}])
    assert (choice.threads, choice.spinning, choice.bound) == (4, True, True)
    # overlapping bindings are shared cores
    overlap = choose_threads(2, cores={0, 1, 2, 3}, machine_cores=8, others=[{3, 4, 5, 6}])
    assert (overlap.threads, overlap.spinning) == (2, False)


def test_a_row_reads_back():
    choice = choose_threads(2, cores={0, 1, 2, 3}, machine_cores=4, others=[{0, 1, 2, 3}])
    assert ThreadChoice.from_row(choice.row()) == choice


def test_doctor_reports_threads():
    done = run_cli("doctor", "--json")
    facts = json.loads(done.stdout)["ranks"]
    assert len(facts) == 1 and "onnxruntime thread(s)" in facts[0]["threads"] and facts[0]["cores"]


@pytest.mark.mpi
def test_run_says_what_each_rank_got(tmp_path):
    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_plan import make_plan
    from sample_models import SAMPLE_DIR, make_inputs
    import onnx
    from tests.conftest import save_npz

    model = SAMPLE_DIR / "mlp.onnx"
    dims = {"batch": 8}
    make_plan(model, make_cluster((1, 2), "cpu"), dims, tmp_path / "plan", PlanOptions(all_devices=True))
    inputs = save_npz(tmp_path / "in.npz", make_inputs(onnx.load(str(model)), dims, seed=0))
    done = run_mpi(2, "run", tmp_path / "plan", "--inputs", inputs)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all("spinning off (" in line and "shared by 2 working ranks" in line for line in lines), \
        done.stdout
