"""The inter-operator pass: layers → stage DP → stages on physical devices.

Produces a ``Plan`` (without its programs, which ``emit`` writes and fills in).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from meshplan.cost.cluster import Cluster
from meshplan.cost.analytic import CostModel
from meshplan.reshard.schedulers import ALGORITHMS
from meshplan.reshard.send_spec import best_resharding
from meshplan.errors import PlanError
from meshplan.model.graph import Graph
from meshplan.intra.intra_op import IntraOpPass, boundary_spec, layer_fingerprints
from meshplan.intra.windows import StageWindows
from meshplan.inter.hints import StageHints
from meshplan.model.layers import Layering, cluster_layers, repeat_period
from meshplan.plan_format import OUTPUT_COLLECTOR, Plan, Resharding, Stage, TensorSpec, Transfer
from meshplan.intra.policies import POLICIES
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.inter.stage_cost import StageCosts, logical_meshes, submesh_shapes
from meshplan.inter.memory_need import memory_error, memory_need
from meshplan.inter.stage_dp import no_plan_error, solve_stages
from meshplan.inter.training_costs import RESHARD_FACTOR, TrainingCosting, TrainingOperatorCosts
from meshplan.intra.strategies import Strategy



@dataclass(frozen=True)
class PlanOptions:
    microbatches: int = 1
    num_layers: int | None = None      # default: max(32, 2 × devices), at most 128 and the node count
    solver: str = "cbc"                # the intra-operator ILP's solver: cbc or highs
    max_stages: int | None = None      # at most this many pipeline stages
    stages: int | None = None          # exactly this many pipeline stages (--stages; excludes max_stages)
    policy: str = "auto"               # strategy policy inside stages (see policies.py)
    submeshes: tuple[tuple[int, int], ...] | None = None   # submesh shapes stages may use (default: all)
    reshard_scheduler: str = "randomized_greedy"   # cross-mesh resharding scheduler (see schedulers.ALGORITHMS)
    batch_dim: tuple[str, ...] = ()    # --batch-dim: a symbolic dim's name, or INPUT:AXIS places
    all_devices: bool = False          # --all-devices: every device holds a stage (none left idle)
    schedule: str = "1f1b"             # a pipelined training plan's schedule: 1f1b or gpipe
    recompute: bool = False            # a training estimate recomputes activations (--recompute)
    tensor_parallel: int = 1           # a pipelined training plan's stages shard their operators over this many devices
    stage_devices: tuple[int, ...] | None = None   # a pipelined training plan's devices of each stage (--stage-devices)
    stage_tensors: tuple[int, ...] | None = None   # each stage's T where they differ (--tensor-parallel 2,1)
    training: TrainingCosting | None = None   # weigh a training step, not a forward call (inter.training_costs)


MAX_DEFAULT_LAYERS = 128   # the stage DP's work grows with the cube of the layer count


def default_num_layers(graph: Graph, cluster: Cluster) -> int:
    return min(len(graph.nodes), max(32, 2 * cluster.num_devices), MAX_DEFAULT_LAYERS)


def choose_layering(graph: Graph, node_seconds: list[float], cluster: Cluster, constants,
                    measured: dict[int, tuple[int, Layering]] | None = None) -> Layering:
    """Cluster into the default number of layers, unless a count that lines the cuts up with
    the model's repeated block (see ``repeat_period``) gives fewer distinct layer structures:
    identical layers share their sharding ILPs, which is what keeps planning fast.

    Block-aligned counts (one to four blocks a layer, or each block in two halves) are
    tried from the device count or a quarter of the default up. (Coarser ones plan faster
    on large meshes but can give worse plans: a 24-block GPT-2 on 16x8 in 48 block-aligned
    layers is estimated 8% slower than in 128; ``--layers`` chooses. On 4x8 its default of
    64 layers has 16 distinct ones, its 48 halves of blocks 4.) ``measured`` keeps each
    count's layering and distinct count between calls on one graph."""
    most = default_num_layers(graph, cluster)
    candidates = [most]
    period = repeat_period(graph)
    if period:
        blocks = len(graph.nodes) // period
        counts = [blocks // per_layer for per_layer in (1, 2, 3, 4) if blocks % per_layer == 0] + [2 * blocks]
        candidates += [c for c in counts if max(cluster.num_devices, most // 4) <= c <= most]
    measured = {} if measured is None else measured
    best = None
    for count in dict.fromkeys(candidates):
        if count not in measured:
            layering = cluster_layers(graph, node_seconds, count)
            measured[count] = (len(set(layer_fingerprints(graph, layering, constants))), layering)
        if best is None or measured[count][0] < best[0]:
            best = measured[count]
    return best[1]


MIN_STAGE_FRACTION = 0.1    # a stage below this fraction of the slowest joins a neighbour (stage_dp "Small stages")


@dataclass
class _Built:
    """A DP solution placed on ranks and connected: what a plan holds of it."""

    solution: object
    stages: list[Stage]
    shardings: dict[int, dict[str, Strategy]]
    transfers: list[Transfer]
    reshardings: list[Resharding]
    latency: float
    region: tuple[int, int]
    layering: Layering | None = None   # the layers its stages are counted in


@dataclass(frozen=True)
class PolicySettings:
    submeshes: list[tuple[int, int]]
    max_stages: int | None
    idle: bool                 # whether devices may stay idle
    reason: str | None = None  # why the policy leaves devices idle, where it does by itself


def policy_settings(options: PlanOptions, cluster: Cluster, submeshes: list[tuple[int, int]],
                    microbatch: int) -> PolicySettings:
    """The submeshes, stage cap and idle-device freedom a policy implies.

    ``megatron``: one stage per host, each on the whole host, so that every large matrix
    product is split over all of a host's devices, and every device used (with
    ``--max-stages`` below the host count, stages of several whole hosts). ``data``: one
    stage, weights replicated and the batch split, on the largest submesh whose devices
    divide the microbatch (the others idle). ``auto``: every submesh, devices may idle."""
    max_stages = options.max_stages
    per_host = cluster.devices_per_host
    if options.stages is not None:
        if max_stages is not None:
            raise PlanError("--stages fixes the stage count and --max-stages caps it: give one of them")
        if options.policy != "auto":
            raise PlanError(f"--policy {options.policy} chooses its own stages", hint="drop --stages")
    if options.policy == "megatron":
        wide = [(1, per_host)] if max_stages is None or max_stages >= cluster.hosts else \
            [(h, per_host) for h in range(1, cluster.hosts + 1)]
        kept = [s for s in submeshes if s in wide]
        if not kept:
            raise PlanError(f"--policy megatron puts its stages on whole hosts ({', '.join(f'{n}x{m}' for n, m in wide)}), "
                            "which the given submeshes exclude")
        return PolicySettings(kept, max_stages, False)
    if options.policy == "data":
        if options.all_devices:
            submeshes = [s for s in submeshes if s[0] * s[1] == cluster.num_devices]
        fitting = [s for s in submeshes if microbatch % (s[0] * s[1]) == 0]
        if not fitting:
            raise PlanError(f"--policy data splits the batch of {microbatch} over one stage's devices, but none of the "
                            f"submeshes {', '.join(f'{n}x{m}' for n, m in submeshes)} divides it")
        widest = max(fitting, key=lambda s: s[0] * s[1])
        devices = widest[0] * widest[1]
        reason = None
        if devices < cluster.num_devices:
            reason = (f"--policy data splits the batch of {microbatch} per microbatch over at most {devices} "
                      "device(s) of one stage")
        return PolicySettings([widest], 1 if max_stages is None else max_stages, not options.all_devices, reason)
    return PolicySettings(submeshes, max_stages, not options.all_devices)


def regions(cluster: Cluster, submeshes: list[tuple[int, int]], idle: bool) -> list[tuple[int, int]]:
    """The parts of the mesh a plan may keep to, smallest first: the first ``w`` devices of
    host 0 for each submesh width ``w``, then the first ``h`` hosts for ``h`` = 2, 4, 8, …
    and every host. The planner keeps the best of their plans, so a mesh is never worse
    than these parts of it (as planned alone, with the same layers). Without idle devices,
    the whole mesh alone."""
    whole = cluster.mesh
    if not idle:
        return [whole]
    found = [(1, w) for w in sorted({m for n, m in submeshes if n == 1})]
    hosts = 2
    while hosts < cluster.hosts:
        found.append((hosts, cluster.devices_per_host))
        hosts *= 2
    found.append(whole)
    return [r for r in dict.fromkeys(found) if any(n <= r[0] and m <= r[1] for n, m in submeshes)]


def plan_pipeline(*args, **kwargs) -> tuple[Plan, dict[int, dict[str, Strategy]]]:
    """``search`` (the plan and each stage's strategies), the processes it forked to solve
    layer ILPs side by side let go at its end (``parallel_solves``)."""
    from meshplan.intra.parallel_solves import close

    try:
        return search(*args, **kwargs)
    finally:
        close()


def search(
    graph: Graph, cluster: Cluster, options: PlanOptions, model_info: dict, batch: dict,
    full_inputs: list[TensorSpec], full_outputs: list[TensorSpec], constants: dict[str, np.ndarray],
    cost_model: CostModel | None = None, hints: StageHints | None = None,
) -> tuple[Plan, dict[int, dict[str, Strategy]]]:
    """The plan, and the chosen strategy of every operator of each multi-device stage.

    The stage DP runs with idle devices allowed (``policy_settings``) and the small-stage
    rule, once for each region of the mesh (``regions``), each with the sends it would
    have there (a region cut into the whole mesh's layers is solved again all the same:
    the DP's estimate is not the built plan's, and a region's own optimum can build
    faster than the whole mesh's); every solution is placed, connected and estimated, and
    the fastest kept (the smallest region on a tie). The cost tables of a region cover its
    own submeshes only. Devices it leaves out are idle, and the plan says why: the best
    plan that uses every device, and its estimate.

    ``hints`` pin operators' strategies and force stage cuts (``inter.hints``); a hinted
    plan is searched on the whole mesh alone (the hints name its devices)."""
    started = time.perf_counter()
    if options.policy not in POLICIES:
        raise PlanError(f"unknown policy {options.policy!r} (choose from {', '.join(POLICIES)})")
    if options.reshard_scheduler not in ALGORITHMS:
        raise PlanError(f"unknown resharding scheduler {options.reshard_scheduler!r} "
                        f"(choose from {', '.join(ALGORITHMS)})")
    described, cluster = cluster, cluster.costed(options.microbatches)
    cost_model = cost_model or CostModel(cluster)
    node_seconds = cost_model.graph_seconds(graph)
    bundles: dict[tuple[int, ...], tuple[Layering, IntraOpPass, StageCosts, StageWindows]] = {}
    cuts: dict[int, Layering] = {}   # device count → its layering (``choose_layering`` depends on no more)
    measured: dict[int, tuple[int, Layering]] = {}   # layer count → (distinct layers, layering)

    def sharding_pass(cut: Layering) -> IntraOpPass:
        costs = None if options.training is None else TrainingOperatorCosts(
            graph, cost_model, cluster, constants, options.training, options.microbatches)
        return IntraOpPass(graph, cut, cost_model, cluster, constants, options.solver, options.policy,
                           hints.pins if hints is not None else None, costs)

    def layered(area: Cluster) -> tuple[Layering, IntraOpPass, StageCosts, StageWindows]:
        """The layers a plan on ``area`` (the cluster, or a region of it planned as a
        cluster of its own) is cut into, with their sharding pass, stage costs and the
        windows its chosen stages are solved again in: a region keeps the layers it would
        have alone, so that its plan is the submesh's plan."""
        if area.num_devices not in cuts:
            cuts[area.num_devices] = cluster_layers(graph, node_seconds, options.num_layers) if options.num_layers \
                else choose_layering(graph, node_seconds, area, constants, measured)
        cut = cuts[area.num_devices]
        if hints is not None:
            cut = hints.layering(cut)
        if cut.bounds not in bundles:
            sharding = sharding_pass(cut)
            bundles[cut.bounds] = (cut, sharding, StageCosts(graph, cut, node_seconds, cost_model, sharding, area,
                                                             options.training, options.microbatches),
                                   StageWindows(cut, sharding_pass))
        return bundles[cut.bounds]

    layering, intra_op, costs, _ = layered(cluster)
    submeshes = submesh_shapes(cluster)
    if options.submeshes is not None:
        submeshes = [s for s in submeshes if s in set(options.submeshes)]
        if not submeshes:
            raise PlanError(f"none of the submeshes {list(options.submeshes)} fits the mesh")
    settings = policy_settings(options, cluster, submeshes, int(batch.get("microbatch_size") or 1))
    submeshes, max_stages, idle = settings.submeshes, settings.max_stages, settings.idle
    memory = cluster.device.memory_bytes

    dp_seconds = 0.0
    solves = 0

    def region_bundle(region: tuple[int, int]):
        return layered(replace(cluster, hosts=region[0], devices_per_host=region[1]))

    def solve(region: tuple[int, int], idle_devices: bool, stages: int | None = max_stages):
        """The DP's solution kept to ``region`` (None where nothing fits), with the region's
        submeshes (indices into ``submeshes``), on the region's own layers, in at most
        ``stages`` stages (in exactly ``options.stages`` where it is given)."""
        nonlocal dp_seconds, solves
        chosen = [k for k, (n, m) in enumerate(submeshes) if n <= region[0] and m <= region[1]
                  and (idle_devices or stages != 1 or n * m == region[0] * region[1])]
        if not chosen:
            return None
        kept = [submeshes[k] for k in chosen]
        _, _, area_costs, _ = region_bundle(region)
        seconds, params, acts = area_costs.tables(kept, across_hosts=cluster.hosts > 1 and region[0] > 1)
        if hints is not None:
            seconds = hints.mask(seconds, kept, region_bundle(region)[0])
        began = time.perf_counter()
        try:
            solution = solve_stages(
                seconds, params, acts, memory,
                np.array([submeshes[k][0] * submeshes[k][1] for k in chosen]), region[0] * region[1],
                options.microbatches, max_stages=stages if options.stages is None else None,
                stages=options.stages, idle_devices=idle_devices, min_stage_fraction=MIN_STAGE_FRACTION)
        except PlanError:
            return None
        finally:
            dp_seconds += time.perf_counter() - began
        solves += solution.tmax_candidates
        return replace(solution, stages=tuple(replace(st, submesh=chosen[st.submesh]) for st in solution.stages))

    def build(solution, region) -> _Built:
        cut, sharding, area_costs, windows = region_bundle(region)
        built = _build(solution, region, submeshes, graph, cut, area_costs, sharding, windows, cluster, options)
        built.layering = cut
        return built

    whole = cluster.mesh

    areas = regions(cluster, submeshes, idle) if hints is None else [whole]
    # a region whose devices together cannot hold every weight once fits no plan: not searched
    held = costs.param_bytes(0, costs.num_layers)
    areas = [r for r in areas if r == whole or r[0] * r[1] * memory >= held]
    first = solve(whole, idle)
    if first is None and options.stages is not None:
        raise PlanError(f"no plan of exactly {options.stages} stage(s) fits: {layering.num_layers} layers on "
                        f"{cluster.num_devices} devices of {memory / 2**30:.1f} GiB",
                        hint="try fewer stages, or --max-stages N to let the planner choose up to N")
    if first is None:
        need = memory_need(costs, submeshes, cluster.num_devices, memory, max_stages, idle)
        if need is None:
            raise no_plan_error(layering.num_layers, cluster.num_devices, idle)
        raise memory_error(need, memory, layering.num_layers)
    found: dict[tuple, _Built] = {}
    best = None
    for region in areas:
        solution = first if region == whole else solve(region, True)
        if solution is None:
            continue
        candidates = [solution]
        if options.stages is None and (len(solution.stages) > 1 or sum(
                submeshes[c.submesh][0] * submeshes[c.submesh][1] for c in solution.stages) < region[0] * region[1]):
            # one stage over the whole region as well: the DP costs stages by their layers'
            # chain, and a stage solved again in windows (``_build``) can beat its choice
            candidates.append(solve(region, False, 1))
        for candidate in filter(None, candidates):
            placement = place_submeshes([submeshes[c.submesh] for c in candidate.stages], cluster, region)
            key = (region_bundle(region)[0].bounds, candidate.stages, tuple(map(tuple, placement)))   # found again
            built = found[key] = found.get(key) or build(candidate, region)
            if best is None or built.latency < best.latency:
                best = built
    used = sum(len(stage.devices) for stage in best.stages)
    idle_info = {}
    if used < cluster.num_devices:
        everyone = None if settings.reason else solve(whole, False)
        limit = f" in exactly {options.stages} stage(s)" if options.stages else \
            f" in at most {max_stages} stage(s)" if max_stages else ""
        idle_info = _idle(best, everyone, build, cluster, limit, settings.reason)
        if "better" in idle_info:
            best = idle_info.pop("better")
    stages, reshardings = best.stages, best.reshardings
    stage_seconds = [s.seconds for s in stages]
    memory_per_device = [0.0] * cluster.num_devices
    for stage in stages:
        for rank in stage.devices:
            memory_per_device[rank] = stage.memory_bytes
    estimate = {
        "stage_seconds": stage_seconds,
        "latency_seconds": best.latency,
        "throughput_per_second": batch["size"] / best.latency if best.latency > 0 else float("inf"),
        "memory_bytes_per_device": memory_per_device,
        "reshard_seconds": sum(r.seconds for r in reshardings),
        **cost_model.summary(),
    }
    stats = intra_op.stats
    solver = {
        "nodes": len(graph.nodes),
        "layers": best.layering.num_layers,
        "submeshes": [list(s) for s in submeshes],
        "tmax_candidates": solves,
        "stages": len(stages),
        "regions": [list(r) for r in areas],
        "ilp": {
            "solver": options.solver, "solved": stats.ilps, "reused": stats.cache_hits,
            "variables": stats.variables, "constraints": stats.constraints,
            "largest_variables": stats.largest,
            **({"warnings": list(stats.warnings)} if stats.warnings else {}),
        },
    }
    plan = Plan(
        model=model_info, cluster=described.to_dict(), microbatches=options.microbatches, batch=batch,
        inputs=full_inputs, outputs=full_outputs, stages=stages, transfers=best.transfers, programs=[],
        reshardings=reshardings, estimate=estimate, solver=solver, idle=idle_info,
        timings={"seconds": time.perf_counter() - started, "stage_dp_seconds": dp_seconds, "ilp_seconds": stats.seconds,
                 "ilps_in_workers": stats.in_workers},
        layer_bounds=list(best.layering.bounds),
    )
    return plan, best.shardings


def _idle(best: _Built, everyone, build, cluster: Cluster, limit: str, reason: str | None) -> dict:
    """Which ranks the plan leaves idle and why: the policy says so (``reason``), or the
    best plan on every device (the DP without idle devices) is slower, or none fits. Where
    that plan, placed and connected, turns out faster after all, it is returned under
    "better" instead."""
    if everyone is not None:
        built = build(everyone, cluster.mesh)
        if built.latency < best.latency:
            return {"better": built}
    busy = {rank for stage in best.stages for rank in stage.devices}
    ranks = [r for r in range(cluster.num_devices) if r not in busy]
    if reason:
        return {"ranks": ranks, "reason": reason, "all_devices_latency_seconds": None}
    if everyone is None:
        why = f"no plan that uses all {cluster.num_devices} devices{limit} fits in their memory"
    else:
        why = (f"the best plan that uses all {cluster.num_devices} devices is estimated at "
               f"{_time(built.latency)} against {_time(best.latency)} without these")
    return {"ranks": ranks, "reason": why, "all_devices_latency_seconds": None if everyone is None else built.latency}


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def _build(solution, region, submeshes, graph: Graph, layering: Layering, costs: StageCosts, intra_op: IntraOpPass,
           windows: StageWindows, cluster: Cluster, options: PlanOptions) -> _Built:
    """Place a DP solution's stages on ranks inside ``region``, build their shardings (the
    layers' chain, or the stage solved again in wider windows where that is faster and
    fits: ``intra.windows``), connect them (cross-mesh reshardings and transfers,
    scheduled) and estimate the pipeline's latency."""
    placement = place_submeshes([submeshes[c.submesh] for c in solution.stages], cluster, region)
    cuts = {layering.bounds[choice.start] for choice in solution.stages}
    across = cluster.hosts > 1 and region[0] > 1
    stages = []
    shardings: dict[int, dict[str, Strategy]] = {}
    layouts: dict[int, tuple[str, str]] = {}   # stage → (layout of its inputs, of its outputs)
    for index, (choice, devices) in enumerate(zip(solution.stages, placement)):
        start, stop = layering.bounds[choice.start], layering.bounds[choice.stop]
        submesh = submeshes[choice.submesh]
        logical = logical_meshes(submesh)[choice.logical]
        cost = costs.stage_cost(choice.start, choice.stop, submesh, logical)
        # microbatches whose activations the stage holds at once (a forward call: one)
        in_flight = 1 if options.training is None else \
            options.training.in_flight(index, len(solution.stages), options.microbatches)
        strategies: dict[str, Strategy] = {}
        layouts[index] = ("R", "R")
        saved, weights, arrival = 0.0, cost.param_bytes, 0.0
        if len(devices) > 1:
            sharded = intra_op.stage(choice.start, choice.stop, submesh, logical)
            arrival = sharded.arrival   # (in the DP's seconds; the resharding into the stage is counted below)
            chosen = intra_op.stage_strategies(choice.start, choice.stop, submesh, logical, sharded)
            room = cluster.device.memory_bytes - cost.act_bytes * (
                options.microbatches if options.training is None else in_flight)
            wider = windows.improve(intra_op, choice.start, choice.stop, cuts, submesh, logical, sharded, room)
            if wider is not None:
                saved, weights = sharded.seconds - wider[0].seconds, wider[0].param_bytes
                sharded, chosen = wider
            strategies = {graph.nodes[i].name: strategy for i, strategy in chosen.items()}
            shardings[index] = strategies
            layouts[index] = (sharded.boundaries[0], sharded.boundaries[-1])
        stages.append(Stage(
            index=index, operators=[graph.nodes[i].name for i in range(start, stop)],
            layers=[choice.start, choice.stop], devices=devices,
            submesh=list(submesh), logical_mesh=list(logical),
            inputs=[], outputs=[], seconds=float(choice.seconds - costs.send_seconds(choice.stop, across) - saved - arrival),
            memory_bytes=float(weights + cost.act_bytes * in_flight),
            strategies={name: str(s) for name, s in strategies.items() if not _replicated(s)},
        ))
    node_stage = np.empty(len(graph.nodes), dtype=np.int64)
    for stage in stages:
        node_stage[layering.bounds[stage.layers[0]]:layering.bounds[stage.layers[1]]] = stage.index
    transfers, reshardings = _connect_stages(graph, stages, node_stage, layouts, cluster, options.reshard_scheduler,
                                             shardings)
    for resharding in reshardings:   # a stage's time includes handing its outputs on (and a gradient back)
        stages[resharding.src_stage].seconds += resharding.seconds * (1 if options.training is None else RESHARD_FACTOR)
    stage_seconds = [s.seconds for s in stages]
    latency = sum(stage_seconds) + (options.microbatches - 1) * max(stage_seconds)
    return _Built(solution, stages, shardings, transfers, reshardings, latency, region)


def _replicated(strategy: Strategy) -> bool:
    return all(s is None or s.is_replicated for s in list(strategy.inputs) + list(strategy.outputs))


def place_submeshes(shapes: list[tuple[int, int]], cluster: Cluster,
                    region: tuple[int, int] | None = None) -> list[list[int]]:
    """Give each stage concrete ranks inside ``region`` (the first ``h`` hosts' first ``w``
    devices; default the whole mesh), first fit: whole hosts for (n, M) shapes, a
    contiguous run inside one host for (1, m) shapes. In stage order; where that leaves no
    room for some stage (the stages need not fill the region when devices may stay idle),
    larger stages first. Either way the first stage placed starts at rank 0, the driver."""
    try:
        return _first_fit(shapes, cluster, region)
    except PlanError:
        order = sorted(range(len(shapes)), key=lambda k: -shapes[k][0] * shapes[k][1])
        placed = _first_fit([shapes[k] for k in order], cluster, region)
        ranks: list[list[int]] = [[] for _ in shapes]
        for k, found in zip(order, placed):
            ranks[k] = found
        return ranks


def _first_fit(shapes: list[tuple[int, int]], cluster: Cluster, region: tuple[int, int] | None) -> list[list[int]]:
    per_host = cluster.devices_per_host
    hosts, width = region or cluster.mesh
    free = [[True] * width for _ in range(hosts)]
    placed = []
    for n, m in shapes:
        ranks = None
        if n == 1:
            for host in range(hosts):
                for first in range(0, width - m + 1):
                    if all(free[host][first:first + m]):
                        ranks = [host * per_host + d for d in range(first, first + m)]
                        break
                if ranks:
                    break
        elif m == width:
            for host in range(hosts - n + 1):
                if all(all(free[h]) for h in range(host, host + n)):
                    ranks = [h * per_host + d for h in range(host, host + n) for d in range(per_host)]
                    break
        if ranks is None:
            raise PlanError(f"cannot place a {n}x{m} stage on the {hosts}x{width} devices")
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
        uses = _tensor_uses(graph, stage, (shardings or {}).get(stage.index, {}))
        for name in stage.inputs:
            if name in state_inputs:
                stage.input_specs[name] = str(_state_spec(graph, name, stage, uses))
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


def _tensor_uses(graph: Graph, stage: Stage, strategies: dict[str, Strategy]) -> tuple[dict, dict]:
    """The stage's operators in one pass: tensor → (operator index, the spec it is made in),
    and tensor → [(operator index, the spec it is read in)] in graph order (a Shape reads no
    layout), for every state of the stage to look up."""
    made, read = {}, {}
    for index, node in enumerate(graph.nodes):
        if node.name not in stage.operators or node.name not in strategies:
            continue
        strategy = strategies[node.name]
        for k, name in enumerate(node.outputs):
            made[name] = (index, strategy.outputs[k])
        if node.op_type != "Shape":
            for name in dict.fromkeys(n for n in node.inputs if n):
                read.setdefault(name, []).append((index, strategy.inputs[node.inputs.index(name)]))
    return made, read


def _state_spec(graph: Graph, name: str, stage: Stage, uses: tuple[dict, dict]) -> ShardingSpec:
    """The layout a state input is held in: the one its paired output is made in (so that it
    leaves with no resharding), else what its first reader that reads more than its shape
    takes; replicated on one device, or where that layout does not fit both tensors
    (``uses``: ``_tensor_uses`` of the stage)."""
    info = graph.tensors[name]
    mesh = _mesh(stage)
    output = next((o for o, i in graph.state.items() if i == name), None)
    made, read = uses
    maker = made.get(output) if output is not None else None
    candidates = [maker[1]] if maker is not None else []
    candidates += [spec for index, spec in read.get(name, []) if maker is None or index != maker[0]]
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
