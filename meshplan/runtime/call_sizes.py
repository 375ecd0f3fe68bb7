"""The sizes of one call of a plan, from its inputs' shapes, checked against the plan.

A ranged plan (``Plan.sizes``) names its ranged dims in its inputs' shapes
(``TensorSpec.shape``): a free dim's size is read from the first input that has it, must
be the same wherever else it appears and one its range accepts; a derived dim (or a dim
named by an expression of known ones) must equal its form at those sizes; a fixed dim
must be its number. Each failure is one ``RunError`` line naming the input and axis. The
resident job checks every call with it before any rank hears of the call, and ``meshplan
verify`` checks its inputs file.
"""

from __future__ import annotations

from meshplan.errors import RunError
from meshplan.model.sizes import Sizes, expression_form
from meshplan.plan_format import TensorSpec


class CallSizes:
    """Collects what a call's input shapes say, then checks it (``values``)."""

    def __init__(self, sizes: Sizes | None):
        self.sizes = sizes
        self.found: dict[str, tuple[int, str, int]] = {}   # free dim → (size, input, axis)
        self.checks: list[tuple[str, int, str, int]] = []   # (dim name, size, input, axis) to check later

    def add(self, spec: TensorSpec, shape) -> None:
        """An input's shape: its rank, its fixed dims, its free dims' agreement."""
        if len(shape) != len(spec.shape):
            raise RunError(f"input '{spec.name}' has {len(shape)} dims, the plan expects {len(spec.shape)} "
                           f"({spec.shape})")
        for axis, (want, size) in enumerate(zip(spec.shape, shape)):
            if isinstance(want, str):
                if self.sizes is not None and want in self.sizes.ranges:
                    if want in self.found and self.found[want][0] != size:
                        first = self.found[want]
                        raise RunError(f"input '{spec.name}' axis {axis} is {size} but input '{first[1]}' axis "
                                       f"{first[2]} is {first[0]}: both are {want}")
                    self.found.setdefault(want, (size, spec.name, axis))
                else:
                    self.checks.append((want, size, spec.name, axis))
            elif want >= 0 and want != size:
                raise RunError(f"input '{spec.name}' has shape {list(shape)}, the plan expects {spec.shape}")

    def check_ranges(self, values: dict | None = None) -> None:
        """Every free dim's size seen so far (or in ``values``) is one its range accepts."""
        if self.sizes is None:
            return
        values = values or {}
        for name, r in self.sizes.ranges.items():
            size = values.get(name, self.found[name][0] if name in self.found else None)
            if size is not None and not r.accepts(size):
                where = f" (input '{self.found[name][1]}' axis {self.found[name][2]})" if name in self.found else ""
                raise RunError(f"{name} = {size}{where} is not a size this plan accepts: {r.describe()}")

    def values(self) -> dict[str, int]:
        """Every dim's size at this call (a free dim no input gave at the bottom of its
        range: an unset state), after checking ranges and derived dims."""
        values = {n: v[0] for n, v in self.found.items()}
        if self.sizes is not None:
            for name, r in self.sizes.ranges.items():
                values.setdefault(name, r.lo)
            self.check_ranges(values)
            values = self.sizes.resolve({n: values[n] for n in self.sizes.ranges})
        for dim, size, where, axis in self.checks:
            want = values.get(dim)
            if want is None:
                form = expression_form(dim, set(values))
                want = form(values) if form is not None else None
            if want is not None and want != size:
                raise RunError(f"input '{where}' axis {axis} is {size}, but {dim} = {want} at this call's sizes")
        return values


def check_inputs(plan, shapes: dict[str, tuple]) -> dict[str, int]:
    """The sizes of a call whose inputs have ``shapes`` (state inputs may be missing)."""
    found = CallSizes(Sizes.from_dict(plan.sizes) if plan.sizes else None)
    for spec in plan.inputs:
        if spec.name in shapes:
            found.add(spec, shapes[spec.name])
    return found.values()


def shape_at(shape: list, values: dict[str, int]) -> tuple | None:
    """A spec's shape at a call's sizes; None where a dim does not follow from them."""
    out = []
    for d in shape:
        if isinstance(d, str):
            if d in values:
                out.append(values[d])
                continue
            form = expression_form(d, set(values))
            if form is None:
                return None
            out.append(form(values))
        elif d < 0:
            return None
        else:
            out.append(int(d))
    return tuple(out)
