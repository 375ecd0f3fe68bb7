"""The sizes a plan is for: dims fixed to one value, dims that range, and dims that follow
from others.

``--dim NAME=INT`` fixes a symbolic dim (0 included: an empty past); ``--dim NAME=LO:HI``
lets it take any size from LO to HI, ``LO:HI:STEP`` only LO, LO+STEP, … (a plan may split
such a dim over K devices only where every accepted size divides by K), and ``@SIZE``
after either says which size costs are taken at (default: HI). The *free* dims are the
ones the user names; every other symbolic dim of the model's inputs is *derived*: an
affine function of the free ones (``past_sequence_length + sequence_length``, torch's
``s53``, ``total_sequence_length``), read from its name when the name is such an
expression of known dims, else from the graph: at a few probe sizes of the free dims,
onnx's shape inference carries the known sizes through the graph, and each operator
whose inputs must agree on a dim (broadcasting, a matrix product's contraction, a
concatenation's other dims) equates an unknown dim with a known size. The fit over the
probes is checked at one more point.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field

import onnx
from onnx import helper

from meshplan.errors import ModelError

# operators whose inputs' aligned dims (from the right) must be equal or 1
BROADCASTING = {
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Mean", "Sum", "Where", "Equal", "Less", "LessOrEqual",
    "Greater", "GreaterOrEqual", "And", "Or", "Xor", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "PRelu",
}


@dataclass(frozen=True)
class DimRange:
    """The sizes a ranged dim accepts: ``lo``, ``lo + step``, … up to ``hi``; costs are
    taken at ``cost``."""

    lo: int
    hi: int
    step: int = 1
    cost: int | None = None

    def __post_init__(self):
        if self.lo < 0 or self.hi < self.lo or self.step < 1:
            raise ValueError(f"bad range {self.text}: need 0 <= LO <= HI and STEP >= 1")
        if (self.hi - self.lo) % self.step:
            raise ValueError(f"bad range {self.text}: HI - LO is not a multiple of STEP")
        if self.cost is not None and not self.accepts(self.cost):
            raise ValueError(f"bad range {self.text}: the cost size {self.cost} is not one of its sizes")

    @property
    def cost_size(self) -> int:
        return self.hi if self.cost is None else self.cost

    @property
    def text(self) -> str:
        body = f"{self.lo}:{self.hi}" + (f":{self.step}" if self.step != 1 else "")
        return body + (f"@{self.cost}" if self.cost is not None else "")

    @property
    def grain(self) -> int:
        """The gcd of every accepted size (0 when the only size is 0)."""
        return math.gcd(self.lo, self.step) if self.hi > self.lo else self.lo

    def accepts(self, size: int) -> bool:
        return self.lo <= size <= self.hi and (size - self.lo) % self.step == 0

    def describe(self) -> str:
        if self.hi == self.lo:
            return f"{self.lo}"
        if self.step == 1:
            return f"{self.lo} to {self.hi}"
        return f"{self.lo} to {self.hi} in steps of {self.step}"

    def to_dict(self) -> dict:
        return {"lo": self.lo, "hi": self.hi, "step": self.step, "cost": self.cost_size}

    @classmethod
    def from_dict(cls, data: dict) -> "DimRange":
        return cls(int(data["lo"]), int(data["hi"]), int(data.get("step", 1)), data.get("cost"))


def parse_size(text: str) -> int | DimRange:
    """``INT`` or ``LO:HI[:STEP][@COST]``; ValueError with a readable message."""
    body, at, cost = text.strip().partition("@")
    parts = body.split(":")
    try:
        numbers = [int(p) for p in parts]
        cost_size = int(cost) if at else None
    except ValueError:
        raise ValueError(f"{text!r} is not an integer nor a range (expected INT or LO:HI[:STEP][@SIZE])") from None
    if len(numbers) == 1:
        if at:
            raise ValueError(f"@SIZE goes with a range LO:HI, got {text!r}")
        if numbers[0] < 0:
            raise ValueError(f"a size cannot be negative, got {text!r}")
        return numbers[0]
    if len(numbers) > 3:
        raise ValueError(f"expected INT or LO:HI[:STEP][@SIZE], got {text!r}")
    return DimRange(numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else 1, cost_size)


@dataclass(frozen=True)
class Affine:
    """const + Σ coef·dim over free dims."""

    const: int
    coefs: tuple[tuple[str, int], ...] = ()

    def __call__(self, values: dict[str, int]) -> int:
        return self.const + sum(c * values[name] for name, c in self.coefs)

    @property
    def text(self) -> str:
        terms = [(f"{c}*" if c not in (1, -1) else ("-" if c == -1 else "")) + name for name, c in self.coefs]
        if self.const or not terms:
            terms.append(str(self.const))
        return " + ".join(terms).replace("+ -", "- ")

    def to_dict(self) -> dict:
        return {"const": self.const, "coefs": dict(self.coefs)}

    @classmethod
    def from_dict(cls, data: dict) -> "Affine":
        return cls(int(data["const"]), tuple(sorted((k, int(v)) for k, v in data["coefs"].items())))


@dataclass
class Sizes:
    """Fixed, ranged (free) and derived dims of a model's inputs."""

    fixed: dict[str, int] = field(default_factory=dict)
    ranges: dict[str, DimRange] = field(default_factory=dict)
    derived: dict[str, Affine] = field(default_factory=dict)

    @property
    def is_ranged(self) -> bool:
        return bool(self.ranges)

    def free_point(self, which: str) -> dict[str, int]:
        """Free dims at ``"cost"``, ``"top"`` (every HI) or ``"low"`` (every LO)."""
        pick = {"cost": lambda r: r.cost_size, "top": lambda r: r.hi, "low": lambda r: r.lo}[which]
        return {name: pick(r) for name, r in self.ranges.items()}

    def resolve(self, free: dict[str, int]) -> dict[str, int]:
        """Every symbolic dim's size at the free dims' sizes ``free``."""
        values = {**self.fixed, **free}
        for name, form in self.derived.items():
            values[name] = form({**self.fixed, **free})
        return values

    def point(self, which: str) -> dict[str, int]:
        return self.resolve(self.free_point(which))

    def grain(self, form: Affine) -> int:
        """gcd of a derived dim's sizes over every accepted size of the free dims."""
        values = {**self.fixed, **self.free_point("low")}
        found = form(values)
        for name, coef in form.coefs:
            if name in self.ranges and self.ranges[name].hi > self.ranges[name].lo:
                found = math.gcd(found, coef * self.ranges[name].step)
        return abs(found)

    def to_dict(self) -> dict:
        return {"fixed": dict(self.fixed), "ranges": {n: r.to_dict() for n, r in self.ranges.items()},
                "derived": {n: f.to_dict() for n, f in self.derived.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "Sizes":
        return cls(dict(data.get("fixed", {})), {n: DimRange.from_dict(r) for n, r in data.get("ranges", {}).items()},
                   {n: Affine.from_dict(f) for n, f in data.get("derived", {}).items()})

    def describe(self) -> str:
        """``batch 1 to 4 (costed at 4), seq …; derived: total = past + seq``."""
        parts = [f"{n} {r.describe()} (costed at {r.cost_size})" for n, r in self.ranges.items()]
        text = ", ".join(parts)
        if self.derived:
            text += "; derived: " + ", ".join(f"{n} = {f.text}" for n, f in self.derived.items())
        return text


def split_dims(dims: dict[str, int | DimRange]) -> Sizes:
    fixed = {n: v for n, v in dims.items() if not isinstance(v, DimRange)}
    for name, value in fixed.items():
        if value < 0:
            raise ModelError(f"dimension {name!r} cannot be negative, got {value}")
    return Sizes(fixed, {n: v for n, v in dims.items() if isinstance(v, DimRange)})


# --- dims named as expressions of others ----------------------------------------------

def expression_form(name: str, known: set[str]) -> Affine | None:
    """The affine form of a dim named by an expression of ``known`` dims
    (``past_sequence_length + sequence_length``, ``2*seq``); None for any other name."""
    try:
        tree = ast.parse(name, mode="eval").body
    except SyntaxError:
        return None

    def walk(node) -> tuple[int, dict[str, int]] | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value, {}
        if isinstance(node, ast.Name) and node.id in known:
            return 0, {node.id: 1}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = walk(node.operand)
            return None if inner is None else (-inner[0], {k: -v for k, v in inner[1].items()})
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            left, right = walk(node.left), walk(node.right)
            if left is None or right is None:
                return None
            if isinstance(node.op, ast.Mult):
                if left[1] and right[1]:
                    return None
                scale, other = (left[0], right) if not left[1] else (right[0], left)
                return scale * other[0], {k: scale * v for k, v in other[1].items()}
            sign = 1 if isinstance(node.op, ast.Add) else -1
            coefs = dict(left[1])
            for k, v in right[1].items():
                coefs[k] = coefs.get(k, 0) + sign * v
            return left[0] + sign * right[0], coefs
        return None

    if isinstance(tree, ast.Name):
        return None   # a plain name is a dim of its own
    found = walk(tree)
    if found is None:
        return None
    return Affine(found[0], tuple(sorted((k, v) for k, v in found[1].items() if v)))


def compose(form: Affine, derived: dict[str, Affine]) -> Affine:
    """``form`` with derived dims replaced by their own forms (over free dims only)."""
    const, coefs = form.const, {}
    for name, coef in form.coefs:
        if name in derived:
            inner = derived[name]
            const += coef * inner.const
            for k, v in inner.coefs:
                coefs[k] = coefs.get(k, 0) + coef * v
        else:
            coefs[name] = coefs.get(name, 0) + coef
    return Affine(const, tuple(sorted((k, v) for k, v in coefs.items() if v)))


# --- dims that follow from the graph -------------------------------------------------------

def input_dims(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Symbolic dim names of the graph inputs (initializers excluded), each with the inputs
    that use it; ModelError for a dynamic dim without a name (nothing could size it)."""
    found: dict[str, list[str]] = {}
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param:
                found.setdefault(dim.dim_param, []).append(value.name)
            elif not dim.HasField("dim_value"):
                raise ModelError(
                    f"input '{value.name}' has an unnamed dynamic dimension",
                    hint="give it a name in the model, then fix it with --dim NAME=INT",
                )
    return found


def _dims_of(value) -> list:
    if value is None or not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in value.type.tensor_type.shape.dim]


def equations(model: onnx.ModelProto) -> list[tuple]:
    """(a, b) pairs of dims that the graph's operators require equal, where a is a symbol
    and b a symbol or a size > 1, from an inferred ``model``. After them, weaker ones: a
    dim that Gather or GatherND indexes with constant indices is as long as the largest
    index read plus one (a mask read at positions 0 … past+seq-1 has past+seq columns)."""
    typed = {v.name: v for v in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    for init in model.graph.initializer:
        typed.setdefault(init.name, helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    found = []

    def equate(dims: list) -> None:
        symbols = [d for d in dims if isinstance(d, str)]
        values = [d for d in dims if isinstance(d, int) and d > 1]
        for s in symbols:
            for other in symbols + values[:1]:
                if other != s:
                    found.append((s, other))

    for node in model.graph.node:
        shapes = [_dims_of(typed.get(name)) if name else [] for name in node.input]
        if node.op_type in BROADCASTING:
            rank = max((len(s) for s in shapes), default=0)
            for k in range(1, rank + 1):
                equate([s[-k] for s in shapes if len(s) >= k])
        elif node.op_type == "MatMul" and len(shapes) == 2 and len(shapes[0]) >= 1 and len(shapes[1]) >= 2:
            equate([shapes[0][-1], shapes[1][-2]])
            for k in range(3, min(len(shapes[0]), len(shapes[1])) + 1):
                equate([shapes[0][-k], shapes[1][-k]])
        elif node.op_type == "Concat" and shapes and all(shapes):
            axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
            rank = len(shapes[0])
            for d in range(rank):
                if d != axis % rank and all(len(s) == rank for s in shapes):
                    equate([s[d] for s in shapes])
    return found + _index_extents(model, typed)


def _index_extents(model: onnx.ModelProto, typed: dict) -> list[tuple]:
    from onnx import numpy_helper

    constants = {t.name: t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    found = []
    for node in model.graph.node:
        if node.op_type not in ("Gather", "GatherND") or len(node.input) < 2 or node.input[1] not in constants:
            continue
        data = _dims_of(typed.get(node.input[0]))
        index = numpy_helper.to_array(constants[node.input[1]])
        if not data or index.size == 0:
            continue
        if node.op_type == "Gather":
            axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0) % len(data)
            extents = {axis: int(index.max()) + 1}
        else:
            if any(helper.get_attribute_value(a) for a in node.attribute if a.name == "batch_dims"):
                continue
            flat = index.reshape(-1, index.shape[-1])
            extents = {j: int(flat[:, j].max()) + 1 for j in range(flat.shape[1])}
        for axis, extent in extents.items():
            if axis < len(data) and isinstance(data[axis], str) and extent > 1:
                found.append((data[axis], extent))
    return found


def solve_point(model: onnx.ModelProto, known: dict[str, int], unknown: list[str]) -> dict[str, int]:
    """Sizes of the ``unknown`` input dims when the others are ``known``, from the graph's
    equations (see the module's doc); a dim the equations leave open is missing."""
    from meshplan.model.fold import fold_constants, infer_shapes

    values = dict(known)
    left = [u for u in unknown if u not in values]
    while left:
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        for value in list(probe.graph.input):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param in values:
                    dim.dim_value = values[dim.dim_param]
        del probe.graph.value_info[:]
        try:
            fold_constants(probe)
            inferred = infer_shapes(probe)
        except ModelError:
            break
        parent = {u: u for u in left}

        def find(x):
            while isinstance(x, str) and parent.get(x, x) != x:
                x = parent[x]
            return x

        solved = {}
        for a, b in equations(inferred):
            ra, rb = find(a), find(b) if isinstance(b, str) else b
            if isinstance(rb, int):
                if ra in parent:
                    solved.setdefault(ra, rb)
            elif ra != rb and ra in parent and rb in parent:
                parent[ra] = rb
        for u in left:
            root = find(u)
            if root in solved:
                values[u] = solved[root]
        progress = [u for u in left if u in values]
        if not progress:
            break
        left = [u for u in left if u not in values]
    return {u: values[u] for u in unknown if u in values}


def derive_dims(model: onnx.ModelProto, sizes: Sizes) -> Sizes:
    """``sizes`` with every other symbolic input dim of ``model`` derived from the given
    ones; ModelError naming a dim that does not follow from them."""
    present = input_dims(model)
    given = set(sizes.fixed) | set(sizes.ranges)
    strangers = sorted(given - set(present))
    if strangers:
        have = ", ".join(sorted(present)) or "none"
        raise ModelError(f"unknown dimension {strangers[0]!r} in --dim (the model's symbolic dims: {have})")
    unknown = sorted(set(present) - given)
    derived: dict[str, Affine] = {}
    for name in unknown:   # names that say what they are
        form = expression_form(name, given)
        if form is not None:
            derived[name] = form
    rest = [u for u in unknown if u not in derived]
    if rest:
        model = _without_large_data(model)
        derived.update(_fit_from_graph(model, sizes, rest))
    rest = [u for u in rest if u not in derived]
    if rest and sizes.fixed:
        # sizes of 1 (or 0) say little (a dim of 1 broadcasts against anything): fit again with
        # the fixed dims moving too, then read the forms at their sizes
        moving = {n: DimRange(max(v, 2), max(v, 2) + 8) for n, v in sizes.fixed.items()}
        derived.update(_fit_from_graph(model, Sizes({}, {**moving, **sizes.ranges}), rest))
    missing = [u for u in rest if u not in derived]
    if missing:
        name = missing[0]
        raise ModelError(f"dimension {name!r} of input '{present[name][0]}' does not follow from the dims given",
                         hint=f"give it with --dim {name}=INT or LO:HI")
    fixed = {n: v for n, v in sizes.fixed.items()}
    return Sizes(fixed, dict(sizes.ranges), {n: compose(f, derived) for n, f in derived.items()})


def probe_point(sizes: Sizes) -> dict[str, int]:
    """Free dims at sizes inside their ranges unlike their cost sizes where the range allows
    (no accidental equality between a ranged dim and a static one goes unseen)."""
    point = _probe(sizes)
    for name, r in sizes.ranges.items():
        if point[name] == r.cost_size and r.hi > r.lo:
            point[name] = r.lo + r.step if r.lo + r.step != r.cost_size else r.lo
    return point


def _without_large_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose large initializers keep their dims and type but not their
    bytes (probing reads shapes and small constants only)."""
    from meshplan.model.fold import SMALL_ELEMENTS

    light = onnx.ModelProto()
    light.CopyFrom(model)
    for tensor in light.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL and math.prod(tensor.dims) > SMALL_ELEMENTS:
            for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                tensor.ClearField(name)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            tensor.external_data.add(key="location", value="<shape only>")
    return light


def _probe(sizes: Sizes, shift: str | None = None) -> dict[str, int]:
    """Free dims at distinct values inside their ranges (``shift``: that one a step higher)."""
    point = {}
    for index, (name, r) in enumerate(sorted(sizes.ranges.items())):
        count = (r.hi - r.lo) // r.step
        k = min(count, 2 + index) if count > 1 else 0
        if name == shift:
            k = k + 1 if k < count else k - 1
        point[name] = r.lo + k * r.step
    return point


def _fit_from_graph(model: onnx.ModelProto, sizes: Sizes, unknown: list[str]) -> dict[str, Affine]:
    free = sorted(n for n, r in sizes.ranges.items() if r.hi > r.lo)
    base_free = _probe(sizes)
    base = solve_point(model, {**sizes.fixed, **base_free}, unknown)
    slopes: dict[str, dict[str, int]] = {u: {} for u in unknown}
    for name in free:
        shifted_free = _probe(sizes, shift=name)
        delta = shifted_free[name] - base_free[name]
        found = solve_point(model, {**sizes.fixed, **shifted_free}, unknown)
        for u in unknown:
            if u in base and u in found:
                change = found[u] - base[u]
                if change % delta:
                    base.pop(u)
                else:
                    slopes[u][name] = change // delta
    forms = {}
    for u in unknown:
        if u not in base or len(slopes[u]) != len(free):
            continue
        coefs = tuple(sorted((n, c) for n, c in slopes[u].items() if c))
        forms[u] = Affine(base[u] - sum(c * base_free[n] for n, c in coefs), coefs)
    if forms and free:   # the fit must hold at one more point
        check_free = {n: r.hi for n, r in sizes.ranges.items()}
        found = solve_point(model, {**sizes.fixed, **check_free}, list(forms))
        for u in list(forms):
            if found.get(u) != forms[u]({**sizes.fixed, **check_free}):
                forms.pop(u)
    return forms
