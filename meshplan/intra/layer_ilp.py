"""One layer's sharding ILP: every operator's strategies, their compute and weight costs,
the resharding between them, and the boundary layouts on both sides of the layer.

A tensor crossing a layer boundary is either replicated (``R``) or split along its first
(batch) dimension over the whole mesh (``B``); model inputs and outputs are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshplan.intra.fold import fold_followers
from meshplan.intra.ilp import MAX_NODES, IlpEdge, IlpNode, ShardingProblem, ShardingSolution, solve
from meshplan.intra.operator_cost import OperatorCosts, held_bytes
from meshplan.intra.pins import Pins
from meshplan.intra.policies import apply_policy
from meshplan.intra.strategies import Strategy, node_strategies
from meshplan.model.graph import Graph
from meshplan.ops import entry
from meshplan.reshard.steps import reshard_seconds, reshard_steps
from meshplan.sharding import R, S0, S01, S1, LogicalMesh, ShardingSpec

BOUNDARY_KINDS = ("R", "B")
# Seconds added to any resharding of a state tensor that moves bytes: state stays where it
# is made (a plan moves the cache only where nothing else can run, e.g. no rule splits its reader).
STATE_MOVE_PENALTY = 1.0
# A layer ILP of at most this many strategy and edge-pair variables is solved as it is;
# a larger one first folds its cheap followers into their producers (``fold_followers``),
# which shrinks it but can miss the optimum: a follower's choice is fixed by its producer's.
EXACT_SIZE = 2000


def ilp_size(problem: ShardingProblem) -> int:
    """Variables of the problem's ILP: one per node strategy and per edge strategy pair."""
    return sum(len(n.costs) for n in problem.nodes) + sum(int(np.size(e.costs)) for e in problem.edges)


def boundary_spec(kind: str, shape: tuple[int, ...], mesh: LogicalMesh) -> ShardingSpec:
    """Layout of a tensor crossing a layer boundary: replicated, or batch-split."""
    spec = ShardingSpec.replicated(len(shape))
    if kind == "B" and shape:
        n, m = mesh.shape
        first = S01 if n > 1 and m > 1 else S0 if n > 1 else S1 if m > 1 else R
        split = ShardingSpec((first,) + (R,) * (len(shape) - 1))
        if split.is_valid_for(shape, mesh):
            return split
    return spec


@dataclass
class LayerSolution:
    seconds: float
    strategies: list[Strategy]                # chosen strategy per node of the layer, in order
    param_bytes: float
    variables: int = 0
    constraints: int = 0
    slices: dict = field(default_factory=dict)   # (initializer, layout) → bytes stored per device
    # of ``seconds``: resharding from the boundary layout on entry, and into it on leaving
    entering_seconds: float = 0.0
    leaving_seconds: float = 0.0


class LayerIlp:
    """Builds and solves the ILP of a range of a graph's nodes."""

    def __init__(self, graph: Graph, costs: OperatorCosts, constants: dict[str, np.ndarray],
                 solver: str = "cbc", policy: str = "auto", pins: Pins | None = None):
        self.graph, self.costs, self.constants = graph, costs, constants
        self.solver, self.policy = solver, policy
        self.pins = pins            # hinted operators: the strategies they may take (``intra.pins``)
        self._producers = graph.producers()
        self._consumers = graph.consumers()
        self._outputs = set(graph.outputs)
        self._state_outputs = set(graph.state)
        self._state_inputs = set(graph.state.values())
        # (submesh, logical) → (src, its segments, dst, its segments, shape, itemsize) → seconds
        self._reshard_memo: dict[tuple, dict] = {}
        self._inputs = set(graph.inputs)
        self._last_body: tuple | None = None          # the latest layer body, reused by its sibling ILPs

    def solve(self, start: int, stop: int, submesh, logical, b_in: str, b_out: str,
              memory_limit: float | None = None) -> tuple[LayerSolution, ShardingSolution]:
        """Every operator's strategy for layer nodes [start, stop), and the solver's answer."""
        mesh = LogicalMesh(logical, tuple(range(logical[0] * logical[1])))
        tensors = self.graph.tensors
        body = self._body(start, stop, submesh, logical, mesh)
        reshard = body.reshard
        nodes, entry_costs, exit_costs = [], [], []
        for offset, (i, strategies, costs, memory) in enumerate(zip(range(start, stop), body.choices, body.costs,
                                                                        body.memory)):
            node = self.graph.nodes[i]
            entering, leaving = np.zeros(len(strategies)), np.zeros(len(strategies))
            # Inputs from outside the layer arrive in the boundary layout (model inputs replicated;
            # state inputs, in their reader's layout, are not among them).
            for k, name in body.entering[offset]:
                kind = "R" if name in self._inputs else b_in
                arriving = boundary_spec(kind, tensors[name].split_sizes, mesh)
                entering = entering + np.array([reshard(arriving, s.inputs[k], name) for s in strategies])
            # Outputs that leave the layer are handed on in the boundary layout (model outputs
            # replicated; state read by no other layer stays where it is made, and is not here).
            for k, name in body.leaving[offset]:
                kind = "R" if name in self._outputs and name not in self._state_outputs else b_out
                target = boundary_spec(kind, tensors[name].split_sizes, mesh)
                leaving = leaving + np.array([reshard(s.outputs[k], target, name) for s in strategies])
            entry_costs.append(entering)
            exit_costs.append(leaving)
            nodes.append(IlpNode(node.name, costs + entering + leaving, memory))
        whole = ShardingProblem(nodes, body.edges, memory_limit)
        if ilp_size(whole) <= EXACT_SIZE:   # small enough to solve as it is: folding only approximates
            problem, recover = whole, list
        else:
            problem, recover = fold_followers(whole, body.heavy)
        lean = memory_limit is not None
        result = solve(problem, self.solver, self.costs.lean_nodes if lean and self.costs.lean_nodes else MAX_NODES,
                       gap=self.costs.lean_gap if lean else 0.0)
        full = recover(result.choices)
        picked = [body.choices[offset][full[offset]] for offset in range(stop - start)]
        slices = {}
        for i, strategy in zip(range(start, stop), picked):
            slices.update(self.costs.param_slices(self.graph.nodes[i], strategy, mesh))
        entering = float(sum(entry_costs[offset][full[offset]] for offset in range(stop - start)))
        leaving = float(sum(exit_costs[offset][full[offset]] for offset in range(stop - start)))
        return LayerSolution(result.objective, picked, held_bytes(slices), result.variables, result.constraints,
                             slices, entering, leaving), result

    def _body(self, start: int, stop: int, submesh, logical, mesh: LogicalMesh) -> "_LayerBody":
        """What a layer's ILPs on one logical mesh share whatever its boundary layouts: the
        strategies, compute and weight costs of its operators and the resharding on the
        edges inside it (built once per layer range and mesh, for the four boundary
        combinations and the memory-lean variant)."""
        key = (start, stop, submesh, logical)
        if self._last_body is not None and self._last_body[0] == key:
            return self._last_body[1]
        collectives = self.costs.collectives(submesh, logical)
        tensors = self.graph.tensors
        memo = self._reshard_memo.setdefault((submesh, logical), {})

        state = self._state_outputs | self._state_inputs
        factor = self.costs.reshard_factor

        def reshard(src: ShardingSpec, dst: ShardingSpec | None, name: str) -> float:
            if dst is None:
                return 0.0
            info = tensors[name]
            # segments take no part in a spec's equality but do in its resharding
            key = (src, src.segments, dst, dst.segments, info.shape, info.dtype.itemsize)
            seconds = memo.get(key)
            if seconds is None:
                try:
                    seconds = reshard_seconds(src, dst, info.shape, info.dtype.itemsize, mesh, collectives)
                except ValueError:
                    seconds = float("inf")
                memo[key] = seconds
            if name in state and seconds < float("inf") and any(step.kind.name != "slice"
                                                                 for step in reshard_steps(src, dst)):
                seconds += STATE_MOVE_PENALTY
            return seconds * factor

        body = _LayerBody(reshard)
        for i in range(start, stop):
            node = self.graph.nodes[i]
            strategies = apply_policy(self.policy, node, self.graph,
                                      node_strategies(node, self.graph, mesh, self.constants, opset=self.graph.opset),
                                      self.constants)
            costs = np.array([self.costs.strategy_seconds(node, s, mesh, collectives) for s in strategies])
            allowed = self.pins.allowed(i, node, strategies, mesh) if self.pins else None
            if allowed is not None:
                costs = np.where(allowed, costs, np.inf)
            entering, leaving = [], []
            for k, name in enumerate(node.inputs):
                if not name or tensors[name].is_param or start <= self._producers.get(name, -1) < stop:
                    continue
                if name in self._state_inputs:
                    # state arrives in whatever layout its reader takes (it stays there between
                    # calls), but whole: a state is never held as addends
                    costs = costs + np.array([float("inf") if s.inputs[k] is not None and s.inputs[k].partial else 0.0
                                              for s in strategies])
                    continue
                entering.append((k, name))
            for k, name in enumerate(node.outputs):
                if not name:
                    continue
                read_outside = any(not (start <= c < stop) for c in self._consumers.get(name, []))
                if name in self._state_outputs and not read_outside:
                    # state stays in the layout it is made in (whole: never as addends)
                    costs = costs + np.array([float("inf") if s.outputs[k] is not None and s.outputs[k].partial else 0.0
                                              for s in strategies])
                    continue
                if name in self._outputs or read_outside:
                    leaving.append((k, name))
            body.choices.append(strategies)
            body.costs.append(costs)
            body.memory.append(np.array([self.costs.param_bytes(node, s, mesh) for s in strategies]))
            body.entering.append(entering)
            body.leaving.append(leaving)
            body.heavy.append(entry(node.op_type, node.domain).heavy)
        for i in range(start, stop):
            node = self.graph.nodes[i]
            for k, name in enumerate(node.inputs):
                where = self._producers.get(name) if name else None
                if where is None or not (start <= where < stop):
                    continue
                out_index = self.graph.nodes[where].outputs.index(name)
                src, dst = body.choices[where - start], body.choices[i - start]
                matrix = np.array([[reshard(a.outputs[out_index], b.inputs[k], name) for b in dst] for a in src])
                body.edges.append(IlpEdge(where - start, i - start, matrix))
        self._last_body = (key, body)
        return body


@dataclass
class _LayerBody:
    reshard: object
    choices: list = field(default_factory=list)      # strategies per node
    costs: list = field(default_factory=list)        # compute seconds per strategy
    memory: list = field(default_factory=list)       # weight bytes per strategy
    entering: list = field(default_factory=list)     # per node: (input index, name) arriving from outside
    leaving: list = field(default_factory=list)      # per node: (output index, name) handed on from the layer
    heavy: list = field(default_factory=list)
    edges: list = field(default_factory=list)
