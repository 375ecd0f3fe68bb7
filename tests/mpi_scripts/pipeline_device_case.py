"""A pipelined training job whose stages keep their tensors where their sessions compute:
``pipeline_device_case.py PLAN_DIR DATA.npz OUT_DIR``.

Every rank trains the plan twice from its source weights, 3 steps each, with a checkpoint at
the end: once on numpy arrays, once with ``on_device=True`` (each stage's state and held
tensors as OrtValues: the path a CUDA job takes, here in host memory). Rank 0 prints ``ok
pipeline_device`` when both give the same losses, norms and checkpointed state to the bit,
else ``FAIL pipeline_device: why``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from meshplan.plan_format import read_plan  # noqa: E402
from meshplan.trainer.checkpoint import Checkpoint  # noqa: E402
from meshplan.trainer.driver import TrainOptions  # noqa: E402
from meshplan.trainer.pipeline_driver import train_pipeline_rank  # noqa: E402


def main(plan_dir: str, data: str, out: str) -> int:
    plan = read_plan(Path(plan_dir))
    reports = {}
    for where in ("host", "device"):
        options = TrainOptions(Path(data), 3, lr=0.05, checkpoint=Path(out) / where)
        reports[where] = train_pipeline_rank(Path(plan_dir), plan, options, "cpu", on_device=where == "device")
    if reports["host"] is None:
        return 0
    host, device = reports["host"], reports["device"]
    if "kept as OrtValues" not in device.transfer_path or "kept" in host.transfer_path:
        print(f"FAIL pipeline_device: transfer paths {host.transfer_path!r}, {device.transfer_path!r}")
        return 1
    if host.losses != device.losses or host.grad_norms != device.grad_norms or len(host.losses) != 3:
        print(f"FAIL pipeline_device: losses {host.losses} against {device.losses}")
        return 1
    expected, got = dict(Checkpoint(Path(out) / "host").tensors()), dict(Checkpoint(Path(out) / "device").tensors())
    if sorted(expected) != sorted(got) or not all(np.array_equal(expected[n], got[n]) for n in expected):
        print("FAIL pipeline_device: the checkpoints differ")
        return 1
    print("ok pipeline_device")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
