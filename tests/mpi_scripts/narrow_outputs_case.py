"""Outputs asked for in part (``Job.run(..., outputs={"logits": box})``) on a 1x2 plan.

Arguments: PLAN_DIR (a 1x2 generation plan of the sample builder Llama, whose logits come
out of an all-gather over the vocabulary), and ``on-device`` to keep the state and
activations in onnxruntime's buffers. Rank 0 prefills one prompt asking for boxes of the
logits, each after a reset, and compares each with the same box of the whole logits: where
the box leaves the gathered dim whole (positions), only the box crosses the ranks (the
bytes sent for the logits shrink in proportion); where it cuts the gathered dim (some of
the vocabulary), the whole is gathered and cut after. Prints ``ok``/``FAIL`` lines.
"""

from __future__ import annotations

import sys

import numpy as np
from generation_job import generation_job


def main() -> int:
    from meshplan.generation.loop import GenerationShape

    opened, on_device = generation_job()
    with opened as job:
        if job is None:
            return 0
        shape = GenerationShape.of_plan(job.plan)
        prompt = np.array([[295, 277, 75, 312, 17, 42]], dtype=np.int64)
        feeds = {shape.input_ids: prompt, shape.attention_mask: np.ones(prompt.shape, np.int64)}

        def call(box):
            job.reset_state()
            out = job.run(feeds, outputs={"logits": box} if box is not None else None)["logits"]
            return out, job.sent.get("logits", 0)

        whole, whole_bytes = call(None)
        where = "on device" if on_device else "host"
        for box, crossing in ((np.s_[:, -1:], 1 / 6), (np.s_[:, 2:4], 2 / 6), (np.s_[:, :, :10], 1.0)):
            got, sent = call(box)
            same = got.shape == whole[box].shape and np.array_equal(got, whole[box])
            print(f"{'ok' if same else 'FAIL'} {where} logits{box}: equal to the box of the whole logits"
                  + ("" if same else f" (shape {got.shape}, max diff {np.abs(got - whole[box]).max()})"))
            fits = sent == round(whole_bytes * crossing)
            print(f"{'ok' if fits else 'FAIL'} {where} logits{box}: {sent} of {whole_bytes} bytes crossed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
