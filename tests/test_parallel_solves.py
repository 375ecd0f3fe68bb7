"""Layer ILPs solved side by side in forked processes (``intra.parallel_solves``): the same
tables, the same ILP count and the same plan as one process solving them in turn.

The planner forks no worker once MPI has started in its process (a test of the suite may
have started it in pytest's): the cases that fork run in a fresh interpreter
(``_fresh``)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import numpy as np
import pytest

from meshplan.intra import parallel_solves
from meshplan.intra.parallel_solves import WORKERS_VARIABLE, solve_all, workers
from tests.conftest import run_cli
from sample_models import SAMPLE_DIR


def _square(job):
    if job == 3:
        raise ValueError("no answer")
    return None if job == 5 else (job * job, os.getpid())


def _fresh(function, *args):
    """``function(*args)`` run in a new interpreter (spawned: nothing of this one's MPI)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result(timeout=600)


def _cube(job):
    return job ** 3


def _answers():
    os.environ[WORKERS_VARIABLE] = "2"
    import multiprocessing

    found = solve_all(_square, list(range(8)))
    pool, workers_now = parallel_solves._held["pool"], {p.pid for p in multiprocessing.active_children()}
    again = solve_all(_square, list(range(8, 12)))          # the same solver: the same processes
    kept = parallel_solves._held["pool"] is pool and all(again[j][1] in workers_now for j in again)
    other = solve_all(_cube, list(range(4)))                # another: new ones
    replaced = parallel_solves._held["pool"] is not pool and other == {j: j ** 3 for j in range(4)}
    parallel_solves.close()
    return found, solve_all(_square, [0]), solve_all(_square, list(range(8)), count=1), os.getpid(), \
        (kept, replaced, parallel_solves._held)


def test_jobs_are_answered_in_other_processes_and_a_failure_is_left_out():
    found, few, one, here, (kept, replaced, held) = _fresh(_answers)
    assert kept and replaced and held == {}
    assert sorted(found) == [0, 1, 2, 4, 5, 6, 7]               # 3 raised: the caller solves it itself
    assert found[5] is None                                    # an answer of None is an answer
    assert all(found[j][0] == j * j for j in found if j != 5)
    assert here not in {found[j][1] for j in found if j != 5}
    assert few == {}                                           # one job: nothing to share out
    assert one == {}


def test_nothing_is_forked_once_mpi_has_started(monkeypatch):
    import sys
    import types

    monkeypatch.setenv(WORKERS_VARIABLE, "2")
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", types.SimpleNamespace(Is_initialized=lambda: True))
    assert not parallel_solves.can_fork() and solve_all(_square, list(range(8))) == {}


def test_the_worker_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(WORKERS_VARIABLE, "3")
    assert workers() == 3
    monkeypatch.delenv(WORKERS_VARIABLE)
    assert 1 <= workers() <= parallel_solves.MAX_WORKERS


@pytest.mark.parametrize("given", ["lots", "0", "-2", "1.5"])
def test_a_bad_worker_count_is_one_error_line_and_no_plan(tmp_path, monkeypatch, given):
    monkeypatch.setenv(WORKERS_VARIABLE, given)
    done = run_cli("plan", SAMPLE_DIR / "gpt.onnx", "--mesh", "2x4", "--dim", "batch=8", "--dim", "seq=32",
                   "--microbatches", 2, "--no-programs", "-o", tmp_path / "plan")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("meshplan: error:") and WORKERS_VARIABLE in lines[0] and repr(given) in lines[0]
    assert not (tmp_path / "plan").exists() and not any(tmp_path.iterdir())


def _pass(memory: float | None):
    from meshplan.cost.analytic import CostModel
    from meshplan.cost.cluster import make_cluster
    from meshplan.intra.intra_op import IntraOpPass
    from meshplan.make_plan import small_constants
    from meshplan.model.graph import build_graph
    from meshplan.model.layers import cluster_layers
    from meshplan.model.load import fix_dims, infer_shapes
    from tests.test_parameter_expressions import tied_gpt2

    model = infer_shapes(fix_dims(tied_gpt2(layers=3), {"batch": 4}))
    graph, constants = build_graph(model), small_constants(model)
    cluster = make_cluster((2, 4), "cpu")
    if memory is not None:
        cluster = replace(cluster, device=replace(cluster.device, memory_bytes=memory))
    cost_model = CostModel(cluster)
    return IntraOpPass(graph, cluster_layers(graph, cost_model.graph_seconds(graph), 8), cost_model, cluster,
                       constants)


VIEWS = [((1, 4), (1, 4)), ((1, 4), (2, 2)), ((2, 4), (2, 4)), ((2, 4), (1, 8))]


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tight"])
def test_tables_solved_side_by_side_equal_the_serial_ones(tight):
    """Every view's stage tables from a pass whose ILPs were solved in two worker processes
    (``prefetch``, and the memory-lean ones a view needs) equal a pass that solved them in
    turn; tight: a device memory between the stages' fastest weights, so that lean chains
    are solved too."""
    _fresh(_tables_case, tight)


def _tables_case(tight: bool) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        _compare_tables(tight, monkeypatch)


def _compare_tables(tight: bool, monkeypatch) -> None:
    from meshplan.intra.layer_ilp import LayerIlp

    memory = None
    if tight:
        roomy = _pass(80e9)
        weights = roomy.stage_tables(*VIEWS[0], 80e9)[1]
        memory = float(np.median(weights[np.isfinite(weights)]))
    monkeypatch.setenv(WORKERS_VARIABLE, "1")
    serial = _pass(memory)
    assert serial.prefetch(VIEWS) == 0
    expected = [serial.stage_tables(*view) for view in VIEWS]
    monkeypatch.setenv(WORKERS_VARIABLE, "2")
    here = []     # the ILPs solved in this process (the workers' calls are theirs)
    solve = LayerIlp.solve
    monkeypatch.setattr(LayerIlp, "solve", lambda self, *a, **k: here.append(a) or solve(self, *a, **k))
    side_by_side = _pass(memory)
    shared = side_by_side.prefetch(VIEWS)
    got = [side_by_side.stage_tables(*view) for view in VIEWS]
    assert shared >= parallel_solves.MIN_BATCH
    for (seconds, weights), (want_seconds, want_weights) in zip(got, expected):
        np.testing.assert_array_equal(seconds, want_seconds)
        np.testing.assert_array_equal(weights, want_weights)
    assert side_by_side.stats.ilps == serial.stats.ilps and side_by_side.stats.cache_hits == serial.stats.cache_hits
    assert side_by_side.stats.in_workers == serial.stats.ilps - len(here) and serial.stats.in_workers == 0
    assert len(here) < serial.stats.ilps
    if tight:
        assert any(key[-1] for key in side_by_side._cache)          # lean solutions made


def test_a_plan_solved_side_by_side_is_the_serial_plan(tmp_path, monkeypatch):
    found = {}
    for count in ("1", "2"):
        monkeypatch.setenv(WORKERS_VARIABLE, count)
        done = run_cli("plan", SAMPLE_DIR / "gpt.onnx", "--mesh", "2x4", "--dim", "batch=8", "--dim", "seq=32",
                       "--microbatches", 2, "--no-programs", "-o", tmp_path / count)
        assert done.returncode == 0, done.stderr
        plan = json.loads((tmp_path / count / "plan.json").read_text())
        found[count] = (tmp_path / count / "plan.json").read_bytes()
        said = re.search(r"planned in [0-9.]+ s(?: \((\d+) of its layer ILPs solved in worker processes\))?",
                         done.stdout)
        assert said is not None, done.stdout
        assert (said.group(1) is None) if count == "1" else (0 < int(said.group(1)) <= plan["solver"]["ilp"]["solved"])
    assert found["1"] == found["2"]       # the same plan, its ILP counts included
