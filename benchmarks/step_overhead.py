"""What a 1x1 decode step costs meshplan on top of onnxruntime's own run of the same program.

The builder Llama sample (``sample_models/genai/llama_fp32``, 1 MB: the model's own work is
tens of microseconds, so what is left is the fixed cost every step pays, on a GPU too) is
planned for generation on one device at ``--capacity``; then, in one process, rounds in
turns of ``--steps`` decode steps each, after a prefill of 8 tokens:

- **onnxruntime**: the plan's program in one session with one IOBinding: the key/value
  buffers bound once as inputs and as their outputs (updated in place, as onnxruntime-genai
  runs them), the token and a static attention mask of the capacity bound once and updated
  in place each step, the logits to the host;
- **meshplan Job**: ``Job.run`` of the same program (one rank, no mpiexec) fed the same
  token and static mask, the cache kept in the job, only the last position's logits asked
  for: what ``meshplan generate`` calls;
- **meshplan generate's loop**: the whole decode step of ``meshplan generate`` (the loop,
  the feeds, the token chosen, ``Job.run``), timed by the loop itself;
- **onnxruntime-genai** (where it is installed): its generator on the sample's own folder
  with as many threads, ``generate_next_token`` and ``get_next_tokens`` per step.

Each runner runs in a process of its own (another session's pool threads, spinning beside
it, slowed onnxruntime alone from 45 to 85 µs a step on 2 cores). Prints the median µs per
step of each runner over the rounds, meshplan's overhead over
onnxruntime (the target: at most 30 µs) and its loop's over onnxruntime-genai's (the
target: at most 50 µs), and the medians of the rounds' own differences. ``--json PATH``
writes the numbers.

``--folder DIR`` runs another builder folder (the 398 MB model of ``generate.py``, say) and
adds a runner: onnxruntime alone on the folder's original model, so that the plan's program
and the model it came from can be told apart.

    python benchmarks/step_overhead.py [--steps 400] [--rounds 7] [--capacity 512] [--folder DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = REPO / "sample_models" / "genai" / "llama_fp32" / "model.onnx"
PROMPT = 8


def plan_one_device(workdir: Path, capacity: int, model: Path = MODEL) -> Path:
    """``meshplan plan MODEL --mesh 1x1 --generate --max-length CAPACITY``."""
    import subprocess

    plan_dir = workdir / "plan"
    done = subprocess.run([sys.executable, "-m", "cli.main", "plan", str(model), "--mesh", "1x1", "--device", "cpu",
                           "--generate", "--max-length", str(capacity), "-o", str(plan_dir)],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"meshplan plan failed: {done.stderr.strip()}")
    return plan_dir


def cache_names(session) -> list[tuple[str, str]]:
    """(past input, present output) pairs of the builder's program."""
    inputs = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    return [(name, name.replace("past_key_values", "present")) for name in inputs]


def onnxruntime_steps(program: Path, capacity: int, steps: int, threads: int) -> float:
    """Seconds per decode step of the program alone, bound once where onnxruntime allows."""
    return onnxruntime_runner(program, capacity, threads)(steps)


def onnxruntime_runner(program: Path, capacity: int, threads: int, prompt: int = PROMPT):
    """A function timing decode steps (after a prefill of ``prompt`` tokens) of the program
    in one onnxruntime session, made here once: the key/value buffers bound once as inputs
    and as their outputs, the token and a static mask of the capacity each bound once and
    updated in place, the logits read and the argmax taken in numpy."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(program), options, providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    binding = session.io_binding()
    caches = {}
    kinds = {i.name: i.type for i in session.get_inputs()}
    for past, present in cache_names(session):
        heads, head = shapes[past][1], shapes[past][3]
        buffer = np.zeros((1, heads, capacity, head), np.float16 if kinds[past] == "tensor(float16)" else np.float32)
        caches[past] = ort.OrtValue.ortvalue_from_numpy(buffer)
        binding.bind_ortvalue_input(past, caches[past])
        binding.bind_ortvalue_output(present, caches[past])

    def run(steps: int) -> float:
        binding.bind_output("logits", "cpu")
        binding.bind_cpu_input("input_ids", np.arange(1, prompt + 1, dtype=np.int64)[None])
        binding.bind_cpu_input("attention_mask", np.ones((1, prompt), np.int64))
        session.run_with_iobinding(binding)
        last = binding.get_outputs()[0].numpy()[0, -1].copy()
        binding.bind_output("logits", "cpu")   # decode's shape from now on, allocated by the first step
        mask = np.zeros((1, capacity), np.int64)
        mask[0, :prompt] = 1
        token = np.zeros((1, 1), np.int64)
        token_value, mask_value = ort.OrtValue.ortvalue_from_numpy(token), ort.OrtValue.ortvalue_from_numpy(mask)
        binding.bind_ortvalue_input("input_ids", token_value)
        binding.bind_ortvalue_input("attention_mask", mask_value)
        length = prompt
        started = time.perf_counter()
        for _ in range(steps):
            token[0, 0] = int(last.argmax())
            mask[0, length] = 1
            length += 1
            token_value.update_inplace(token)
            mask_value.update_inplace(mask)
            session.run_with_iobinding(binding)
            last = binding.get_outputs()[0].numpy()[0, -1]
        return (time.perf_counter() - started) / steps
    return run


def job_steps(job, capacity: int, steps: int) -> float:
    """Seconds per decode step through ``Job.run``."""
    job.reset_state()
    ids = np.arange(1, PROMPT + 1, dtype=np.int64)[None]
    logits = job.run({"input_ids": ids, "attention_mask": np.ones((1, PROMPT), np.int64)},
                     outputs={"logits": np.s_[:, -1:]})["logits"]
    mask = np.zeros((1, capacity), np.int64)
    mask[0, :PROMPT] = 1
    length = PROMPT
    started = time.perf_counter()
    for _ in range(steps):
        token = np.array([[int(logits[0, -1].argmax())]], np.int64)
        mask[0, length] = 1
        length += 1
        logits = job.run({"input_ids": token, "attention_mask": mask}, outputs={"logits": np.s_[:, -1:]})["logits"]
    return (time.perf_counter() - started) / steps


def loop_steps(job, steps: int) -> float:
    """Seconds per decode step of ``meshplan generate``'s loop (its own timing)."""
    from meshplan.generation.driver import JobStepper
    from meshplan.generation.loop import Generation, GenerationShape
    from meshplan.generation.sampling import Sampler

    _, metrics = Generation(GenerationShape.of_plan(job.plan), JobStepper(job)).run(
        [list(range(1, PROMPT + 1))], steps + 1, Sampler())
    return statistics.mean(metrics.decode_seconds)


def genai_runner(workdir: Path, capacity: int, threads: int, source: Path = MODEL.parent, prompt: int = PROMPT):
    """A function timing onnxruntime-genai's decode steps (after a prompt of ``prompt``
    tokens) on a copy of the ``source`` folder's configuration (its model files linked, not
    copied) (None where onnxruntime-genai is not installed)."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    folder = workdir
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and not (folder / item.name).exists():
            (folder / item.name).symlink_to(item.resolve())
    (folder / "genai_config.json").unlink()
    config = json.loads((source / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    (folder / "genai_config.json").write_text(json.dumps(config))
    model = og.Model(str(folder))

    def run(steps: int) -> float:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=capacity, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens([list(range(1, prompt + 1))])
        generator.generate_next_token()
        started = time.perf_counter()
        for _ in range(steps):
            generator.generate_next_token()
            generator.get_next_tokens()
        return (time.perf_counter() - started) / steps
    return run


def run_alone(name: str, work: Path, capacity: int, steps: int, model: Path = MODEL) -> dict:
    """Seconds per step of one runner (a warm-up run first), and the threads it used."""
    from meshplan.plan_format import read_plan
    from meshplan.runtime.job import Job

    plan_dir = work / "plan"
    job = Job(plan_dir, "cpu", cache_in_place=True)
    threads = job.threads.threads
    if name in ("onnxruntime", "model"):
        job.close()
        program = plan_dir / read_plan(plan_dir).programs[0].file if name == "onnxruntime" else model
        run = lambda: onnxruntime_steps(program, capacity, steps, threads)   # noqa: E731
    elif name == "job":
        run = lambda: job_steps(job, capacity, steps)   # noqa: E731
    elif name == "loop":
        run = lambda: loop_steps(job, steps)   # noqa: E731
    else:
        job.close()
        run = genai_runner(work / name, capacity, threads, model.parent)
        run = (lambda run=run: run(steps))
    run()
    return {"seconds": run(), "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--folder", type=Path, help="a builder folder [default: the 1 MB sample's]")
    parser.add_argument("--runner", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if PROMPT + args.steps >= args.capacity:
        raise SystemExit(f"--steps must stay below the capacity less the prompt ({args.capacity - PROMPT})")

    model = (args.folder / "model.onnx").resolve() if args.folder else MODEL
    if args.runner:   # one runner in a process of its own: its seconds per step
        print(json.dumps(run_alone(args.runner, Path(args.work), args.capacity, args.steps, model)))
        return
    import importlib.util
    import subprocess

    runners = ["onnxruntime", "job", "loop"] + (["genai"] if importlib.util.find_spec("onnxruntime_genai") else [])
    if args.folder:
        runners.insert(0, "model")
    times: dict[str, list[float]] = {name: [] for name in runners}
    with tempfile.TemporaryDirectory(prefix="meshplan-step-") as work:
        plan_one_device(Path(work), args.capacity, model)
        for _ in range(args.rounds):
            for name in runners:   # each in a fresh process: no other session's threads spin beside it
                done = subprocess.run([sys.executable, __file__, "--runner", name, "--work", work, "--capacity",
                                       str(args.capacity), "--steps", str(args.steps),
                                       *(["--folder", str(args.folder)] if args.folder else [])],
                                      capture_output=True, text=True, cwd=REPO)
                if done.returncode:
                    raise SystemExit(f"runner {name} failed: {done.stderr.strip()[-500:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                times[name].append(result["seconds"])
                threads = result["threads"]
    ort_times, job_times, loop_times, genai_times = (times["onnxruntime"], times["job"], times["loop"],
                                                     times.get("genai", []))
    ort_us, job_us = statistics.median(ort_times) * 1e6, statistics.median(job_times) * 1e6
    paired_us = statistics.median(j - o for j, o in zip(job_times, ort_times)) * 1e6
    print(f"1x1 decode step, {args.folder or 'builder Llama sample'}, capacity {args.capacity}, {threads} onnxruntime "
          f"thread(s), {args.rounds} rounds of {args.steps} steps (medians):")
    if "model" in times:
        print(f"  onnxruntime alone on the original model            {statistics.median(times['model']) * 1e6:8.1f} us/step")
    print(f"  onnxruntime alone (IOBinding, cache bound once)  {ort_us:8.1f} us/step")
    print(f"  meshplan Job.run                                  {job_us:8.1f} us/step")
    print(f"  meshplan's overhead                               {job_us - ort_us:8.1f} us/step (target: <= 30)")
    print(f"  median of the rounds' differences                 {paired_us:8.1f} us/step")
    loop_us = statistics.median(loop_times) * 1e6
    print(f"  meshplan generate's loop (its whole step)         {loop_us:8.1f} us/step")
    genai_us = over_genai_us = None
    if genai_times:
        genai_us = statistics.median(genai_times) * 1e6
        over_genai_us = statistics.median(m - g for m, g in zip(loop_times, genai_times)) * 1e6
        print(f"  onnxruntime-genai                                 {genai_us:8.1f} us/step")
        print(f"  the loop over onnxruntime-genai (rounds' median)  {over_genai_us:8.1f} us/step (target: <= 50)")
    elif "genai" not in times:
        print("  onnxruntime-genai                                 not installed: its runner left out")
    if args.json:
        args.json.write_text(json.dumps({"onnxruntime_us": ort_us, "job_us": job_us, "overhead_us": job_us - ort_us,
                                         "paired_overhead_us": paired_us, "loop_us": loop_us, "genai_us": genai_us,
                                         "loop_over_genai_us": over_genai_us,
                                         "rounds": args.rounds, "steps": args.steps, "capacity": args.capacity,
                                         "threads": threads}, indent=1) + "\n")


if __name__ == "__main__":
    main()
