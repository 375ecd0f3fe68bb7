"""Hints held against the planned graph: pinned strategies for the layer ILPs, forced cuts
and ruled-out submeshes for the stage DP, and the check that a plan keeps them.

``resolve_hints`` finds each hinted node of ``model.hints.Hints`` among the canonical
graph's operators and checks that its hints can hold: the tensors are the node's, their
sizes are the graph's, every split divides, each stage's devices form a submesh, stages
never go back along the model's order, and some strategy of the node, on a mesh
of its stage's size, lays its tensors out as hinted. A hint that cannot hold is a
``HintError`` naming the node. What it returns, ``StageHints``, then constrains a search:

- ``pins``: each hinted operator's strategies, restricted in its layer's ILP
  (``intra.pins``);
- ``layering``: the layering with a cut between the last node of each hinted stage and
  the first node of the next (where it has none, at the cheapest place between them);
- ``mask``: the stage DP's cost table with infinite entries for every stage that would
  cross a forced cut, hold part of a hinted stage, lie between two hinted stages whose
  numbers differ by one, come before a hinted stage 0, or run a hinted stage on a submesh
  of another size (or, where the hints name it, another submesh or logical mesh).
  Stage numbers so hold exactly where the hints number their stages 0, 1, 2, … from the
  first; elsewhere they give the order (a larger number is a later stage, consecutive
  numbers are consecutive stages);
- ``violations``: what a finished plan does not keep (``make_plan`` keeps the free plan
  when it keeps every hint: it is then also the best plan that does).

Nodes of parameter expressions (a Transpose of a weight) are not operators of the search:
their annotations are read but not held (a weight's layout is hinted on the node that
reads it). Devices are read relative to their stage: the k-th smallest device a hinted
stage names is its device k, so a hint fixes a stage's size, mesh and layouts, and stages
are placed on the cluster in order (``pipeline.place_submeshes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshplan.cost.cluster import Cluster
from meshplan.errors import HintError
from meshplan.inter.stage_cost import logical_meshes, submesh_shapes
from meshplan.intra.pins import NodePin, Pins
from meshplan.intra.policies import apply_policy
from meshplan.intra.segments import tensor_segments
from meshplan.intra.strategies import Strategy, node_strategies
from meshplan.model.graph import Graph
from meshplan.model.hints import Hints, NodeHint
from meshplan.model.layers import Layering
from meshplan.onnx_sharding import DeviceLayout, LayoutProblem, normalised
from meshplan.plan_format import Plan
from meshplan.sharding import LogicalMesh, ShardingSpec


@dataclass
class _Group:
    """The hinted operators of one stage."""
    stage: int
    nodes: list[int] = field(default_factory=list)      # graph node indices, in order
    devices: tuple[int, ...] | None = None               # the configuration's devices it names
    mesh: tuple | None = None                             # (submesh, logical mesh) where the hints name them


@dataclass
class StageHints:
    hints: Hints
    graph: Graph
    pins: Pins
    groups: list[_Group]                   # by stage number
    loose: dict[int, int]                  # node index → device count, for pinned nodes without a stage
    labels: dict[int, str]                 # node index → the hint's name for it

    # --- the stage DP --------------------------------------------------------------------

    def layering(self, layering: Layering) -> Layering:
        """``layering`` with a cut between consecutive hinted stages where it has none."""
        bounds = set(layering.bounds)
        for before, after in zip(self.groups, self.groups[1:]):
            last, first = before.nodes[-1], after.nodes[0]
            if any(last < b <= first for b in bounds):
                continue
            places = np.arange(last + 1, first + 1)
            bounds.add(int(places[np.argmin(layering.cut_bytes[places])]))
        return Layering(tuple(sorted(bounds)), layering.cut_bytes)

    def mask(self, seconds: np.ndarray, submeshes: list[tuple[int, int]], layering: Layering) -> np.ndarray:
        """``seconds`` (the DP's (L, L, S, K) table) with the stages the hints rule out infinite."""
        out = np.array(seconds, dtype=np.float64, copy=True)
        L = out.shape[0]
        owner = layering.layer_of_node()
        first, last = np.arange(L)[:, None], np.arange(L)[None, :]
        bad = np.zeros((L, L), dtype=bool)
        spans = [(int(owner[g.nodes[0]]), int(owner[g.nodes[-1]])) for g in self.groups]
        if spans and self.groups[0].stage == 0:
            bad |= last < spans[0][0]                                    # a stage before stage 0
        for lo, hi in spans:                                             # part of a hinted stage
            bad |= (first <= hi) & (last >= lo) & ~((first <= lo) & (last >= hi))
        for (_, hi), (lo, _), a, b in zip(spans, spans[1:], self.groups, self.groups[1:]):
            bad |= (first <= hi) & (last >= lo)                          # across a forced cut
            if b.stage == a.stage + 1:
                bad |= (first > hi) & (last < lo)                        # a stage between consecutive ones
        out[bad] = np.inf
        views = [logical_meshes(s) for s in submeshes]
        sizes = np.array([n * m for n, m in submeshes])
        for group, (lo, hi) in zip(self.groups, spans):
            holds = (first <= lo) & (last >= hi)
            count = len(group.devices) if group.devices else None
            self._mask_meshes(out, holds, count, group.mesh, submeshes, views, sizes)
        for node, count in self.loose.items():
            layer = int(owner[node])
            self._mask_meshes(out, (first <= layer) & (last >= layer), count, None, submeshes, views, sizes)
        return out

    @staticmethod
    def _mask_meshes(out, holds, count, mesh, submeshes, views, sizes) -> None:
        for s, submesh in enumerate(submeshes):
            for k in range(out.shape[3]):
                wrong = count is not None and sizes[s] != count
                if mesh is not None:
                    wrong = wrong or submesh != mesh[0] or k >= len(views[s]) or views[s][k] != mesh[1]
                if wrong:
                    out[:, :, s, k][holds] = np.inf

    # --- a finished plan -----------------------------------------------------------------

    def violations(self, plan: Plan, shardings: dict[int, dict[str, Strategy]]) -> list[str]:
        """One line per hint ``plan`` does not keep (empty when it keeps them all)."""
        where = {name: stage for stage in plan.stages for name in stage.operators}
        found = []
        placed = []                      # each group's stage in the plan
        for group in self.groups:
            stages = {where[self.graph.nodes[i].name].index for i in group.nodes}
            if len(stages) > 1:
                found.append(f"the nodes hinted in stage {group.stage} are in stages {sorted(stages)}")
            placed.append(min(stages))
        for k, group in enumerate(self.groups):
            label = self.labels[group.nodes[0]]
            exact = all(g.stage == j for j, g in enumerate(self.groups[:k + 1]))
            if exact and placed[k] != group.stage:
                found.append(f"node '{label}' is in stage {placed[k]}, hinted stage {group.stage}")
            elif k and (placed[k] <= placed[k - 1] or (group.stage == self.groups[k - 1].stage + 1
                                                         and placed[k] != placed[k - 1] + 1)):
                found.append(f"node '{label}' is in stage {placed[k]} after stage {placed[k - 1]}, hinted stage "
                             f"{group.stage} after {self.groups[k - 1].stage}")
        for index, pin in self.pins.pins.items():
            node = self.graph.nodes[index]
            stage = where[node.name]
            label = self.labels[index]
            if pin.devices is not None and pin.devices != len(stage.devices):
                found.append(f"node '{label}' runs on {len(stage.devices)} device(s), hinted {pin.devices}")
                continue
            group = next((g for g in self.groups if index in g.nodes), None)
            if group is not None and group.mesh is not None and (
                    tuple(stage.submesh), tuple(stage.logical_mesh)) != group.mesh:
                found.append(f"node '{label}' runs on a {_shape(stage.submesh)} submesh viewed as "
                             f"{_shape(stage.logical_mesh)}, hinted {_shape(group.mesh[0])} viewed as "
                             f"{_shape(group.mesh[1])}")
                continue
            strategy = shardings.get(stage.index, {}).get(node.name) or _replicated(self.graph, node)
            mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(range(len(stage.devices))))
            if not self.pins.matches(node, strategy, pin, mesh):
                found.append(f"node '{label}' has strategy {strategy}, not the hinted layouts")
        return found

    def placement_notes(self, plan: Plan) -> list[str]:
        """Where a hinted stage names other devices than the ones its stage was placed on."""
        notes = []
        where = {name: stage for stage in plan.stages for name in stage.operators}
        for group in self.groups:
            if group.devices is None:
                continue
            placed = where[self.graph.nodes[group.nodes[0]].name].devices
            if list(group.devices) != sorted(placed):
                notes.append(f"hinted stage {group.stage} names devices {_ranks(group.devices)}; it runs on "
                             f"{_ranks(placed)} (stages are placed in order; a hint fixes a stage's size and layouts)")
        return notes


def _shape(pair) -> str:
    return f"{pair[0]}x{pair[1]}"


def _ranks(devices) -> str:
    return ",".join(str(d) for d in devices)


def _replicated(graph: Graph, node) -> Strategy:
    def whole(name):
        return ShardingSpec.replicated(len(graph.tensors[name].shape)) if name else None

    return Strategy(tuple(whole(n) for n in node.inputs), tuple(whole(n) for n in node.outputs))


# --- resolving the hints against the graph ----------------------------------------------------

def resolve_hints(hints: Hints, graph: Graph, cluster: Cluster, constants, policy: str = "auto") -> StageHints:
    """The hints as constraints on the search of ``graph`` on ``cluster``; HintError (one line
    naming the node) for a hint that cannot hold."""
    origin = hints.origin
    found = _find_nodes(hints, graph)
    labels = {index: hint.label for index, hint in found}
    segments = tensor_segments(graph)
    layouts: dict[int, list[tuple[str, DeviceLayout]]] = {}
    for index, hint in found:
        layouts[index] = [(t.tensor, _checked_layout(hint, t.tensor, t.layout, graph, index, segments, origin))
                          for t in hint.tensors]
    groups = _groups(found, layouts, hints, origin, labels)
    shapes = submesh_shapes(cluster)
    sizes = {n * m for n, m in shapes}
    used = 0
    for group in groups:
        if group.devices is None:
            continue
        count = len(group.devices)
        if count not in sizes:
            raise HintError(f"hint for node '{labels[group.nodes[0]]}' in {origin}: stage {group.stage} is hinted on "
                            f"{count} devices; submeshes of this mesh have {', '.join(map(str, sorted(sizes)))}")
        if group.mesh is not None and (group.mesh[0] not in shapes or group.mesh[1] not in logical_meshes(group.mesh[0])):
            raise HintError(f"hint for node '{labels[group.nodes[0]]}' in {origin}: stage {group.stage}'s mesh "
                            f"{_shape(group.mesh[0])} viewed as {_shape(group.mesh[1])} is not one this cluster has")
        used += count
    if used > cluster.num_devices:
        raise HintError(f"the hinted stages of {origin} need {used} devices; the mesh has {cluster.num_devices}")
    staged = {i: g for g in groups for i in g.nodes}
    loose: dict[int, int] = {}
    pins: dict[int, NodePin] = {}
    for index, hint in found:
        entries = layouts[index]
        group = staged.get(index)
        devices = group.devices if group is not None else _named(entries, hint, origin)
        if group is None and devices is not None:
            if len(devices) not in sizes:
                raise HintError(f"hint for node '{hint.label}' in {origin}: its tensors are laid out on "
                                f"{len(devices)} devices; submeshes of this mesh have "
                                f"{', '.join(map(str, sorted(sizes)))}")
            loose[index] = len(devices)
        if not entries:
            continue
        for tensor, layout in entries:
            if layout.holders is not None and devices is not None and layout.devices != tuple(devices):
                raise HintError(f"hint for node '{hint.label}' in {origin}: tensor '{tensor}' is laid out on devices "
                                f"{_ranks(layout.devices)}, its stage on {_ranks(devices)}")
        order = devices if devices is not None else ()
        pin = NodePin(None if devices is None else len(devices),
                      tuple((t, layout.renumbered(order) if layout.holders is not None else layout)
                            for t, layout in entries))
        pins[index] = pin
        _check_feasible(graph, index, hint, pin, cluster, shapes, group.mesh if group else None, constants, policy,
                        origin)
    return StageHints(hints, graph, Pins(graph, pins), groups, loose, labels)


def _find_nodes(hints: Hints, graph: Graph) -> list[tuple[int, NodeHint]]:
    """(graph node index, hint) of each hinted operator, in graph order: by name, or by its
    first output for a node without one. Hints on nodes of parameter expressions, and on
    nodes canonicalisation folded away (their outputs are constants now), are set aside."""
    by_name = {node.name: i for i, node in enumerate(graph.nodes)}
    by_output = {out: i for i, node in enumerate(graph.nodes) for out in node.outputs if out}
    chain_names = {node.name for node in graph.chains.values()}
    found: dict[int, NodeHint] = {}
    for hint in hints.nodes:
        # by name; a node without one (in a model other than the canonical one) by its output
        index = by_name.get(hint.name) if hint.name else by_output.get(hint.outputs[0] if hint.outputs else "")
        if index is None:
            if hint.name in chain_names or any(out in graph.chains for out in hint.outputs):
                continue
            info = [graph.tensors.get(out) for out in hint.outputs if out]
            if info and all(t is not None and t.is_param for t in info):
                continue     # folded: a constant of the canonical model
            raise HintError(f"hint for node '{hint.label}' in {hints.origin}: the model has no such operator "
                            "(node names are the canonical model's, as in plan.json)")
        if index in found:
            raise HintError(f"hint for node '{hint.label}' in {hints.origin}: the node is hinted twice")
        found[index] = hint
    return sorted(found.items())


def _checked_layout(hint: NodeHint, tensor: str, layout: DeviceLayout, graph: Graph, index: int, segments,
                    origin: str) -> DeviceLayout:
    node = graph.nodes[index]
    where = f"hint for node '{hint.label}' in {origin}: tensor '{tensor}'"
    if tensor not in set(node.inputs) | set(node.outputs) or not tensor:
        raise HintError(f"{where} is not an input or output of the node")
    info = graph.tensors[tensor]
    try:
        layout = normalised(layout, len(info.shape))
    except LayoutProblem as exc:
        raise HintError(f"{where}: {exc}") from None
    for dim in layout.dims:
        axis = dim.axis
        symbolic = axis in info.ranged or axis in info.dynamic
        if isinstance(dim.size, int) and not symbolic and dim.size != info.shape[axis]:
            raise HintError(f"{where}: axis {axis} has size {info.shape[axis]}, the hint says {dim.size}")
        if axis in info.dynamic and dim.shards > 1:
            raise HintError(f"{where}: axis {axis} depends on the data and cannot be split")
        size = info.split_sizes[axis]
        if axis not in segments.get(tensor, {}) and size % dim.shards:
            raise HintError(f"{where}: axis {axis} of size {size} does not split into {dim.shards} pieces")
    if layout.partial and not np.issubdtype(info.dtype, np.floating):
        raise HintError(f"{where}: a {info.dtype} tensor cannot be held as addends")
    return layout


def _named(entries, hint: NodeHint, origin: str) -> tuple[int, ...] | None:
    """The devices a node's tensor hints name (the same set for every tensor that names any)."""
    named = [layout.devices for _, layout in entries if layout.holders is not None]
    if not named:
        return None
    if any(devices != named[0] for devices in named):
        raise HintError(f"hint for node '{hint.label}' in {origin}: its tensors are laid out on different devices "
                        f"({' and '.join(_ranks(d) for d in dict.fromkeys(named))})")
    return named[0]


def _groups(found, layouts, hints: Hints, origin: str, labels) -> list[_Group]:
    """The hinted stages in order, checked: numbered 0, 1, 2, … along the operators' order."""
    groups: list[_Group] = []
    for index, hint in found:
        if hint.stage is None:
            continue
        if groups and hint.stage < groups[-1].stage:
            raise HintError(f"hint for node '{hint.label}' in {origin}: stage {hint.stage} comes after stage "
                            f"{groups[-1].stage} (node '{labels[groups[-1].nodes[-1]]}') in the model's order; a stage "
                            "is a run of consecutive operators")
        if not groups or hint.stage > groups[-1].stage:
            groups.append(_Group(hint.stage))
        groups[-1].nodes.append(index)
    for group in groups:
        meta = hints.stages.get(group.stage)
        named = {d for i in group.nodes for _, layout in layouts[i] for d in layout.devices}
        # meshplan.stages describes the stages of the plan the annotations were written for;
        # where a node's own annotations were edited since, they win
        if meta is not None and (not named or named == set(meta["devices"])):
            group.devices = tuple(sorted(meta["devices"]))
            group.mesh = (meta["submesh"], meta["logical_mesh"])
            if meta["submesh"][0] * meta["submesh"][1] != len(group.devices):
                raise HintError(f"the {len(group.devices)} devices of stage {group.stage} in {origin} do not form its "
                                f"{_shape(meta['submesh'])} submesh")
        elif named:
            group.devices = tuple(sorted(named))
    return groups


def _check_feasible(graph: Graph, index: int, hint: NodeHint, pin: NodePin, cluster: Cluster, shapes, mesh,
                    constants, policy: str, origin: str) -> None:
    """Some strategy of the node, on some mesh of its stage's size, holds the pin."""
    node = graph.nodes[index]
    views = []
    for submesh in shapes:
        if pin.devices is not None and submesh[0] * submesh[1] != pin.devices:
            continue
        for logical in logical_meshes(submesh):
            if mesh is None or (submesh, logical) == mesh:
                views.append(logical)
    views = list(dict.fromkeys(views))
    pins = Pins(graph, {index: pin})
    candidates = []
    for logical in views:
        positions = LogicalMesh(logical, tuple(range(logical[0] * logical[1])))
        strategies = apply_policy(policy, node, graph, node_strategies(node, graph, positions, constants,
                                                                       opset=graph.opset), constants)
        if any(pins.matches(node, s, pin, positions) for s in strategies):
            return
        candidates.append((positions, strategies))
    meshes = " or ".join(_shape(v) for v in views) or "no"
    for tensor, layout in pin.tensors:
        alone = NodePin(pin.devices, ((tensor, layout),))
        if not any(pins.matches(node, s, alone, m) for m, strategies in candidates for s in strategies):
            raise HintError(f"hint for node '{hint.label}' in {origin}: no strategy of this {node.op_type}"
                            f"{'' if policy == 'auto' else f' under --policy {policy}'} lays tensor '{tensor}' out as "
                            f"{layout.describe()} on a {meshes} mesh")
    raise HintError(f"hint for node '{hint.label}' in {origin}: no strategy of this {node.op_type} lays out all of its "
                    f"hinted tensors as hinted at once on a {meshes} mesh")

