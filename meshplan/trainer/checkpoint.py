"""Checkpoints of a training job: the trained weights, the optimizer's slots, the step, the
data position and the shuffling generator's state.

A checkpoint is a folder ``DIR/step-NNNNNNNN`` holding ``state.npz`` (one array per state
input, written one tensor at a time: rank 0 holds one tensor at once, never the model) and
``manifest.json``; it is written under a temporary name and renamed whole, so a job that
dies leaves the last complete checkpoint as it was. ``--resume DIR`` takes the newest.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from meshplan.errors import TrainError
from meshplan.files import atomic_write_bytes, file_sha256
from meshplan.plan_format import PLAN_FILE

FORMAT = 1
STATE_FILE = "state.npz"
MANIFEST = "manifest.json"
PREFIX = "step-"


def plan_digest(plan_dir: str | Path) -> str:
    return file_sha256(Path(plan_dir) / PLAN_FILE)


def write_checkpoint(directory: str | Path, step: int, tensors, manifest: dict) -> Path:
    """``tensors`` yields (state input, array) one at a time."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{PREFIX}{step:08d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=directory))
    try:
        names = []
        with zipfile.ZipFile(staging / STATE_FILE, "w", allowZip64=True) as archive:
            for name, array in tensors:
                with archive.open(f"{len(names)}.npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, np.ascontiguousarray(array), allow_pickle=False)
                names.append(name)
        body = {"format": FORMAT, "step": step, "tensors": names, **manifest}
        atomic_write_bytes(staging / MANIFEST, (json.dumps(body, indent=1) + "\n").encode())
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def latest(directory: str | Path) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise TrainError(f"checkpoint directory not found: {directory}")
    found = sorted(p for p in directory.glob(f"{PREFIX}*") if (p / MANIFEST).is_file() and (p / STATE_FILE).is_file())
    if not found:
        if (directory / MANIFEST).is_file():
            return directory
        raise TrainError(f"no complete checkpoint in {directory}")
    return found[-1]


class Checkpoint:
    """A checkpoint read back: its manifest, and its tensors one at a time."""

    def __init__(self, path: str | Path):
        self.path = latest(path)
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise TrainError(f"{self.path / MANIFEST} is not readable ({exc})") from None
        if self.manifest.get("format") != FORMAT:
            raise TrainError(f"{self.path}: checkpoint format {self.manifest.get('format')} is not {FORMAT}")

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def check_plan(self, digest: str, trained: dict) -> None:
        """A checkpoint of another plan is refused (its weights would not fit this one)."""
        if self.manifest.get("weights") != trained:
            raise TrainError(f"{self.path} is a checkpoint of another model or optimizer (its weights and slots "
                             "differ from the plan's)")
        if self.manifest.get("plan_sha256") != digest:
            self.other_plan = True

    def tensors(self):
        with zipfile.ZipFile(self.path / STATE_FILE) as archive:
            for index, name in enumerate(self.manifest["tensors"]):
                with archive.open(f"{index}.npy") as source:
                    yield name, np.lib.format.read_array(source, allow_pickle=False)

    def tensor(self, wanted: str) -> np.ndarray:
        for name, array in self.tensors():
            if name == wanted:
                return array
        raise TrainError(f"{self.path} holds no tensor {wanted!r}")
