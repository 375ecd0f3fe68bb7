"""A job's requests one after another: TTFT and onnxruntime's prefill run of each.

A one-device generation plan's job (as ``meshplan generate`` and ``meshplan serve`` run it,
after the same warm-up) serves ``--requests`` requests in turn, each a prompt and
``--new-tokens`` decode steps, and prints each request's TTFT and the part of it that is
onnxruntime's run of the prefill; then onnxruntime alone does the same on the plan's program
in a session of its own (the prompt's run, then the decode steps, replayed as a CUDA graph
where the session has them). Whether a job's first requests pay what later ones do not, and
whether onnxruntime alone pays it too (on an H100, a 0.4 B fp16 Llama's prefill run took
0.8-1.0 ms in a job's first requests against 0.49 ms later, and onnxruntime-genai's whole
TTFT was 0.89 ms). ``--gap-ms`` waits between requests (a server's idle time).

    python benchmarks/request_sequence.py PLAN [--provider cuda] [--requests 24] [--new-tokens 16] [--gap-ms 0]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.decode_phases import alone_session, one_device_parser, one_device_plan, prompt_ids  # noqa: E402


def job_sequence(plan_dir: Path, provider: str, graphs: bool, prompt: list[int], new_tokens: int, requests: int,
                 gap: float) -> list[tuple[float, float]]:
    """(TTFT µs, onnxruntime's prefill run µs) of each request of one job after its warm-up."""
    import onnxruntime as ort

    from meshplan.generation.driver import JobStepper, warm_up_steps
    from meshplan.generation.loop import Generation, GenerationShape
    from meshplan.generation.sampling import Sampler
    from meshplan.runtime.job import Job

    job = Job(plan_dir, provider, cache_in_place=True, graphs=graphs, choose=None)
    original = ort.InferenceSession.run_with_iobinding
    runs: list[int] = []

    def timed(*args, **kwargs):
        began = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            runs.append(time.perf_counter_ns() - began)

    found = []
    try:
        generation = Generation(GenerationShape.of_plan(job.plan), JobStepper(job))
        generation.run([prompt], 1 + warm_up_steps(job, graphs), Sampler(), ())   # `generate`'s warm-up
        ort.InferenceSession.run_with_iobinding = timed
        for _ in range(requests):
            if gap:
                time.sleep(gap)
            runs.clear()
            _, metrics = generation.run([prompt], new_tokens, Sampler(), ())
            found.append((metrics.prefill_seconds * 1e6, runs[0] / 1e3 if runs else float("nan")))
    finally:
        ort.InferenceSession.run_with_iobinding = original
        job.close()
    return found


def alone_sequence(program: Path, provider: str, graphs: bool, capacity: int, prompt: list[int], new_tokens: int,
                   requests: int, gap: float) -> list[float]:
    """onnxruntime alone on the plan's program: µs of each request's prefill run (the cache
    bound once at its capacity; the decode steps replayed as a graph where the session has them)."""
    import onnxruntime as ort

    from meshplan.providers import cuda_synchronize

    alone = alone_session(program, provider, graphs, capacity)
    session, binding, plain, graph, where = alone.session, alone.binding, alone.plain, alone.graph, alone.where
    on_cuda, vocab, logits_type = alone.on_cuda, alone.vocab, alone.logits_type
    prefill_ids = ort.OrtValue.ortvalue_from_numpy(np.array([prompt], np.int64), *where)
    prefill_mask = ort.OrtValue.ortvalue_from_numpy(np.ones((1, len(prompt)), np.int64), *where)
    prefill_logits = ort.OrtValue.ortvalue_from_shape_and_type([1, len(prompt), vocab], logits_type, *where)
    token, mask = np.zeros((1, 1), np.int64), np.zeros((1, capacity), np.int64)
    token_value = ort.OrtValue.ortvalue_from_numpy(token, *where)
    mask_value = ort.OrtValue.ortvalue_from_numpy(mask, *where)
    step_logits = ort.OrtValue.ortvalue_from_shape_and_type([1, 1, vocab], logits_type, *where)

    def request() -> float:
        binding.bind_ortvalue_input("input_ids", prefill_ids)
        binding.bind_ortvalue_input("attention_mask", prefill_mask)
        binding.bind_ortvalue_output("logits", prefill_logits)
        began = time.perf_counter_ns()
        session.run_with_iobinding(binding, plain)
        took = (time.perf_counter_ns() - began) / 1e3
        last = prefill_logits.numpy()[0, -1]
        mask[:] = 0
        mask[0, :len(prompt)] = 1
        binding.bind_ortvalue_input("input_ids", token_value)
        binding.bind_ortvalue_input("attention_mask", mask_value)
        binding.bind_ortvalue_output("logits", step_logits)
        for step in range(new_tokens):
            token[0, 0] = int(np.argmax(last))
            mask[0, len(prompt) + step] = 1
            token_value.update_inplace(token)
            mask_value.update_inplace(mask)
            if on_cuda:
                cuda_synchronize()
            session.run_with_iobinding(binding, graph)
            last = step_logits.numpy()[0, -1]
        return took

    request()   # the warm-up: each shape's first run, the step's graph captured
    found = []
    for _ in range(requests):
        if gap:
            time.sleep(gap)
        found.append(request())
    return found


def main() -> None:
    parser = one_device_parser(__doc__.splitlines()[0], 16)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each request")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    from meshplan.errors import MeshplanError

    plan, shape = one_device_plan(args.plan)
    if min(args.requests, args.new_tokens, args.prompt_length) < 1 or args.gap_ms < 0:
        raise SystemExit("error: --requests, --new-tokens and --prompt-length must be at least 1, --gap-ms at least 0")
    if args.prompt_length + args.new_tokens + 1 > shape.context:
        raise SystemExit(f"error: a prompt of {args.prompt_length} and {args.new_tokens} new tokens exceed the plan's "
                         f"capacity of {shape.context}")
    prompt = prompt_ids(args.prompt_length, shape.vocab or 32000)
    gap = args.gap_ms / 1e3
    try:
        job = job_sequence(args.plan, args.provider, args.graphs, prompt, args.new_tokens, args.requests, gap)
    except MeshplanError as exc:
        raise SystemExit(f"error: {exc}")
    alone = alone_sequence(args.plan / plan.programs[0].file, args.provider, args.graphs, shape.context, prompt,
                           args.new_tokens, args.requests, gap)
    print(f"{args.plan} on {args.provider}, CUDA graphs {'on' if args.graphs else 'off'}: {args.requests} requests "
          f"of a {len(prompt)}-token prompt and {args.new_tokens} decode steps, {args.gap_ms:g} ms apart; µs")
    print(f"{'request':>8} {'job TTFT':>10} {'job prefill run':>16} {'onnxruntime alone prefill run':>30}")
    for index, ((ttft, run), own) in enumerate(zip(job, alone), 1):
        print(f"{index:8d} {ttft:10.1f} {run:16.1f} {own:30.1f}")
    half = len(job) // 2
    for name, rows in (("first half", slice(0, max(1, half))), ("second half", slice(half, None))):
        print(f"  median, {name}: job TTFT {statistics.median(t for t, _ in job[rows]):.1f}, job prefill run "
              f"{statistics.median(r for _, r in job[rows]):.1f}, onnxruntime alone {statistics.median(alone[rows]):.1f}")
    if args.json:
        args.json.write_text(json.dumps({"job": job, "alone": alone, "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
