"""Greedy generation through the resident job, for each plan directory given.

Under mpiexec: for each plan (of the same number of ranks), open a ``meshplan.Job``; rank 0
prefills a prompt from an empty cache, then decodes token after token feeding its own
greedy choice back, asking only for the last position's logits, and compares every
step's logits with onnxruntime on the original model given the same tokens (its own
cache carried by hand). After each call it reads the job's counters: no byte of the
cache may have moved, and each rank must hold exactly its share of the cache under the
plan's layout. Rank 0 prints one ``ok``/``FAIL`` line per plan and check.
"""

from __future__ import annotations

import sys
import traceback

import numpy as np


def reference_session(path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def expected_state_bytes(job, shapes: dict[str, tuple]) -> list[int]:
    """Per rank: the bytes of its share of every state under the plan's layout."""
    from meshplan.runtime.state_layout import state_spec
    from meshplan.sharding import LogicalMesh

    plan = job.plan
    found = [0] * job.size
    for entry in plan.state:
        stage = plan.stages[entry["stage"]]
        mesh = LogicalMesh(tuple(stage.logical_mesh), tuple(stage.devices))
        spec = state_spec(entry)
        itemsize = np.dtype(next(t.dtype for t in plan.inputs if t.name == entry["input"])).itemsize
        for rank in stage.devices:
            found[rank] += spec.local_bytes(shapes[entry["input"]], itemsize, mesh)
    return found


def generate(plan_dir: str, prompt: int, steps: int, batch: int) -> list[str]:
    from meshplan.errors import RunError
    from meshplan.runtime.job import Job

    lines = []
    with Job(plan_dir, provider="cpu") as job:
        if job is None:
            return lines
        label = plan_dir.rstrip("/").split("/")[-1]
        reference = reference_session(job.plan.model["path"])
        state_names = set(job.state_inputs) | set(job.state_outputs)
        pairs = job.state_names
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 256, (batch, prompt)).astype(np.int64)
        past = {name: np.zeros((batch, 2, 0, 8), np.float32) for name in job.state_inputs}
        length, worst, moved, share, calls = 0, 0.0, 0, True, 0
        for step in range(steps + 1):
            seq = ids.shape[1]
            feeds = {"input_ids": ids, "attention_mask": np.ones((batch, length + seq), np.int64),
                     "position_ids": np.broadcast_to(np.arange(length, length + seq), (batch, seq)).astype(np.int64).copy()}
            got = job.run(feeds, outputs={"logits": np.s_[:, -1:]})
            calls += 1
            names = [o.name for o in reference.get_outputs()]
            want = dict(zip(names, reference.run(None, {**feeds, **past})))
            if got["logits"].shape != (batch, 1, want["logits"].shape[-1]):
                lines.append(f"FAIL {label} step {step}: logits {got['logits'].shape}")
                return lines
            worst = max(worst, float(np.abs(got["logits"] - want["logits"][:, -1:]).max()))
            past = {pairs[o]: want[o] for o in pairs}
            stats = job.stats()
            moved += stats.bytes_of(state_names)
            expected = expected_state_bytes(job, {name: value.shape for name, value in past.items()})
            share = share and stats.state_bytes == expected
            if not share:
                lines.append(f"FAIL {label} step {step}: state bytes per rank {stats.state_bytes}, "
                             f"expected {expected}")
                return lines
            length += seq
            ids = got["logits"][:, -1].argmax(-1).astype(np.int64)[:, None]
        tag = "ok" if worst < 1e-3 else "FAIL"
        lines.append(f"{tag} {label}: prefill {prompt} + {steps} decode steps, worst logit error {worst:.2e}")
        lines.append(f"{'ok' if moved == 0 else 'FAIL'} {label}: cache bytes moved between ranks: {moved}")
        lines.append(f"ok {label}: each rank held its share of the cache after every one of {calls} calls")
        kept = job.get_state()
        same = all(np.array_equal(kept[name], past[name]) or np.allclose(kept[name], past[name], atol=1e-4)
                   for name in past)
        lines.append(f"{'ok' if same else 'FAIL'} {label}: get_state gathers the cache ({len(kept)} tensors)")
        try:   # a call the plan cannot take: one error on rank 0, and the job goes on
            job.run({"input_ids": np.zeros((5, 1), np.int64), "attention_mask": np.ones((5, 1), np.int64),
                     "position_ids": np.zeros((5, 1), np.int64)})
            lines.append(f"FAIL {label}: batch 5 was accepted")
        except RunError as exc:
            lines.append(f"ok {label}: refused in one line: {exc}")
        job.reset_state()
        again = job.run({"input_ids": ids[:, :1], "attention_mask": np.ones((batch, 1), np.int64),
                         "position_ids": np.zeros((batch, 1), np.int64)})
        fresh = {name: np.zeros((batch, 2, 0, 8), np.float32) for name in job.state_inputs}
        want = reference.run(["logits"], {"input_ids": ids[:, :1], "attention_mask": np.ones((batch, 1), np.int64),
                                          "position_ids": np.zeros((batch, 1), np.int64), **fresh})[0]
        good = np.allclose(again["logits"], want, atol=1e-3)
        lines.append(f"{'ok' if good else 'FAIL'} {label}: after the refusal and a reset the job runs from empty")
    return lines


def main() -> int:
    from mpi4py import MPI

    prompt, steps, batch = 16, 16, 2
    failed = False
    for plan_dir in sys.argv[1:]:
        try:
            lines = generate(plan_dir, prompt, steps, batch)
        except Exception:
            traceback.print_exc()
            failed = True
            lines = [f"FAIL {plan_dir}: exception"]
            MPI.COMM_WORLD.Abort(1)
        if MPI.COMM_WORLD.rank == 0:
            print("\n".join(lines), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
