"""Greedy generation through ``meshplan.generation`` on the resident job, for each entry of
a manifest (JSON: plan_dir, prompts, new tokens, the expected ids and, where checked, each
rank's expected key/value-cache bytes).

Under mpiexec, one job per plan: rank 0 generates with the job as the stepper and prints
one ``ok``/``FAIL`` line per plan for the ids (against the single-device onnxruntime ids the
test computed), one for the cache bytes each rank reports holding (``Job.stats``), and one
for the bytes of the cache sent between ranks during generation (none may move). The job
runs as ``meshplan generate`` runs it (``cache_in_place``): a fixed-capacity cache must
stay in the buffers it started in (checked on rank 0), a growing one is replaced by
each call's present outputs. An entry with ``on_device`` keeps the state and what passes
between segments in onnxruntime's buffers (``Job(on_device=True)``), as a GPU runs it; one
with ``transfer`` "device" hands MPI those buffers too (a CUDA-aware MPI's path).
"""

from __future__ import annotations

import json
import sys
import traceback


def check(entry: dict) -> list[str]:
    from meshplan.generation.driver import JobStepper
    from meshplan.generation.loop import Generation, GenerationShape
    from meshplan.generation.sampling import Sampler
    from meshplan.runtime.job import Job

    lines = []
    # "on_device": the state and activations in onnxruntime's buffers (the path a GPU runs)
    # "transfer": "device": tensors cross ranks as the device buffers they are (a CUDA-aware MPI's path)
    with Job(entry["plan_dir"], provider="cpu", cache_in_place=True, on_device=entry.get("on_device"),
             transfer=entry.get("transfer", "auto")) as job:
        if job is None:
            return lines
        label = entry["name"]
        shape = GenerationShape.of_plan(job.plan)
        moved = {"bytes": 0}
        stepper = JobStepper(job)
        inner = stepper.step
        state_names = set(job.state_inputs) | set(job.state_outputs)

        buffers = []   # after each call: rank 0's cache buffers

        def step(feeds, last):
            out = inner(feeds, last)
            moved["bytes"] += job.stats().bytes_of(state_names)
            buffers.append({name: id(value) for name, value in job.state.items()})
            return out

        stepper.step = step
        if entry.get("on_device"):
            # a first request, then the one checked: its cache is the buffer the first one left
            # (taken again without zeroing: the positions it reads are the ones it writes)
            Generation(shape, JobStepper(job)).run([[3] * len(p) for p in entry["prompts"]], entry["new_tokens"],
                                                   Sampler())
            buffers.clear()
        sequences, _ = Generation(shape, stepper).run(entry["prompts"], entry["new_tokens"], Sampler())
        ids = [s.ids for s in sequences]
        lines.append(f"{'ok' if ids == entry['expected'] else 'FAIL'} {label}: ids {ids} (onnxruntime "
                     f"{entry['expected']})")
        kept = all(b == buffers[0] for b in buffers) and len(buffers[0]) > 0
        if shape.shared:
            lines.append(f"{'ok' if kept else 'FAIL'} {label}: the cache stayed in its buffers over {len(buffers)} "
                         "calls (updated in place)")
        else:
            lines.append(f"{'FAIL' if kept else 'ok'} {label}: the growing cache is each call's present output")
        held = job.stats().state_bytes
        if entry.get("cache_bytes") is not None:
            good = held == entry["cache_bytes"]
            lines.append(f"{'ok' if good else 'FAIL'} {label}: key/value cache bytes per rank {held} "
                         f"(expected {entry['cache_bytes']})")
        lines.append(f"{'ok' if moved['bytes'] == 0 else 'FAIL'} {label}: cache bytes moved between ranks: "
                     f"{moved['bytes']}")
        if entry.get("transfer") == "device":   # device buffers, and the runs keeping their bindings
            runs = [s.session._resident for s in job.session.segments if s.session is not None]
            repeated = sum(1 for r in runs if r.repeat is not None)
            good = job.buffers.name == "device" and job.session.kept_on is job.buffers and repeated > 0
            lines.append(f"{'ok' if good else 'FAIL'} {label}: {job.buffers.name} buffers, {repeated} of "
                         f"{len(runs)} segment(s) repeating their bound decode run")
    return lines


def main() -> int:
    from mpi4py import MPI

    entries = json.loads(open(sys.argv[1]).read())
    for entry in entries:
        try:
            lines = check(entry)
        except Exception:
            traceback.print_exc()
            print(f"FAIL {entry['name']}: exception", flush=True)
            MPI.COMM_WORLD.Abort(1)
        if MPI.COMM_WORLD.rank == 0:
            print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
