"""The profile file: versioned JSON with measured operator times and communication fits.

Written atomically (temporary sibling + rename). ``load_profile`` is what planning calls:
it refuses, with one line, a profile of another model or for another mesh or device.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from meshplan.cost.cluster import DEVICE_PRESETS, Cluster
from meshplan.files import atomic_write_bytes, read_json
from meshplan.errors import PlanError
from meshplan.profile.comm import CommFit
from meshplan.profile.errors import ProfileError

FORMAT_VERSION = 1
KIND = "meshplan-profile"


@dataclass
class OpEntry:
    """One signature's time (None when it could not be timed: the analytic model answers)."""

    key: str
    signature: dict
    seconds: float | None
    count: int                       # occurrences in the profiled model (variants: in the sets given)
    source: str                      # "measured" | "cache" | "failed"
    sources: list[str] = field(default_factory=list)   # "model", "microbatches=2", "model:variant", …
    input_key: str = ""
    repeats: int = 0
    spread: float = 0.0
    copies: int = 1
    error: str | None = None
    nodes: list[str] = field(default_factory=list)

    @property
    def description(self) -> str:
        from meshplan.profile.signatures import OpSignature

        return OpSignature.from_dict(self.signature).short()


@dataclass
class Profile:
    model: dict                       # {"path", "sha256", "dims", "program_dims": [...]}
    mesh: list[int]                   # [hosts, devices per host]
    device: str                       # the cluster's device preset / name the profile was made for
    hardware: str                     # CPU model or GPU name
    provider: str
    onnxruntime: str
    threads: int
    ranks: int                        # ranks of the job that measured it (1 without mpiexec)
    operators: dict[str, OpEntry]
    communication: list[CommFit]
    communication_source: str         # "measured" | "cached" | "cluster"
    cuda_aware_mpi: dict              # {"value": bool | None, "method": str}
    stats: dict = field(default_factory=dict)
    # the profiled model run whole against the sum of its operators timed one at a time
    # ({"factor", "whole_seconds", "operators_seconds", "label"}, or {"skipped": why}; empty
    # in a profile from before it was measured): measured operators count ``factor`` times
    composition: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def composition_factor(self) -> float:
        """What a measured operator's seconds are multiplied by in a plan's estimate (1 where
        the whole model was not run)."""
        factor = self.composition.get("factor")
        return float(factor) if factor else 1.0

    # --- queries ----------------------------------------------------------------------

    def op_seconds(self, key: str) -> float | None:
        entry = self.operators.get(key)
        return entry.seconds if entry is not None else None

    def op_seconds_by_inputs(self, input_key: str) -> float | None:
        if getattr(self, "_by_inputs", None) is None:
            index: dict[str, float] = {}
            for entry in self.operators.values():
                if entry.seconds is not None:
                    index[entry.input_key] = max(index.get(entry.input_key, 0.0), entry.seconds)
            self._by_inputs = index
        return self._by_inputs.get(input_key)

    def comm_fit(self, collective: str, axis: int, group_size: int | None = None) -> CommFit | None:
        """The fit for a collective along an axis; the group size nearest to the one asked."""
        candidates = [f for f in self.communication if f.collective == collective and f.axis == axis]
        if not candidates:
            return None
        if group_size is None:
            return max(candidates, key=lambda f: f.group_size)
        exact = [f for f in candidates if f.group_size == group_size]
        if exact:
            return exact[0]
        return min(candidates, key=lambda f: (abs(f.group_size - group_size), -f.group_size))

    def total_seconds(self, source: str = "model") -> float:
        return sum(e.seconds * e.count for e in self.operators.values() if e.seconds is not None and source in e.sources)

    def costliest(self, limit: int = 10, source: str = "model") -> list[tuple[OpEntry, float, float]]:
        """(entry, seconds × count, share of the model's measured total), costliest first."""
        total = self.total_seconds(source)
        rows = [(e, e.seconds * e.count) for e in self.operators.values() if e.seconds is not None and source in e.sources]
        rows.sort(key=lambda r: -r[1])
        return [(e, t, t / total if total > 0 else 0.0) for e, t in rows[:limit]]

    # --- (de)serialisation --------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version, "kind": KIND,
            "model": self.model, "mesh": list(self.mesh), "device": self.device,
            "hardware": self.hardware, "provider": self.provider, "onnxruntime": self.onnxruntime,
            "threads": self.threads, "ranks": self.ranks,
            "cuda_aware_mpi": self.cuda_aware_mpi,
            "communication_source": self.communication_source,
            "communication": [f.to_dict() for f in self.communication],
            "operators": {k: _entry_dict(e) for k, e in self.operators.items()},
            "composition": self.composition,
            "stats": self.stats,
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> "Profile":
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise PlanError(f"{where} is not a meshplan profile")
        version = data.get("format_version")
        if not isinstance(version, int):
            raise PlanError(f"{where} has no format_version")
        if version > FORMAT_VERSION:
            raise PlanError(f"profile format {version} of {where} is newer than this meshplan understands ({FORMAT_VERSION})",
                            hint="upgrade meshplan or re-run meshplan profile")
        try:
            return cls(
                model=data["model"], mesh=list(data["mesh"]), device=data["device"], hardware=data["hardware"],
                provider=data["provider"], onnxruntime=data["onnxruntime"], threads=int(data["threads"]),
                ranks=int(data["ranks"]),
                operators={k: OpEntry(key=k, **v) for k, v in data["operators"].items()},
                communication=[CommFit.from_dict(f) for f in data["communication"]],
                communication_source=data["communication_source"], cuda_aware_mpi=data["cuda_aware_mpi"],
                stats=data.get("stats", {}), composition=dict(data.get("composition") or {}),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{where} is malformed ({exc})") from None


def _entry_dict(entry: OpEntry) -> dict:
    body = dict(entry.__dict__)
    body.pop("key")
    return body


def write_profile(profile: Profile, path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.is_dir():
        raise ProfileError(f"output {path} is a directory", hint="give a file name with -o")
    if not path.parent.is_dir():
        raise ProfileError(f"output directory does not exist: {path.parent}")
    data = (json.dumps(profile.to_dict(), indent=1) + "\n").encode()
    atomic_write_bytes(path, data)
    return path


def read_profile(path: str | os.PathLike) -> Profile:
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"profile not found: {path}", hint="create one with meshplan profile")
    data = read_json(path, f"profile {path}", PlanError)
    return Profile.from_dict(data, str(path))


def training_record(source_sha256: str, spec) -> dict:
    """What a profile of a training step (``meshplan profile --train``) records of it: the
    source model's digest and the step's loss, optimizer and frozen patterns (and whether its
    weights are float32 masters: ``--master-weights``)."""
    return {"source_sha256": source_sha256, "loss": spec.loss, "optimizer": spec.optimizer,
            "frozen": list(spec.frozen), "microbatches": int(spec.microbatches),
            **({"master_weights": True} if getattr(spec, "master_weights", False) else {})}


def load_profile(path: str | os.PathLike, model_sha256: str, cluster: Cluster, training=None) -> Profile:
    """Read a profile for planning ``model_sha256`` on ``cluster``; PlanError if it is for
    something else. For a training plan (``training``: its ``TrainSpec``) a profile of that
    very training step of the model is taken (``profile --train``), or one of the model's
    forward pass (the backward and update then analytic)."""
    profile = read_profile(path)
    theirs = profile.model.get("sha256", "")
    step = profile.model.get("training")
    if step is not None:
        wanted = training_record(model_sha256, training) if training is not None else None
        if wanted is None or step.get("source_sha256") != model_sha256:
            raise PlanError(f"profile {path} was measured for a training step"
                            + ("" if training is None else " of another model"),
                            hint="plan with the same --train options, or profile the model without --train")
        if {k: v for k, v in step.items() if k != "microbatches"} != \
                {k: v for k, v in wanted.items() if k != "microbatches"}:
            raise PlanError(f"profile {path} was measured for another training step ({step['loss']}, "
                            f"{step['optimizer']}, frozen {step['frozen'] or 'none'})",
                            hint="profile with this plan's --loss, --optimizer, --frozen and --master-weights")
        theirs = model_sha256
    if theirs != model_sha256:
        raise PlanError(
            f"profile {path} was measured for another model (sha256 {theirs[:12]}…, this model {model_sha256[:12]}…)",
            hint="run meshplan profile on this model",
        )
    mesh = [cluster.hosts, cluster.devices_per_host]
    if list(profile.mesh) != mesh:
        raise PlanError(
            f"profile {path} was measured for mesh {profile.mesh[0]}x{profile.mesh[1]}, the plan is for {mesh[0]}x{mesh[1]}",
            hint="profile again with this --mesh",
        )
    if profile.device != cluster.device.name:
        raise PlanError(
            f"profile {path} was measured for device {profile.device!r} ({profile.hardware}, {profile.provider}), "
            f"the plan is for {cluster.device.name!r}",
            hint="plan for the profile's device (with --mesh, leave out --device) or profile again",
        )
    return profile


def profile_preset(profile: Profile, path: str | os.PathLike) -> str:
    """The device preset ``profile`` (read from ``path``) was measured for: what a plan on
    a ``--mesh`` without ``--device`` is for. PlanError when it was a cluster file's own device."""
    if profile.device not in DEVICE_PRESETS:
        raise PlanError(f"profile {path} was measured for device {profile.device!r}, which is not a device preset",
                        hint="plan with the --cluster file it was profiled with")
    return profile.device
