"""Where a decode step's time goes: onnxruntime's run, the copies, the waits, the loop.

For a one-device generation plan (``meshplan plan MODEL --mesh 1x1 --generate``), in one
process, on CUDA or the CPU:

- **meshplan**: ``meshplan generate``'s loop over a ``Job`` (the warm-up ``generate`` runs
  first, then generations of ``--new-tokens`` and of twice as many, in turns: their
  difference over ``--new-tokens`` is one decode step, free of the prefill and of what a
  request pays once). onnxruntime's entry points are timed as they are called:
  ``run_with_iobinding``/``run`` (on CUDA with a graph: the replay and its wait for the
  GPU), ``OrtValue.update_inplace`` (a numpy feed copied into its buffer), the wait for those
  copies before a graph's replay, ``OrtValue.numpy`` (what returns to the host) and the
  token's choice (``Sampler``); the step less all of them is meshplan's Python;
- **replay alone**: the last decode run again, back to back, nothing else: what onnxruntime
  and the GPU take for the step by themselves;
- **the first request** (``--first-requests N``): TTFT of the first request after
  `generate`'s warm-up, in fresh jobs, with that warm-up and with one more prefill in it
  (whether a request's second prefill of the process pays what later ones do not);
- **onnxruntime alone** (``--floor``): the plan's program in one session, every buffer bound
  once where the provider computes (the cache as its own output, the token and a static mask
  of the capacity updated in place, the logits' last row read back and its argmax taken in
  numpy); with CUDA graphs on CUDA unless ``--no-cuda-graph``: the least a Python loop over
  onnxruntime pays for a step that chooses its token on the host.

Prints µs per decode step for each part; ``--json PATH`` writes them.

    python benchmarks/decode_phases.py PLAN [--provider cuda] [--no-cuda-graph] [--floor] [--first-requests N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PARTS = ("run", "update_inplace", "wait_for_copies", "numpy", "sampler")


class Timers:
    """Nanoseconds and calls per part, from wrappers put around onnxruntime's and meshplan's
    entry points (taken off again by ``remove``)."""

    def __init__(self):
        import onnxruntime as ort

        from meshplan.generation import sampling
        from meshplan.runtime import resident

        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.last_run = None
        self._undo = []
        session_class = ort.InferenceSession
        self._wrap(session_class, "run_with_iobinding", "run", keep=True)
        self._wrap(session_class, "run", "run")
        self._wrap(ort.OrtValue, "update_inplace", "update_inplace")
        self._wrap(ort.OrtValue, "numpy", "numpy")
        self._wrap(resident, "_wait_for_copies", "wait_for_copies")
        self._wrap(sampling.Sampler, "__call__", "sampler")

    def _wrap(self, owner, attribute: str, part: str, keep: bool = False) -> None:
        original = getattr(owner, attribute)
        ns, calls, clock = self.ns, self.calls, time.perf_counter_ns

        def timed(*args, **kwargs):
            began = clock()
            try:
                return original(*args, **kwargs)
            finally:
                ns[part] += clock() - began
                calls[part] += 1
                if keep:
                    self.last_run = (original, args)

        setattr(owner, attribute, timed)
        self._undo.append((owner, attribute, original))

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.ns), dict(self.calls)

    def remove(self) -> None:
        for owner, attribute, original in reversed(self._undo):
            setattr(owner, attribute, original)
        self._undo.clear()


def prompt_ids(length: int, vocab: int) -> list[int]:
    return [(7 * i + 5) % min(vocab - 4, 390) + 4 for i in range(length)]


def meshplan_phases(plan_dir: Path, provider: str, graphs: bool, prompt: list[int], new_tokens: int,
                    rounds: int, replays: int, on_device: bool | None = None, choose: bool | None = None) -> dict:
    """µs per decode step of each part (the medians of the rounds), and the replay alone's.
    ``choose``: the job's token choice next to the logits (``Job(choose=...)``; None: its default)."""
    from meshplan.generation.driver import JobStepper
    from meshplan.generation.loop import Generation, GenerationShape
    from meshplan.generation.sampling import Sampler
    from meshplan.runtime.job import Job

    job = Job(plan_dir, provider, cache_in_place=True, graphs=graphs, on_device=on_device, choose=choose)
    try:
        generation = Generation(GenerationShape.of_plan(job.plan), JobStepper(job))
        generation.run([prompt], 2, Sampler(), ())            # the warm-up `meshplan generate` runs
        timers = Timers()
        per_step: dict[str, list[float]] = defaultdict(list)
        per_first: dict[str, list[float]] = defaultdict(list)
        steps_wall = []
        try:
            for round_ in range(rounds):
                seen = {}
                for tokens in ((new_tokens, 2 * new_tokens) if round_ % 2 == 0 else (2 * new_tokens, new_tokens)):
                    before = timers.snapshot()
                    began = time.perf_counter_ns()
                    _, metrics = generation.run([prompt], tokens, Sampler(), ())
                    wall = time.perf_counter_ns() - began
                    after = timers.snapshot()
                    seen[tokens] = (wall, {p: after[0].get(p, 0) - before[0].get(p, 0) for p in PARTS},
                                    {p: after[1].get(p, 0) - before[1].get(p, 0) for p in PARTS},
                                    sum(metrics.decode_seconds))
                (w1, ns1, c1, d1), (w2, ns2, c2, d2) = seen[new_tokens], seen[2 * new_tokens]
                step = (w2 - w1) / new_tokens
                steps_wall.append(step / 1e3)
                per_step["step"].append(step / 1e3)
                per_step["loop's own decode timing"].append((d2 - d1) * 1e6 / new_tokens)
                for part in PARTS:
                    per_step[part].append((ns2[part] - ns1[part]) / new_tokens / 1e3)
                    per_step[part + " calls"].append((c2[part] - c1[part]) / new_tokens)
                per_step["python (the rest)"].append(per_step["step"][-1] - sum(per_step[p][-1] for p in PARTS))
                decode_run = timers.last_run
                # the first token alone: a generation of one token is the prefill and its choice
                before = timers.snapshot()
                began = time.perf_counter_ns()
                _, metrics = generation.run([prompt], 1, Sampler(), ())
                wall = time.perf_counter_ns() - began
                after = timers.snapshot()
                per_first["first token (whole call)"].append(wall / 1e3)
                per_first["ttft"].append(metrics.prefill_seconds * 1e6)
                for part in PARTS:
                    per_first[part].append((after[0].get(part, 0) - before[0].get(part, 0)) / 1e3)
                    per_first[part + " calls"].append(after[1].get(part, 0) - before[1].get(part, 0))
            original, args = decode_run
        finally:
            timers.remove()
        replay = replay_alone(original, args, replays)
        result = {name: statistics.median(values) for name, values in per_step.items()}
        result["replay alone"] = replay
        result["first token"] = {name: statistics.median(values) for name, values in per_first.items()}
        result["graphs"] = job.session.graphs if job.session is not None else None
        result["token choice"] = "device" if job.chosen is not None else "host"
        return result
    finally:
        job.close()


def profile_calls(plan_dir: Path, provider: str, graphs: bool, prompt: list[int], new_tokens: int, top: int,
                  on_device: bool | None) -> None:
    """cProfile's functions of most time of their own in ``--rounds``-independent runs: decode
    steps (generations of ``new_tokens``), then first tokens (generations of one token)."""
    import cProfile
    import pstats

    from meshplan.generation.driver import JobStepper
    from meshplan.generation.loop import Generation, GenerationShape
    from meshplan.generation.sampling import Sampler
    from meshplan.runtime.job import Job

    job = Job(plan_dir, provider, cache_in_place=True, graphs=graphs, on_device=on_device, choose=None)
    try:
        generation = Generation(GenerationShape.of_plan(job.plan), JobStepper(job))
        generation.run([prompt], 6, Sampler(), ())
        for what, tokens, times in (("decode steps", new_tokens, 5), ("first tokens", 1, 50)):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(times):
                generation.run([prompt], tokens, Sampler(), ())
            profile.disable()
            print(f"-- cProfile, {what}: {times} generations of {tokens} token(s)")
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(top)
    finally:
        job.close()


def first_requests(plan_dir: Path, provider: str, graphs: bool, prompt: list[int], new_tokens: int, jobs: int,
                   on_device: bool | None, requests: int = 4) -> dict:
    """TTFT (µs) of the first ``requests`` requests of a job after ``meshplan generate``'s
    warm-up (a prefill and ``warm_up_steps`` decode steps; the first is what `generate`
    reports), in ``jobs`` fresh jobs (the medians), with that warm-up alone and with one more
    prefill (and a decode step) after it, and onnxruntime's run of each request's prefill
    alone: whether a job's first requests pay what later ones do not, and whether it is
    onnxruntime's run or the host's work around it (on an H100 a steady request's TTFT was
    0.97 ms where `generate`'s was 1.6 ms, 0.4 B fp16 Llama)."""
    from meshplan.generation.driver import JobStepper, warm_up_steps
    from meshplan.generation.loop import Generation, GenerationShape
    from meshplan.generation.sampling import Sampler
    from meshplan.runtime.job import Job

    found: dict[str, list[float]] = defaultdict(list)
    for index in range(2 * jobs):
        extra = index % 2 == 1
        job = Job(plan_dir, provider, cache_in_place=True, graphs=graphs, on_device=on_device, choose=None)
        try:
            generation = Generation(GenerationShape.of_plan(job.plan), JobStepper(job))
            generation.run([prompt], 1 + warm_up_steps(job, graphs), Sampler(), ())
            if extra:   # a decode step after it too: the request's prefill follows a decode step either way
                generation.run([prompt], 2, Sampler(), ())
            warm_up = "one more prefill in the warm-up" if extra else "generate's warm-up"
            timers = Timers()
            try:
                for request in range(1, requests + 1):
                    ran: list[float] = []
                    stepper_step = generation.stepper.step, getattr(generation.stepper, "choose", None)

                    def timed(call):
                        def run(*args, **kwargs):
                            before = timers.ns.get("run", 0)
                            try:
                                return call(*args, **kwargs)
                            finally:
                                if not ran:   # the prefill's call: onnxruntime's part of it
                                    ran.append((timers.ns.get("run", 0) - before) / 1e3)
                        return run

                    generation.stepper.step = timed(stepper_step[0])
                    if stepper_step[1] is not None:
                        generation.stepper.choose = timed(stepper_step[1])
                    try:
                        _, metrics = generation.run([prompt], new_tokens, Sampler(), ())
                    finally:
                        generation.stepper.step = stepper_step[0]
                        if stepper_step[1] is not None:
                            generation.stepper.choose = stepper_step[1]
                    found[f"{warm_up}: request {request} TTFT"].append(metrics.prefill_seconds * 1e6)
                    found[f"{warm_up}: request {request} onnxruntime's prefill run"].append(ran[0] if ran else 0.0)
            finally:
                timers.remove()
        finally:
            job.close()
    return {name: statistics.median(values) for name, values in found.items()}


def replay_alone(run, args, replays: int) -> float:
    """µs per call of the last decode run, back to back."""
    for _ in range(5):
        run(*args)
    began = time.perf_counter_ns()
    for _ in range(replays):
        run(*args)
    return (time.perf_counter_ns() - began) / replays / 1e3


def alone_session(program: Path, provider: str, graphs: bool, capacity: int) -> SimpleNamespace:
    """onnxruntime alone on a plan's program: its session (CUDA graphs where asked), one
    IOBinding with the key/value cache bound once at ``capacity`` as both input and output,
    run options for a plain run and for the graph, where its OrtValues go, and the logits'
    vocabulary and dtype."""
    import onnxruntime as ort

    on_cuda = provider == "cuda"
    if on_cuda:
        providers = [("CUDAExecutionProvider", {"device_id": "0", "use_tf32": "0",
                                                "enable_cuda_graph": "1" if graphs else "0"})]
        where = ("cuda", 0)
    else:
        providers, where = ["CPUExecutionProvider"], ("cpu", 0)
    session = ort.InferenceSession(str(program), ort.SessionOptions(), providers=providers)
    plain, graph = ort.RunOptions(), ort.RunOptions()
    if on_cuda and graphs:
        plain.add_run_config_entry("gpu_graph_id", "-1")
        graph.add_run_config_entry("gpu_graph_id", "1")
    inputs = {i.name: i for i in session.get_inputs()}
    kinds = {"tensor(float16)": np.float16, "tensor(float)": np.float32}
    logits = next(o for o in session.get_outputs() if o.name == "logits")
    caches = [n for n in inputs if n.startswith("past_key_values.")]
    if any(t not in kinds for t in [logits.type] + [inputs[n].type for n in caches]):
        raise SystemExit(f"error: onnxruntime alone here takes float16 or float32 caches and logits ({program})")
    binding = session.io_binding()
    for past in caches:
        shape = inputs[past].shape
        cache = ort.OrtValue.ortvalue_from_shape_and_type([1, shape[1], capacity, shape[3]],
                                                          kinds[inputs[past].type], *where)
        binding.bind_ortvalue_input(past, cache)
        binding.bind_ortvalue_output(past.replace("past_key_values", "present"), cache)
    return SimpleNamespace(session=session, binding=binding, plain=plain, graph=graph, where=where, on_cuda=on_cuda,
                           vocab=logits.shape[-1], logits_type=kinds[logits.type])


def floor_phases(program: Path, provider: str, graphs: bool, capacity: int, prompt: list[int], steps: int,
                 rounds: int) -> dict:
    """onnxruntime alone: µs per decode step of the loop, and of its run by itself."""
    import onnxruntime as ort

    from meshplan.generation.sampling import Sampler
    from meshplan.providers import cuda_synchronize

    alone = alone_session(program, provider, graphs, capacity)
    session, binding, plain, graph, where = alone.session, alone.binding, alone.plain, alone.graph, alone.where
    on_cuda, vocab, logits_type = alone.on_cuda, alone.vocab, alone.logits_type
    choose = Sampler()

    def feed(name: str, array: np.ndarray):
        value = ort.OrtValue.ortvalue_from_numpy(array, *where)
        binding.bind_ortvalue_input(name, value)
        return value

    def one_round() -> tuple[float, float]:
        held = [feed("input_ids", np.array([prompt], np.int64)),
                feed("attention_mask", np.ones((1, len(prompt)), np.int64))]
        first = ort.OrtValue.ortvalue_from_shape_and_type([1, len(prompt), vocab], logits_type, *where)
        binding.bind_ortvalue_output("logits", first)
        session.run_with_iobinding(binding, plain)
        last = first.numpy()[:, -1]
        token, mask = np.zeros((1, 1), np.int64), np.zeros((1, capacity), np.int64)
        mask[0, :len(prompt)] = 1
        token_value, mask_value = feed("input_ids", token), feed("attention_mask", mask)
        logits = ort.OrtValue.ortvalue_from_shape_and_type([1, 1, vocab], logits_type, *where)
        binding.bind_ortvalue_output("logits", logits)
        length = len(prompt)
        began = None
        for step in range(steps + 5):   # five steps first: a graph is captured at its third run
            if step == 5:
                began = time.perf_counter_ns()
            token[0, 0] = int(choose(last)[0])
            mask[0, length] = 1
            length += 1
            token_value.update_inplace(token)
            mask_value.update_inplace(mask)
            if on_cuda:
                cuda_synchronize()
            session.run_with_iobinding(binding, graph)
            last = logits.numpy()[:, -1]
        loop = (time.perf_counter_ns() - began) / steps / 1e3
        del held
        return loop, replay_alone(session.run_with_iobinding, (binding, graph), steps)

    one_round()   # onnxruntime's first runs of each shape: not the step's
    found = [one_round() for _ in range(rounds)]
    return {"step": statistics.median(f[0] for f in found), "replay alone": statistics.median(f[1] for f in found)}


def one_device_parser(description: str, new_tokens: int) -> argparse.ArgumentParser:
    """The options of a benchmark of a one-device generation plan: the plan, the provider,
    CUDA graphs, the prompt's length and the new tokens."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("plan", type=Path, help="a one-device generation plan folder")
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-cuda-graph", dest="graphs", action="store_false")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    return parser


def one_device_plan(plan_dir: Path):
    """The plan and its ``GenerationShape``; one line and exit 1 unless it is a one-device
    generation plan with a shared key/value buffer."""
    from meshplan.errors import MeshplanError
    from meshplan.generation.loop import GenerationShape
    from meshplan.plan_format import read_plan

    try:
        plan = read_plan(plan_dir)
        shape = GenerationShape.of_plan(plan)
    except MeshplanError as exc:
        raise SystemExit(f"error: {exc}")
    if plan.num_ranks != 1 or not shape.shared:
        raise SystemExit(f"error: {plan_dir} is not a one-device generation plan (meshplan plan --mesh 1x1 --generate)")
    return plan, shape


def main() -> None:
    parser = one_device_parser(__doc__.splitlines()[0], 64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--floor", action="store_true", help="also onnxruntime alone on the plan's program")
    parser.add_argument("--on-device", action="store_true",
                        help="with the CPU provider: the path a GPU runs (tensors kept in onnxruntime's buffers)")
    parser.add_argument("--first-requests", type=int, default=0, metavar="N",
                        help="also the first request's TTFT after the warm-up, in N fresh jobs with it and N with "
                             "one more prefill in it")
    parser.add_argument("--choice", choices=("auto", "device", "host", "both"), default="auto",
                        help="where the token is chosen: next to the logits (device), from logits copied to the host, "
                             "both in turn, or the job's default (auto: the device on CUDA)")
    parser.add_argument("--choice-op", choices=("argmax", "topk", "chunked"), default=None,
                        help="how a choice next to the logits finds the index (meshplan.runtime.greedy_choice)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N functions of most time of their own (cProfile) in decode steps and "
                             "in first tokens, measured apart after the rest")
    args = parser.parse_args()
    if args.choice_op:
        from meshplan.runtime import greedy_choice

        greedy_choice.METHOD = args.choice_op
    from meshplan.errors import MeshplanError

    plan, shape = one_device_plan(args.plan)
    if args.new_tokens < 1 or args.rounds < 1 or args.prompt_length < 1:
        raise SystemExit("error: --new-tokens, --rounds and --prompt-length must be at least 1")
    if args.first_requests < 0:
        raise SystemExit("error: --first-requests must be 0 or more")
    capacity = shape.context
    if args.prompt_length + 2 * args.new_tokens + 1 > capacity:
        raise SystemExit(f"error: a prompt of {args.prompt_length} and {2 * args.new_tokens} new tokens exceed the "
                         f"plan's capacity of {capacity}")
    vocab = shape.vocab or 32000
    prompt = prompt_ids(args.prompt_length, vocab)
    result = {"plan": str(args.plan), "provider": args.provider, "graphs": args.graphs}
    choices = {"auto": (None,), "device": (True,), "host": (False,), "both": (False, True)}[args.choice]
    for choose in choices:
        try:
            measured = meshplan_phases(args.plan, args.provider, args.graphs, prompt, args.new_tokens, args.rounds,
                                       args.replays, True if args.on_device else None, choose)
        except MeshplanError as exc:
            raise SystemExit(f"error: {exc}")
        result.setdefault("meshplan", measured)
        result[f"meshplan, token chosen on the {measured['token choice']}"] = measured
    if args.floor:
        result["onnxruntime alone"] = floor_phases(args.plan / plan.programs[0].file, args.provider, args.graphs,
                                                   capacity, prompt, 2 * args.new_tokens, args.rounds)
    for choose in choices:
        m = result["meshplan"] if len(choices) == 1 else \
            result[f"meshplan, token chosen on the {'device' if choose else 'host'}"]
        how = f" ({args.choice_op or 'argmax'})" if m["token choice"] == "device" else ""
        print(f"{args.plan} on {args.provider}, CUDA graphs {'on' if args.graphs else 'off'}, token chosen on the "
              f"{m['token choice']}{how}: µs per decode step (median of {args.rounds} rounds)")
        for name in ("step", "loop's own decode timing", *PARTS, "python (the rest)", "replay alone"):
            calls = m.get(name + " calls")
            print(f"  meshplan {name:28} {m[name]:9.1f}" + (f"   ({calls:.1f} calls)" if calls is not None else ""))
        first = m["first token"]
        print(f"  first token (a generation of one token): whole call {first['first token (whole call)']:.1f}, "
              f"TTFT {first['ttft']:.1f}; " + ", ".join(
                  f"{part} {first[part]:.1f} ({first[part + ' calls']:.0f})" for part in PARTS))
        if args.provider == "cuda" and m.get("graphs"):
            print(f"  CUDA graphs: {m['graphs']}")
        if "onnxruntime alone" in result:
            print(f"  meshplan over onnxruntime alone   {m['step'] - result['onnxruntime alone']['step']:9.1f}")
    if args.first_requests:
        try:
            result["first request"] = first_requests(args.plan, args.provider, args.graphs, prompt, args.new_tokens,
                                                      args.first_requests, True if args.on_device else None)
        except MeshplanError as exc:   # a later job's start, say, that finds the device full
            raise SystemExit(f"error: {exc}")
        print(f"  a job's first requests after the warm-up, µs (median of {args.first_requests} jobs each):")
        for name, value in result["first request"].items():
            print(f"    {name:66} {value:9.1f}")
    if "onnxruntime alone" in result:
        f = result["onnxruntime alone"]
        print(f"  onnxruntime alone step            {f['step']:9.1f}")
        print(f"  onnxruntime alone replay alone    {f['replay alone']:9.1f}")
    if args.profile:
        profile_calls(args.plan, args.provider, args.graphs, prompt, args.new_tokens, args.profile,
                      True if args.on_device else None)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
