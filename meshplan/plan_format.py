"""The plan: a versioned JSON document describing stages, devices, programs and estimates.

``plan.json`` carries a checksum of its own content so that an edited plan is detected
before anything runs. Reading a plan written by a newer meshplan is a clear error.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshplan.errors import PlanError
from meshplan.files import atomic_write_bytes, read_json

FORMAT_VERSION = 4             # 2: ranged sizes and state; 3: idle devices; 4: training (a plan without them is written as
                               # the least version that holds it)
PLAN_FILE = "plan.json"
OUTPUT_COLLECTOR = -1          # dst_stage of a transfer that brings a model output to rank 0
COLLECTIVE_DOMAIN = "meshplan"  # the domain of the collective nodes in the programs


def local_name(tensor: str, spec) -> str:
    """The name a program gives its shard of ``tensor`` held in ``spec`` (a ShardingSpec)."""
    return tensor if spec.is_replicated else f"{tensor}@{spec}"


def state_segments(entry: dict) -> dict[int, tuple[tuple[int, int], ...]]:
    """A state entry's segmented dims: dim → ((size, heads), …) (``ShardingSpec.segments``)."""
    return {int(dim): tuple((int(size), int(heads)) for size, heads in segs) for dim, segs in entry.get("segments", [])}


@dataclass
class TensorSpec:
    name: str
    shape: list            # ints; in a ranged plan a dim that follows the sizes is its name (``Plan.sizes``)
    dtype: str


@dataclass
class Stage:
    index: int
    operators: list[str]
    layers: list[int]                 # [first, last + 1]
    devices: list[int]                # ranks
    submesh: list[int]                # physical [n, m]
    logical_mesh: list[int]           # [n, m]
    inputs: list[str]                 # tensors the stage receives (or reads from the inputs file)
    outputs: list[str]                # tensors the stage sends on (or that are model outputs)
    seconds: float
    memory_bytes: float
    strategies: dict = field(default_factory=dict)   # operator → sharding strategy (non-replicated ones)
    input_specs: dict = field(default_factory=dict)  # stage input → sharding spec it arrives in
    output_specs: dict = field(default_factory=dict)  # stage output → sharding spec it leaves in
    collectives: list = field(default_factory=list)   # each segment boundary: tensor, op, specs before/after


@dataclass
class Resharding:
    """One tensor moved from a stage's mesh to a later stage's mesh, for every microbatch:
    the unit tasks (``transfer``, see ``reshard.tasks.CrossMeshTransfer``) and their order and
    senders (``schedule``), with the simulated seconds they take."""

    tensor: str
    src_stage: int
    dst_stage: int
    shape: list[int]
    dtype: str
    src_spec: str
    dst_spec: str
    transfer: dict
    schedule: dict
    seconds: float


@dataclass
class Transfer:
    """A tensor sent whole from the first device of the stage that computes it, for every
    microbatch: a model output to rank 0 (``dst_stage`` OUTPUT_COLLECTOR), or a
    data-dependent tensor to one device of a later stage. A data-dependent dim is -1 in
    ``shape``: the sender sends the actual shape first."""

    tensor: str
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int
    shape: list[int]
    dtype: str

    @property
    def is_dynamic(self) -> bool:
        return any(d < 0 for d in self.shape)


@dataclass
class Program:
    rank: int
    stage: int
    file: str
    sha256: str
    data_files: list[dict] = field(default_factory=list)   # [{"file", "sha256"}] external weights

    @property
    def files(self) -> list[tuple[str, str]]:
        """(file, sha256) of the program and of its weights' data files."""
        return [(self.file, self.sha256)] + [(d["file"], d["sha256"]) for d in self.data_files]

    @property
    def hash_record(self) -> str:
        """The plan folder's record of its files' sums and stamps (``files.HashRecord``): a
        run reads a file again only if it changed since planning (or since the run that
        last read it)."""
        return f".{self.file}.sha256.json"


@dataclass
class Plan:
    model: dict                       # {"path", "sha256", "dims"}
    cluster: dict
    microbatches: int
    # {"dim": name or None, "size": int, "microbatch_size": int, "batched_inputs": [names]}; a static
    # batch rewritten to the microbatch size adds "axes" ({batched input or output: its batch
    # axis}) and "rewritten" ({"shape_constants": [names], "constants_cut": [names]})
    batch: dict
    inputs: list[TensorSpec]          # full-batch model inputs
    outputs: list[TensorSpec]         # full-batch model outputs
    stages: list[Stage]
    transfers: list[Transfer]
    programs: list[Program]
    reshardings: list[Resharding]
    estimate: dict
    solver: dict                      # what the search did: counts and sizes, never wall-clock times
    format_version: int = FORMAT_VERSION
    # A ranged plan: ``meshplan.model.sizes.Sizes.to_dict()`` (fixed, ranged and derived dims)
    sizes: dict = field(default_factory=dict)
    # State: [{"output", "input", "stage", "spec"[, "segments"]}], each output kept on its stage's
    # devices in ``spec`` to be the next call's ``input``; "segments" ([[dim, [[size, heads], …]]])
    # where a split dim holds heads in segments (``state_segments``)
    state: list = field(default_factory=list)
    # Idle devices: {"ranks": [...], "reason": one line, "all_devices_latency_seconds": the
    # estimate of the best plan on every device, or None where none fits}. Idle ranks hold
    # no stage and no program; they are started with the others and only take part in the
    # job's start-up and broadcasts.
    idle: dict = field(default_factory=dict)
    # A training plan (``meshplan plan --train``): the loss, the optimizer, the trained weights
    # ({name: {"shape", "dtype"}}) and their optimizer slots, the hyperparameter inputs and the
    # source model the weights start from ({"path", "sha256"}); the planned model is the
    # training step (``training/step.onnx`` in the plan directory).
    training: dict = field(default_factory=dict)
    # Wall-clock seconds of this planning run (total, stage DP, ILPs): reported, never
    # written, so that the same command writes the same plan on any machine.
    timings: dict = field(default_factory=dict, compare=False, repr=False)
    # The node index where each of the planner's layers starts, and the node count: reported
    # and annotated (annotated.onnx), never written to plan.json.
    layer_bounds: list = field(default_factory=list, compare=False, repr=False)
    # Lines for the report (how hints were held): reported, never written to plan.json.
    notes: list = field(default_factory=list, compare=False, repr=False)
    # The operators a hint pinned, where the hints changed the plan (annotated.onnx marks
    # them, ``meshplan show`` says so): never written to plan.json.
    hinted: list = field(default_factory=list, compare=False, repr=False)

    @property
    def is_ranged(self) -> bool:
        return bool(self.sizes.get("ranges"))

    @property
    def step_seconds(self) -> float:
        """The estimated training step: a pipeline's played schedule, or a one-stage plan's M
        calls with the update in the last alone (``inter.accumulated_step``); M calls of the
        program where the plan predates that."""
        if "step_seconds" in self.estimate:
            return float(self.estimate["step_seconds"])
        return float(self.estimate["latency_seconds"]) * int(self.training.get("microbatches", 1))

    @property
    def num_ranks(self) -> int:
        """The ranks a job of this plan has: every device of the mesh, idle ones included."""
        return sum(len(s.devices) for s in self.stages) + len(self.idle_ranks)

    @property
    def idle_ranks(self) -> list[int]:
        return list(self.idle.get("ranks", []))

    def is_idle(self, rank: int) -> bool:
        return rank in self.idle.get("ranks", ())

    @property
    def model_sha256(self) -> str:
        return self.model["sha256"]

    def stage_of_rank(self, rank: int) -> Stage | None:
        """The stage ``rank`` works in (None for an idle rank)."""
        for stage in self.stages:
            if rank in stage.devices:
                return stage
        if self.is_idle(rank):
            return None
        raise PlanError(f"rank {rank} has no stage in the plan")

    def program_of_rank(self, rank: int) -> Program | None:
        """The program of ``rank`` (None for an idle rank)."""
        for program in self.programs:
            if program.rank == rank:
                return program
        if self.is_idle(rank):
            return None
        raise PlanError(f"rank {rank} has no program in the plan")

    def to_dict(self) -> dict:
        body = asdict(self)
        body.pop("timings")
        body.pop("layer_bounds")
        body.pop("notes")
        body.pop("hinted")
        for key in ("sizes", "state", "idle", "training"):   # absent when unused: such a plan reads as format 1
            if not body[key]:
                body.pop(key)
        body["format_version"] = 4 if "training" in body else 3 if "idle" in body else \
            2 if ("sizes" in body or "state" in body) else 1
        body = {"format_version": body.pop("format_version"), "model_sha256": self.model_sha256, **body}
        body["checksum"] = _checksum(body)
        return body

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        version = data.get("format_version")
        if not isinstance(version, int):
            raise PlanError("plan.json has no format_version")
        if version > FORMAT_VERSION:
            raise PlanError(
                f"plan format {version} is newer than this meshplan understands ({FORMAT_VERSION})",
                hint="upgrade meshplan or re-plan",
            )
        if data.get("checksum") != _checksum({k: v for k, v in data.items() if k != "checksum"}):
            raise PlanError("plan.json was changed after planning (checksum mismatch)", hint="re-run meshplan plan")
        try:
            return cls(
                model=data["model"], cluster=data["cluster"], microbatches=data["microbatches"],
                batch=data["batch"],
                inputs=[TensorSpec(**t) for t in data["inputs"]],
                outputs=[TensorSpec(**t) for t in data["outputs"]],
                stages=[Stage(**s) for s in data["stages"]],
                transfers=[Transfer(**t) for t in data["transfers"]],
                reshardings=[Resharding(**r) for r in data["reshardings"]],
                programs=[Program(**p) for p in data["programs"]],
                estimate=data["estimate"], solver=data["solver"], format_version=version,
                sizes=data.get("sizes", {}), state=data.get("state", []), idle=data.get("idle", {}),
                training=data.get("training", {}),
            )
        except (KeyError, TypeError) as exc:
            raise PlanError(f"plan.json is malformed ({exc})") from None


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_plan(plan: Plan, directory: Path) -> Path:
    path = Path(directory) / PLAN_FILE
    atomic_write_bytes(path, (json.dumps(plan.to_dict(), indent=1) + "\n").encode())
    return path


def require_programs(plan: Plan, directory: str | os.PathLike) -> None:
    """A plan made without programs (``meshplan plan --no-programs``) cannot be run, nor a
    pipelined training plan (its stages' parts run under ``meshplan train``)."""
    if plan.training.get("pipeline"):
        raise PlanError(f"plan {directory} is a pipelined training plan: start it with mpiexec -n "
                        f"{sum(len(s.devices) for s in plan.stages)} meshplan train {directory} --data DATA.npz "
                        "--steps K")
    if not plan.programs:
        raise PlanError(f"plan {directory} has no programs: it was planned with --no-programs",
                        hint="plan again without --no-programs, with the model's weights, to run it")


def read_plan(directory: str | os.PathLike) -> Plan:
    directory = Path(directory)
    path = directory / PLAN_FILE
    if not directory.is_dir():
        raise PlanError(f"plan directory not found: {directory}")
    if not path.is_file():
        raise PlanError(f"no {PLAN_FILE} in {directory}", hint="create one with meshplan plan")
    data = read_json(path, str(path), PlanError)
    if not isinstance(data, dict):
        raise PlanError(f"{path} is not a plan")
    return Plan.from_dict(data)
