"""``Job.train_step`` from a user's own loop: ``train_step_case.py PLAN_DIR DATA.npz EXPECTED.json [device]``.

Every rank makes the job; rank 0 runs one step per batch of DATA (in order) at the learning
rates and settings of EXPECTED ({"lr", "hyper", "losses"}) and prints ``ok train_step`` when
each loss is within 1e-4 relative of the expected one, else ``FAIL train_step: why``; the
workers serve. With ``device``, the job keeps its tensors where its provider computes (the
path a CUDA job takes, here on host OrtValues), and rank 0 checks that its state is still
there after the steps (no step copied it to the host).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from meshplan.runtime.buffers import DeviceTensor  # noqa: E402
from meshplan.runtime.job import Job  # noqa: E402
from meshplan.trainer.data import Batches  # noqa: E402


def main(plan_dir: str, data: str, expected_path: str, where: str = "") -> int:
    expected = json.loads(open(expected_path).read())
    job = Job(plan_dir, on_device=True if where == "device" else None)
    if not job.is_driver:
        job.serve()
        return 0
    batches = Batches(data, job.plan)
    losses = [job.train_step(batches.next(), expected["lr"], **expected["hyper"])
              for _ in expected["losses"]]
    on_host = sorted(n for n, v in job.state.items() if not isinstance(v, DeviceTensor))
    job.close()
    if where == "device" and on_host:
        print(f"FAIL train_step: state copied to the host: {on_host[:3]}")
        return 1
    if job.train_steps != len(losses) or job.grad_norm is None:
        print(f"FAIL train_step: {job.train_steps} steps counted, grad_norm {job.grad_norm}")
        return 1
    if not np.allclose(losses, expected["losses"], rtol=1e-4, atol=0):
        print(f"FAIL train_step: losses {losses} against {expected['losses']}")
        return 1
    print("ok train_step")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
