"""Run every rank's program in one process, with an in-memory stand-in for MPI, and
compare with onnxruntime on the original, unpartitioned model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshplan.errors import PlanError
from meshplan.files import file_sha256
from meshplan.plan_format import OUTPUT_COLLECTOR, Plan, local_name, require_programs
from meshplan.reshard.simulator import Schedule
from meshplan.reshard.steps import apply_steps
from meshplan.reshard.tasks import CrossMeshTransfer
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.runtime.cross_mesh_mpi import reshard_in_memory
from meshplan.runtime.program import ProgramRunner, run_lockstep
from meshplan.runtime.sessions import StageSession, check_program_files, providers_for
from meshplan.runtime.state_layout import assemble, distinct_holders, piece_of, state_mesh, state_spec
from meshplan.runtime.tensors import join_microbatches, split_microbatches


def run_in_process(plan: Plan, plan_dir: Path, inputs: dict[str, np.ndarray], provider: str = "cpu") -> dict[str, np.ndarray]:
    """Execute the plan's stages in order for every microbatch. Inside a stage every device
    runs its program segment by segment in lockstep, and the collectives between segments
    are done in memory with the same semantics as under MPI; between stages each tensor
    goes through its planned cross-mesh resharding, in memory."""
    return InProcessPlan(plan, plan_dir, provider).run(inputs)


class InProcessPlan:
    """Every rank's program loaded once in this process (``run`` as many calls as wanted:
    a generation loop)."""

    def __init__(self, plan: Plan, plan_dir: Path, provider: str = "cpu"):
        require_programs(plan, plan_dir)
        providers = providers_for(provider)
        self.plan = plan
        self.runners = {program.rank: ProgramRunner(check_program_files(plan, Path(plan_dir), program), providers, threads=1)
                        for program in plan.programs}
        self.transfers = [(r, CrossMeshTransfer.from_dict(r.transfer), Schedule.from_dict(r.schedule))
                          for r in plan.reshardings]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        plan, runners, transfers = self.plan, self.runners, self.transfers
        outputs = []
        for feeds in split_microbatches(inputs, plan):
            held: dict[int, dict[str, np.ndarray]] = {}   # rank → its local tensors
            for stage in plan.stages:
                local = {rank: {n: feeds[n] for n in stage.inputs if n in feeds} for rank in stage.devices}
                _split_state_inputs(plan, stage, local)
                for r, transfer, schedule in transfers:
                    if r.dst_stage != stage.index:
                        continue
                    source = local_name(r.tensor, ShardingSpec.parse(r.src_spec))
                    src_ranks = plan.stages[r.src_stage].devices
                    moved = reshard_in_memory({rank: held[rank][source] for rank in src_ranks}, transfer, schedule)
                    target = local_name(r.tensor, ShardingSpec.parse(r.dst_spec))
                    for rank in stage.devices:
                        local[rank][target] = moved[rank]
                for t in plan.transfers:   # data-dependent tensors, whole
                    if t.dst_stage == stage.index:
                        local[t.dst_rank][t.tensor] = held[t.src_rank][t.tensor]
                held.update(_run_stage(stage, runners, local))
            lead = held[0]
            kept = {s["output"]: s for s in plan.state}
            outputs.append({spec.name: _state_output(plan, held, kept[spec.name]) if spec.name in kept
                            else lead[spec.name] if spec.name in lead else _output_of(plan, held, spec.name)
                            for spec in plan.outputs})
        return join_microbatches(outputs, plan)


def _split_state_inputs(plan: Plan, stage, local: dict[int, dict[str, np.ndarray]]) -> None:
    """State inputs held split: each device gets its piece, under the program's name for it."""
    for entry in plan.state:
        spec = state_spec(entry)
        if entry["stage"] != stage.index or spec.is_replicated:
            continue
        mesh = state_mesh(plan, entry)
        for rank in stage.devices:
            if entry["input"] in local[rank]:
                whole = local[rank].pop(entry["input"])
                local[rank][local_name(entry["input"], spec)] = piece_of(whole, spec, mesh, rank)


def _state_output(plan: Plan, held, entry: dict) -> np.ndarray:
    """A state output put together from the pieces its stage's devices hold."""
    stage = plan.stages[entry["stage"]]
    spec = state_spec(entry)
    name = local_name(entry["output"], spec)
    if spec.is_replicated:
        return held[stage.devices[0]][name]
    return assemble({rank: held[rank][name] for rank in distinct_holders(plan, entry)}, spec, state_mesh(plan, entry))


def _output_of(plan: Plan, held, name: str) -> np.ndarray:
    for transfer in plan.transfers:
        if transfer.tensor == name and transfer.dst_stage == OUTPUT_COLLECTOR:
            return held[transfer.src_rank][name]
    raise PlanError(f"no stage of the plan computes model output '{name}'")


def _run_stage(stage, runners, feeds: dict[int, dict[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
    mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
    values = [{rank: dict(feeds[rank]) for rank in stage.devices}]
    run_lockstep({rank: runners[rank] for rank in stage.devices}, values, in_memory_exchange(mesh))
    return values[0]


def in_memory_exchange(mesh: LogicalMesh):
    """A collective step across every rank of ``mesh`` in this process (``apply_steps``):
    the exchange ``run_lockstep`` calls, with the same semantics as MPI's."""
    def exchange(step, tensors: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        result = apply_steps({mesh.coord(rank): value for rank, value in tensors.items()}, [step], mesh)
        return {rank: result[mesh.coord(rank)] for rank in tensors}
    return exchange


def reference_outputs(plan: Plan, inputs: dict[str, np.ndarray], model_path: str | Path | None = None,
                      provider: str = "cpu") -> dict[str, np.ndarray]:
    """onnxruntime on the original model file (checked against the plan's model hash), with
    only the optimisations that keep its arithmetic (basic level): extended fusions may
    compute another thing (e.g. dequantize-then-MatMul fused into integer products), and
    the reference is the user's computation."""
    session = StageSession(checked_model_path(plan, model_path), providers_for(provider), optimization="basic")
    return session.run(inputs)


def reference_with_bounds(plan: Plan, inputs: dict[str, np.ndarray], model_path: str | Path | None = None,
                          provider: str = "cpu") -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """``reference_outputs`` and each output's quantization bound on these inputs (empty
    where the model quantizes no activations): the rule ``compare_outputs`` applies."""
    from meshplan.runtime.quantization_bound import QuantizationBound

    path = checked_model_path(plan, model_path)
    expected = reference_outputs(plan, inputs, path, provider)
    return expected, QuantizationBound(path, providers_for(provider)).bounds(inputs, expected)


def checked_model_path(plan: Plan, model_path: str | Path | None = None) -> Path:
    """The planned model's file (``model_path`` where it moved), checked against the plan's hash."""
    path = Path(model_path or plan.model["path"])
    if not path.is_file():
        raise PlanError(f"the planned model {path} is not there", hint="pass its new location with --model")
    if file_sha256(path) != plan.model_sha256:
        raise PlanError(f"model {path} was changed after planning (sha256 mismatch)", hint="re-run meshplan plan")
    return path


# float16 and bfloat16 outputs pass within this many machine epsilons (relative, and
# absolute for values near zero). One rounding costs at most eps/2 relative; a plan adds a
# few roundings the single-device run does not make, or makes in another order: each
# partial sum of a split reduction is rounded to the output dtype before the all-reduce,
# the all-reduce rounds once per step (log2 of up to 8 devices: 3), and the pointwise ops,
# norms and softmax after it round again and pass the error on at about unit gain. Some 8
# half-ulps is the worst such chain we expect; 8 eps leaves a factor two over it while still
# catching a wrong shard (errors of order one). Cancellation in a sum leaves absolute error
# of eps times the terms' size, hence atol = rtol for values near zero.
HALF_PRECISION_EPS_MULTIPLE = 8

# float32 (and wider): the tolerances verify has always used.
FLOAT32_TOLERANCE = (1e-3, 1e-4)


def is_numeric(dtype) -> bool:
    """Whether values of ``dtype`` have a distance (numbers, bool); strings and other
    objects compare only as equal or not."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or dtype.type.__module__ == "ml_dtypes"   # bfloat16, float8, int4


def default_tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing outputs of ``dtype`` with a single-device run: float32
    and wider 1e-3 / 1e-4, float16 and bfloat16 a multiple of their epsilon, integers,
    bool, strings and other non-numeric values exactly (0, 0)."""
    import ml_dtypes

    dtype = np.dtype(dtype)
    if dtype == ml_dtypes.bfloat16 or dtype == np.float16:
        eps = float(ml_dtypes.finfo(dtype).eps)
        return HALF_PRECISION_EPS_MULTIPLE * eps, HALF_PRECISION_EPS_MULTIPLE * eps
    if dtype.kind in "biu" or not is_numeric(dtype):
        return 0.0, 0.0
    return FLOAT32_TOLERANCE


def tolerance_for(dtype, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    """``default_tolerance(dtype)`` with whichever of ``rtol``, ``atol`` is given in its place."""
    default_rtol, default_atol = default_tolerance(dtype)
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def allclose(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> bool:
    """|got - want| <= atol + rtol * |want| elementwise, in float64 (NaN equals NaN)."""
    if got.shape != want.shape:
        return False
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True))


@dataclass
class Comparison:
    name: str
    max_abs: float
    max_rel: float
    ok: bool
    rtol: float = FLOAT32_TOLERANCE[0]
    atol: float = FLOAT32_TOLERANCE[1]
    # Non-numeric outputs (strings): compared for equality only; ``differing`` elements of
    # ``elements`` differ (the errors above are then 0 or inf).
    exact: bool = False
    differing: int = 0
    elements: int = 0
    # The quantization bound added to atol (``quantization_bound``): 0 where the model
    # quantizes no activations.
    bound: float = 0.0

    def merged(self, other: "Comparison") -> "Comparison":
        """The worse of two comparisons of one output (e.g. over microbatches)."""
        return Comparison(self.name, max(self.max_abs, other.max_abs), max(self.max_rel, other.max_rel),
                          self.ok and other.ok, other.rtol, other.atol, self.exact or other.exact,
                          self.differing + other.differing, self.elements + other.elements,
                          max(self.bound, other.bound))


def compare_outputs(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray],
                    rtol: float | None = None, atol: float | None = None,
                    bounds: dict[str, float] | None = None) -> list[Comparison]:
    """Per output: worst absolute and relative error, and whether allclose holds with the
    tolerance of its dtype (``default_tolerance``), or ``rtol`` / ``atol`` where given, with
    the output's quantization bound (``bounds``, see ``quantization_bound``) added to atol."""
    results = []
    bounds = bounds or {}
    for name, want in expected.items():
        out_rtol, out_atol = tolerance_for(want.dtype, rtol, atol)
        bound = bounds.get(name, 0.0)
        got = actual.get(name)
        exact = not is_numeric(want.dtype)
        if got is None or got.shape != want.shape or exact and is_numeric(got.dtype):
            results.append(Comparison(name, float("inf"), float("inf"), False, out_rtol, out_atol, exact,
                                      int(want.size), int(want.size)))
            continue
        if exact:
            differing = int(np.count_nonzero(got.astype(str) != want.astype(str)))
            error = 0.0 if differing == 0 else float("inf")
            results.append(Comparison(name, error, error, differing == 0, 0.0, 0.0, True, differing, int(want.size)))
            continue
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        max_abs = float(diff.max()) if diff.size else 0.0
        rel = diff / np.maximum(np.abs(want.astype(np.float64)), 1e-12)
        max_rel = float(rel.max()) if rel.size else 0.0
        results.append(Comparison(name, max_abs, max_rel, allclose(got, want, out_rtol, out_atol + bound), out_rtol,
                                  out_atol, bound=bound))
    return results
