"""The intra-operator pass: shard a stage's operators over its logical mesh with the ILP.

The stage DP asks for the cost of many (layer range, submesh, logical mesh) triples, so
the ILP is solved per *layer*, not per range: for each layer, logical mesh and choice of
boundary layout on each side (``R``: tensors crossing the layer boundary replicated;
``B``: split along their first (batch) dimension over the whole mesh), one ILP picks every
operator's strategy. Layers with the same structure share one solve (a transformer stack
solves one layer per distinct cluster shape). A stage's cost is then a chain DP over its
layers' boundary layouts.

Operators without a sharding rule get the replicated strategy only, which is always
correct; so is any plan this pass returns, because the emitter inserts whatever
resharding the chosen specs need. Tensors move between stages in their boundary layout,
by cross-mesh resharding (see ``meshplan.reshard``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from meshplan.cost.cluster import Cluster
from meshplan.cost.protocol import CostModelProtocol
from meshplan.errors import PlanError
from meshplan.model.layers import Layering
from meshplan.intra import ilp
from meshplan.intra.chain import StageSharding, best_chain, chain_tables
from meshplan.intra.fingerprint import layer_fingerprints
from meshplan.intra.fold import fold_followers
from meshplan.intra.layer_ilp import BOUNDARY_KINDS, LayerIlp, LayerSolution, boundary_spec
from meshplan.intra.segments import tensor_segments
from meshplan.intra.operator_cost import OperatorCosts, held_bytes
from meshplan.intra.pins import Pins
from meshplan.intra.strategies import Strategy
from meshplan.reshard.steps import axis_links, reshard_seconds
from meshplan.sharding import LogicalMesh, ShardingSpec, segments_fit

__all__ = ["BOUNDARY_KINDS", "IntraOpPass", "IntraOpStats", "LayerSolution", "StageSharding",
           "boundary_spec", "fold_followers", "layer_fingerprints"]

LEAN_FACTOR = 1.25   # a lean layer keeps its weights within this factor of an even split


@dataclass
class IntraOpStats:
    ilps: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    variables: int = 0
    constraints: int = 0
    largest: int = 0
    in_workers: int = 0     # of ``ilps``: solved side by side in worker processes (``parallel_solves``)
    warnings: list[str] = field(default_factory=list)   # solves cut short (distinct messages)


class IntraOpPass:
    """Answers "cost of layers [start, stop) on submesh S viewed as logical mesh M"; caches
    each layer's solution by structure."""

    def __init__(self, graph, layering: Layering, cost_model: CostModelProtocol, cluster: Cluster,
                 constants: dict[str, np.ndarray], solver: str = "cbc", policy: str = "auto", pins: Pins | None = None,
                 operator_costs: OperatorCosts | None = None):
        """``operator_costs``: what the ILP weighs strategies by (default ``OperatorCosts``: a
        forward call's; a training step's: ``inter.training_costs``)."""
        self.graph = graph
        self.layering = layering
        self.cluster = cluster
        self.stats = IntraOpStats()
        self.pins = pins if pins else None
        costs = operator_costs or OperatorCosts(graph, cost_model, cluster, constants)
        self.ilp = LayerIlp(graph, costs, constants, solver, policy,
                            self.pins)
        self._producers = graph.producers()
        self._consumers = graph.consumers()
        self._graph_inputs = set(graph.inputs)
        self._cache: dict[tuple, LayerSolution] = {}
        self._splittable: dict[tuple, bool] = {}
        self._arrivals: dict[tuple, dict[str, float]] = {}
        self._layer_keys = layer_fingerprints(graph, layering, constants)
        owner = layering.layer_of_node()
        readers: dict[str, set[int]] = {}
        for i in range(len(graph.nodes)):
            for source in graph.params_of(i):
                readers.setdefault(source, set()).add(int(owner[i]))
        self._shared = {source for source, layers in readers.items() if len(layers) > 1}
        self._own: dict[tuple, LayerSolution] = {}
        self._forms: dict[int, tuple] = {}   # ``_weights_form``
        self._form_slices: dict[tuple, tuple] = {}   # (form, ILP, mesh) → (solution, own bytes, shared slices by position)
        self._layer_dims: dict[int, tuple] = {}
        self._views: dict[tuple, tuple] = {}
        self._by_view: dict[tuple, dict] = {}
        self._fast_tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._lean_failed: dict[tuple, float] = {}   # ILP → the loosest memory row it had no solution under
        self._fresh: set = set()   # ILPs solved ahead (``prefetch``) and not asked for yet

    # --- one layer ------------------------------------------------------------------

    def layer_solution(self, layer: int, submesh: tuple[int, int], logical: tuple[int, int],
                       b_in: str, b_out: str, lean: bool = False) -> LayerSolution:
        """The layer's ILP optimum (shared by every layer with the same structure).

        ``lean`` adds a memory row holding the layer's weights near an even split over the
        mesh, for stages whose fastest layout does not fit the devices."""
        key, b_in, b_out = self._key(layer, submesh, logical, b_in, b_out, lean)
        if key in self._fresh:   # solved ahead (``prefetch``): its first use counts as its solve did
            self._fresh.discard(key)
        elif key in self._cache:
            self.stats.cache_hits += 1
        else:
            limit = self._lean_limit(layer, logical) if lean else None
            # a lean ILP with no solution under a memory row has none under a tighter one
            # either: views whose layers see the same ILP (``_effective_view``) and divide
            # the weights over more devices skip the solve
            same = (key[0], self._effective_view(layer, submesh, logical), b_in, b_out) if lean else None
            try:
                if lean and self._lean_failed.get(same, -1.0) >= limit:
                    raise PlanError("no lean layout (known from a looser memory row)")
                self._cache[key] = self._solve_layer(layer, submesh, logical, b_in, b_out, limit)
            except PlanError:
                if not lean:
                    raise
                self._lean_failed[same] = max(self._lean_failed.get(same, -1.0), limit)
                self._cache[key] = self.layer_solution(layer, submesh, logical, b_in, b_out)
        return self._cache[key]

    def _key(self, layer: int, submesh, logical, b_in: str, b_out: str, lean: bool) -> tuple:
        """(the key of the layer's ILP on this view, the boundary kinds it is solved with):
        layers of the same structure, views and kinds that give the same ILP share it."""
        b_in = self._effective_kind(layer, b_in, logical, entering=True)
        b_out = self._effective_kind(layer, b_out, logical, entering=False)
        # the lean variant's memory row depends on the device count: it keeps its own mesh
        view = (submesh, logical) if lean else self._effective_view(layer, submesh, logical)
        return (self._layer_keys[layer] + self._pin_key(layer, logical), view, b_in, b_out, lean), b_in, b_out

    def prefetch(self, views) -> int:
        """Solve side by side (``parallel_solves``) the fastest layouts' ILPs that the chains
        of ``views`` ((submesh, logical mesh) pairs) will ask for and that are not known yet:
        every layer with every pair of boundary kinds (the memory-lean ones a view needs are
        solved so when its table finds it needs them: ``_prefetch_lean``). Returns how many
        it solved; the others (too few to share out, one core, an ILP without a solution)
        are left to the chains, which solve them one at a time as before."""
        from meshplan.intra.parallel_solves import solve_all, workers

        if workers() < 2:
            return 0
        jobs: dict[tuple, tuple] = {}
        for submesh, logical in views:
            for layer in range(self.layering.num_layers):
                for b_in in BOUNDARY_KINDS:
                    for b_out in BOUNDARY_KINDS:
                        key, kind_in, kind_out = self._key(layer, submesh, logical, b_in, b_out, lean=False)
                        if key not in self._cache and key not in jobs:
                            jobs[key] = (layer, submesh, logical, kind_in, kind_out)
        found = solve_all(self._solve_job, list(jobs.values()))
        keys = {job: key for key, job in jobs.items()}
        for job, (solution, result, seconds) in found.items():
            self._record(result, seconds)
            self._cache[keys[job]] = solution
            self._fresh.add(keys[job])
        self.stats.in_workers += len(found)
        return len(found)

    def _solve_job(self, job: tuple):
        """A job of ``prefetch`` (layer, submesh, logical mesh, kinds) or of ``_prefetch_lean``
        (…, memory row) solved (``_solved``'s answer); a lean one without a solution None."""
        try:
            return self._solved(*job)
        except PlanError:
            if len(job) == 5:
                raise
            return None      # no lean layout under this memory row

    def _lean_limit(self, layer: int, logical) -> float:
        """A lean layer's memory row: its weights and caches near an even split over the mesh."""
        start, stop = self.layering.bounds[layer], self.layering.bounds[layer + 1]
        full = sum(self.ilp.costs.stored_bytes(p) for p in {p for i in range(start, stop) for p in self.graph.params_of(i)})
        full += sum(self.graph.tensors[name].peak_nbytes for i in range(start, stop) for name in self._caches(i))
        return LEAN_FACTOR * full / (logical[0] * logical[1])

    def _prefetch_lean(self, views) -> int:
        """``prefetch`` for the memory-lean chains of ``views`` ((submesh, logical mesh, first
        layer) triples): their ILPs not known yet, nor known to have no solution
        (``_lean_failed``), solved side by side; one without a solution is recorded as such
        (the chain then takes the fastest layouts' for it, as ``layer_solution`` does). One
        view at a time: a batch of several would solve ILPs that another view of the batch
        shows to have no solution, which take the longest to answer (the 70B shape on 128x8,
        2 cores, a pool forked per batch: 89 s so, against 80-83 s a view at a time)."""
        from meshplan.intra.parallel_solves import solve_all, workers

        if workers() < 2:
            return 0
        jobs: dict[tuple, tuple] = {}
        for submesh, logical, first in views:
            for layer in range(first, self.layering.num_layers):
                limit = self._lean_limit(layer, logical)
                for b_in in BOUNDARY_KINDS:
                    for b_out in BOUNDARY_KINDS:
                        key, kind_in, kind_out = self._key(layer, submesh, logical, b_in, b_out, lean=True)
                        same = (key[0], self._effective_view(layer, submesh, logical), kind_in, kind_out)
                        if key not in self._cache and key not in jobs and self._lean_failed.get(same, -1.0) < limit:
                            jobs[key] = (layer, submesh, logical, kind_in, kind_out, limit)
        found = solve_all(self._solve_job, list(jobs.values()))
        for key, job in jobs.items():
            if job not in found:
                continue
            if found[job] is None:
                layer, submesh, logical, kind_in, kind_out, limit = job
                same = (key[0], self._effective_view(layer, submesh, logical), kind_in, kind_out)
                self._lean_failed[same] = max(self._lean_failed.get(same, -1.0), limit)
                continue
            solution, result, seconds = found[job]
            self._record(result, seconds)
            self._cache[key] = solution
            self._fresh.add(key)
            self.stats.in_workers += 1
        return len(found)

    def _caches(self, index: int) -> list[str]:
        """The outputs of node ``index`` held like weights (its cache and state outputs)."""
        node = self.graph.nodes[index]
        return [node.outputs[k] for k in self.ilp.costs.held(node)]

    def _effective_view(self, layer: int, submesh: tuple[int, int], logical: tuple[int, int]) -> tuple:
        """What the layer's ILP on this view depends on: for each mesh axis that can split
        something, its size and its link; an axis that can split nothing (nor make anything
        partial) leaves the ILP the one without it. An axis splits something where its size
        divides some dim of the layer's tensors, or where a segmented dim (split by heads,
        ``intra.segments``) fits it, alone or with the other axis: a segment of fewer heads
        than devices splits over a count that divides no dim. (A 13x8 view of a layer whose
        dims are powers of two has the ILP of 1x8: one solve serves every host count that
        divides nothing.)"""
        found = self._views.get((layer, submesh, logical))
        if found is None:
            dims, segmented = self._dims_of(layer)
            links = axis_links(self.cluster, submesh, logical)
            inter = self.cluster.hosts > 1

            def splits(size: int, other: int) -> bool:
                return size > 1 and (any(d % size == 0 for d in dims) or any(
                    segments_fit(segs, size) or segments_fit(segs, size * other) for segs in segmented))

            found = tuple(
                (size, links[axis].bandwidth, links[axis].latency, inter and links[axis] == self.cluster.inter_host)
                if splits(size, logical[1 - axis]) else None
                for axis, size in enumerate(logical))
            if self._pin_key(layer, logical):   # a pin depends on the whole mesh
                found = (found, logical)
            self._views[(layer, submesh, logical)] = found
        return found

    def _dims_of(self, layer: int) -> tuple[frozenset[int], frozenset]:
        """Every dim size of the tensors the layer's operators read and write (a parameter's
        sources included), and the segments of those of their dims that are segmented."""
        if layer not in self._layer_dims:
            tensors, chains = self.graph.tensors, self.graph.chains
            names: set[str] = set()
            todo = [name for i in range(self.layering.bounds[layer], self.layering.bounds[layer + 1])
                    for name in list(self.graph.nodes[i].inputs) + list(self.graph.nodes[i].outputs) if name]
            while todo:          # a parameter expression's chain and sources too
                name = todo.pop()
                if name in names:
                    continue
                names.add(name)
                if name in chains:
                    todo.extend(n for n in list(chains[name].inputs) + list(chains[name].outputs) if n)
                todo.extend(tensors[name].sources if name in tensors else ())
            segments = tensor_segments(self.graph)
            self._layer_dims[layer] = (
                frozenset(d for name in names if name in tensors for d in tensors[name].shape),
                frozenset(segs for name in names for segs in segments.get(name, {}).values()))
        return self._layer_dims[layer]

    def _effective_kind(self, layer: int, kind: str, logical: tuple[int, int], entering: bool) -> str:
        """``B`` is the same layout as ``R`` when no tensor crossing that side of the layer can
        be batch-split on this mesh (batch 1, say): then both share one ILP."""
        if kind == "R":
            return kind
        key = (layer, logical, entering)
        if key not in self._splittable:
            mesh = LogicalMesh(logical, tuple(range(logical[0] * logical[1])))
            start, stop = self.layering.bounds[layer], self.layering.bounds[layer + 1]
            if entering:
                names = self._entering(layer)
            else:
                names = {n for i in range(start, stop) for n in self.graph.nodes[i].outputs
                         if n and any(not (start <= c < stop) for c in self._consumers.get(n, []))}
            self._splittable[key] = any(
                not boundary_spec("B", self.graph.tensors[n].split_sizes, mesh).is_replicated for n in names)
        return kind if self._splittable[key] else "R"

    def _entering(self, layer: int) -> set[str]:
        """The tensors a layer reads from earlier layers (not weights, not model inputs)."""
        start, stop = self.layering.bounds[layer], self.layering.bounds[layer + 1]
        return {n for i in range(start, stop) for n in self.graph.nodes[i].inputs
                if n and not self.graph.tensors[n].is_param and n not in self._graph_inputs
                and not (start <= self._producers.get(n, -1) < stop)}

    def arrival(self, layer: int, submesh: tuple[int, int], logical: tuple[int, int]) -> dict[str, float]:
        """What each boundary layout adds to bringing a stage that starts at ``layer`` its
        inputs from the stage before: arriving replicated needs the all-gather, in this mesh,
        of what arriving batch-split does not (the cross-mesh resharding sends each device
        its slice either way). Nothing for the first layer (model inputs come from rank 0)."""
        key = (layer, submesh, logical)
        if key not in self._arrivals:
            seconds = 0.0
            if layer > 0 and self._effective_kind(layer, "B", logical, entering=True) == "B":
                mesh = LogicalMesh(logical, tuple(range(logical[0] * logical[1])))
                collectives = self.ilp.costs.collectives(submesh, logical)
                for name in sorted(self._entering(layer)):
                    info = self.graph.tensors[name]
                    split = boundary_spec("B", info.split_sizes, mesh)
                    if not split.is_replicated:
                        seconds += reshard_seconds(split, boundary_spec("R", info.split_sizes, mesh), info.shape,
                                                   info.dtype.itemsize, mesh, collectives)
            self._arrivals[key] = {"R": seconds * self.ilp.costs.reshard_factor, "B": 0.0}
        return self._arrivals[key]

    def _arrival_table(self, submesh, logical) -> np.ndarray:
        """(L, kinds): ``arrival`` of every start layer (``chain_tables``)."""
        return np.array([[self.arrival(layer, submesh, logical)[kind] for kind in BOUNDARY_KINDS]
                         for layer in range(self.layering.num_layers)])

    def _pin_key(self, layer: int, logical: tuple[int, int]) -> str:
        """What the pins that apply on ``logical`` add to the layer's fingerprint: a layer
        with pinned operators shares its ILP only with layers pinned alike ("" for none)."""
        if not self.pins:
            return ""
        return self.pins.layer_key(self.layering.bounds[layer], self.layering.bounds[layer + 1],
                                   logical[0] * logical[1])

    def _solve_layer(self, layer, submesh, logical, b_in, b_out, memory_limit=None) -> LayerSolution:
        solution, result, seconds = self._solved(layer, submesh, logical, b_in, b_out, memory_limit)
        self._record(result, seconds)
        return solution

    def _solved(self, layer, submesh, logical, b_in, b_out, memory_limit=None) -> tuple:
        """(the layer's solution, the ILP's result or None where pins cannot hold on this
        mesh, the seconds it took): counted nowhere yet (``_record``)."""
        started = ilp.clock()
        start, stop = self.layering.bounds[layer], self.layering.bounds[layer + 1]
        try:
            solution, result = self.ilp.solve(start, stop, submesh, logical, b_in, b_out, memory_limit)
        except PlanError:
            if memory_limit is not None or not self._pin_key(layer, logical):
                raise
            return _unreachable(self.graph, start, stop), None, 0.0   # the pins cannot hold on this mesh
        return solution, result, ilp.clock() - started

    def _record(self, result, seconds: float) -> None:
        """Count a solved ILP in ``stats``."""
        if result is None:
            return
        self.stats.ilps += 1
        self.stats.seconds += seconds
        self.stats.variables += result.variables
        self.stats.constraints += result.constraints
        self.stats.largest = max(self.stats.largest, result.variables)
        if result.warning and result.warning not in self.stats.warnings:
            self.stats.warnings.append(result.warning)

    # --- a stage: chain of layers --------------------------------------------------------

    def stage(self, start: int, stop: int, submesh: tuple[int, int], logical: tuple[int, int],
              memory: float | None = None) -> StageSharding:
        """Best boundary layouts for layers [start, stop): ``boundaries[0]`` is the layout the
        stage's inputs arrive in, ``boundaries[-1]`` the one its outputs leave in (model
        outputs always leave replicated). The fastest layout is used when its weights fit a
        device (of ``memory`` bytes; default the cluster's), else the memory-lean one."""
        fast = self._chain(start, stop, submesh, logical, lean=False)
        if fast.param_bytes <= (self.cluster.device.memory_bytes if memory is None else memory):
            return fast
        return self._chain(start, stop, submesh, logical, lean=True)

    def _chain(self, start, stop, submesh, logical, lean: bool) -> StageSharding:
        return best_chain(range(start, stop), self._solutions(submesh, logical, lean), lean,
                          self.arrival(start, submesh, logical))

    def _solutions(self, submesh, logical, lean: bool):
        """``solution(layer, b_in, b_out)`` on one view, remembered per view (a chain asks
        for the same few many times)."""
        known = self._by_view.setdefault((submesh, logical, lean), {})

        def solution(layer, b_in, b_out):
            found = known.get((layer, b_in, b_out))
            if found is None:
                found = known[(layer, b_in, b_out)] = self._split_weights(layer, submesh, logical, b_in, b_out, lean)
            return found

        return solution

    def stage_tables(self, submesh: tuple[int, int], logical: tuple[int, int],
                     memory: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(L, L) seconds and weight bytes per device: [i, j] is ``stage(i, j + 1, …, memory)``
        for every stage of the layering (inf for j < i), from one pass over the layers
        (``chain_tables``). Where a stage's fastest layouts do not fit ``memory``, its
        memory-lean ones are taken, solved only from the first start that needs them."""
        memory = self.cluster.device.memory_bytes if memory is None else memory
        L = self.layering.num_layers
        seconds, weights = self._fast(submesh, logical)
        over = np.triu(weights > memory)   # (entries below the diagonal are no stage)
        if over.any():
            first = int(np.argmax(over.any(axis=1)))
            self._prefetch_lean([(submesh, logical, first)])
            lean_seconds, lean_weights = chain_tables(L, self._solutions(submesh, logical, True), True, first,
                                                      self._arrival_table(submesh, logical))
            seconds = np.where(over, lean_seconds, seconds)
            weights = np.where(over, lean_weights, weights)
        return seconds, weights

    def _fast(self, submesh, logical) -> tuple[np.ndarray, np.ndarray]:
        """``stage_tables`` with the fastest layouts alone, whatever their memory. Their chain
        depends on each layer's ILP alone (``_split_weights``'s key): views whose layers all
        see the same ILPs (a host count that splits nothing) share one pass."""
        L = self.layering.num_layers
        arrival = self._arrival_table(submesh, logical)
        same = tuple((self._effective_view(layer, submesh, logical),
                      self._effective_kind(layer, "B", logical, entering=True),
                      self._effective_kind(layer, "B", logical, entering=False)) for layer in range(L)) \
            + (arrival.tobytes(),)
        if same not in self._fast_tables:
            self._fast_tables[same] = chain_tables(L, self._solutions(submesh, logical, False), False,
                                                   arrival=arrival)
        return self._fast_tables[same]

    def _split_weights(self, layer, submesh, logical, b_in, b_out, lean) -> LayerSolution:
        """The layer's solution with ``param_bytes`` the weights only this layer reads and
        ``slices`` the (initializer, layout) slices of the weights other layers read too."""
        # keyed like layer_solution: views and boundary kinds that give the same ILP give the
        # same slices (an axis that splits nothing changes no byte count)
        view = (submesh, logical) if lean else self._effective_view(layer, submesh, logical)
        key = (layer, view, self._effective_kind(layer, b_in, logical, entering=True),
               self._effective_kind(layer, b_out, logical, entering=False), lean)
        if key in self._own:
            self.stats.cache_hits += 1   # as layer_solution counts a reuse
        else:
            solution = self.layer_solution(layer, submesh, logical, b_in, b_out, lean)
            form, names = self._weights_form(layer)
            same = (form, self._key(layer, submesh, logical, b_in, b_out, lean)[0], logical)
            known = self._form_slices.get(same)
            if known is not None and known[0] is solution:
                # a layer like one already split: the same bytes, its own tensors' names
                own_bytes, shared = known[1], {(names[i], spec): size for (i, spec), size in known[2].items()}
            else:
                mesh = LogicalMesh(logical, tuple(range(logical[0] * logical[1])))
                first = self.layering.bounds[layer]
                slices: dict = {}
                for k, strategy in enumerate(solution.strategies):
                    slices.update(self.ilp.costs.param_slices(self.graph.nodes[first + k], strategy, mesh))
                shared = {key: size for key, size in slices.items() if key[0] in self._shared}
                own_bytes = held_bytes({key: size for key, size in slices.items() if key[0] not in self._shared})
                index = {name: i for i, name in enumerate(names)}
                if all(name in index for name, _ in slices):
                    self._form_slices[same] = (solution, own_bytes,
                                               {(index[name], spec): size for (name, spec), size in shared.items()})
            self._own[key] = replace(solution, param_bytes=own_bytes, slices=shared)
        return self._own[key]

    def _weights_form(self, layer: int) -> tuple[tuple, list[str]]:
        """What ``_split_weights`` reads of a layer beyond its ILP, and the names it reads
        them by: layers of one form split alike, each naming its own tensors. The form: the
        layer's fingerprint; which of its weight reads and held outputs name the same tensor
        (positions in the names: ``held_bytes`` counts a slice once), a held output's largest
        shape; and which of those names other layers read too."""
        if layer not in self._forms:
            names: dict[str, int] = {}
            pattern: list = []
            for i in range(self.layering.bounds[layer], self.layering.bounds[layer + 1]):
                node = self.graph.nodes[i]
                pattern.append(tuple((names.setdefault(node.outputs[k], len(names)),
                                      self.graph.tensors[node.outputs[k]].peak) for k in self.ilp.costs.held(node)))
                for name in node.inputs:
                    info = self.graph.tensors.get(name) if name else None
                    if info is not None and info.is_param:
                        pattern.append(tuple(names.setdefault(source, len(names))
                                             for source in info.sources or (name,)))
            order = list(names)
            self._forms[layer] = ((self._layer_keys[layer], tuple(pattern),
                                   tuple(name in self._shared for name in order)), order)
        return self._forms[layer]

    def boundary_seconds(self, start: int, stop: int, submesh, logical, sharding: StageSharding) -> float:
        """Of the stage's seconds, those spent resharding into and out of the boundary
        layouts between its layers (what wider windows could save: ``intra.windows``); the
        stage's own inputs and outputs are not counted."""
        boundaries = sharding.boundaries
        total = 0.0
        for offset, layer in enumerate(range(start, stop)):
            solution = self.layer_solution(layer, submesh, logical, boundaries[offset], boundaries[offset + 1],
                                           sharding.lean)
            total += (solution.entering_seconds if layer > start else 0.0) + (
                solution.leaving_seconds if layer < stop - 1 else 0.0)
        return total

    def stage_strategies(self, start: int, stop: int, submesh, logical, sharding: StageSharding) -> dict[int, Strategy]:
        chosen: dict[int, Strategy] = {}
        boundaries = sharding.boundaries
        for offset, layer in enumerate(range(start, stop)):
            solution = self.layer_solution(layer, submesh, logical, boundaries[offset], boundaries[offset + 1],
                                           sharding.lean)
            first = self.layering.bounds[layer]
            chosen.update({first + k: strategy for k, strategy in enumerate(solution.strategies)})
        return chosen


def _unreachable(graph, start: int, stop: int) -> LayerSolution:
    """A layer whose pinned operators have no strategy on a mesh: infinitely slow there."""
    def whole(name):
        return ShardingSpec.replicated(len(graph.tensors[name].shape)) if name else None

    strategies = [Strategy(tuple(whole(n) for n in graph.nodes[i].inputs), tuple(whole(n) for n in graph.nodes[i].outputs))
                  for i in range(start, stop)]
    return LayerSolution(float("inf"), strategies, float("inf"))
