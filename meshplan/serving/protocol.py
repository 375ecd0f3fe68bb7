"""Request bodies of the OpenAI API read into a ``Submission``, or refused with one
``BadRequest`` (HTTP 400 and an OpenAI-style error body naming the field): malformed JSON,
text that is not Unicode (a lone surrogate), a field this server does not know or cannot
honour, a value of the wrong JSON type, not finite (``NaN`` and ``Infinity``, which
Python's JSON reader takes) or out of range, a prompt longer than the context, token ids
outside the vocabulary, ``max_tokens`` beyond the context. Nothing in a body gets past
here that the engine cannot take: no request fails there."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from meshplan.errors import RunError
from meshplan.generation.sampling import LARGEST_SEED, Adjustment, Sampler

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
          "user", "presence_penalty", "frequency_penalty", "logprobs", "ignore_eos", "repetition_penalty",
          "logit_bias", "min_tokens"}
COMPLETION = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
DEFAULT_COMPLETION_TOKENS = 16   # OpenAI's default for /v1/completions
LARGEST_TOP_K = 2**31 - 1
MOST_LOGPROBS = 20               # alternatives per token, as OpenAI's
MOST_REPETITION_PENALTY = 100.0
LARGEST_TOKEN_ID = 2**31 - 1     # where the plan does not say its vocabulary
SHOWN_CHARACTERS = 40            # of a value quoted in an error message


class BadRequest(Exception):
    """One line for the client; ``status`` 400 unless said."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Limits:
    """What the plan and model folder accept."""

    model: str
    context: int
    vocab: int | None
    tokenizer: object | None = None
    chat: object | None = None      # a ChatTemplate
    slots: int = 1                  # the plan's batch: the most choices (``n``) one request can have


@dataclass
class Submission:
    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False          # an extension (as vLLM's): generate max_tokens whatever comes
    logprobs: int | None = None       # alternatives per token (None: no log-probabilities)
    n: int = 1                        # choices: sequences sampled from the one prompt
    echo: bool = False                # completions: the prompt's text before the completion's
    adjust: Adjustment = field(default_factory=Adjustment)

    def sampler(self, choice: int = 0) -> Sampler:
        """The sampler of choice ``choice``: with a seed, choice i draws from seed + i."""
        seed = None if self.seed is None else (self.seed + choice) % (LARGEST_SEED + 1)
        try:
            return Sampler(self.temperature, self.top_k, self.top_p, seed)
        except RunError as exc:   # (``read_submission`` checked each value already)
            text = str(exc).replace("--", "")
            name = text.split()[0].replace("-", "_")
            raise BadRequest(text.replace(text.split()[0], f"'{name}'", 1), name) from None


def parse_body(raw: bytes) -> dict:
    """The body as a JSON object whose every string is Unicode (one ``BadRequest`` else)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not JSON: {exc}") from None
    except UnicodeDecodeError:
        raise BadRequest("the request body is not JSON: it is not UTF-8 text") from None
    except ValueError:   # (an integer of more digits than Python converts)
        raise BadRequest("the request body holds a number with too many digits") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_text(body)
    return body


def _check_text(body: dict) -> None:
    """Every key and string in the body encodes to UTF-8: JSON's escapes let a lone surrogate
    (``"\\ud800"``) through, which no tokenizer, template or response can take."""
    stack = [(_safe(key), key, value) for key, value in body.items()]
    while stack:
        name, key, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((name, k, v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((name, None, v) for v in value)
        for text in (key, value):
            if isinstance(text, str) and not _unicode(text):
                raise BadRequest(f"'{name}' holds text that is not Unicode (a lone surrogate)", name)


def _unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _safe(name: str) -> str:
    """A field's name as a message and ``param`` can carry it: Unicode, cut short."""
    name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return name if len(name) <= SHOWN_CHARACTERS else name[:SHOWN_CHARACTERS] + "..."


def _shown(value) -> str:
    """A value as an error message quotes it: JSON, cut short; a list or an object by its kind."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        cut = value[:SHOWN_CHARACTERS]
        return json.dumps(_safe(cut)) + ("..." if len(value) > len(cut) else "")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**SHOWN_CHARACTERS:
        return f"an integer of {len(str(abs(value)))} digits"
    return json.dumps(value)


def _number(body, name, lo=None, hi=None, integer=False, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {_shown(value)}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a finite number, got {_shown(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"from {lo}" + (f" to {hi}" if hi is not None else " up")
        raise BadRequest(f"'{name}' must be {span}, got {_shown(value)}", name)
    return value


def _must_be(body, name, allowed, why):
    """``name`` absent, or one of ``allowed`` (of the same JSON type: ``true`` is not 1)."""
    if name in body and not any(type(body[name]) is type(a) and body[name] == a for a in allowed):
        raise BadRequest(f"'{name}' = {_shown(body[name])} is not supported: {why}", name)


def _text(body, name) -> None:
    if body.get(name) is not None and not isinstance(body[name], str):
        raise BadRequest(f"'{name}' must be a string, got {_shown(body[name])}", name)


def read_submission(body: dict, limits: Limits, chat: bool) -> Submission:
    known = CHAT if chat else COMPLETION
    unknown = sorted(set(body) - known)
    if unknown:
        name = _safe(unknown[0])
        raise BadRequest(f"unknown field '{name}'", name)
    _text(body, "model")
    _text(body, "user")
    model = body.get("model")
    if model is not None and model != limits.model:
        raise BadRequest(f"the model '{_safe(model)}' does not exist: this server serves '{limits.model}'", "model",
                         status=404)
    n = _number(body, "n", lo=1, integer=True, default=1)
    if n > limits.slots:
        raise BadRequest(f"'n' is {_shown(n)}: this server's plan has {limits.slots} batch slot(s), so at most "
                         f"{limits.slots} choices a request", "n")
    _must_be(body, "best_of", (None, 1), "one choice per request")
    _must_be(body, "suffix", (None,), "no suffix")
    logprobs, echo = _logprobs(body, chat)
    prompt = _chat_prompt(body, limits) if chat else _completion_prompt(body, limits)
    if len(prompt) >= limits.context:
        raise BadRequest(f"the prompt has {len(prompt)} tokens: the context holds {limits.context} "
                         "(the prompt and at least one new token)", "messages" if chat else "prompt")
    room = limits.context - len(prompt)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, lo=0 if echo else 1, integer=True)
    if max_tokens is None:
        max_tokens = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
    if max_tokens > room:
        raise BadRequest(f"'{name}' is {_shown(max_tokens)}, but the context holds {limits.context} tokens and the "
                         f"prompt takes {len(prompt)}: at most {room}", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be true or false", "ignore_eos")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise BadRequest("'stream_options' may only hold include_usage (true or false)", "stream_options")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    if stop and limits.tokenizer is None:
        raise BadRequest("'stop' needs text: the model folder has no tokenizer.json", "stop")
    submission = Submission(
        chat=chat, prompt_ids=prompt, max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", lo=0, hi=2, default=1.0)),
        top_p=float(_number(body, "top_p", lo=0, hi=1, default=1.0)),
        top_k=int(_number(body, "top_k", lo=0, hi=LARGEST_TOP_K, integer=True, default=0)),
        seed=_number(body, "seed", lo=0, hi=LARGEST_SEED, integer=True), stop=stop, stream=stream,
        include_usage=bool(options and options.get("include_usage")), ignore_eos=ignore_eos, logprobs=logprobs,
        echo=echo, adjust=_adjustment(body, limits, max_tokens), n=int(n))
    if submission.top_p == 0:
        raise BadRequest("'top_p' must be above 0", "top_p")
    submission.sampler()   # the sampler's own checks, as a 400
    return submission


def _logprobs(body: dict, chat: bool) -> tuple[int | None, bool]:
    """(alternatives per token, or None for no log-probabilities; echo): completions'
    ``logprobs`` an integer 0..20 and ``echo``; chat's ``logprobs`` true or false and
    ``top_logprobs`` 0..20, which needs it."""
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("'echo' must be true or false", "echo")
    if chat:
        wanted = body.get("logprobs", False)
        if wanted is None:
            wanted = False
        if not isinstance(wanted, bool):
            raise BadRequest(f"'logprobs' must be true or false, got {_shown(wanted)}", "logprobs")
        top = _number(body, "top_logprobs", lo=0, hi=MOST_LOGPROBS, integer=True)
        if top is not None and not wanted:
            raise BadRequest("'top_logprobs' needs 'logprobs' true", "top_logprobs")
        return (top or 0) if wanted else None, False
    return _number(body, "logprobs", lo=0, hi=MOST_LOGPROBS, integer=True), echo


def _adjustment(body: dict, limits: Limits, max_tokens: int) -> Adjustment:
    """The penalties, biases and ``min_tokens`` of a request, each checked."""
    repetition = float(_number(body, "repetition_penalty", lo=0, hi=MOST_REPETITION_PENALTY, default=1.0))
    if repetition == 0:
        raise BadRequest("'repetition_penalty' must be above 0", "repetition_penalty")
    bias = body.get("logit_bias")
    if bias is None:
        bias = {}
    if not isinstance(bias, dict):
        raise BadRequest(f"'logit_bias' must be an object of token ids to numbers, got {_shown(bias)}", "logit_bias")
    top = limits.vocab if limits.vocab is not None else LARGEST_TOKEN_ID + 1
    biases = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12 or not int(key) < top:
            raise BadRequest(f"'logit_bias' has token id {_shown(key)}: token ids are integers from 0 to "
                             f"{top - 1}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -100 <= value <= 100:
            raise BadRequest(f"'logit_bias' of token {key} must be a number from -100 to 100, got {_shown(value)}",
                             "logit_bias")
        biases[int(key)] = float(value)
    min_tokens = _number(body, "min_tokens", lo=0, hi=max_tokens, integer=True, default=0)
    return Adjustment(presence=float(_number(body, "presence_penalty", lo=-2, hi=2, default=0.0)),
                      frequency=float(_number(body, "frequency_penalty", lo=-2, hi=2, default=0.0)),
                      repetition=repetition, bias=biases, min_tokens=min_tokens)


def _completion_prompt(body: dict, limits: Limits) -> list[int]:
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        if limits.tokenizer is None:
            raise BadRequest("the model folder has no tokenizer.json: give the prompt as token ids", "prompt")
        ids = _encode(limits.tokenizer, prompt, "prompt")
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        top = limits.vocab if limits.vocab is not None else LARGEST_TOKEN_ID + 1
        bad = [t for t in ids if not 0 <= t < top]
        if bad:
            raise BadRequest(f"token id {_shown(bad[0])} is outside the vocabulary (0 to {top - 1})", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("one prompt per request (send the others as requests of their own)", "prompt")
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")
    if not ids:
        raise BadRequest("the prompt has no tokens", "prompt")
    return ids


def _chat_prompt(body: dict, limits: Limits) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"message {index} must be an object with a 'role'", "messages")
        content = message.get("content")
        if isinstance(content, list):   # parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"message {index}: only text content is supported", "messages")
        elif not isinstance(content, str):
            raise BadRequest(f"message {index} must have a string 'content'", "messages")
    if limits.chat is None:
        raise BadRequest("the model folder has no chat template (tokenizer_config.json's chat_template): "
                         "use /v1/completions", "messages")
    if limits.tokenizer is None:
        raise BadRequest("the model folder has no tokenizer.json: use /v1/completions with token ids", "messages")
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in messages]
    try:
        text = limits.chat.render(flat)
    except ValueError as exc:
        raise BadRequest(str(exc), "messages") from None
    ids = _encode(limits.tokenizer, text, "messages", add_special_tokens=False)
    if not ids:
        raise BadRequest("the messages render to no tokens", "messages")
    return ids


def _encode(tokenizer, text: str, name: str, **options) -> list[int]:
    try:
        return tokenizer.encode(text, **options).ids
    except Exception as exc:   # (the tokenizers library's own errors)
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadRequest(f"the {name} cannot be tokenized: {line}", name) from None
