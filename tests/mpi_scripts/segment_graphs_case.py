"""``MESHPLAN_SEGMENT_GRAPHS=1``: a job with CUDA graphs on makes, in each segment of a program
cut at its collectives, the integer tensors that segment reads (``remake_integers``), and lets
every segment capture graphs (on the CPU provider none is captured: graphs are CUDA's). Under
mpiexec, on a 1x2 tensor-parallel plan of the builder Llama sample.

Arguments: PLAN_DIR. Every rank starts the job with the variable set; no segment after the
first may read an integer tensor that an earlier one made, and greedy generation of a prompt
must give the ids of the same job without the variable (a second job, started after the
first closed). Prints ``ok``/``FAIL`` lines on rank 0.
"""

from __future__ import annotations

import os
import sys

import onnx


def crossing_integers(job) -> list[str]:
    """The integer tensors (not the program's inputs) that a segment after the first reads."""
    program = job.plan.program_of_rank(job.rank)
    model = onnx.load(str(job.plan_dir / program.file), load_external_data=False)
    typed = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    integers = {v.name for v in typed if v.type.tensor_type.elem_type in (onnx.TensorProto.INT32,
                                                                           onnx.TensorProto.INT64)}
    inputs = {v.name for v in model.graph.input}
    return [n for s in job.session.segments[1:] for n in s.inputs if n in integers and n not in inputs]


def generated(plan_dir: str, remade: bool) -> tuple[list, list[str], int] | None:
    from meshplan.generation.driver import JobStepper
    from meshplan.generation.loop import Generation, GenerationShape
    from meshplan.generation.sampling import Sampler
    from meshplan.runtime.job import Job
    from meshplan.runtime.program import SEGMENT_GRAPHS

    if remade:
        os.environ[SEGMENT_GRAPHS] = "1"
    else:
        os.environ.pop(SEGMENT_GRAPHS, None)
    job = Job(plan_dir, "cpu", cache_in_place=True, graphs=True)
    crossing = crossing_integers(job)
    segments = len(job.session.segments)
    if not job.is_driver:
        job.serve()
        return None
    try:
        sequences, _ = Generation(GenerationShape.of_plan(job.plan), JobStepper(job)).run([[5, 9, 13, 2]], 6, Sampler())
    finally:
        job.close()
    return [list(s.ids) for s in sequences], crossing, segments


def main() -> int:
    plan_dir = sys.argv[1]
    remade = generated(plan_dir, True)
    plain = generated(plan_dir, False)
    if remade is None:
        return 0
    (ids, crossing, segments), (plain_ids, plain_crossing, _) = remade, plain
    print(f"{'ok' if segments > 2 and not crossing else 'FAIL'} no integer crosses a cut of rank 0's {segments} "
          f"segments: {crossing}")
    print(f"{'ok' if plain_crossing else 'FAIL'} without the variable some do: {plain_crossing[:3]}")
    print(f"{'ok' if ids == plain_ids and ids[0] else 'FAIL'} the same ids: {ids} and {plain_ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
