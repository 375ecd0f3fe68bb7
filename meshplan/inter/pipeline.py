"""The inter-operator pass: layers → stage DP → stages on physical devices.

Produces a ``Plan`` (without its programs, which ``emit`` writes and fills in).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from meshplan.cost.cluster import Cluster
from meshplan.cost.analytic import CostModel
from meshplan.reshard.schedulers import ALGORITHMS
from meshplan.reshard.send_spec import best_resharding
from meshplan.errors import PlanError
from meshplan.model.graph import Graph
from meshplan.intra.intra_op import IntraOpPass, boundary_spec, layer_fingerprints
from meshplan.inter.hints import StageHints
from meshplan.model.layers import Layering, cluster_layers, repeat_period
from meshplan.plan_format import OUTPUT_COLLECTOR, Plan, Resharding, Stage, TensorSpec, Transfer
from meshplan.intra.policies import POLICIES
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.inter.stage_cost import StageCosts, logical_meshes, submesh_shapes
from meshplan.inter.stage_dp import solve_stages
from meshplan.intra.strategies import Strategy



@dataclass(frozen=True)
class PlanOptions:
    microbatches: int = 1
    num_layers: int | None = None      # default: max(32, 2 × devices), at most 128 and the node count
    solver: str = "cbc"                # the intra-operator ILP's solver: cbc or highs
    max_stages: int | None = None      # at most this many pipeline stages
    policy: str = "auto"               # strategy policy inside stages (see policies.py)
    submeshes: tuple[tuple[int, int], ...] | None = None   # submesh shapes stages may use (default: all)
    reshard_scheduler: str = "randomized_greedy"   # cross-mesh resharding scheduler (see schedulers.ALGORITHMS)
    batch_dim: tuple[str, ...] = ()    # --batch-dim: a symbolic dim's name, or INPUT:AXIS places


MAX_DEFAULT_LAYERS = 128   # the stage DP's work grows with the cube of the layer count


def default_num_layers(graph: Graph, cluster: Cluster) -> int:
    return min(len(graph.nodes), max(32, 2 * cluster.num_devices), MAX_DEFAULT_LAYERS)


def choose_layering(graph: Graph, node_seconds: list[float], cluster: Cluster, constants) -> Layering:
    """Cluster into the default number of layers, unless a count that lines the cuts up with
    the model's repeated block (see ``repeat_period``) gives fewer distinct layer structures:
    identical layers share their sharding ILPs, which is what keeps planning fast.

    Block-aligned counts (one to four blocks a layer) are tried from the device count or a
    quarter of the default up. (Coarser ones plan faster on large meshes but can give
    worse plans: a 24-block GPT-2 on 16x8 in 48 block-aligned layers is estimated 8% slower
    than in 128; ``--layers`` chooses.)"""
    most = default_num_layers(graph, cluster)
    candidates = [most]
    period = repeat_period(graph)
    if period:
        blocks = len(graph.nodes) // period
        for per_layer in (1, 2, 3, 4):
            if blocks % per_layer == 0 and max(cluster.num_devices, most // 4) <= blocks // per_layer <= most:
                candidates.append(blocks // per_layer)
    best = None
    for count in dict.fromkeys(candidates):
        layering = cluster_layers(graph, node_seconds, count)
        distinct = len(set(layer_fingerprints(graph, layering, constants)))
        if best is None or distinct < best[0]:
            best = (distinct, layering)
    return best[1]


def plan_pipeline(
    graph: Graph, cluster: Cluster, options: PlanOptions, model_info: dict, batch: dict,
    full_inputs: list[TensorSpec], full_outputs: list[TensorSpec], constants: dict[str, np.ndarray],
    cost_model: CostModel | None = None, hints: StageHints | None = None,
) -> tuple[Plan, dict[int, dict[str, Strategy]]]:
    """The plan, and the chosen strategy of every operator of each multi-device stage;
    ``hints`` pin operators' strategies and force stage cuts (``inter.hints``)."""
    started = time.perf_counter()
    if options.policy not in POLICIES:
        raise PlanError(f"unknown policy {options.policy!r} (choose from {', '.join(POLICIES)})")
    if options.reshard_scheduler not in ALGORITHMS:
        raise PlanError(f"unknown resharding scheduler {options.reshard_scheduler!r} "
                        f"(choose from {', '.join(ALGORITHMS)})")
    cost_model = cost_model or CostModel(cluster)
    node_seconds = cost_model.graph_seconds(graph)
    if options.num_layers:
        layering = cluster_layers(graph, node_seconds, options.num_layers)
    else:
        layering = choose_layering(graph, node_seconds, cluster, constants)
    if hints is not None:
        layering = hints.layering(layering)
    intra_op = IntraOpPass(graph, layering, cost_model, cluster, constants, options.solver, options.policy,
                           hints.pins if hints is not None else None)
    costs = StageCosts(graph, layering, node_seconds, cost_model, intra_op)
    submeshes = submesh_shapes(cluster)
    if options.submeshes is not None:
        submeshes = [s for s in submeshes if s in set(options.submeshes)]
        if not submeshes:
            raise PlanError(f"none of the submeshes {list(options.submeshes)} fits the mesh")
    seconds, params, acts = costs.tables(submeshes)
    if hints is not None:
        seconds = hints.mask(seconds, submeshes, layering)
    sizes = np.array([n * m for n, m in submeshes])
    dp_started = time.perf_counter()
    solution = solve_stages(
        seconds, params, acts, cluster.device.memory_bytes, sizes, cluster.num_devices, options.microbatches,
        max_stages=options.max_stages,
    )
    dp_seconds = time.perf_counter() - dp_started

    placement = place_submeshes([submeshes[c.submesh] for c in solution.stages], cluster)
    stages = []
    shardings: dict[int, dict[str, Strategy]] = {}
    layouts: dict[int, tuple[str, str]] = {}   # stage → (layout of its inputs, of its outputs)
    for index, (choice, devices) in enumerate(zip(solution.stages, placement)):
        start, stop = layering.bounds[choice.start], layering.bounds[choice.stop]
        submesh = submeshes[choice.submesh]
        logical = logical_meshes(submesh)[choice.logical]
        cost = costs.stage_cost(choice.start, choice.stop, submesh, logical)
        strategies: dict[str, Strategy] = {}
        layouts[index] = ("R", "R")
        if len(devices) > 1:
            sharded = intra_op.stage(choice.start, choice.stop, submesh, logical)
            chosen = intra_op.stage_strategies(choice.start, choice.stop, submesh, logical, sharded)
            strategies = {graph.nodes[i].name: strategy for i, strategy in chosen.items()}
            shardings[index] = strategies
            layouts[index] = (sharded.boundaries[0], sharded.boundaries[-1])
        stages.append(Stage(
            index=index, operators=[graph.nodes[i].name for i in range(start, stop)],
            layers=[choice.start, choice.stop], devices=devices,
            submesh=list(submesh), logical_mesh=list(logical),
            inputs=[], outputs=[], seconds=float(choice.seconds - costs.send_seconds(choice.stop)),
            memory_bytes=float(cost.param_bytes + cost.act_bytes),
            strategies={name: str(s) for name, s in strategies.items() if not _replicated(s)},
        ))
    node_stage = np.empty(len(graph.nodes), dtype=np.int64)
    for stage in stages:
        node_stage[layering.bounds[stage.layers[0]]:layering.bounds[stage.layers[1]]] = stage.index
    transfers, reshardings = _connect_stages(graph, stages, node_stage, layouts, cluster, options.reshard_scheduler,
                                             shardings)
    for resharding in reshardings:   # a stage's time includes handing its outputs on
        stages[resharding.src_stage].seconds += resharding.seconds

    stage_seconds = [s.seconds for s in stages]
    latency = sum(stage_seconds) + (options.microbatches - 1) * max(stage_seconds)
    memory = [0.0] * cluster.num_devices
    for stage in stages:
        for rank in stage.devices:
            memory[rank] = stage.memory_bytes
    estimate = {
        "stage_seconds": stage_seconds,
        "latency_seconds": latency,
        "throughput_per_second": batch["size"] / latency if latency > 0 else float("inf"),
        "memory_bytes_per_device": memory,
        "reshard_seconds": sum(r.seconds for r in reshardings),
        **cost_model.summary(),
    }
    stats = intra_op.stats
    solver = {
        "nodes": len(graph.nodes),
        "layers": layering.num_layers,
        "submeshes": [list(s) for s in submeshes],
        "tmax_candidates": solution.tmax_candidates,
        "stages": len(stages),
        "ilp": {
            "solver": options.solver, "solved": stats.ilps, "reused": stats.cache_hits,
            "variables": stats.variables, "constraints": stats.constraints,
            "largest_variables": stats.largest,
            **({"warnings": list(stats.warnings)} if stats.warnings else {}),
        },
    }
    plan = Plan(
        model=model_info, cluster=cluster.to_dict(), microbatches=options.microbatches, batch=batch,
        inputs=full_inputs, outputs=full_outputs, stages=stages, transfers=transfers, programs=[],
        reshardings=reshardings, estimate=estimate, solver=solver,
        timings={"seconds": time.perf_counter() - started, "stage_dp_seconds": dp_seconds, "ilp_seconds": stats.seconds},
        layer_bounds=list(layering.bounds),
    )
    return plan, shardings


def _replicated(strategy: Strategy) -> bool:
    return all(s is None or s.is_replicated for s in list(strategy.inputs) + list(strategy.outputs))


def place_submeshes(shapes: list[tuple[int, int]], cluster: Cluster) -> list[list[int]]:
    """Give each stage concrete ranks, in stage order, first fit: whole hosts for (n, M)
    shapes, a contiguous run inside one host for (1, m) shapes."""
    per_host = cluster.devices_per_host
    free = [[True] * per_host for _ in range(cluster.hosts)]
    placed = []
    for n, m in shapes:
        ranks = None
        if n == 1:
            for host in range(cluster.hosts):
                for first in range(0, per_host - m + 1):
                    if all(free[host][first:first + m]):
                        ranks = [host * per_host + d for d in range(first, first + m)]
                        break
                if ranks:
                    break
        else:
            for host in range(cluster.hosts - n + 1):
                if all(all(free[h]) for h in range(host, host + n)):
                    ranks = [h * per_host + d for h in range(host, host + n) for d in range(per_host)]
                    break
        if ranks is None:
            raise PlanError(f"cannot place a {n}x{m} stage on the {cluster.hosts}x{per_host} mesh")
        for rank in ranks:
            free[rank // per_host][rank % per_host] = False
        placed.append(ranks)
    return placed


def _connect_stages(graph: Graph, stages: list[Stage], node_stage: np.ndarray, layouts: dict[int, tuple[str, str]],
                    cluster: Cluster, scheduler: str,
                    shardings: dict[int, dict[str, Strategy]] | None = None) -> tuple[list[Transfer], list[Resharding]]:
    """Fill each stage's inputs and outputs with their specs; plan the cross-mesh
    resharding of every tensor that goes from one stage to another (a data-dependent one,
    or one whose size follows the call's in a ranged plan, goes whole, by transfers: its
    shape first), and the transfers that bring model outputs to rank 0. State (an output
    that is the next call's input, ``graph.state``) stays where it is: its input arrives in
    the layout its reader takes and its output leaves in that same layout, on the same
    devices, with no transfer."""
    producers = graph.producers()
    inputs = set(graph.inputs)
    outputs = set(graph.outputs)
    for stage in stages:
        first, last = node_stage.searchsorted(stage.index), node_stage.searchsorted(stage.index, "right")
        needed = []
        for i in range(first, last):
            for name in graph.nodes[i].inputs:
                if not name or graph.tensors[name].is_param or name in needed:
                    continue
                if name in inputs or node_stage[producers[name]] != stage.index:
                    needed.append(name)
        stage.inputs = needed
    reshardings: list[Resharding] = []
    between: list[Transfer] = []
    state_inputs = {i: o for o, i in graph.state.items()}
    for stage in stages:
        for name in stage.inputs:
            if name in state_inputs:
                stage.input_specs[name] = str(_state_spec(graph, name, stage, (shardings or {}).get(stage.index, {})))
                continue
            if name in inputs:
                stage.input_specs[name] = str(_spec("R", graph, name, stage))   # read from the inputs file
                continue
            src = stages[node_stage[producers[name]]]
            if name not in src.outputs:
                src.outputs.append(name)
            if graph.tensors[name].is_data_dependent or graph.tensors[name].ranged:
                # its size is known at run time only: whole, one transfer per device of the
                # destination, the shape sent first
                stage.input_specs[name] = str(_spec("R", graph, name, stage))
                src.output_specs[name] = str(_spec("R", graph, name, src))
                between.extend(_transfer(graph, name, src, stage.index, rank) for rank in stage.devices)
                continue
            dst_spec = _spec(layouts[stage.index][0], graph, name, stage)
            stage.input_specs[name] = str(dst_spec)
            src_spec = _spec("R" if name in outputs else layouts[src.index][1], graph, name, src)
            src.output_specs[name] = str(src_spec)
            reshardings.append(_resharding(graph, name, src, src_spec, stage, dst_spec, cluster, scheduler))
    transfers = between
    for name in graph.outputs:
        if name not in producers:
            raise PlanError(f"model output '{name}' is not computed by any operator")
        src = stages[node_stage[producers[name]]]
        if name not in src.outputs:
            src.outputs.append(name)
        if name in graph.state:
            src.output_specs[name] = _state_output_spec(graph, name, graph.state[name], src, stages)
            continue
        src.output_specs[name] = str(_spec("R", graph, name, src))
        transfers.append(_transfer(graph, name, src, OUTPUT_COLLECTOR, 0))
    return transfers, reshardings


def _state_spec(graph: Graph, name: str, stage: Stage, strategies: dict[str, Strategy]) -> ShardingSpec:
    """The layout a state input is held in: the one its paired output is made in (so that it
    leaves with no resharding), else what its first reader that reads more than its shape
    takes; replicated on one device, or where that layout does not fit both tensors."""
    info = graph.tensors[name]
    mesh = _mesh(stage)
    output = next((o for o, i in graph.state.items() if i == name), None)
    candidates = []
    for node in graph.nodes:
        if node.name not in stage.operators or node.name not in strategies:
            continue
        strategy = strategies[node.name]
        if output is not None and output in node.outputs:
            candidates.insert(0, strategy.outputs[node.outputs.index(output)])
        elif name in node.inputs and node.op_type != "Shape":
            candidates.append(strategy.inputs[node.inputs.index(name)])
    for spec in candidates:
        if spec is None or spec.partial or not spec.is_valid_for(info.split_sizes, mesh):
            continue
        if output is not None:
            out = graph.tensors[output]
            if len(out.shape) != len(info.shape) or not spec.is_valid_for(out.split_sizes, mesh):
                continue
        return spec
    return ShardingSpec.replicated(len(info.shape))


def _state_output_spec(graph: Graph, output: str, state_input: str, src: Stage, stages: list[Stage]) -> str:
    """A state output leaves in its input's layout, from the stage that holds that input."""
    holders = [s for s in stages if state_input in s.inputs]
    if not holders:   # the next call does not read it: it is only kept
        return str(ShardingSpec.replicated(len(graph.tensors[output].shape)))
    if len(holders) > 1 or holders[0].index != src.index:
        raise PlanError(f"state {output} -> {state_input}: the output is made in stage {src.index} but the input is "
                        f"read in stage(s) {', '.join(str(s.index) for s in holders)}; state must stay on one set "
                        "of devices", hint="plan with --max-stages 1, or without --state for this pair")
    return src.input_specs[state_input]


def _mesh(stage: Stage) -> LogicalMesh:
    return LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))


def _spec(kind: str, graph: Graph, name: str, stage: Stage) -> ShardingSpec:
    return boundary_spec(kind, graph.tensors[name].split_sizes, _mesh(stage))


def _resharding(graph: Graph, name: str, src: Stage, src_spec: ShardingSpec, dst: Stage, dst_spec: ShardingSpec,
                cluster: Cluster, scheduler: str) -> Resharding:
    """The fastest way found to move ``name`` between the stages: possibly rearranged
    inside the source mesh first, possibly with the local all-gather in the destination
    (``send_spec.best_resharding``); its seconds are prepare + tasks + all-gathers."""
    info = graph.tensors[name]
    choice = best_resharding(info.shape, src_spec, _mesh(src), dst_spec, _mesh(dst), info.dtype.itemsize, cluster,
                             scheduler)
    return Resharding(name, src.index, dst.index, list(info.shape), info.dtype.name, str(src_spec), str(dst_spec),
                      choice.transfer.to_dict(), choice.schedule.to_dict(), choice.seconds)


def _transfer(graph: Graph, name: str, src: Stage, dst_stage: int, dst_rank: int) -> Transfer:
    info = graph.tensors[name]
    # data-dependent or ranged: the actual shape is sent first
    shape = [-1 if axis in info.dynamic or axis in info.ranged else d for axis, d in enumerate(info.shape)]
    return Transfer(name, src.index, dst_stage, src.devices[0], dst_rank, shape, info.dtype.name)
