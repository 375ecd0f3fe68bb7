"""No request body can stop ``meshplan serve``: every value the API takes is checked for its
JSON type, finiteness and range (a 400 naming the field), and whatever a body holds, the
answer is a 2xx or an OpenAI-style 4xx on a connection that stays usable.

In one process: the server's own front (``app.build_app`` on uvicorn, on a loopback
socket) and its engine (``Engine`` over a ``SlotBatch`` of 4 slots, on a thread of its
own), with a stepper that gives random logits in place of the job — what a request does
to the server up to the job's calls is what it does here. Every test of the front runs
twice: the app calling the engine itself, and the app calling it over the link that
``meshplan serve`` puts between its two processes (``link``, on a socket pair). A property test (hypothesis)
sends bodies of both endpoints made of valid values and hostile ones (wrong JSON types,
NaN and infinities, huge numbers, lists and strings, lone surrogates, unknown fields),
streamed or not, and broken JSON, all on one keep-alive connection; then a normal request
must succeed. The MPI server gets the findings of the issue in ``test_serve.py``.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.errors import RunError
from meshplan.generation.driver import load_tokenizer
from meshplan.generation.loop import GenerationShape
from meshplan.generation.sampling import Sampler
from meshplan.serving.app import MAX_BODY_BYTES, build_app
from meshplan.serving.batching import SlotBatch, Work
from meshplan.serving.chat import ChatTemplate
from meshplan.serving.engine import Engine
from meshplan.serving.link import EngineEnd, EngineLink
from meshplan.serving.metrics import ServerMetrics
from meshplan.serving.protocol import BadRequest, Limits, parse_body, read_submission
from meshplan.serving.text import ChoiceText
from sample_models import SAMPLE_DIR

pytestmark = pytest.mark.serial   # timed servers: run apart from the parallel tests (docs/testing.md)

LLAMA = SAMPLE_DIR / "genai" / "llama_fp32"
MODEL, CONTEXT, VOCAB, SLOTS = "llama_fp32", 64, 320, 4
PATHS = ("/v1/completions", "/v1/chat/completions")


class RandomLogits:
    """A stepper in place of the job: random logits for every call."""

    row_calls = True

    def __init__(self, pause: float = 0.0):
        self.rng, self.pause = np.random.default_rng(0), pause

    def reset(self) -> None:
        pass

    def step(self, feeds: dict, last: int, row: int | None = None) -> np.ndarray:
        time.sleep(self.pause)
        return self.rng.standard_normal((len(feeds["input_ids"]), last, VOCAB)).astype(np.float32)


def limits() -> Limits:
    return Limits(MODEL, CONTEXT, VOCAB, load_tokenizer(LLAMA), ChatTemplate.of_folder(LLAMA))


class Front:
    """The app and the engine, serving on a loopback port until ``close``; ``linked``: the
    app calls the engine over a link."""

    def __init__(self, linked: bool = False, queue: int = 64, pause: float = 0.0):
        import uvicorn

        shape = GenerationShape("input_ids", "attention_mask", None, {}, True, (1, SLOTS), 16, CONTEXT, VOCAB, {}, {})
        self.limits = limits()
        self.metrics = ServerMetrics()
        self.engine = Engine(SlotBatch(shape, RandomLogits(pause), 1, SLOTS), [1], self.metrics, queue)
        self.stop = threading.Event()
        caller, metrics, after = self.engine, self.metrics, None
        if linked:
            ours, theirs = socket.socketpair()
            self.end = EngineEnd(self.engine, Connection(ours.detach()), self.metrics)
            self.end.start()
            caller = metrics = self.link = EngineLink(Connection(theirs.detach()))
            self.link.start()
            after = self.end.flush
        self.engine_thread = threading.Thread(target=self.engine.run, args=(self.stop, None, after), daemon=True)
        self.engine_thread.start()
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(16)
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(build_app(caller, self.limits, metrics),
                                                    log_level="warning", access_log=False, lifespan="off",
                                                    timeout_keep_alive=600))   # (idle while hypothesis draws)
        self.http_thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.http_thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started
        self.connection = self.connect()

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def post(self, path: str, raw: bytes, connection=None) -> tuple[int, bytes]:
        """On the kept connection: a reset or a closed connection fails the test."""
        connection = connection or self.connection
        connection.request("POST", path, raw, {"Content-Type": "application/json"})
        response = connection.getresponse()
        body = response.read()
        assert not response.will_close, (response.status, body[:200])
        return response.status, body

    def close(self) -> None:
        self.connection.close()
        self.stop.set()
        self.engine.wake.set()
        self.server.should_exit = True
        self.http_thread.join(10)
        self.engine_thread.join(10)


@pytest.fixture(scope="module", params=["in-process", "linked"])
def front(request):
    served = Front(linked=request.param == "linked")
    yield served
    served.close()


def openai_error(status: int, body: bytes) -> dict:
    answer = json.loads(body)
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, answer
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), answer
    assert error["param"] is None or isinstance(error["param"], str), answer
    return error


def a_normal_request_succeeds(front: Front) -> None:
    # (ignore_eos: the random logits choose the end token now and then, which would end it sooner)
    status, body = front.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                             "ignore_eos": True}).encode())
    assert status == 200, body
    assert len(json.loads(body)["choices"][0]["token_ids"]) == 3
    assert front.engine_thread.is_alive() and not front.engine.stopping


# --- the findings of the issue, value by value ----------------------------------------------

FINDINGS = [   # (body, the field named)
    ({"prompt": "hi", "max_tokens": 2, "temperature": math.nan}, "temperature"),
    ({"prompt": "hi", "temperature": math.inf}, "temperature"),
    ({"prompt": "hi", "temperature": 1, "top_p": math.nan}, "top_p"),
    ({"prompt": "hi", "top_p": -math.inf}, "top_p"),
    ({"prompt": "hi", "top_k": math.nan}, "top_k"),
    ({"prompt": "hi", "top_k": 10**30}, "top_k"),
    ({"prompt": "hi", "seed": -1, "temperature": 1}, "seed"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "max_tokens": math.inf}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**100}, "max_tokens"),
    ({"model": "\ud800", "prompt": "hi"}, "model"),
    ({"model": 7, "prompt": "hi"}, "model"),
    ({"prompt": "\udfff"}, "prompt"),
    ({"prompt": ["\ud800"]}, "prompt"),
    ({"prompt": "hi", "stop": ["\ud800"]}, "stop"),
    ({"prompt": "hi", "user": {"a": 1}}, "user"),
    ({"prompt": "hi", "stream": {"a": 1}}, "stream"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": math.nan}}, "stream_options"),
    ({"prompt": "hi", "n": True}, "n"),
    ({"prompt": "hi", "presence_penalty": math.nan}, "presence_penalty"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [2**63]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": "hi", "\ud800": 1}, "\\ud800"),
    ({"prompt": "hi", "x" * 1000: 1}, "x" * 40 + "..."),
]


@pytest.mark.parametrize("body, param", FINDINGS, ids=[f"{i}-{p[:12]}" for i, (_, p) in enumerate(FINDINGS)])
def test_a_bad_value_is_a_400_naming_its_field(front, body, param):
    status, answer = front.post("/v1/completions", json.dumps({"model": MODEL, **body}).encode())
    error = openai_error(status, answer)
    assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error"), error


def test_chat_values_are_checked_too(front):
    for body, param in [({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": math.nan},
                         "max_completion_tokens"),
                        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": math.inf}, "top_logprobs"),
                        ({"messages": [{"role": math.nan, "content": "hi"}]}, "messages")]:
        status, answer = front.post("/v1/chat/completions", json.dumps(body).encode())
        assert (status, openai_error(status, answer)["param"]) == (400, param), answer


def test_broken_and_huge_bodies_are_4xx_on_a_usable_connection(front):
    for raw in (b"{not json", b"[" * 100_000, b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
                b"\xff\xfe\x00", b"NaN", b"", b'{"prompt": "hi"' + b" " * 100):
        status, answer = front.post("/v1/completions", raw)
        assert status == 400 and openai_error(status, answer)["param"] is None, (raw[:40], answer)
    status, answer = front.post("/v1/completions", b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}')
    assert status == 413 and openai_error(status, answer)["type"] == "invalid_request_error"
    a_normal_request_succeeds(front)


def test_a_tiny_temperature_samples():
    """(Divided first, logits of a temperature of 1e-320 were infinities, and their
    probabilities NaN.)"""
    logits = np.array([[0.5, 3.0, 2.9, -1.0]])
    assert Sampler(temperature=1e-320, seed=1)(logits).tolist() == [1]
    assert Sampler(temperature=2.0, top_k=2, seed=1)(logits).tolist()[0] in (1, 2)
    with pytest.raises(RunError, match="NaN or an infinity"):
        Sampler(temperature=1.0, seed=1)(np.array([[0.5, np.nan, 1.0]]))


@pytest.mark.parametrize("settings, says", [
    ({"temperature": math.nan}, "--temperature must be a finite number"),
    ({"temperature": math.inf}, "--temperature must be a finite number"),
    ({"temperature": -1.0}, "--temperature must be a finite number, 0 (greedy) or more"),
    ({"top_p": math.nan}, "--top-p must be in (0, 1]"),
    ({"top_k": -1}, "--top-k must be an integer"),
    ({"seed": -1}, "--seed must be an integer from 0"),
    ({"seed": 2**64}, "--seed must be an integer from 0"),
])
def test_the_sampler_refuses_what_it_cannot_draw_with(settings, says):
    with pytest.raises(RunError, match=says.replace("(", r"\(").replace(")", r"\)")):
        Sampler(**settings)


def test_read_submission_raises_nothing_but_bad_request():
    """Straight through the protocol: what the property test's bodies reach."""
    for body in ({"prompt": "hi", "temperature": math.nan}, {"prompt": {"a": [1]}}, {"messages": "hi"},
                 {"prompt": "hi", "stop": [None]}, {"prompt": "hi", "logprobs": math.nan}):
        with pytest.raises(BadRequest):
            read_submission(parse_body(json.dumps(body).encode()), limits(), chat="messages" in body)


def test_choice_text_cuts_at_the_first_stop_string_and_never_sends_part_of_one():
    """The front's text of a choice: pieces as tokens come, held back while they may begin a
    stop string; the first stop string ends it, its text up to the string."""
    tokenizer = load_tokenizer(LLAMA)
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog").ids
    whole = ChoiceText(tokenizer, [])
    assert "".join([whole.token(i) for i in ids] + [whole.done("length")]) == tokenizer.decode(ids)
    assert whole.reason == "length" and whole.ids == ids
    for stop in (["fox"], ["lazy", "own f"], ["o"]):
        choice, pieces = ChoiceText(tokenizer, stop), []
        for token in ids:
            pieces.append(choice.token(token))
            assert not any(s in "".join(pieces) for s in stop), (stop, pieces)
            if choice.reason is not None:
                break
        full = tokenizer.decode(ids)
        assert choice.reason == "stop" and "".join(pieces) == full[:min(full.find(s) for s in stop if s in full)]
    end = ChoiceText(tokenizer, [])   # an end token has no text
    assert end.token(ids[0]) + end.token(1, end=True) + end.done("stop") == tokenizer.decode(ids[:1])


def test_over_the_link_a_full_queue_is_a_429_and_a_client_gone_frees_its_slot():
    served = Front(linked=True, queue=1, pause=0.03)   # (slow enough that a client leaving is seen mid-stream)
    try:
        body = json.dumps({"model": MODEL, "prompt": [5, 6], "max_tokens": 40, "stream": True}).encode()
        answers, lock = [], threading.Lock()

        def one():
            found = served.post("/v1/completions", body, served.connect())
            with lock:
                answers.append(found)
        clients = [threading.Thread(target=one) for _ in range(SLOTS + 3)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(60)
        codes = sorted(code for code, _ in answers)
        assert set(codes) == {200, 429}, codes   # (one may wait: those that come before it is taken get 429)
        assert all(b.rstrip().endswith(b"data: [DONE]") for code, b in answers if code == 200)
        connection = served.connect()   # a stream its client leaves after its first token
        longest = json.dumps({"model": MODEL, "prompt": [5, 6], "max_tokens": CONTEXT - 2, "stream": True}).encode()
        connection.request("POST", "/v1/completions", longest, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        connection.close()
        deadline = time.monotonic() + 10
        while served.metrics.running._value.get() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert served.metrics.running._value.get() == 0
        status, text = http_get(served.port, "/metrics")
        assert status == 200 and b'meshplan_requests_total{outcome="cancelled"} 1.0' in text, text[-600:]
        assert not served.link._works and not served.end.works   # nothing held for requests that ended
    finally:
        served.close()


def http_get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, response.read()


def test_a_second_stop_ends_what_runs_at_once():
    """The engine stopped with ``hurry`` (a second SIGTERM): a running request gets an error
    at the next step, and the loop returns."""
    shape = GenerationShape("input_ids", "attention_mask", None, {}, True, (1, 2), 16, CONTEXT, VOCAB, {}, {})
    engine = Engine(SlotBatch(shape, RandomLogits(pause=0.01), 1, 2), [], ServerMetrics(), 4)
    events = []
    engine.submit(Work([5, 6], 60, Sampler(), emit=events.append))
    stop, hurry = threading.Event(), threading.Event()
    runner = threading.Thread(target=engine.run, args=(stop, hurry))
    runner.start()
    while not events:
        time.sleep(0.001)
    stop.set()
    hurry.set()
    runner.join(10)
    assert not runner.is_alive()
    assert events[-1] == ("error", "the server is stopping", 503) and len(events) < 60


# --- the property test ------------------------------------------------------------------------

def texts(size: int = 12):
    """Text, lone surrogates among its characters at times."""
    return st.text(alphabet=st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
                   max_size=size)


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([10**30, -(10**30), 2**64]),
                    st.floats(allow_nan=True, allow_infinity=True), texts())
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts(6), inner, max_size=4),
                        max_leaves=8)
HUGE = st.sampled_from([[5] * 100_000, "word " * 20_000, ["x"] * 5_000, {f"k{i}": i for i in range(5_000)},
                        [[1, 2]] * 1000])
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                           "content": st.one_of(st.text(max_size=20), st.just([{"type": "text",
                                                                                                 "text": "hi"}]))}),
                    min_size=1, max_size=3)
VALID = {
    "model": st.just(MODEL),
    "prompt": st.one_of(st.text(max_size=20), IDS, st.lists(st.text(max_size=8), min_size=1, max_size=1),
                        st.lists(IDS, min_size=1, max_size=1)),
    "messages": MESSAGES,
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.floats(0, 2), st.just(1e-320), st.just(0)),
    "top_p": st.floats(1e-300, 1),
    "top_k": st.integers(0, 400),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "user": st.text(max_size=8),
    "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0),
    "logprobs": st.sampled_from([None, False]),
    "top_logprobs": st.just(0),
    "ignore_eos": st.booleans(),
    "echo": st.just(False),
    "best_of": st.just(1),
    "suffix": st.none(),
}
COMPLETION_FIELDS = [f for f in VALID if f not in ("messages", "max_completion_tokens", "top_logprobs")]
CHAT_FIELDS = [f for f in VALID if f not in ("prompt", "echo", "best_of", "suffix")]


@st.composite
def bodies(draw):
    """(path, raw body, whether it is a JSON object). Hypothesis leans to the first choice of
    each draw: a valid value, no unknown field, a JSON object."""
    path = draw(st.sampled_from(PATHS))
    chat = path.endswith("chat/completions")
    fields = draw(st.lists(st.sampled_from(CHAT_FIELDS if chat else COMPLETION_FIELDS), max_size=8, unique=True))
    body = {"messages" if chat else "prompt": draw(VALID["messages" if chat else "prompt"])}
    for name in fields:
        body[name] = draw(st.one_of(VALID[name], VALID[name], ANY_JSON, HUGE))
    if draw(st.integers(0, 9)) == 9:
        body[draw(texts(8))] = draw(ANY_JSON)
    if draw(st.integers(0, 2)) < 2:   # (a short generation most of the time: the property is in the checks)
        body.setdefault("max_completion_tokens" if chat else "max_tokens", draw(st.integers(1, 4)))
    if draw(st.integers(0, 2)) == 2:
        body.setdefault("stream", True)
    raw = json.dumps(body).encode()   # (NaN and Infinity as JavaScript's literals; surrogates as \\u escapes)
    how = draw(st.integers(0, 19))
    if how == 18:   # broken JSON
        return path, draw(st.one_of(st.just(raw[:draw(st.integers(0, len(raw)))]), st.binary(max_size=40))), False
    if how == 19:
        return path, json.dumps(draw(ANY_JSON)).encode(), False
    return path, raw, True


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(request=bodies())
def test_every_body_gets_a_2xx_or_an_openai_4xx(front, request):
    path, raw, an_object = request
    status, body = front.post(path, raw)
    if 200 <= status < 300:
        if body.startswith(b"data: "):   # streamed: its events, [DONE] last
            events = [line[6:] for line in body.decode().split("\n\n") if line]
            assert events[-1] == "[DONE]", body[-300:]
            assert not any("error" in json.loads(e) for e in events[:-1]), body[-300:]
        else:
            assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length"), body
    else:
        error = openai_error(status, body)
        assert 400 <= status < 500 and status != 429, (status, error)
        if an_object and status == 400:
            assert error["param"] is not None, (raw[:200], error)   # the field at fault is named
    assert front.engine_thread.is_alive() and not front.engine.stopping


def test_a_normal_request_succeeds_after_them(front):
    a_normal_request_succeeds(front)
    streamed = json.dumps({"model": MODEL, "prompt": [5, 6], "max_tokens": 3, "stream": True}).encode()
    status, body = front.post("/v1/completions", streamed)
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
