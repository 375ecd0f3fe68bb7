"""Batches of several sizes through one resident job per plan.

Arguments: pairs of PLAN_DIR and a comma-separated list of batch sizes. For each plan rank
0 runs each batch and compares the outputs with onnxruntime on the original model; a
batch the plan refuses is reported with its one-line error, and the job goes on. Rank 0
prints one ``ok``/``FAIL`` line per batch.
"""

from __future__ import annotations

import sys

import numpy as np


def main() -> int:
    import onnxruntime as ort

    from meshplan.errors import RunError
    from meshplan.runtime.job import Job

    args = sys.argv[1:]
    for plan_dir, sizes in zip(args[::2], args[1::2]):
        with Job(plan_dir, provider="cpu") as job:
            if job is None:
                continue
            reference = ort.InferenceSession(job.plan.model["path"], providers=["CPUExecutionProvider"])
            name = reference.get_inputs()[0].name
            for batch in (int(s) for s in sizes.split(",")):
                image = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32)).astype(np.float32)
                try:
                    got = job.run({name: image})
                except RunError as exc:
                    print(f"ok batch {batch} refused: {exc}", flush=True)
                    continue
                want = dict(zip([o.name for o in reference.get_outputs()], reference.run(None, {name: image})))
                good = all(np.allclose(got[n], w, rtol=1e-3, atol=1e-4) for n, w in want.items())
                print(f"{'ok' if good else 'FAIL'} batch {batch} of {plan_dir.rstrip('/').split('/')[-1]} "
                      f"{'matches' if good else 'differs from'} onnxruntime", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
