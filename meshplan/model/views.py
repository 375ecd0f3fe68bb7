"""A model planned for ranges of sizes: one canonical model for every size, and its shapes
at the sizes the planner looks at.

The canonical model of a ranged plan keeps the ranged and derived dims symbolic: folding
evaluates only what does not depend on them, so a Reshape target that names the batch or
the sequence stays the computation it is (Shape, Gather, Concat …) and every program cut
from it runs at whatever size its inputs have. The planner needs numbers, so the model
is also folded at two points: the *cost* sizes (every free dim at its ``@SIZE``, by
default its top) and the *top* sizes (every free dim at its largest). Tensor names are
kept by folding, so each tensor of the canonical model gets its shape at both points
(``SizeViews``): costs come from the first, memory from the second, and a strategy must
hold at both. A dim that is not a number in the canonical model is *ranged*, unless it
has one size at the cost, top and probe sizes alike (a buffer of fixed capacity that the
model declares with a length that varies: GroupQueryAttention's present key and value);
its *grain* (the gcd of every size it takes: a split over K devices must divide it) is the
free dim's own where the dim carries a free dim's name, the derived form's where it
carries a derived name, and 1 (never split) otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from meshplan.errors import ModelError
from meshplan.files import file_sha256
from meshplan.model.bounds import bound_dynamic_dims, read_bounds
from meshplan.model.fold import SMALL_ELEMENTS, fold_constants, infer_shapes
from meshplan.model.graph import TensorInfo, _dtype
from meshplan.model.load import CanonicalModel, _unbounded, canonical_graph
from meshplan.model.sizes import Sizes, probe_point


@dataclass
class SizeViews:
    """Shapes of every tensor of a ranged canonical model at its cost and top sizes."""

    sizes: Sizes
    cost: dict[str, tuple[int, ...]]
    top: dict[str, tuple[int, ...]]
    dynamic: dict[str, tuple[int, ...]]                      # data-dependent dims (at the cost sizes)
    symbols: dict[str, tuple] = field(default_factory=dict)   # the canonical model's dims (int, name or None)
    dtypes: dict[str, int] = field(default_factory=dict)
    probe: dict[str, tuple[int, ...]] = field(default_factory=dict)   # at sizes unlike the cost sizes

    def _make(self, name: str, elem_type: int) -> TensorInfo:
        if name not in self.cost or name not in self.top:
            raise ModelError(f"the shape of tensor '{name}' is unknown at the cost or top sizes "
                             f"({self.sizes.describe()})")
        shape, peak = self.cost[name], self.top[name]
        if len(shape) != len(peak):
            raise ModelError(f"tensor '{name}' changes rank with the sizes ({list(shape)} vs {list(peak)})")
        dims = self.symbols.get(name) or (None,) * len(shape)
        dynamic = self.dynamic.get(name, ())
        probe = self.probe.get(name)
        ranged = tuple(a for a in range(len(shape))
                       if a not in dynamic and (shape[a] != peak[a] or not isinstance(dims[a], int) and not (
                           probe is not None and len(probe) == len(shape) and probe[a] == shape[a])))
        grains = tuple(self._grain(dims[a]) if a in ranged else size for a, size in enumerate(shape))
        return TensorInfo(name, tuple(shape), _dtype(elem_type, name), dynamic=dynamic, ranged=ranged,
                          peak=tuple(peak), grains=grains)

    def _grain(self, dim) -> int:
        if isinstance(dim, str):
            if dim in self.sizes.ranges:
                return self.sizes.ranges[dim].grain
            if dim in self.sizes.derived:
                return self.sizes.grain(self.sizes.derived[dim])
        return 1

    def info(self, value: onnx.ValueInfoProto) -> TensorInfo:
        return self._make(value.name, value.type.tensor_type.elem_type)

    def info_of(self, name: str) -> TensorInfo:
        if name not in self.dtypes:
            raise ModelError(f"tensor '{name}' has no inferred type")
        return self._make(name, self.dtypes[name])


def _dims(value: onnx.ValueInfoProto) -> tuple | None:
    kind = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not kind.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in kind.shape.dim)


def shapes_at(model: onnx.ModelProto, point: dict[str, int]) -> tuple[dict, dict, dict]:
    """(static shapes, data-dependent dims, element types) of every tensor of ``model`` with
    its symbolic input dims at ``point``: the model folded there (folded tensors keep their
    names), data-dependent dims at their bounds."""
    view = onnx.ModelProto()
    view.CopyFrom(model)
    for value in list(view.graph.input) + list(view.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in point:
                dim.dim_value = point[dim.dim_param]
    del view.graph.value_info[:]
    seen: dict[str, tuple[int, ...]] = {}
    fold_constants(view, SMALL_ELEMENTS, seen)
    view = infer_shapes(view)
    bound_dynamic_dims(view, _unbounded)
    bounds = read_bounds(view)
    dynamic: dict[str, tuple[int, ...]] = {}
    types: dict[str, int] = {}
    for value in list(view.graph.input) + list(view.graph.value_info) + list(view.graph.output):
        dims = _dims(value)
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
        if dims is None or any(d is None for d in dims):
            continue
        seen[value.name] = tuple(bounds[d] if isinstance(d, str) else d for d in dims)
        found = tuple(a for a, d in enumerate(dims) if isinstance(d, str))
        if found:
            dynamic[value.name] = found
    for init in view.graph.initializer:
        seen.setdefault(init.name, tuple(init.dims))
        types.setdefault(init.name, init.data_type)
    return seen, dynamic, types


def canonicalize_ranged(source: str | os.PathLike, sizes: Sizes, workdir: str | os.PathLike,
                        weights: str = "read") -> tuple[CanonicalModel, SizeViews]:
    """The canonical model of a ranged plan (ranged and derived dims symbolic) under
    ``workdir``, and its shapes at the cost and top sizes. ``weights`` is ``canonicalize``'s:
    without ``"read"`` no byte of the external data is read and the canonical model's
    weights are left unplaced (it serves planning only)."""
    source, workdir = Path(source), Path(workdir)
    symbolic = tuple(sizes.ranges) + tuple(sizes.derived)
    canonical, path = canonical_graph(source, sizes.fixed, symbolic, workdir, weights)
    onnx.save_model(canonical, str(path))
    cost, dynamic, types = shapes_at(canonical, sizes.point("cost"))
    top, _, _ = shapes_at(canonical, sizes.point("top"))
    probe, _, _ = shapes_at(canonical, sizes.resolve(probe_point(sizes)))
    symbols = {}
    for value in list(canonical.graph.input) + list(canonical.graph.value_info) + list(canonical.graph.output):
        dims = _dims(value)
        if dims is not None:
            symbols[value.name] = dims
        if value.type.HasField("tensor_type"):
            types.setdefault(value.name, value.type.tensor_type.elem_type)
    views = SizeViews(sizes, cost, top, dynamic, symbols, types, probe)
    fixed = dict(sizes.fixed)
    return CanonicalModel(source=source, source_sha256=file_sha256(source), dims=fixed, path=path,
                          model=canonical), views
