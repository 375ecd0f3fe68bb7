"""``meshplan serve`` under mpiexec, with the openai client on a loopback port.

A 1x2 tensor-parallel plan of the sample builder Llama (batch 4, a shared key/value buffer
split by heads): completions and chat, whole and streamed, give the ids of ``meshplan
generate``; requests that arrive
at different times share the model's calls; bad requests get OpenAI-style 400s and leave
no slot taken; a client that goes away frees its slot; a full queue answers 429 with
Retry-After; SIGTERM lets what runs finish and exits 0; a rank that dies ends the job
with an error for the request in flight. Hostile bodies (NaN and infinities, lone
surrogates, wrong JSON types, numbers too large) get a 400 naming the field on a
connection that stays usable, and the server goes on; a draw that fails inside the engine
answers every request in flight and waiting with an error, then ends every rank within
seconds, exit 1; SIGTERM while the job starts ends every rank. A growing-cache export
(optimum) serves requests together, each with its own ids.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from meshplan.generation.driver import load_tokenizer
from sample_models import SAMPLE_DIR
from tests.conftest import run_cli, run_mpi, run_mpi_script
from tests.jobs import left_after, marked
from tests.serving import Served

pytestmark = [pytest.mark.mpi, pytest.mark.serial]

LLAMA = SAMPLE_DIR / "genai" / "llama_fp32"
MODEL = "llama_fp32"
PROMPT = "the quick brown fox"


def plan(tmp_path_factory, name: str, model, *args):
    out = tmp_path_factory.mktemp(name)
    # a context of 1024: a request of 1000 tokens holds its slot for a while (the tests that
    # need one running do not race its end)
    done = run_cli("plan", model, "--mesh", "1x2", "--generate", "--max-length", "1024", "--prefill-chunk", "16",
                   "--policy", "megatron", "--max-stages", "1", "-o", out, *args)   # heads and cache on both ranks
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def batch4(llama_batch4):
    return llama_batch4   # (``plan``'s, with --batch 4: shared with test_job_failures)


@pytest.fixture(scope="module")
def batch1(tmp_path_factory):
    return plan(tmp_path_factory, "batch1", LLAMA / "model.onnx")


@pytest.fixture(scope="module")
def server(batch4):
    with Served(batch4, 2) as served:
        yield served


def post(url: str, body, raw: bytes | None = None):
    """(status, JSON body, headers) of a POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def generate_ids(plan_dir, prompt: str, tokens: int, tmp_path) -> list[int]:
    out = tmp_path / "generated.json"
    done = run_mpi(2, "generate", plan_dir, "--prompt", prompt, "--max-new-tokens", tokens, "--output", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())["sequences"][0]["ids"]


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    assert server.metric("meshplan_batch_slots") == 4
    for rank in (0, 1):
        assert server.metric("meshplan_rank_weight_bytes", f'{{rank="{rank}"}}') > 0
        assert server.metric("meshplan_rank_kv_cache_bytes", f'{{rank="{rank}"}}') > 0
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    for name in ("meshplan_requests_running", "meshplan_requests_waiting", "meshplan_time_to_first_token_seconds_bucket",
                 "meshplan_time_per_output_token_seconds_bucket", "meshplan_output_tokens_per_second"):
        assert name in text


def test_completion_gives_the_ids_of_meshplan_generate(server, batch4, tmp_path):
    expected = generate_ids(batch4, PROMPT, 12, tmp_path)
    whole = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.model_extra["token_ids"] == expected
    tokenizer = load_tokenizer(LLAMA)
    assert choice.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(PROMPT).ids)
    assert whole.usage.completion_tokens == 12 and choice.finish_reason == "length"
    # the same streamed, with the usage chunk last
    chunks = list(server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    ids = [i for c in chunks if c.choices for i in c.choices[0].model_extra["token_ids"]]
    assert ids == expected
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"
    # token ids as the prompt
    by_ids = server.client().completions.create(model=MODEL, prompt=tokenizer.encode(PROMPT).ids, max_tokens=12,
                                                temperature=0)
    assert by_ids.choices[0].model_extra["token_ids"] == expected


def test_chat_renders_the_folders_template(server):
    from meshplan.serving.chat import ChatTemplate

    messages = [{"role": "user", "content": "a small model speaks"}]
    reply = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    rendered = ChatTemplate.of_folder(LLAMA).render(messages)
    assert rendered == "<s><|user|>a small model speaks</s><|assistant|>"
    ids = load_tokenizer(LLAMA).encode(rendered, add_special_tokens=False).ids
    assert reply.usage.prompt_tokens == len(ids)
    same = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert reply.choices[0].model_extra["token_ids"] == same.choices[0].model_extra["token_ids"]
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == same.choices[0].text
    streamed = list(server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                            temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == reply.choices[0].message.content


def test_stop_strings_and_end_tokens(server):
    whole = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    text = whole.choices[0].text
    cut = next(i for i in range(3, len(text)) if text[i - 2:i].strip())   # a stop string inside the text
    stop = text[cut - 2:cut]
    stopped = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.find(stop)]


def test_ignore_eos_goes_on_past_the_end_token(server):
    ended = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0)
    ids = ended.choices[0].model_extra["token_ids"]
    assert ended.choices[0].finish_reason == "stop" and ids[-1] == 1 and len(ids) < 1000   # the sample's end token
    on = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert on.choices[0].finish_reason == "length"
    assert on.choices[0].model_extra["token_ids"][:len(ids)] == ids and on.usage.completion_tokens == 1000


def test_sampling_is_seeded(server):
    def sample(seed):
        return server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0,
                                                  top_p=0.9, seed=seed, extra_body={"top_k": 40}
                                                  ).choices[0].model_extra["token_ids"]
    assert sample(7) == sample(7)
    assert len({tuple(sample(s)) for s in range(6)}) > 1



# --- log-probabilities, echo, penalties: numbers checked against onnxruntime on the model ---------

TOLERANCE = 2e-4   # float32 logits summed over two ranks' heads, a log-softmax in float64


@pytest.fixture(scope="module")
def reference():
    """The log-softmax (float64) of onnxruntime's float32 logits at every position of a
    sequence fed whole, the original model in one process, the cache empty."""
    import numpy as np
    import onnxruntime

    def log_softmax(row):
        values = row.astype(np.float64) - row.max()
        return values - np.log(np.exp(values).sum())

    session = onnxruntime.InferenceSession(str(LLAMA / "model.onnx"), providers=["CPUExecutionProvider"])
    past = {i.name: np.zeros((1, 2, 0, 16), dtype=np.float32) for i in session.get_inputs()
            if i.name.startswith("past_key_values")}

    def logits(ids: list[int]):
        feeds = {"input_ids": np.array([ids], dtype=np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
                 **past}
        return session.run(["logits"], feeds)[0][0]

    def logprobs(ids: list[int]):
        return np.stack([log_softmax(row) for row in logits(ids)])
    logprobs.logits = logits
    return logprobs


def test_logprobs_are_a_log_softmax_of_onnxruntimes_logits(server, reference):
    tokenizer = load_tokenizer(LLAMA)
    prompt = tokenizer.encode(PROMPT).ids
    whole = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5)
    choice = whole.choices[0]
    ids = choice.model_extra["token_ids"]
    expected = reference(prompt + ids[:-1])[len(prompt) - 1:]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) == 8
    for step, token in enumerate(ids):
        assert abs(logprobs.token_logprobs[step] - expected[step][token]) < TOLERANCE
        top = sorted(range(len(expected[step])), key=lambda i: -expected[step][i])[:5]
        assert logprobs.tokens[step] == tokenizer.decode([token], skip_special_tokens=False)
        # (a dict by token text, as OpenAI's: ids of the same text take one key, the less likely's value)
        wanted = {tokenizer.decode([i], skip_special_tokens=False): expected[step][i] for i in top}
        assert logprobs.top_logprobs[step].keys() == wanted.keys()
        assert all(abs(logprobs.top_logprobs[step][k] - v) < TOLERANCE for k, v in wanted.items())
        assert token == top[0]   # greedy: the most likely
    offsets = [0]
    for name in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(name))
    assert logprobs.text_offset == offsets
    # streamed: the same per chunk
    chunks = list(server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                     logprobs=5, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=1e-6)   # (a reused prefix: float32 rounding)
    # sampled: the chosen token's logprob is still the model's (no temperature in it)
    sampled = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.5, seed=3,
                                                 logprobs=0).choices[0]
    ids = sampled.model_extra["token_ids"]
    expected = reference(prompt + ids[:-1])[len(prompt) - 1:]
    assert all(abs(value - expected[step][token]) < TOLERANCE
               for step, (value, token) in enumerate(zip(sampled.logprobs.token_logprobs, ids)))
    assert all(top == {} for top in sampled.logprobs.top_logprobs)


def test_chat_logprobs_in_openais_chat_format(server, reference):
    messages = [{"role": "user", "content": "a small model speaks"}]
    reply = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                    logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    ids = choice.model_extra["token_ids"]
    from meshplan.serving.chat import ChatTemplate
    prompt = load_tokenizer(LLAMA).encode(ChatTemplate.of_folder(LLAMA).render(messages), add_special_tokens=False).ids
    expected = reference(prompt + ids[:-1])[len(prompt) - 1:]
    content = choice.logprobs.content
    assert len(content) == len(ids)
    for step, (entry, token) in enumerate(zip(content, ids)):
        assert abs(entry.logprob - expected[step][token]) < TOLERANCE
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    streamed = list(server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                            temperature=0, logprobs=True, top_logprobs=3, stream=True))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # (the streamed request reuses the cache positions the first one left: equal up to float32 rounding)
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-6)
    plain = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_scores_the_prompt_as_a_log_likelihood_request(server, reference):
    tokenizer = load_tokenizer(LLAMA)
    context, continuation = "the quick brown", " fox jumps over the lazy dog"
    ids = tokenizer.encode(context + continuation).ids
    start = len(tokenizer.encode(context).ids)
    scored = server.client().completions.create(model=MODEL, prompt=context + continuation, max_tokens=0, echo=True,
                                                logprobs=1, temperature=0).choices[0]
    assert scored.text == context + continuation and scored.model_extra["token_ids"] == []
    logprobs = scored.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.tokens) == len(ids)
    expected = reference(ids)
    for position in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[position] - expected[position - 1][ids[position]]) < TOLERANCE
    # what an evaluation harness sums: the continuation's log-likelihood
    total = sum(logprobs.token_logprobs[start:])
    assert abs(total - sum(expected[p - 1][ids[p]] for p in range(start, len(ids)))) < TOLERANCE * len(ids)
    # a prompt longer than one call (16 positions) and given as ids, echoed with new tokens, streamed
    long_ids = (ids * 3)[:40]
    chunks = list(server.client().completions.create(model=MODEL, prompt=long_ids, max_tokens=3, echo=True,
                                                     logprobs=2, temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == tokenizer.decode(long_ids, skip_special_tokens=False)
    values = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    new = [i for c in chunks if c.choices for i in c.choices[0].model_extra["token_ids"]]
    expected = reference(long_ids + new[:-1])
    assert len(values) == len(long_ids) + 3 and values[0] is None
    sequence = long_ids + new
    assert all(abs(values[p] - expected[p - 1][sequence[p]]) < TOLERANCE for p in range(1, len(sequence)))
    # echo without logprobs: the text only
    plain = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True, temperature=0)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_penalties_and_biases_replayed_on_onnxruntimes_logits(server, reference):
    import numpy as np

    tokenizer = load_tokenizer(LLAMA)
    prompt = tokenizer.encode(PROMPT).ids
    options = {"presence_penalty": 0.7, "frequency_penalty": 1.3, "repetition_penalty": 1.8,
               "logit_bias": {"42": 3.5, "7": -2.0}}
    ids = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                             extra_body=options).choices[0].model_extra["token_ids"]
    plain = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0
                                               ).choices[0].model_extra["token_ids"]
    assert ids != plain
    logits = reference.logits(prompt + ids[:-1])[len(prompt) - 1:].astype(np.float64)
    for step, token in enumerate(ids):
        values = logits[step].copy()
        seen = sorted(set(prompt + ids[:step]))
        values[seen] = np.where(values[seen] > 0, values[seen] / 1.8, values[seen] * 1.8)
        for i in set(ids[:step]):
            values[i] -= 1.3 * ids[:step].count(i) + 0.7
        values[42] += 3.5
        values[7] -= 2.0
        assert int(values.argmax()) == token, step
    # a bias of 100 takes every draw
    forced = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=1,
                                                extra_body={"logit_bias": {"99": 100}})
    assert forced.choices[0].model_extra["token_ids"] == [99] * 4
    # min_tokens: the end token masked until then
    ended = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0)
    short = ended.choices[0].model_extra["token_ids"]
    assert short[-1] == 1
    longer = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0,
                                                extra_body={"min_tokens": len(short) + 3})
    got = longer.choices[0].model_extra["token_ids"]
    assert len(got) >= len(short) + 3 and got[:len(short) - 1] == short[:-1] and 1 not in got[:len(short) + 2]

    # with a seed, the same request gives the same tokens
    def sample(seed):
        return server.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed, presence_penalty=1.0,
            frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2, "logit_bias": {"5": 2}, "min_tokens": 4}
        ).choices[0].model_extra["token_ids"]
    assert sample(11) == sample(11)
    assert len({tuple(sample(s)) for s in range(4)}) > 1


def test_adjustment_numerics():
    import numpy as np

    from meshplan.generation.sampling import Adjustment
    from meshplan.generation.scoring import Scores

    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0], dtype=np.float32)
    values = Adjustment(presence=0.5, frequency=0.25, repetition=2.0, bias={4: 10.0}, min_tokens=3)(
        logits, [0], [3, 3, 1], {2})
    assert values.tolist() == [1.0, -2.0 - 0.75, 0.5, 1.5 - 1.0, 8.0]   # the end id masked only under min_tokens
    assert Adjustment(min_tokens=4)(logits, [0], [3, 3, 1], {2})[2] == -np.inf
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]
    big = Scores(np.array([[1000.0, 999.0, -1000.0]]), 3)   # (no exponential overflows)
    assert np.isfinite(big.logprobs).all() and abs(np.exp(big.logprobs.astype(np.float64)).sum() - 1) < 1e-6
    token, logprob, top = Scores(np.array([[1.0, 3.0, 3.0, 0.0]], dtype=np.float16), 3).of(0, 0, 3)
    assert (token, [i for i, _ in top]) == (0, [1, 2, 0])   # the lower id first on a tie
    assert abs(logprob - (1 - (3 + np.log(2 + np.exp(-2) + np.exp(-3))))) < 1e-6


BAD = [
    ("/v1/completions", None, b"{not json", "not JSON"),
    ("/v1/completions", None, b"[1, 2]", "JSON object"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "bogus": 1}, None, "unknown field 'bogus'"),
    ("/v1/completions", {"prompt": [5, 400, 7], "max_tokens": 4}, None, "token id 400 is outside the vocabulary"),
    ("/v1/completions", {"prompt": [5] * 1024}, None, "the context holds 1024"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2000}, None, "'max_tokens' is 2000"),
    ("/v1/completions", {"prompt": PROMPT, "n": 5}, None, "'n' is 5: this server's plan has 4 batch slot(s)"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, None, "'n' must be from 1"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, None, "'max_tokens' must be from 1"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, None, "'temperature' must be from 0 to 2"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, None, "'max_tokens' must be an integer"),
    ("/v1/completions", {"max_tokens": 3}, None, "'prompt' is required"),
    ("/v1/completions", {"prompt": PROMPT, "ignore_eos": "yes"}, None, "'ignore_eos' must be true or false"),
    ("/v1/completions", {"prompt": [PROMPT, PROMPT]}, None, "one prompt per request"),
    ("/v1/chat/completions", {"messages": []}, None, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, None, "string 'content'"),
]


@pytest.mark.parametrize("path, body, raw, message", BAD, ids=[b[3] for b in BAD])
def test_bad_requests_get_a_400(server, path, body, raw, message):
    status, answer, _ = post(server.url + path, body, raw)
    assert status == 400, answer
    assert message in answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
    assert server.metric("meshplan_requests_running") == 0 and server.metric("meshplan_requests_waiting") == 0


# what a hostile client sent (issue: a NaN temperature killed the server), each with the
# field its 400 names (None: the body as a whole)
HOSTILE = [
    ("/v1/completions", b'{"model": "llama_fp32", "prompt": "hi", "max_tokens": 2, "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1, "top_p": NaN}', "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', "top_p"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "hi"}', "model"),
    ("/v1/completions", b'{"prompt": "a \\udfff"}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "stream": {"a": 1}}', "stream"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1, "seed": -1}', "seed"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 1e400}', "seed"),
    ("/v1/completions", b'{"prompt": "hi", "top_k": 99999999999999999999}', "top_k"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    ("/v1/completions", b'{"prompt": "hi", "model": 7}', "model"),
    ("/v1/completions", b'{"prompt": "hi", "n": true}', "n"),
    ("/v1/completions", b'{"prompt": [-1]}', "prompt"),
    ("/v1/completions", b"[" * 100_000, None),
    ("/v1/completions", b'\xff\xfe{"prompt"', None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": NaN}',
     "max_completion_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 21}', "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": true}', "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "top_logprobs": 2}', "top_logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "echo": 1}', "echo"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', "top_logprobs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
                             b'"top_logprobs": 21}', "top_logprobs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}', "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": 101}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"320": 1}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"-1": 1}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": [1]}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "presence_penalty": 2.5}', "presence_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "frequency_penalty": NaN}', "frequency_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "repetition_penalty": 0}', "repetition_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 3, "min_tokens": 4}', "min_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "min_tokens": -1}', "min_tokens"),
]


def test_hostile_bodies_get_a_400_naming_the_field_and_the_server_goes_on(server):
    """One keep-alive connection for all of them: none may end it."""
    address = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    for path, raw, param in HOSTILE:
        connection.request("POST", path, raw, {"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 400, (raw[:80], answer)
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param, \
            (raw[:80], answer)
    # a tiny temperature samples (it made every probability NaN)
    connection.request("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 3, "temperature": 1e-320}',
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and len(json.loads(response.read())["choices"][0]["token_ids"]) == 3
    assert server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert server.metric("meshplan_requests_running") == 0 and server.process.poll() is None


def test_another_model_is_a_404_and_the_client_says_so(server):
    import openai

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"best": 1})
    assert server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_requests_arriving_at_different_times_share_calls(server):
    client = server.client()
    alone = {}
    for name, prompt, tokens in (("long", PROMPT, 1000), ("short", "each device holds the heads", 8)):
        alone[name] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0
                                                ).choices[0].model_extra["token_ids"]
    assert len(alone["long"]) >= 200 and len(alone["short"]) == 8   # (before the end token, if any)

    def calls():
        return {kind: server.metric("meshplan_model_calls_total", f'{{kind="{kind}"}}')
                for kind in ("prompts", "row", "decode")}
    before = calls()
    got = {}
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0, stream=True)
    ids = []
    for chunk in stream:
        ids.extend(chunk.choices[0].model_extra["token_ids"])
        if len(ids) == 1:   # the long one runs: the short one arrives
            worker = threading.Thread(target=lambda: got.update(short=client.completions.create(
                model=MODEL, prompt="each device holds the heads", max_tokens=8, temperature=0
            ).choices[0].model_extra["token_ids"]))
            worker.start()
    worker.join(60)
    made = {kind: count - before[kind] for kind, count in calls().items()}
    assert ids == alone["long"] and got["short"] == alone["short"]
    # one after the other they need len(long) + 8 calls; together the short one's prompt goes
    # in one call of its row, then it decodes in the long one's steps (the long one's prompt:
    # one call, of every row, or of its row where it reuses the positions its run alone left)
    assert made["prompts"] + made["row"] == 2 and made["row"] >= 1, made
    assert made["decode"] == len(alone["long"]) - 1, made


def test_a_prompt_scored_while_another_request_runs(server, reference):
    """The joining request's prompt goes in by calls of its row (16 positions each): their
    logits score it as a first prompt's do."""
    tokenizer = load_tokenizer(LLAMA)
    ids = (tokenizer.encode("each device holds the heads of the model").ids * 4)[:37]
    got = {}
    stream = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=300, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    count = 0
    for chunk in stream:
        count += len(chunk.choices[0].model_extra["token_ids"]) if chunk.choices else 0
        if count == 1:
            worker = threading.Thread(target=lambda: got.update(echo=server.client().completions.create(
                model=MODEL, prompt=ids, max_tokens=2, echo=True, logprobs=3, temperature=0).choices[0]))
            worker.start()
    worker.join(60)
    choice = got["echo"]
    sequence = ids + choice.model_extra["token_ids"]
    expected = reference(sequence[:-1])
    values = choice.logprobs.token_logprobs
    assert len(values) == len(sequence) and values[0] is None
    assert all(abs(values[p] - expected[p - 1][sequence[p]]) < TOLERANCE for p in range(1, len(sequence)))


def test_a_client_that_goes_away_frees_its_slot(server):
    before = server.metric("meshplan_generation_tokens_total")
    stream = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream):
        if count == 2:
            break
    stream.response.close()
    deadline = time.monotonic() + 10
    while server.metric("meshplan_requests_running") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.metric("meshplan_requests_running") == 0
    assert server.metric("meshplan_requests_total", '{outcome="cancelled"}') >= 1
    generated = server.metric("meshplan_generation_tokens_total") - before
    assert generated < 1000, generated


def test_a_client_that_gives_up_on_a_whole_response_frees_its_slot(server):
    import openai

    before = server.metric("meshplan_generation_tokens_total")
    cancelled = server.metric("meshplan_requests_total", '{outcome="cancelled"}')
    with pytest.raises(openai.APITimeoutError):
        server.client().with_options(timeout=0.03).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000,
                                                                     extra_body={"ignore_eos": True},
                                                                     temperature=0)
    deadline = time.monotonic() + 10
    while server.metric("meshplan_requests_running") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.metric("meshplan_requests_running") == 0
    assert server.metric("meshplan_requests_total", '{outcome="cancelled"}') == cancelled + 1
    assert server.metric("meshplan_generation_tokens_total") - before < 1000


def test_full_queue_answers_429_and_sigterm_finishes_what_runs(batch1):
    import openai

    with Served(batch1, 2, "--max-queue", "1") as served:
        client = served.client()
        holder = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(holder))                     # it holds the one slot
        waited = {}

        def wait():
            try:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
            except openai.APIStatusError as exc:
                waited["status"] = exc.status_code
        waiter = threading.Thread(target=wait)
        waiter.start()
        deadline = time.monotonic() + 10
        while served.metric("meshplan_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, answer, headers = post(served.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 429 and answer["error"]["type"] == "rate_limit_error"
        assert int(headers["Retry-After"]) >= 1
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        # SIGTERM to the launcher: the running request finishes, the waiting one is refused
        os.kill(served.process.pid, signal.SIGTERM)
        rest = list(holder)
        ids = first.choices[0].model_extra["token_ids"] + [i for c in rest for i in c.choices[0].model_extra["token_ids"]]
        assert (rest[-1].choices[0].finish_reason, len(ids)) == ("length", 1000)   # it ran to its own end
        waiter.join(30)
        assert waited == {"status": 503}      # it waited, and the server stopped before its turn
        assert served.wait(60) == 0, served.output
        assert "stopped" in served.output


def test_a_rank_that_dies_ends_the_job_with_an_error(batch4):
    import openai

    with Served(batch4, 2) as served:
        stream = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0,
                                                    extra_body={"ignore_eos": True},
                                                    stream=True)
        began = time.monotonic()
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            for count, chunk in enumerate(stream):
                if count == 2:
                    os.kill(served.pids[1], signal.SIGKILL)
        assert time.monotonic() - began < 60
        assert served.wait(60) != 0
        assert time.monotonic() - began < 20, served.output
        assert not left_after(served.mark), served.output


def front_pids(mark: str) -> list[int]:
    found = []
    for pid in marked(mark):
        try:
            if b"meshplan.serving.front" in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(pid)
        except OSError:
            pass
    return found


def test_the_front_is_a_process_of_its_own_that_ends_with_the_job(batch4):
    """The HTTP front runs beside rank 0 as a process of its own: a front that dies ends the
    job with one line; a rank 0 that dies takes its front with it."""
    with Served(batch4, 2) as served:
        fronts = front_pids(served.mark)
        assert len(fronts) == 1 and fronts[0] not in served.pids.values(), (fronts, served.pids)
        assert f"HTTP front: pid {fronts[0]} " in served.output
        answer = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
        assert answer.choices[0].finish_reason == "length"
        os.kill(fronts[0], signal.SIGKILL)
        assert served.wait(30) != 0
        assert "meshplan: error: the HTTP server stopped on its own" in served.output
        assert "Traceback" not in served.output
        assert not left_after(served.mark), served.output
    with Served(batch4, 2) as served:
        assert len(front_pids(served.mark)) == 1
        os.kill(served.pids[0], signal.SIGKILL)
        served.wait(30)
        assert not left_after(served.mark), served.output


def test_a_failing_draw_answers_every_request_and_ends_the_job(batch4, tmp_path):
    """A failure inside the engine (a sampler that raises, put in by ``failing_command.py``
    once the flag file exists): the three greedy streams and the sampled one in the four
    slots end with an error event, the request waiting for a slot gets a 500 body, and
    every rank is gone within seconds, exit non-zero, one error line, no traceback."""
    import openai

    flag = tmp_path / "fail-now"
    with Served(batch4, 2, failure="sampler-raises", env={"FAIL_WHEN": str(flag)}) as served:
        client = served.client()
        streams = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0 if i < 3 else 1,
                                             stream=True, extra_body={"ignore_eos": True}) for i in range(4)]
        firsts = [next(iter(stream)) for stream in streams]
        waited = {}

        def wait():
            try:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
            except openai.APIStatusError as exc:
                waited.update(status=exc.status_code, message=exc.message)
        waiter = threading.Thread(target=wait)
        waiter.start()
        deadline = time.monotonic() + 10
        while served.metric("meshplan_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.metric("meshplan_requests_running") == 4 and all(firsts)
        flag.touch()
        began = time.monotonic()
        for stream in streams:
            with pytest.raises(openai.APIError, match="the job failed: a draw failed"):
                list(stream)
        waiter.join(30)
        assert waited["status"] == 500 and "the job failed" in waited["message"], waited
        assert served.wait(30) != 0, served.output
        assert time.monotonic() - began < 20, served.output
        assert not left_after(served.mark), served.output
    errors = [line for line in served.output.splitlines() if line.startswith("meshplan: error:")]
    assert errors and "rank 0 failed: a draw failed" in errors[0], served.output
    assert "Traceback" not in served.output


def test_sigterm_while_the_job_starts_ends_every_rank(batch4):
    with Served(batch4, 2, wait=False) as served:
        time.sleep(1.5)   # the ranks import and load (a start takes 4-6 s on 2 cores)
        os.kill(served.process.pid, signal.SIGTERM)
        began = time.monotonic()
        served.wait(30)
        assert time.monotonic() - began < 20, served.output
        assert not left_after(served.mark), served.output


def test_a_growing_cache_serves_requests_together(tmp_path_factory):
    from meshplan.generation.loop import Generation, GenerationShape, SessionStepper
    from meshplan.generation.sampling import Sampler
    from meshplan.plan_format import read_plan
    from meshplan.runtime.sessions import StageSession, providers_for

    plan_dir = plan(tmp_path_factory, "optimum", SAMPLE_DIR / "llama_optimum.onnx", "--batch", "2",
                    "--max-length", "64")
    prompts = [[5, 17, 42, 7, 9, 3], [11, 12], [7, 8, 9]]
    shape = GenerationShape.of_plan(read_plan(plan_dir))
    session = StageSession(str(SAMPLE_DIR / "llama_optimum.onnx"), providers_for("cpu"), optimization="basic")
    expected = [Generation(shape, SessionStepper(shape, session.run)).run([p], 5, Sampler())[0][0].ids
                for p in prompts]
    with Served(plan_dir, 2) as served:
        assert "a growing cache: requests join while it has room" in served.output
        got = [None] * 3

        def ask(i):
            got[i] = served.client().completions.create(model="llama_optimum", prompt=prompts[i], max_tokens=5,
                                                        temperature=0).choices[0].model_extra["token_ids"]
        workers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        # the growing cache's calls score a prompt too: the generated tokens' logprobs again
        made = served.client().completions.create(model="llama_optimum", prompt=prompts[0], max_tokens=5,
                                                  temperature=0, logprobs=2).choices[0]
        scored = served.client().completions.create(model="llama_optimum", prompt=prompts[0] + expected[0],
                                                    max_tokens=0, echo=True, logprobs=2).choices[0]
    assert got == expected
    assert scored.logprobs.token_logprobs[0] is None and len(scored.logprobs.tokens) == len(prompts[0]) + 5
    assert scored.logprobs.token_logprobs[len(prompts[0]):] == pytest.approx(made.logprobs.token_logprobs, abs=1e-5)


def test_start_up_errors_are_one_line(batch4, tmp_path_factory):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        done = run_mpi(2, "serve", batch4, "--port", taken.getsockname()[1], timeout=120)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("meshplan: error:")]
    assert lines and "cannot listen on 127.0.0.1" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    done = run_mpi(2, "serve", batch4, "--port", "0", "--prefill-chunk", "17", timeout=120)
    assert done.returncode == 1 and "--prefill-chunk must be from 1 to the plan's longest call (16)" in done.stderr
    no_cache = tmp_path_factory.mktemp("mlp")
    assert run_cli("plan", SAMPLE_DIR / "mlp.onnx", "--mesh", "1x2", "--dim", "batch=4", "-o", no_cache).returncode == 0
    done = run_mpi(2, "serve", no_cache, "--port", "0", timeout=120)
    assert done.returncode == 1 and "no key/value cache" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("where", ["host", "on-device"])
def test_calls_of_one_row_through_the_job(tmp_path_factory, where):
    """``on-device``: the state and the tensors between segments in onnxruntime's buffers,
    rows of the cache bound by address (the path a GPU runs)."""
    plan_dir = plan(tmp_path_factory, "rows", LLAMA / "model.onnx", "--batch", "2")
    lines = run_mpi_script("row_calls_case.py", ranks=2, args=[plan_dir] + ([where] if where != "host" else []))
    assert len(lines) == (3 if where != "host" else 2)


def test_a_prompt_fed_one_token_per_decode_call_is_scored(batch4, reference):
    """Where the plan makes no row calls, a joining prompt rides along the others' decode
    calls a token at a time: each call's logits score one prompt token (the slots in one
    process, onnxruntime on the original model as the stepper)."""
    from meshplan.generation.loop import GenerationShape, SessionStepper
    from meshplan.generation.sampling import Sampler
    from meshplan.plan_format import read_plan
    from meshplan.runtime.sessions import StageSession, providers_for
    from meshplan.serving.batching import SlotBatch, Work

    shape = GenerationShape.of_plan(read_plan(batch4))
    stepper = SessionStepper(shape, StageSession(str(LLAMA / "model.onnx"), providers_for("cpu"),
                                                 optimization="basic").run)
    stepper.row_calls = False
    slots = SlotBatch(shape, stepper, 0, 4)
    assert not slots.row_calls
    running = Work([5, 17, 42, 7], 50, Sampler())
    slots.admit(running)
    running.ids.extend(token for _, token in slots.step())   # (what the engine does)
    prompt = [1, 9, 33, 71, 12, 150, 8]
    scored = Work(prompt, 1, Sampler(), logprobs=2, echo=True)
    slots.admit(scored)
    chosen = []
    while not chosen:
        for work, token in slots.step():
            work.ids.append(token)
            chosen += [token] if work is scored else []
    assert slots.made.count("decode") == len(prompt)   # the last prompt token's call gives its first token
    expected = reference(prompt)
    assert [s[0] for s in scored.prompt_scores] == prompt[1:]
    for position, (token, logprob, top) in enumerate(scored.prompt_scores, start=1):
        assert abs(logprob - expected[position - 1][token]) < TOLERANCE and len(top) == 2
    assert abs(scored.score[1] - expected[-1][chosen[0]]) < TOLERANCE


# --- several choices, prefix caching ------------------------------------------------------------

def _greedy(reference, ids: list[int], count: int) -> list[int]:
    """The model's greedy continuation, each step from onnxruntime on the whole sequence."""
    import numpy as np

    ids, found = list(ids), []
    for _ in range(count):
        token = int(np.argmax(reference.logits(ids)[-1]))
        found.append(token)
        ids.append(token)
    return found


def test_n_choices_share_one_prefill_and_draw_by_their_seeds(server):
    client = server.client()
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    three = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.model_extra["token_ids"] == one.choices[0].model_extra["token_ids"] for c in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens and three.usage.completion_tokens == 18

    def sample(seed: int, n: int) -> list[list[int]]:
        found = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, n=n)
        return [c.model_extra["token_ids"] for c in found.choices]
    pair = sample(11, 2)
    assert pair == [sample(11, 1)[0], sample(12, 1)[0]]    # choice i draws from seed + i
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=5, temperature=0, n=2, stream=True))
    streamed: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).extend(choice.model_extra.get("token_ids") or [])
    assert set(streamed) == {0, 1} and streamed[0] == streamed[1] and streamed[0]
    assert sum(1 for c in chunks for choice in c.choices if choice.finish_reason) == 2
    status, body, _ = post(server.url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 5})
    assert status == 400 and body["error"]["param"] == "n"     # the plan has 4 slots


def test_a_prompt_beginning_as_an_earlier_one_reuses_its_cache(server, reference):
    """The second prompt's shared beginning is taken from the row the first left (the
    metric counts it), and its greedy ids are onnxruntime's on the model itself."""
    tokenizer = load_tokenizer(LLAMA)
    client = server.client()
    system = "you are a careful assistant who answers briefly and plainly. " * 3
    first, second = system + "the first question", system + "a second one"
    ids = [tokenizer.encode(text).ids for text in (first, second)]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    before = server.metric("meshplan_prefix_cache_reused_positions_total")
    client.completions.create(model=MODEL, prompt=first, max_tokens=3, temperature=0)
    answer = client.completions.create(model=MODEL, prompt=second, max_tokens=5, temperature=0)
    assert server.metric("meshplan_prefix_cache_reused_positions_total") - before >= shared
    assert answer.choices[0].model_extra["token_ids"] == _greedy(reference, ids[1], 5)
