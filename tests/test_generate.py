"""Generation across devices: ``meshplan plan --generate``, ``meshplan generate`` under
mpiexec, ``meshplan verify --generate``.

The builder's models (Llama with 8 query / 2 key-value heads, Qwen2 8 / 4, Phi3 8 / 8, in
float32 and int4) and the optimum and dynamo Llama exports are planned for generation on
1x2, 1x4 and 2x2 (one plan for the prefill and every decode step); greedy generation
through the resident job gives the ids of the same loop on single-device onnxruntime,
and for the builder's models the ids of onnxruntime-genai's own generator. The cache
never moves between ranks, and on 1x4 each rank holds its heads' share of it.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.generation.compare import compare_generation, plan_stepper, reference_stepper
from meshplan.generation.loop import Generation, GenerationShape, SessionStepper
from meshplan.generation.sampling import Sampler
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import generation_plan_dims, make_plan
from meshplan.runtime.sessions import StageSession, providers_for
from sample_models import SAMPLE_DIR
from tests.conftest import meshplan_command, mpiexec_path, run_cli, run_mpi_script

BUILDER = ["llama_fp32", "llama_int4", "qwen2_fp32", "qwen2_int4", "phi3_fp32", "phi3_int4"]
EXPORTS = ["llama_optimum", "llama_dynamo"]
MESHES = [(1, 2), (1, 4), (2, 2)]
MAX_LENGTH, CHUNK, NEW_TOKENS = 32, 16, 6
LONG_CONTEXT = 512   # where the exports' caches split by heads (at MAX_LENGTH the solver keeps them whole)
PROMPTS = {"builder": [[295, 277, 75, 312, 223, 311, 89]], "export": [[5, 17, 42, 7, 9, 3]]}
BATCHED = {"builder": [[295, 277, 75, 312, 223], [17, 42, 7]], "export": [[5, 17, 42, 7, 9, 3], [11, 12]]}
REPO = Path(__file__).resolve().parents[1]


def model_path(name: str) -> Path:
    return SAMPLE_DIR / "genai" / name / "model.onnx" if name in BUILDER else SAMPLE_DIR / f"{name}.onnx"


def family(name: str) -> str:
    return "builder" if name in BUILDER else "export"


def options(name: str, mesh) -> PlanOptions:
    """Builder models on 1x4 under megatron in one stage (attention split by heads, the cache
    with it, key/value heads shared by pairs where there are two); the rest automatic, with
    every device holding a stage (these samples are small enough that the automatic plan
    would run them on fewer devices: the tests are of generating across all of them)."""
    if name in BUILDER and mesh == (1, 4):
        return PlanOptions(policy="megatron", max_stages=1)
    return PlanOptions(all_devices=True)


def plan_for(name: str, mesh, out: Path, batch: int = 1, device=None):
    dims, _ = generation_plan_dims(model_path(name), batch, MAX_LENGTH, CHUNK)
    cluster = make_cluster(mesh, "cpu")
    if device is not None:
        cluster = replace(cluster, device=device(cluster.device))
    return make_plan(model_path(name), cluster, dims, out, options(name, mesh))


def reference_ids(plan, prompts, new_tokens=NEW_TOKENS) -> list[list[int]]:
    shape = GenerationShape.of_plan(plan)
    session = StageSession(plan.model["path"], providers_for("cpu"), optimization="basic")
    sequences, _ = Generation(shape, SessionStepper(shape, session.run)).run(prompts, new_tokens, Sampler())
    return [s.ids for s in sequences]


def cache_bytes(name: str, mesh) -> list[int] | None:
    """Per rank on 1x4 under megatron: the whole cache × the rank's key/value heads / all."""
    if name not in BUILDER or mesh != (1, 4):
        return None
    model = onnx.load(str(model_path(name)), load_external_data=False)
    heads = next(d.dim_value for d in model.graph.input[2].type.tensor_type.shape.dim if d.dim_value)
    total = 2 * 2 * heads * MAX_LENGTH * 16 * 4          # 2 layers, key and value, head size 16, float32
    return [total * max(1, heads // 4) // heads] * 4


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    cases = []
    for name in BUILDER + EXPORTS:
        for mesh in MESHES:
            out = root / f"{name}_{mesh[0]}x{mesh[1]}"
            plan = plan_for(name, mesh, out)
            prompts = PROMPTS[family(name)]
            cases.append({"name": f"{name} {mesh[0]}x{mesh[1]}", "plan_dir": str(out), "prompts": prompts,
                          "new_tokens": NEW_TOKENS, "expected": reference_ids(plan, prompts),
                          "cache_bytes": cache_bytes(name, mesh), "ranks": mesh[0] * mesh[1]})
    for name in ("llama_fp32", "llama_optimum"):    # two prompts of different lengths, padded
        out = root / f"{name}_batched"
        plan = plan_for(name, (1, 2), out, batch=2)
        prompts = BATCHED[family(name)]
        cases.append({"name": f"{name} 1x2 batch 2", "plan_dir": str(out), "prompts": prompts,
                      "new_tokens": NEW_TOKENS, "expected": reference_ids(plan, prompts), "ranks": 2})
        # the same with the state and activations in onnxruntime's buffers (the GPU's path)
        cases.append({**cases[-1], "name": f"{name} 1x2 batch 2 on device", "on_device": True})
        if name == "llama_fp32":   # … and crossing ranks as device buffers (a CUDA-aware MPI's path)
            cases.append({**cases[-1], "name": f"{name} 1x2 batch 2 on device, device buffers", "transfer": "device"})
    # one tensor-parallel stage, its collectives' tensors crossing ranks as device buffers
    out = root / "llama_fp32_tensor_parallel"
    dims, _ = generation_plan_dims(model_path("llama_fp32"), 1, MAX_LENGTH, CHUNK)
    plan = make_plan(model_path("llama_fp32"), make_cluster((1, 2), "cpu"), dims, out,
                     PlanOptions(policy="megatron", max_stages=1))
    prompts = PROMPTS["builder"]
    cases.append({"name": "llama_fp32 1x2 tensor parallel on device, device buffers", "plan_dir": str(out),
                  "prompts": prompts, "new_tokens": NEW_TOKENS, "expected": reference_ids(plan, prompts), "ranks": 2,
                  "on_device": True, "transfer": "device"})
    for name in EXPORTS:   # a longer context, one tensor-parallel stage: the growing cache split by heads
        out = root / f"{name}_long"
        dims, _ = generation_plan_dims(model_path(name), 1, LONG_CONTEXT, CHUNK)
        plan = make_plan(model_path(name), make_cluster((1, 2), "cpu"), dims, out,
                         PlanOptions(policy="megatron", max_stages=1))
        prompts = PROMPTS["export"]
        cases.append({"name": f"{name} 1x2 context {LONG_CONTEXT}", "plan_dir": str(out), "prompts": prompts,
                      "new_tokens": NEW_TOKENS, "expected": reference_ids(plan, prompts), "ranks": 2,
                      "split_cache": True})
    return cases


def test_plans_for_generation_split_the_cache_by_heads(planned):
    """One plan for prefill and decode; on 1x4 the builder's cache is state held by heads
    (2 key/value heads: by pairs, the segments recorded), and each rank's program holds its
    heads' share."""
    from meshplan.emit.kv_cache import kv_cache_bytes
    from meshplan.plan_format import read_plan

    assert len(planned) == len(BUILDER + EXPORTS) * len(MESHES) + 6 + len(EXPORTS)
    for case in planned:
        plan = read_plan(Path(case["plan_dir"]))
        assert plan.is_ranged and len(plan.state) == 4
        if case.get("split_cache"):   # an export's growing cache, by heads on both ranks
            assert all(entry["spec"] == "RS1RR" for entry in plan.state), (case["name"], plan.state)
        if case.get("cache_bytes") is None:
            continue
        assert all(entry["spec"] == "RS1RR" for entry in plan.state), (case["name"], plan.state)
        heads = 2 if "llama" in case["name"] else 4 if "qwen2" in case["name"] else 8
        assert all(("segments" in entry) == (heads < 4) for entry in plan.state), plan.state
        assert list(kv_cache_bytes(plan, case["plan_dir"]).values()) == case["cache_bytes"], case["name"]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_generate_under_mpiexec_gives_onnxruntime_ids(planned, ranks, tmp_path):
    entries = [case for case in planned if case["ranks"] == ranks]
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(entries))
    lines = run_mpi_script("generate_tokens_case.py", ranks=ranks, timeout=900, args=[manifest])
    assert len(lines) == sum(3 + (e.get("cache_bytes") is not None) + (e.get("transfer") == "device") for e in entries)
    assert sum("key/value cache bytes per rank" in line for line in lines) == (6 if ranks == 4 else 0)
    builder = sum(1 for e in entries if e["name"].split()[0] in BUILDER)
    assert sum("updated in place" in line for line in lines) == builder > 0


def test_builder_models_match_onnxruntime_genai(planned):
    """onnxruntime-genai's own generator (greedy, the same prompt) gives the ids the plans gave."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is a test dependency from Python 3.11")
    for name in BUILDER:
        model = og.Model(str(model_path(name).parent))
        params = og.GeneratorParams(model)
        prompt = PROMPTS["builder"][0]
        params.set_search_options(max_length=len(prompt) + NEW_TOKENS, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens([prompt])
        ids = []
        while not generator.is_done():
            generator.generate_next_token()
            ids.append(int(generator.get_next_tokens()[0]))
        expected = next(c["expected"] for c in planned if c["name"] == f"{name} 1x2")
        assert [ids] == expected, (name, ids, expected)


def test_verify_generate_compares_each_step(planned, tmp_path):
    case = next(c for c in planned if c["name"] == "llama_int4 1x4")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(case["prompts"]))
    done = run_cli("verify", "--generate", case["plan_dir"], "--prompt-ids", prompts, "--max-new-tokens", 4)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("same greedy ids") == 4 and "PASSED" in done.stdout
    # with text through the model folder's tokenizer, batched prompts of different lengths
    batched = next(c for c in planned if c["name"] == "llama_fp32 1x2 batch 2")
    done = run_cli("verify", "--generate", batched["plan_dir"], "--prompt", "the quick brown fox", "--prompt",
                   "each device", "--max-new-tokens", 3)
    assert done.returncode == 0 and "PASSED" in done.stdout, done.stdout + done.stderr


def test_verify_generate_finds_a_wrong_plan(planned, tmp_path):
    """A stepper whose logits are off gives a failing comparison at the first step."""
    from meshplan.plan_format import read_plan

    case = next(c for c in planned if c["name"] == "llama_optimum 1x2")
    plan = read_plan(Path(case["plan_dir"]))
    shape = GenerationShape.of_plan(plan)
    good = plan_stepper(plan, case["plan_dir"], shape)

    class Off:
        def reset(self):
            good.reset()

        def step(self, feeds, last):
            window = good.step(feeds, last).copy()
            window[..., 3] += 100.0
            return window

    result = compare_generation(shape, reference_stepper(plan, shape), Off(), case["prompts"], 3)
    assert not result.ok and result.first_difference == 0 and result.worst >= 99


@pytest.mark.mpi
def test_generate_command(planned, tmp_path):
    """``meshplan generate`` with text through the tokenizer: streams, writes the JSON, and
    its ids are onnxruntime's."""
    case = next(c for c in planned if c["name"] == "qwen2_int4 1x2")
    out = tmp_path / "out.json"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path("qwen2_int4").parent / "tokenizer.json"))
    text = "grouped query attention shares"
    prompt = tokenizer.encode(text).ids
    from meshplan.plan_format import read_plan

    expected = reference_ids(read_plan(Path(case["plan_dir"])), [prompt], 5)
    command = [mpiexec_path(), "-n", "2", *meshplan_command(), "generate", case["plan_dir"], "--prompt", text,
               "--max-new-tokens", "5", "--eos", "999", "--output", str(out), "--no-cuda-graph"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    body = json.loads(out.read_text())
    assert body["sequences"][0]["prompt_ids"] == prompt and [body["sequences"][0]["ids"]] == expected
    assert body["sequences"][0]["text"] == tokenizer.decode(expected[0], skip_special_tokens=True)
    metrics = body["metrics"]
    assert metrics["generated_tokens"] == 5 and metrics["decode_steps"] == 4 and len(metrics["ranks"]) == 2
    assert all(r["weight_bytes"] > 0 and r["kv_cache_bytes"] > 0 for r in metrics["ranks"])
    # the load (programs and a warm-up call) apart from the first token; the plan's estimate
    assert metrics["load_seconds"] > metrics["ttft_seconds"] > 0 and metrics["estimate_step_seconds"] > 0
    assert all(r["threads"] >= 1 and r["threads_why"] and isinstance(r["one_pool"], bool) for r in metrics["ranks"])
    assert "cuda_graphs" not in metrics and "CUDA graphs" not in done.stdout   # the CPU provider: none
    for word in ("TTFT", "per output token", "rank 0: weights", "rank 1: weights", "key/value cache",
                 "ms per step (the plan's", "load ", "onnxruntime thread(s)"):
        assert word in done.stdout, done.stdout


@pytest.mark.parametrize("name", ["llama_fp32", "qwen2_fp32", "phi3_fp32"])
def test_text_stream_pieces_make_the_decoded_text(name):
    """Streamed text, a few tokens at a time: the pieces put together are the whole
    sequence's decoded text (multi-byte characters split over tokens and random ids
    included), and each step decodes a window of a few tokens, not the sequence."""
    from tokenizers import Tokenizer

    from meshplan.generation.driver import TextStream

    tokenizer = Tokenizer.from_file(str(SAMPLE_DIR / "genai" / name / "tokenizer.json"))
    rng = np.random.default_rng(1)
    texts = ["grouped query attention shares keys, values: wörld 日本語 ünïcode!" * 3]
    sequences = [tokenizer.encode(t).ids for t in texts]
    sequences += [rng.integers(0, tokenizer.get_vocab_size(), int(rng.integers(1, 60))).tolist() for _ in range(30)]
    for ids in sequences:
        stream, pieces, k, widest = TextStream(tokenizer), [], 0, 0
        while k < len(ids):
            step = int(rng.integers(1, 3))
            pieces.append(stream.add(ids[k:k + step]))
            widest = max(widest, stream.count - stream.prefix)
            k += step
        pieces.append(stream.finish())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        if ids == sequences[0]:
            assert len(ids) > 40 and widest <= 16


def test_sampler():
    logits = np.array([[0.1, 3.0, 2.9, -1.0], [5.0, 5.0, 1.0, 0.0]])
    assert Sampler()(logits).tolist() == [1, 0]                       # greedy: the first of a tie
    assert Sampler(temperature=1.0, top_k=1, seed=3)(logits).tolist() == [1, 0]
    assert Sampler(temperature=1.0, top_p=1e-6, seed=3)(logits).tolist() == [1, 0]
    a = [Sampler(temperature=2.0, seed=7)(logits).tolist() for _ in range(2)]
    assert a[0] == a[1]                                                # seeded: reproducible
    drawn = {tuple(Sampler(temperature=5.0, seed=s)(logits).tolist()) for s in range(40)}
    assert len(drawn) > 1                                               # and it does sample
    with pytest.raises(Exception):
        Sampler(temperature=-1)
    # float16 logits (chosen from their bits): numpy's choice on the same values, ties (-0 and
    # +0 too), all-negative rows, infinities and NaN (the first NaN) included
    rng = np.random.default_rng(1)
    half = rng.standard_normal((8, 32000)).astype(np.float16)
    half[2, [5, 9]] = half[2].max() + 1
    half[3] = -np.abs(half[3])
    half[4] = -np.abs(half[4]) - 1
    half[4, [3, 7]] = [-0.0, 0.0]   # equal: the first
    half[5, [11, 12]] = np.nan
    half[6] = -np.inf
    half[7, 100] = np.inf
    want = half.astype(np.float64).argmax(axis=-1).tolist()
    assert Sampler()(half).tolist() == want and want[2] == 5 and want[4] == 3 and want[5] == 11
    assert Sampler()(half[:5]).tolist() == want[:5]   # without a NaN: the bits' own path


def test_end_tokens_stop_each_sequence(planned):
    """A sequence stops at its end token; the other goes on (the ids after the end are the
    ones greedy generation gives without it)."""
    from meshplan.plan_format import read_plan

    case = next(c for c in planned if c["name"] == "llama_optimum 1x2 batch 2")
    plan = read_plan(Path(case["plan_dir"]))
    shape = GenerationShape.of_plan(plan)
    full = case["expected"]
    stop = full[0][2]
    stepper = plan_stepper(plan, case["plan_dir"], shape)
    sequences, metrics = Generation(shape, stepper).run(case["prompts"], NEW_TOKENS, Sampler(), [stop])
    assert sequences[0].ids == full[0][:full[0].index(stop) + 1] and sequences[0].done
    second = full[1][:full[1].index(stop) + 1] if stop in full[1] else full[1]
    assert sequences[1].ids == second
    assert metrics.generated_tokens == len(sequences[0].ids) + len(sequences[1].ids)


@pytest.mark.parametrize("name", ["llama_fp32", "llama_optimum"])
def test_batched_prompts_generate_what_each_prompt_alone_does(planned, name):
    """Prompts of different lengths in one batch (padded on the right in the builder's
    shared buffer, on the left in a growing cache) give each prompt's own greedy ids, on
    onnxruntime and on the plan; the builder's plan reads as a shared buffer whose capacity
    is the context."""
    from meshplan.plan_format import read_plan

    case = next(c for c in planned if c["name"] == f"{name} 1x2 batch 2")
    plan = read_plan(Path(case["plan_dir"]))
    shape = GenerationShape.of_plan(plan)
    assert shape.shared == (name in BUILDER)
    assert shape.context == (MAX_LENGTH if name in BUILDER else shape.context)
    alone = [reference_ids(plan, [prompt])[0] for prompt in case["prompts"]]
    assert case["expected"] == alone
    sequences, _ = Generation(shape, plan_stepper(plan, case["plan_dir"], shape)).run(case["prompts"], NEW_TOKENS,
                                                                                     Sampler())
    assert [s.ids for s in sequences] == alone


@pytest.mark.parametrize("name", EXPORTS)
def test_export_cache_never_moves_under_megatron(name, tmp_path):
    """An export's attention reads the cache it has just grown (through Shape, in the
    optimum export: repeat_kv's target shape): on 1x2 under megatron no collective touches
    the cache, the solver's estimate carries no move of it (each would cost a second), and
    the plan generates onnxruntime's ids. (Whether the cache is split is the solver's
    choice at these sizes; that a Shape may read it split is ``test_ranges``'.)"""
    dims, _ = generation_plan_dims(model_path(name), 1, MAX_LENGTH, CHUNK)
    plan = make_plan(model_path(name), make_cluster((1, 2), "cpu"), dims, tmp_path / "plan",
                     PlanOptions(policy="megatron", max_stages=1))
    assert len(plan.state) == 4
    state = {entry["input"] for entry in plan.state} | {entry["output"] for entry in plan.state}
    assert not [c for stage in plan.stages for c in stage.collectives if c["tensor"] in state]
    assert plan.estimate["latency_seconds"] < 0.1      # no state moved (each move costs a second)
    shape = GenerationShape.of_plan(plan)
    prompts = PROMPTS["export"]
    sequences, _ = Generation(shape, plan_stepper(plan, tmp_path / "plan", shape)).run(prompts, NEW_TOKENS, Sampler())
    assert [s.ids for s in sequences] == reference_ids(plan, prompts)


def _one_line(done: subprocess.CompletedProcess, text: str) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stdout + done.stderr
    assert lines and lines[-1].startswith("meshplan: error:") and text in lines[-1], done.stderr
    assert "Traceback" not in done.stderr


def test_bad_input_is_one_line(planned, tmp_path):
    """A prompt longer than the context, a token id outside the vocabulary, --prompt without
    a tokenizer, a plan of a model without a key/value cache, --generate on such a model."""
    single = tmp_path / "single"
    plan_for("llama_optimum", (1, 1), single)
    builder = tmp_path / "builder"
    plan_for("llama_fp32", (1, 1), builder)
    ids = tmp_path / "ids.json"

    def generate(plan_dir, *args):
        return subprocess.run([mpiexec_path(), "-n", "1", *meshplan_command(), "generate", str(plan_dir), *map(str, args)],
                              capture_output=True, text=True, timeout=300, cwd=REPO)

    ids.write_text(json.dumps([list(range(1, MAX_LENGTH + 1))]))
    _one_line(generate(single, "--prompt-ids", ids), "the context holds 32")
    ids.write_text(json.dumps([[5, 300, 7]]))
    _one_line(generate(single, "--prompt-ids", ids), "token id 300, outside the vocabulary")
    _one_line(generate(single, "--prompt", "hello"), "no tokenizer beside the model")
    ids.write_text(json.dumps([[5, 6]]))
    _one_line(generate(builder, "--prompt-ids", ids, "--tokenizer", tmp_path), "no tokenizer.json in")
    gpt = tmp_path / "gpt"
    make_plan(SAMPLE_DIR / "gpt.onnx", make_cluster((1, 1), "cpu"), {"batch": 1, "seq": 8}, gpt)
    _one_line(generate(gpt, "--prompt-ids", ids), "no key/value cache")
    done = run_cli("plan", SAMPLE_DIR / "gpt.onnx", "--mesh", "1x2", "--generate", "--max-length", 16,
                   "-o", tmp_path / "nope")
    _one_line(done, "no key/value cache")
    assert not (tmp_path / "nope").exists()
    done = run_cli("plan", model_path("llama_optimum"), "--mesh", "1x2", "--generate", "-o", tmp_path / "nope")
    _one_line(done, "no context length")


@pytest.mark.parametrize("name, policy", [("llama_fp32", "auto"), ("qwen2_fp32", "megatron")])
def test_devices_holding_forty_percent_generate(name, policy, tmp_path):
    """Devices that hold 40% of the weights plus the cache at its longest (1024 positions):
    the plan fits, no rank holds more than 60% of them, and the tokens are onnxruntime's."""
    from meshplan.plan_format import read_plan

    model = onnx.load(str(model_path(name)), load_external_data=False)
    weights = sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                  for t in model.graph.initializer)
    heads = next(d.dim_value for d in model.graph.input[2].type.tensor_type.shape.dim if d.dim_value)
    cache = 2 * 2 * heads * 1024 * 16 * 4
    limit = 0.4 * (weights + cache)
    dims, _ = generation_plan_dims(model_path(name), 1, 1024, CHUNK)
    cluster = make_cluster((1, 4), "cpu")
    cluster = replace(cluster, device=replace(cluster.device, memory_bytes=limit))
    plan = make_plan(model_path(name), cluster, dims, tmp_path / "plan", PlanOptions(policy=policy))
    assert all(stage.memory_bytes <= limit for stage in plan.stages)
    assert max(stage.memory_bytes for stage in plan.stages) <= 0.6 * (weights + cache)
    assert all(entry["spec"] != "RRRR" for entry in plan.state if len(plan.stages[entry["stage"]].devices) > 1)
    plan = read_plan(tmp_path / "plan")
    shape = GenerationShape.of_plan(plan)
    prompts = PROMPTS["builder"]
    sequences, _ = Generation(shape, plan_stepper(plan, tmp_path / "plan", shape)).run(prompts, NEW_TOKENS, Sampler())
    assert [s.ids for s in sequences] == reference_ids(plan, prompts)


class _ScriptedStepper:
    """A stepper whose logits choose, for each row, the next id of its script; records what
    each call was fed."""

    def __init__(self, scripts, vocab=16):
        self.scripts, self.vocab, self.fed, self.calls = scripts, vocab, [], 0

    def reset(self):
        self.fed, self.calls = [], 0

    def step(self, feeds, last):
        self.fed.append((feeds["input_ids"].copy(), feeds["attention_mask"].copy()))
        logits = np.zeros((len(self.scripts), last, self.vocab), np.float32)
        for row, script in enumerate(self.scripts):
            logits[row, :, script[min(self.calls, len(script) - 1)]] = 1
        self.calls += 1
        return logits


def test_a_row_that_ended_feeds_its_last_id_while_the_others_go_on():
    """Two prompts on a static mask: the first ends (its eos) at its second id and from then
    on feeds that id again, its mask still growing; the second goes on to the last step;
    every step's time is kept."""
    shape = GenerationShape("input_ids", "attention_mask", None, {"present": "past"}, True, (2, 2), 8, 12, 16,
                            {"past": [2, 1, 12, 4]}, {"past": "float32"})
    stepper = _ScriptedStepper([[3, 9, 4, 4, 4], [5, 6, 7, 8, 2]])
    sequences, metrics = Generation(shape, stepper).run([[1, 1, 1], [1, 1]], 5, Sampler(), eos_ids=[9])
    assert sequences[0].ids == [3, 9] and sequences[0].done
    assert sequences[1].ids == [5, 6, 7, 8, 2] and not sequences[1].done
    fed = [ids[:, 0].tolist() for ids, _ in stepper.fed[1:]]
    assert fed == [[3, 5], [9, 6], [9, 7], [9, 8]]
    masks = [mask.sum(axis=1).tolist() for _, mask in stepper.fed[1:]]
    assert masks == [[4, 3], [5, 4], [6, 5], [7, 6]]
    assert len(metrics.decode_seconds) == 4 and all(t > 0 for t in metrics.decode_seconds)
    assert metrics.generated_tokens == 7


def test_the_warm_up_decodes_until_a_cuda_graph_is_captured():
    from types import SimpleNamespace

    from meshplan.generation.driver import GRAPH_WARM_UP_STEPS, warm_up_steps
    from meshplan.providers import CPU, CUDA

    # a decode step gets its graph id at its 2nd run, onnxruntime captures an id at its 3rd run
    assert GRAPH_WARM_UP_STEPS >= 1 + 3
    assert warm_up_steps(SimpleNamespace(provider=CUDA), graphs=True) == GRAPH_WARM_UP_STEPS
    assert warm_up_steps(SimpleNamespace(provider=CUDA), graphs=False) == 1
    assert warm_up_steps(SimpleNamespace(provider=CPU), graphs=True) == 1
