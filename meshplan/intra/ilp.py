"""The intra-operator ILP (Alpa's formulation), solved with python-mip.

Each node v picks one of k_v strategies (one-hot s_v); the objective is

    Σ_v s_vᵀ c_v  +  Σ_(v,u) s_vᵀ R_vu s_u

where c_v holds compute + communication seconds per strategy and R_vu the resharding
seconds between v's output under strategy i and what u's strategy j needs. The quadratic
term is linearised with one variable e_vu(i, j) per edge and strategy pair, tied to
the nodes by its marginals: Σ_j e_vu(i, j) = s_v(i) and Σ_i e_vu(i, j) = s_u(j). With s
one-hot these force e_vu to the product, so e needs no integrality (and this form's LP
relaxation is much tighter than the textbook e ≤ s_v, e ≤ s_u, Σ e = 1). A memory row bounds
Σ_v s_vᵀ m_v (bytes per device). Infinite entries forbid a choice or a pair.

The problem is shrunk before it reaches the solver: nodes with one feasible choice are
fixed and their edges folded into the other end's costs, and parallel edges are merged.

The answer depends on the problem alone: the solver runs single-threaded with a fixed
seed to optimality, bounded by a work limit (branch-and-bound nodes) that does not
depend on the clock. A wall-clock limit remains only as a safety stop; a solution cut
short by either limit carries a ``warning`` that the plan's solver statistics report.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from meshplan.errors import PlanError

SOLVERS = ("cbc", "highs")
OBJECTIVE_SCALE = 1e6   # the ILP's objective in microseconds (costs are seconds)
SOLVER_NAMES = {"cbc": "CBC", "highs": "HiGHS"}
# What to do when a solver does not load: the other one, or the package that brings it.
REMEDIES = {
    "cbc": "use --solver highs, or reinstall mip's CBC: pip install --force-reinstall 'mip>=1.17,<3' cbcbox",
    "highs": "use --solver cbc, or install a HiGHS that mip can load: pip install 'highspy>=1.9,<1.16'",
}
MAX_NODES = 100_000        # branch-and-bound nodes: the work limit (deterministic)
SAFETY_SECONDS = 600.0     # wall-clock safety stop (reported, never silent)
clock = time.perf_counter  # the time source for statistics and the safety check


@dataclass
class IlpNode:
    name: str
    costs: np.ndarray                 # (k,) seconds per strategy; inf = not allowed
    memory: np.ndarray | None = None  # (k,) bytes per device per strategy


@dataclass
class IlpEdge:
    src: int
    dst: int
    costs: np.ndarray                 # (k_src, k_dst) seconds; inf = not allowed


@dataclass
class ShardingProblem:
    nodes: list[IlpNode]
    edges: list[IlpEdge] = field(default_factory=list)
    memory_limit: float | None = None


@dataclass
class ShardingSolution:
    choices: list[int]
    objective: float
    seconds: float = 0.0
    variables: int = 0
    constraints: int = 0
    solver: str = ""
    warning: str | None = None        # why the solution may not be optimal, when it may not be


class _Kept(logging.Handler):
    """Keeps python-mip's log records (its solver loaders log failures at import) off the
    terminal; ``solver_problem`` quotes them."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


_MIP_LOG = _Kept()


def _mip():
    """python-mip, imported with its log records kept (see ``_Kept``)."""
    logger = logging.getLogger("mip")
    if _MIP_LOG not in logger.handlers:
        logger.addHandler(_MIP_LOG)
        logger.propagate = False
    import mip

    return mip


@functools.cache
def solver_problem(solver: str) -> str | None:
    """Why ``solver`` ("cbc" or "highs") cannot solve here, in one line ending with the
    remedy; None when it loads. Tried once per process."""
    if solver not in SOLVERS:
        return f"unknown ILP solver {solver!r} (choose from {', '.join(SOLVERS)})"
    name = SOLVER_NAMES[solver]
    try:
        mip = _mip()
        mip.Model(solver_name=mip.CBC if solver == "cbc" else mip.HIGHS)
    except Exception as exc:  # python-mip raises several types for a library it cannot load
        said = [m for m in _MIP_LOG.messages if name.lower() in m.lower()]
        reason = said[0] if said else str(exc) or type(exc).__name__
        reason = " ".join(reason.split()).split("  Additionally")[0].split(" Additionally,")[0]
        reason = reason.split("library: ", 1)[-1] if reason.startswith("An error occurred") else reason
        return f"the {name} solver does not load: {reason[:200]} ({REMEDIES[solver]})"
    return None


def check_solver(solver: str) -> None:
    """Raise the one-line ``PlanError`` of ``solver_problem`` when ``solver`` cannot solve here."""
    problem = solver_problem(solver)
    if problem:
        raise PlanError(problem)


def evaluate(problem: ShardingProblem, choices: list[int]) -> float:
    """Objective of a full assignment (inf if it breaks a constraint)."""
    total = sum(float(node.costs[c]) for node, c in zip(problem.nodes, choices))
    total += sum(float(e.costs[choices[e.src], choices[e.dst]]) for e in problem.edges)
    if problem.memory_limit is not None:
        used = sum(float(n.memory[c]) for n, c in zip(problem.nodes, choices) if n.memory is not None)
        if used > problem.memory_limit * (1 + 1e-9):
            return float("inf")
    return total


def solve(problem: ShardingProblem, solver: str = "cbc", max_nodes: int = MAX_NODES,
          time_limit: float | None = None, gap: float = 0.0) -> ShardingSolution:
    """Optimal strategy per node. Deterministic for the same problem unless the wall-clock
    safety stop (``time_limit``, default ``SAFETY_SECONDS``) cuts the search short. ``gap``
    (> 0): stop at a solution within this fraction of the bound (the solver's default else)."""
    time_limit = SAFETY_SECONDS if time_limit is None else time_limit
    check_solver(solver)
    started = clock()
    nodes = problem.nodes
    allowed = [np.isfinite(n.costs) for n in nodes]
    for index, ok in enumerate(allowed):
        if not ok.any():
            raise PlanError(f"no strategy is allowed for node '{nodes[index].name}'")
    # Fold edges touching a node with one allowed choice into the other end's costs.
    linear = [np.where(ok, n.costs, 0.0).astype(np.float64) for n, ok in zip(nodes, allowed)]
    fixed = {i: int(np.flatnonzero(ok)[0]) for i, ok in enumerate(allowed) if ok.sum() == 1}
    constant = 0.0
    merged: dict[tuple[int, int], np.ndarray] = {}
    for edge in problem.edges:
        if edge.src == edge.dst:
            raise PlanError("an edge joins a node to itself")
        costs = np.asarray(edge.costs, dtype=np.float64)
        if edge.src in fixed and edge.dst in fixed:
            constant += costs[fixed[edge.src], fixed[edge.dst]]
        elif edge.src in fixed:
            row = costs[fixed[edge.src], :]
            allowed[edge.dst] &= np.isfinite(row)
            linear[edge.dst] = linear[edge.dst] + np.where(np.isfinite(row), row, 0.0)
        elif edge.dst in fixed:
            col = costs[:, fixed[edge.dst]]
            allowed[edge.src] &= np.isfinite(col)
            linear[edge.src] = linear[edge.src] + np.where(np.isfinite(col), col, 0.0)
        else:
            key = (edge.src, edge.dst) if edge.src < edge.dst else (edge.dst, edge.src)
            oriented = costs if edge.src < edge.dst else costs.T
            merged[key] = merged.get(key, 0.0) + oriented
    if np.isinf(constant) or any(not ok.any() for ok in allowed):
        raise PlanError("no feasible sharding: fixed strategies conflict")

    free = [i for i in range(len(nodes)) if i not in fixed]
    if not free:   # nothing to choose: no solver (which would say so on the terminal)
        choices = [fixed[i] for i in range(len(nodes))]
        objective = evaluate(problem, choices)
        if np.isinf(objective):
            raise PlanError("no sharding fits the device memory")
        return ShardingSolution(choices, objective, clock() - started, 0, 0, solver)

    mip = _mip()

    model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC if solver == "cbc" else mip.HIGHS)
    model.verbose = 0
    model.threads = 1
    if solver == "cbc":
        model.seed = 0
    # Expressions are built from (variables, coefficients) lists: the same rows, columns
    # and order as summing terms, without an expression object per term.
    linexpr = mip.LinExpr
    s = {}
    variables, coefficients = [], []          # the objective
    for i in range(len(nodes)):
        if i in fixed:
            continue
        choices = np.flatnonzero(allowed[i]).tolist()
        for k in choices:
            s[i, k] = model.add_var(var_type=mip.BINARY, name=f"s_{i}_{k}")
            if linear[i][k]:
                variables.append(s[i, k])
                coefficients.append(float(linear[i][k]))
        model.add_constr(linexpr([s[i, k] for k in choices], [1] * len(choices), const=-1, sense="="), name=f"one_{i}")
    for (a, b), costs in merged.items():
        rows, cols = np.flatnonzero(allowed[a]).tolist(), np.flatnonzero(allowed[b]).tolist()
        finite = [(p, q) for p in rows for q in cols if np.isfinite(costs[p, q])]
        if not finite:
            raise PlanError(f"no compatible strategies between '{nodes[a].name}' and '{nodes[b].name}'")
        e = {(p, q): model.add_var(lb=0.0, ub=1.0, name=f"e_{a}_{b}_{p}_{q}") for p, q in finite}
        # Marginals: the pair variables of row p sum to s_v(p), of column q to s_u(q). With
        # one-hot s this makes e the product; a choice with no finite partner gets 0.
        for p in rows:
            row = [e[p, q] for q in cols if (p, q) in e]
            model.add_constr(linexpr(row + [s[a, p]], [1] * len(row) + [-1], sense="="))
        for q in cols:
            col = [e[p, q] for p in rows if (p, q) in e]
            model.add_constr(linexpr(col + [s[b, q]], [1] * len(col) + [-1], sense="="))
        for p, q in finite:
            if costs[p, q]:
                variables.append(e[p, q])
                coefficients.append(float(costs[p, q]))
    if problem.memory_limit is not None:
        fixed_memory = sum(float(nodes[i].memory[k]) for i, k in fixed.items() if nodes[i].memory is not None)
        held = [(var, float(nodes[i].memory[k])) for (i, k), var in s.items() if nodes[i].memory is not None]
        model.add_constr(linexpr([v for v, _ in held], [c for _, c in held],
                                 const=-(problem.memory_limit - fixed_memory), sense="<"), name="memory")
    # in microseconds: the solvers' absolute tolerances (1e-6 and below) are a sizeable part
    # of costs in seconds (a layer's ILP objective is often under 1e-3), and CBC stopped up
    # to 1 % above the optimum HiGHS found on the same problem
    model.objective = linexpr(variables, [c * OBJECTIVE_SCALE for c in coefficients])
    if gap > 0:
        model.max_mip_gap = gap
    status = model.optimize(max_seconds=time_limit, max_nodes=max_nodes)
    warning = None
    if status == mip.OptimizationStatus.FEASIBLE:
        warning = (f"an ILP stopped at the {time_limit:g} s wall-clock safety stop before proving optimality; "
                   "the plan may differ on another machine" if clock() - started >= time_limit else
                   f"an ILP stopped at the work limit of {max_nodes} nodes before proving optimality")
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        raise PlanError("no sharding fits the device memory" if status == mip.OptimizationStatus.INFEASIBLE
                        else f"the ILP solver stopped without a solution ({status.name})")
    choices = []
    for i in range(len(nodes)):
        if i in fixed:
            choices.append(fixed[i])
        else:
            choices.append(max(np.flatnonzero(allowed[i]), key=lambda k: s[i, k].x))
    choices = [int(c) for c in choices]
    return ShardingSolution(
        choices, evaluate(problem, choices), clock() - started,
        model.num_cols, model.num_rows, solver, warning,
    )
