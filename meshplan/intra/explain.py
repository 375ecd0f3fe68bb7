"""Why a sharded stage's operators have the strategies they have: the cost terms of the
layer ILP's objective for an operator's chosen strategy, for the best other one with its
neighbours' choices kept, and for the replicated one — what ``meshplan show`` prints.

The terms are the ILP's own: the operator's compute seconds under the strategy, the
resharding of its inputs from what their producers hand over (inside the stage: the
producer's chosen output layout; from another stage or the model's inputs: the layout
they arrive in) and of its outputs into what their readers inside the stage take, and
the weight bytes a device stores for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.cost.cluster import Cluster
from meshplan.cost.protocol import CostModelProtocol
from meshplan.intra.operator_cost import OperatorCosts
from meshplan.intra.policies import apply_policy
from meshplan.intra.strategies import Strategy, node_strategies
from meshplan.model.graph import Graph
from meshplan.ops import entry
from meshplan.reshard.steps import reshard_seconds
from meshplan.sharding import LogicalMesh, ShardingSpec


@dataclass(frozen=True)
class Terms:
    strategy: str
    compute: float          # seconds
    reshard_in: float       # seconds
    reshard_out: float      # seconds
    weight_bytes: float     # per device

    @property
    def total(self) -> float:
        return self.compute + self.reshard_in + self.reshard_out

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "compute_s": self.compute, "reshard_in_s": self.reshard_in,
                "reshard_out_s": self.reshard_out, "weight_bytes": self.weight_bytes}


def explain_stage(graph: Graph, cost_model: CostModelProtocol, cluster: Cluster, constants, policy: str,
                  submesh: tuple[int, int], logical: tuple[int, int], nodes: list[int],
                  chosen: dict[str, Strategy], arriving: dict[str, ShardingSpec],
                  leaving: dict[str, ShardingSpec] | None = None,
                  operator_costs: OperatorCosts | None = None) -> dict[str, dict]:
    """For each heavy operator among ``nodes`` (indices into ``graph.nodes``, a stage's
    operators in order) that has more than one strategy: {"chosen", "alternative"
    (absent when there is none), "replicated"} as ``Terms.to_dict``. ``chosen`` maps every
    operator of the stage to its strategy, ``arriving`` the stage's inputs to their layouts,
    ``leaving`` its outputs to the layouts they leave in. ``operator_costs``: the ILP's
    (default a forward call's; a training estimate's weigh the step)."""
    leaving = leaving or {}
    mesh = LogicalMesh(logical, tuple(range(logical[0] * logical[1])))
    costs = operator_costs or OperatorCosts(graph, cost_model, cluster, constants)
    collectives = costs.collectives(submesh, logical)
    producers, consumers = graph.producers(), graph.consumers()
    inside = set(nodes)
    found: dict[str, dict] = {}

    def reshard(src: ShardingSpec | None, dst: ShardingSpec | None, name: str) -> float:
        if src is None or dst is None:
            return 0.0
        info = graph.tensors[name]
        return reshard_seconds(src, dst, info.shape, info.dtype.itemsize, mesh, collectives) * costs.reshard_factor

    for index in nodes:
        node = graph.nodes[index]
        if not entry(node.op_type, node.domain).heavy or node.name not in chosen:
            continue
        strategies = apply_policy(policy, node, graph,
                                  node_strategies(node, graph, mesh, constants, opset=graph.opset), constants)
        if len(strategies) < 2:
            continue

        def terms(strategy: Strategy) -> Terms:
            into = 0.0
            for k, name in enumerate(node.inputs):
                if not name or graph.tensors[name].is_param:
                    continue
                where = producers.get(name)
                if where in inside:
                    producer = graph.nodes[where]
                    given = chosen[producer.name].outputs[producer.outputs.index(name)]
                else:
                    given = arriving.get(name) or ShardingSpec.replicated(len(graph.tensors[name].shape))
                into += reshard(given, strategy.inputs[k], name)
            out = 0.0
            for k, name in enumerate(node.outputs):
                if name in leaving:
                    out += reshard(strategy.outputs[k], leaving[name], name)
                for reader in consumers.get(name, []) if name else []:
                    if reader in inside:
                        other = graph.nodes[reader]
                        out += reshard(strategy.outputs[k], chosen[other.name].inputs[other.inputs.index(name)], name)
            return Terms(str(strategy), costs.strategy_seconds(node, strategy, mesh, collectives), into, out,
                         costs.param_bytes(node, strategy, mesh))

        mine = chosen[node.name]
        picked = terms(mine)
        others = [t for t in (terms(s) for s in strategies if s != mine) if math.isfinite(t.total)]
        best = min((t for t in others if t.strategy != str(strategies[0]) or len(others) == 1),
                   key=lambda t: t.total, default=None)
        record = {"chosen": picked.to_dict(), "replicated": terms(strategies[0]).to_dict()}
        if best is not None:
            record["alternative"] = best.to_dict()
        found[node.name] = record
    return found


def explain_plan(plan, shardings: dict[int, dict[str, Strategy]], graph: Graph, cost_model: CostModelProtocol,
                 cluster: Cluster, constants, policy: str, operator_costs: OperatorCosts | None = None) -> dict[str, dict]:
    """Per operator of the plan: {"compute_s": its seconds per microbatch under its strategy},
    and for the heavy operators of sharded stages the terms of ``explain_stage``, by the
    ILP's ``operator_costs`` (default a forward call's)."""
    index = {node.name: i for i, node in enumerate(graph.nodes)}
    found: dict[str, dict] = {}
    costs = operator_costs or OperatorCosts(graph, cost_model, cluster, constants)
    for stage in plan.stages:
        nodes = [index[name] for name in stage.operators if name in index]
        chosen = shardings.get(stage.index, {})
        logical = tuple(stage.logical_mesh)
        mesh = LogicalMesh(logical, tuple(range(logical[0] * logical[1])))
        collectives = costs.collectives(tuple(stage.submesh), logical) if chosen else None
        for i in nodes:
            node = graph.nodes[i]
            strategy = chosen.get(node.name)
            seconds = (costs.strategy_seconds(node, strategy, mesh, collectives)
                       if strategy is not None else cost_model.node_seconds(node, graph) * costs.call_factor)
            found[node.name] = {"compute_s": seconds}
        if chosen:
            arriving = {name: ShardingSpec.parse(spec) for name, spec in stage.input_specs.items()}
            leaving = {name: ShardingSpec.parse(spec) for name, spec in stage.output_specs.items()}
            for name, terms in explain_stage(graph, cost_model, cluster, constants, policy, tuple(stage.submesh),
                                             logical, nodes, chosen, arriving, leaving, costs).items():
                found[name].update(terms)
    return found
