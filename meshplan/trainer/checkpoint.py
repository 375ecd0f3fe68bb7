"""Checkpoints of a training job: the trained weights and the optimizer's slots as each
rank's own pieces, the step, the data position and the shuffling generator's state.

A checkpoint is a folder ``DIR/step-NNNNNNNN`` holding ``rankN.npz`` for each rank that
holds a distinct piece of the state (``runtime.state_files``: every rank writes its own, no
rank gathers the model; ``DIR`` must be on a file system every rank sees) and
``manifest.json`` (the layout each state was held in, so that a job of another plan of the
same model, or ``meshplan export``, can put each tensor back together, one at a time). It is
written under a temporary name and renamed whole: a job that dies leaves the last complete
checkpoint as it was. ``--resume DIR`` takes the newest.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from meshplan.errors import TrainError
from meshplan.files import atomic_write_bytes, file_sha256
from meshplan.plan_format import PLAN_FILE
from meshplan.runtime.state_files import read_whole

FORMAT = 2
MANIFEST = "manifest.json"
PREFIX = "step-"


def plan_digest(plan_dir: str | Path) -> str:
    return file_sha256(Path(plan_dir) / PLAN_FILE)


def staging_folder(directory: str | Path, step: int) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{PREFIX}{step:08d}.", dir=directory))


def finish_checkpoint(staging: Path, directory: str | Path, step: int, manifest: dict) -> Path:
    """Write the manifest into ``staging`` (the ranks' files are there) and rename it whole."""
    final = Path(directory) / f"{PREFIX}{step:08d}"
    try:
        body = {"format": FORMAT, "step": step, **manifest}
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
    found = sorted(p for p in directory.glob(f"{PREFIX}*") if (p / MANIFEST).is_file())
    if not found:
        if (directory / MANIFEST).is_file():
            return directory
        raise TrainError(f"no complete checkpoint in {directory}")
    return found[-1]


class Checkpoint:
    """A checkpoint read back: its manifest, and its tensors whole, one at a time."""

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

    @property
    def names(self) -> list[str]:
        return list(self.manifest["layouts"])

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.manifest["layouts"]:
            raise TrainError(f"{self.path} holds no tensor {name!r}")
        return read_whole(self.path, self.manifest["layouts"], name)

    def tensors(self):
        for name in self.names:
            yield name, self.tensor(name)
