"""The planner's search space, as input shapes to profile: every strategy of every
operator on every logical mesh the planner will try, so that sharded stages are costed
from measurements too."""

from __future__ import annotations

from meshplan.cost.cluster import Cluster
from meshplan.inter.stage_cost import logical_meshes, submesh_shapes
from meshplan.intra.strategies import local_attributes, node_strategies
from meshplan.sharding import LogicalMesh
from meshplan.profile.signatures import Variant, Variants


def sharded_variants(cluster: Cluster) -> Variants:
    """``variants(node, graph)`` for ``ProfileOptions.variants``: the distinct local input
    shapes (None for an absent input or one without a spec), with the rewritten shape
    constants, that ``node`` has under each of its strategies on the logical meshes of
    every submesh but 1×1."""
    meshes = [LogicalMesh(view, tuple(range(view[0] * view[1])))
              for shape in submesh_shapes(cluster) if shape != (1, 1) for view in logical_meshes(shape)]

    def variants(node, graph):
        seen = set()
        for mesh in meshes:
            for strategy in node_strategies(node, graph, mesh, opset=graph.opset):
                shapes = tuple(spec.local_shape(graph.tensors[name].shape, mesh) if name and spec is not None else None
                               for name, spec in zip(node.inputs, strategy.inputs))
                attrs = tuple(sorted(local_attributes(node, graph, strategy, mesh).items()))
                variant = Variant(shapes, tuple(strategy.rewrites), attrs)
                if variant not in seen:
                    seen.add(variant)
                    yield variant

    return variants
