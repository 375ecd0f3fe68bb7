"""The intra-operator ILP against brute-force enumeration on small random problems."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.errors import PlanError
from meshplan.intra.ilp import IlpEdge, IlpNode, ShardingProblem, evaluate, solve
from meshplan.testing.ilp import brute_force


def random_problem(rng: np.random.Generator, nodes: int, memory: bool) -> ShardingProblem:
    items = []
    for v in range(nodes):
        k = int(rng.integers(1, 4))
        costs = rng.uniform(0, 10, k)
        if k > 1 and rng.random() < 0.2:
            costs[rng.integers(k)] = np.inf
        items.append(IlpNode(f"n{v}", costs, rng.uniform(1, 5, k) if memory else None))
    edges = []
    for u in range(1, nodes):
        for v in rng.choice(u, size=min(u, int(rng.integers(1, 3))), replace=False):
            cost = rng.uniform(0, 6, (len(items[v].costs), len(items[u].costs)))
            cost[rng.random(cost.shape) < 0.1] = np.inf
            edges.append(IlpEdge(int(v), u, cost))
    limit = None
    if memory:
        limit = float(sum(np.min(n.memory) for n in items) + rng.uniform(0, 3))
    return ShardingProblem(items, edges, limit)


@pytest.mark.parametrize("solver", ["cbc", "highs"])
@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_brute_force(seed, solver):
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, nodes=int(rng.integers(2, 7)), memory=seed % 3 == 0)
    try:
        expected = brute_force(problem)
    except PlanError:
        with pytest.raises(PlanError):
            solve(problem, solver)
        return
    got = solve(problem, solver)
    assert got.objective == pytest.approx(expected.objective, rel=1e-6, abs=1e-9)
    assert evaluate(problem, got.choices) == pytest.approx(got.objective)


def test_memory_bound_changes_the_choice():
    fast_big = IlpNode("a", np.array([1.0, 5.0]), np.array([10.0, 1.0]))
    problem = ShardingProblem([fast_big], [], memory_limit=None)
    assert solve(problem).choices == [0]
    problem.memory_limit = 2.0
    assert solve(problem).choices == [1]
    problem.memory_limit = 0.5
    with pytest.raises(PlanError, match="memory"):
        solve(problem)


def test_edge_costs_and_forbidden_pairs():
    a = IlpNode("a", np.array([0.0, 0.0]))
    b = IlpNode("b", np.array([0.0, 3.0]))
    # Resharding from a's choice 0 to b's choice 0 is forbidden, 1→0 costs 1, x→1 free.
    edge = IlpEdge(0, 1, np.array([[np.inf, 0.0], [1.0, 0.0]]))
    got = solve(ShardingProblem([a, b], [edge]))
    assert got.objective == pytest.approx(1.0) and got.choices == [1, 0]


def test_deterministic_and_reports_size():
    problem = random_problem(np.random.default_rng(42), nodes=6, memory=False)
    first, second = solve(problem), solve(problem)
    assert first.choices == second.choices
    assert first.variables > 0 and first.constraints > 0


def test_unknown_solver():
    with pytest.raises(PlanError, match="unknown ILP solver"):
        solve(ShardingProblem([IlpNode("a", np.array([1.0]))]), "gurobi")


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_nothing_to_choose_needs_no_solver_and_prints_nothing(solver, capfd):
    """Every node fixed, under a memory bound: answered without a solver (CBC would print
    "Model has no variables" on the terminal), infeasible memory still an error."""
    problem = ShardingProblem([IlpNode("a", np.array([1.0]), np.array([5.0])),
                               IlpNode("b", np.array([np.inf, 2.0]), np.array([1.0, 1.0]))],
                              [IlpEdge(0, 1, np.array([[0.5, 0.25]]))], memory_limit=10.0)
    got = solve(problem, solver)
    assert got.choices == [0, 1] and got.objective == pytest.approx(3.25) and got.variables == 0
    problem.memory_limit = 5.5
    with pytest.raises(PlanError, match="memory"):
        solve(problem, solver)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_solvers_print_nothing_of_their_own(solver, capfd):
    rng = np.random.default_rng(3)
    solve(random_problem(rng, nodes=6, memory=True), solver)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


def test_a_solver_that_does_not_load_is_one_line_with_the_remedy(tmp_path):
    """python-mip's own loader logs its failure; meshplan keeps that off the terminal and
    says which solver, why, and what to do (in a fresh process: loading happens once)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    script = ("import numpy as np\n"
              "from meshplan.errors import PlanError\n"
              "from meshplan.intra.ilp import IlpNode, ShardingProblem, solve, solver_problem\n"
              "problem = ShardingProblem([IlpNode('a', np.array([1.0, 2.0]))])\n"
              "assert solve(problem, 'cbc').choices == [0]\n"
              "try:\n    solve(problem, 'highs')\nexcept PlanError as exc:\n    print('error:', exc)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), PMIP_HIGHS_LIBRARY=str(tmp_path / "libhighs.so"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    (line,) = done.stdout.splitlines()
    assert line.startswith("error: the HiGHS solver does not load: ") and "--solver cbc" in line
    assert "libhighs.so" in line
