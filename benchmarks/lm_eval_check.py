"""An evaluation harness as the client of ``meshplan serve``: lm-evaluation-harness's
``local-completions`` model pointed at the server, on two tasks defined in local files (no
data from a hub), each answer checked against onnxruntime on the model itself.

- **a log-likelihood task** (``output_type: multiple_choice``): the harness asks, per choice,
  for the prompt's own log-probabilities (``echo``, ``logprobs``, ``max_tokens`` 1) and sums
  the continuation's. Each of those sums must equal the sum of onnxruntime's log-softmax of
  the unpartitioned model's float32 logits at the same token ids (the harness's own
  tokenization of the pair) within ``--tolerance``; the harness's ``is_greedy`` is compared
  with onnxruntime's argmax too.
- **a generate_until task**: the harness asks for greedy text up to its ``until`` strings;
  each answer must equal onnxruntime's greedy continuation of the same ids (the whole
  sequence fed again at each step, no cache), decoded and cut at the first ``until`` string.

The harness is heavy (it brings torch, transformers and datasets), so it is not a
dependency of meshplan nor of its tests: run this script with a Python that has both the
harness and meshplan's own requirements, and point ``--bin`` at meshplan's environment
(where ``meshplan`` and ``mpiexec`` are; default: the repository's ``.venv/bin``):

    python -m venv /tmp/eval && /tmp/eval/bin/pip install "lm-eval[api]" onnxruntime
    /tmp/eval/bin/python benchmarks/lm_eval_check.py --mesh 1x2 [--json PATH]

Printed: per task the requests the server answered, the largest difference of a
log-likelihood from onnxruntime's, and the answers that differ; the exit status is 1 when
any check fails, 2 where the harness is not installed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing on an old green "
         "tree near the river bank and people walk home").split()
UNTIL = ["\n", "."]


def write_tasks(folder: Path, count: int, seed: int = 0) -> list[str]:
    """The two tasks' files (JSON lines and their YAML), ``count`` documents each."""
    rng = random.Random(seed)
    phrase = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "choice.jsonl", "w") as out:
        for _ in range(count):
            out.write(json.dumps({"question": phrase(4, 12), "choices": [phrase(1, 4) for _ in range(4)],
                                  "answer": rng.randrange(4)}) + "\n")
    with open(folder / "until.jsonl", "w") as out:
        for _ in range(count):
            out.write(json.dumps({"prompt": phrase(4, 12), "target": phrase(1, 3)}) + "\n")
    (folder / "meshplan_choice.yaml").write_text(f"""task: meshplan_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'choice.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
""")
    (folder / "meshplan_until.yaml").write_text(f"""task: meshplan_until
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'until.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: {json.dumps(UNTIL)}
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    return ["meshplan_choice", "meshplan_until"]


class Reference:
    """onnxruntime on the unpartitioned model, one sequence at a time from an empty cache."""

    def __init__(self, model: Path, decoder: dict):
        import onnxruntime

        self.session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        names = {i.name for i in self.session.get_inputs()}
        self.past = {}   # (batch, key/value heads, 0 positions, head size): genai_config.json's decoder
        for given in self.session.get_inputs():
            if given.name in ("input_ids", "attention_mask", "position_ids"):
                continue
            shape = (1, decoder["num_key_value_heads"], 0, decoder["head_size"])
            self.past[given.name] = np.zeros(shape, dtype=np.float16 if "float16" in given.type else np.float32)
        self.with_mask, self.with_positions = "attention_mask" in names, "position_ids" in names

    def logits(self, ids: list[int]) -> np.ndarray:
        feeds = {"input_ids": np.array([ids], dtype=np.int64), **self.past}
        if self.with_mask:
            feeds["attention_mask"] = np.ones((1, len(ids)), dtype=np.int64)
        if self.with_positions:
            feeds["position_ids"] = np.arange(len(ids), dtype=np.int64)[None, :]
        return self.session.run(["logits"], feeds)[0][0].astype(np.float64)

    def loglikelihood(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        logits = self.logits(context + continuation)
        total, greedy = 0.0, True
        for offset, token in enumerate(continuation):
            row = logits[len(context) + offset - 1]
            shifted = row - row.max()
            total += float(shifted[token] - np.log(np.exp(shifted).sum()))
            greedy = greedy and int(row.argmax()) == token
        return total, greedy

    def greedy(self, ids: list[int], tokens: int, ends: set[int]) -> list[int]:
        ids, made = list(ids), []
        for _ in range(tokens):
            token = int(self.logits(ids)[-1].argmax())
            if token in ends:
                break
            ids.append(token)
            made.append(token)
        return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=REPO / "sample_models" / "genai" / "llama_fp32",
                        help="a builder folder (model.onnx, genai_config.json, tokenizer) [default: the 1 MB "
                             "sample Llama]")
    parser.add_argument("--mesh", default="1x2")
    parser.add_argument("--bin", type=Path, default=REPO / ".venv" / "bin",
                        help="where meshplan and mpiexec are [default: the repository's .venv/bin]")
    parser.add_argument("--documents", type=int, default=12, help="documents per task")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="the largest difference of a log-likelihood from onnxruntime's")
    parser.add_argument("--workdir", type=Path, help="[default: a temporary folder]")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args()
    try:
        import lm_eval
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        from lm_eval.tasks import TaskManager
    except ImportError:
        print("lm-evaluation-harness is not installed here: pip install 'lm-eval[api]' (see --help)", file=sys.stderr)
        return 2
    import subprocess

    import serve as bench   # its Server (a process whose first lines say its address)

    bench.BIN = args.bin
    folder = args.folder.resolve()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="meshplan-lm-eval-"))
    plan = workdir / "plan"
    ranks = eval(args.mesh.replace("x", "*"))
    if not (plan / "plan.json").exists():
        policy = ["--policy", "megatron", "--max-stages", "1"] if ranks > 1 else []
        done = subprocess.run([str(args.bin / "meshplan"), "plan", str(folder / "model.onnx"), "--mesh", args.mesh,
                               "--device", "cpu", "--generate", "--batch", "4", "--max-length", "256", *policy,
                               "-o", str(plan)], capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            raise SystemExit(f"meshplan plan failed: {done.stderr.strip()}")
    tasks = write_tasks(workdir / "tasks", args.documents)
    config = json.loads((folder / "genai_config.json").read_text())   # (a builder folder's)
    ends = config.get("model", {}).get("eos_token_id", [])   # (what the server stops at)
    ends = {ends} if isinstance(ends, int) else set(ends)
    server = bench.Server([str(args.bin / "mpiexec"), "-n", str(ranks), str(args.bin / "meshplan"), "serve",
                           "--port", "0", str(plan)])
    try:
        name = next(line.split()[1] for line in server.lines if line.startswith("serving "))
        lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=name, tokenizer=str(folder),
                                 tokenizer_backend="huggingface", max_length=256, num_concurrent=4,
                                 max_retries=1)
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(
            include_path=str(workdir / "tasks")), log_samples=True)
    finally:
        server.stop()
    reference = Reference(folder / "model.onnx", config["model"]["decoder"])
    report, failed = {}, False
    choice = results["samples"]["meshplan_choice"]
    differences, greedy_differ = [], 0
    for sample in choice:
        for arguments, answer in zip(sample["arguments"], sample["resps"]):
            context, continuation = _pair(arguments)
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ll, greedy = reference.loglikelihood(context_ids, continuation_ids)
            served_ll, served_greedy = _answer(answer)
            differences.append(abs(served_ll - ll))
            greedy_differ += int(bool(served_greedy) != greedy)
    report["meshplan_choice"] = {"requests": len(differences), "largest_difference": max(differences),
                                 "greedy_differ": greedy_differ, "acc": results["results"]["meshplan_choice"].get(
                                     "acc,none")}
    failed |= max(differences) > args.tolerance or greedy_differ > 0
    until = results["samples"]["meshplan_until"]
    texts_differ, characters = 0, 0
    for sample in until:
        context = _pair(sample["arguments"][0])[0]
        made = reference.greedy(lm.tok_encode(context), 16, ends)
        text = lm.tokenizer.decode(made, skip_special_tokens=True)
        for stop in UNTIL:
            text = text.split(stop)[0]
        texts_differ += int(_answer(sample["resps"][0]) != text)
        characters += len(text)
    report["meshplan_until"] = {"requests": len(until), "texts_differ": texts_differ, "characters": characters}
    failed |= texts_differ > 0 or not characters   # (texts all empty would check nothing)
    for task, row in report.items():
        print(f"{task}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    print("FAILED" if failed else f"every answer equals onnxruntime's (log-likelihoods within {args.tolerance})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed else 0


def _pair(arguments) -> tuple[str, str]:
    """(context, continuation) of a sample's arguments, as the harness logs them."""
    if isinstance(arguments, dict):
        arguments = list(arguments.values())
    return arguments[0], arguments[1] if len(arguments) > 1 else ""


def _answer(response):
    """A response as the harness logs it: (log-likelihood, is_greedy) or a text, unwrapped."""
    while isinstance(response, list) and len(response) == 1:
        response = response[0]
    if isinstance(response, list) and len(response) == 2 and isinstance(response[0], (int, float)):
        return float(response[0]), response[1]
    return response


if __name__ == "__main__":
    sys.exit(main())
