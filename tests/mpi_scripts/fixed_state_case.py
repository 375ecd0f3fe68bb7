"""Fixed-capacity state through the resident job: a buffer of CAP rows that each call
writes one row of (at position ``pos``), kept on its ranks between calls.

Arguments: PLAN_DIR STEPS. Rank 0 writes rows 0 … STEPS-1 and compares each call's output
and, at the end, the gathered buffer with numpy; it prints ``ok``/``FAIL`` lines.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import numpy_helper


def main() -> int:
    from meshplan.runtime.job import Job

    plan_dir, steps = sys.argv[1], int(sys.argv[2])
    with Job(plan_dir, provider="cpu") as job:
        if job is None:
            return 0
        model = onnx.load(job.plan.model["path"])
        weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
        batch, cap, width = 3, 8, 4
        buffer = np.zeros((batch, cap, width), np.float32)
        worst, moved = 0.0, 0
        rng = np.random.default_rng(0)
        for step in range(steps):
            x = rng.standard_normal((batch, width)).astype(np.float32)
            got = job.run({"x": x, "pos": np.array([step], np.int64)})
            buffer[:, step] = x
            worst = max(worst, float(np.abs(got["y"] - buffer.sum(axis=1) @ weight).max()))
            moved += job.stats().bytes_of({"cache_in", "cache_out"})
        held = job.get_state()["cache_in"]
        print(f"{'ok' if worst < 1e-4 else 'FAIL'} {steps} writes into a buffer of {cap} rows, worst error {worst:.1e}")
        print(f"{'ok' if np.array_equal(held, buffer) else 'FAIL'} the buffer gathered on request is the one written")
        print(f"{'ok' if moved == 0 else 'FAIL'} buffer bytes moved between ranks: {moved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
