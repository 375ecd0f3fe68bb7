"""Calls of one row through the resident job (``Job.run(..., row=r)``).

Arguments: PLAN_DIR (a 1x2 generation plan of the sample builder Llama, batch 1 to 2), and
``on-device`` to keep the state and activations in onnxruntime's buffers (``Job(on_device=True)``:
the path a GPU runs, here on OrtValues in host memory).
Rank 0 prefills two prompts as one batch, then feeds the second one's next tokens by calls
of its row alone and the first one's by calls of the whole batch; every logit must equal
onnxruntime's on the original model running each sequence alone. A row call refuses, in
one line and with the job still usable, a row outside the batch, state given with it, and
a job that holds no state yet. Prints ``ok``/``FAIL`` lines.
"""

from __future__ import annotations

import sys

import numpy as np
from generation_job import generation_job


def main() -> int:
    from meshplan.errors import RunError
    from meshplan.generation.loop import GenerationShape, SessionStepper
    from meshplan.runtime.sessions import StageSession, providers_for

    opened, on_device = generation_job()
    with opened as job:
        if job is None:
            return 0
        shape = GenerationShape.of_plan(job.plan)
        session = StageSession(job.plan.model["path"], providers_for("cpu"), optimization="basic")
        refused = []
        for what, call in (("before any state", lambda: job.run(feeds([[5]], 1, 0), row=0)),):
            try:
                call()
                refused.append(f"{what}: not refused")
            except RunError as exc:
                refused.append(f"{what}: {exc}" if "whole batch" not in str(exc) else "")
        prompts = [[295, 277, 75, 312], [17, 42, 7, 9]]
        ids = np.array(prompts, dtype=np.int64)
        got = [[job.run({shape.input_ids: ids, shape.attention_mask: np.ones((2, 4), np.int64)},
                        outputs={"logits": np.s_[:, -1:]})["logits"][r, -1]] for r in range(2)]
        for what, call in (("row 2", lambda: job.run(feeds([[5]], 1, 4), row=2)),
                           ("state given", lambda: job.run({**feeds([[5]], 1, 4),
                                                            "past_key_values.0.key": np.zeros(1)}, row=0))):
            try:
                call()
                refused.append(f"{what}: not refused")
            except RunError as exc:
                refused.append("" if ("outside" in str(exc) or "give no state" in str(exc)) else f"{what}: {exc}")
        lengths = [4, 4]
        nexts = [[11, 12, 13], [21, 22, 23]]
        for step in range(3):
            # row 1 alone, then both rows with row 1 fed a pad that its next row call overwrites
            out = job.run(feeds([[nexts[1][step]]], 1, lengths[1]), outputs={"logits": np.s_[:, -1:]}, row=1)
            got[1].append(out["logits"][0, -1])
            lengths[1] += 1
            mask = np.zeros((2, shape.context), np.int64)
            mask[0, :lengths[0] + 1] = 1
            mask[1, :lengths[1] + 1] = 1
            out = job.run({shape.input_ids: np.array([[nexts[0][step]], [0]], np.int64), shape.attention_mask: mask},
                          outputs={"logits": np.s_[:, -1:]})
            got[0].append(out["logits"][0, -1])
            lengths[0] += 1
        worst = 0.0
        for r in range(2):
            alone = SessionStepper(shape, session.run)
            alone.reset()
            want = [alone.step({shape.input_ids: np.array([prompts[r]], np.int64),
                                shape.attention_mask: np.ones((1, 4), np.int64)}, 1)[0, -1]]
            for step, token in enumerate(nexts[r]):
                mask = np.zeros((1, shape.context), np.int64)
                mask[0, :5 + step] = 1
                want.append(alone.step({shape.input_ids: np.array([[token]], np.int64), shape.attention_mask: mask},
                                       1)[0, -1])
            worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(got[r], want)))
        print(f"{'ok' if worst < 1e-4 else 'FAIL'} row calls and batch calls against each sequence alone: "
              f"worst error {worst:.1e}")
        if on_device:
            from meshplan.runtime.buffers import DeviceTensor

            kept = [type(v).__name__ for v in job.state.values() if not isinstance(v, DeviceTensor)]
            sessions = [s.session for s in job.session.segments if s.session is not None]
            ok = not kept and job.state and all(s.device is not None for s in sessions) and len(sessions) > 1
            print(f"{'ok' if ok else 'FAIL'} state and {len(sessions)} segments on the device: state types not "
                  f"on it {kept}")
        bad = [line for line in refused if line]
        print(f"{'ok' if not bad else 'FAIL'} row calls refused in one line: {bad or 'all'}")
    return 0


def feeds(ids, rows, length):
    """A row call's inputs: ``ids`` [rows, 1] after ``length`` positions (a mask of
    ``length`` + 1 ones)."""
    mask = np.zeros((rows, max(length + 1, 1)), np.int64)
    mask[:, :length + 1] = 1
    return {"input_ids": np.array(ids, np.int64), "attention_mask": mask}


if __name__ == "__main__":
    sys.exit(main())
