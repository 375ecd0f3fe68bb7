"""The ASGI application (Starlette): the OpenAI endpoints over the engine.

``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as server-sent
events, ``data: [DONE]`` last), ``GET /v1/models``, ``/health`` and ``/metrics``. Every
error is an OpenAI-style body: 400 for a request the plan cannot take, 404 for another
model, 413 for a body over ``MAX_BODY_BYTES``, 429 with ``Retry-After`` when the queue is
full, 503 while the server stops, 500 when the job fails. No request body reaches the
engine unchecked (``protocol``), and none ends the connection: what reading one raises
unforeseen is a 500 body too, the server going on. A client that goes away cancels its
request (its slot is free within one step).

The engine is the ``Engine`` itself (in one process) or its ``link.EngineLink`` (the
engine in another process: ``submit`` and the metrics' ``text`` are then awaited). The
text of each choice is made here from the engine's token ids (``text.ChoiceText``): a
stop string ends a choice here, and the engine is told to stop it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from meshplan.serving.batching import Work
from meshplan.serving.engine import QueueFull, Stopping
from meshplan.serving.protocol import BadRequest, parse_body, read_submission
from meshplan.serving.text import ChoiceText

RETRY_AFTER_SECONDS = 1
MAX_BODY_BYTES = 4 << 20    # a request body larger than this is refused (413), read to its end


def build_app(engine, limits, metrics, started: float | None = None):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    created = int(started or time.time())
    names: dict[int, str] = {}   # each token's text as logprobs show it, decoded once

    class ErrorResponse(JSONResponse):   # escaped to ASCII: whatever text a message quotes, it renders
        def render(self, content) -> bytes:
            return json.dumps(content, separators=(",", ":")).encode("ascii")

    def error(exc: BadRequest, headers=None) -> JSONResponse:
        return ErrorResponse(exc.body(), status_code=exc.status, headers=headers)

    async def health(request):
        if engine.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": limits.model, "object": "model", "created": created,
                                                         "owned_by": "meshplan", "max_model_len": limits.context}]})

    async def metrics_text(request):
        return Response(await _maybe(metrics.text()), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def generate(request, chat: bool):
        try:
            body = parse_body(await _read_body(request))
            submission = read_submission(body, limits, chat)
            sampler = submission.sampler()
        except BadRequest as exc:
            return error(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:   # a check that failed unforeseen: this request's 500, not the server's
            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return error(BadRequest(f"the request could not be read: {line}", status=500, kind="server_error"))
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        works = [Work(submission.prompt_ids, submission.max_tokens, submission.sampler(i),
                      emit=_emitter(loop, events, i), ignore_eos=submission.ignore_eos,
                      logprobs=submission.logprobs, echo=submission.echo, adjust=submission.adjust)
                 for i in range(submission.n)]
        works[0].followers = works[1:]
        try:
            await _maybe(engine.submit(works[0]))
        except QueueFull:
            return error(BadRequest("too many requests wait: try again later", status=429, kind="rate_limit_error"),
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        except Stopping:
            return error(BadRequest("the server is stopping", status=503, kind="server_error"))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        shape = _Shape(ident, limits.model, int(time.time()), chat, limits.tokenizer, submission.logprobs, names)
        if submission.echo:
            shape.echo(body["prompt"], submission.prompt_ids)
        choices = _Choices(engine, works, limits.tokenizer, submission.stop)
        if submission.stream:
            return StreamingResponse(_stream(choices, events, shape, submission.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        whole = [{"text": [], "ids": [], "scores": []} for _ in works]
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():   # the client went away: its slots are freed at the next step
                    getter.cancel()
                    return Response(status_code=499)
                index, event = getter.result()
                if event[0] == "prompt":
                    shape.prompt_scores = event[1]
                    continue
                if event[0] == "error":
                    choices.failed = True
                    return error(BadRequest(event[1], status=event[2], kind="server_error"))
                piece = choices.take(index, event)
                if piece is not None:
                    whole[index]["text"].append(piece[0])
                    whole[index]["ids"].extend(piece[1])
                    whole[index]["scores"].extend(piece[2])
                if choices.ended:
                    return JSONResponse(shape.whole([("".join(c["text"]), c["ids"], t.reason, c["scores"])
                                                     for c, t in zip(whole, choices.texts)], choices.usage()))
        finally:
            gone.cancel()
            choices.cancel()

    async def not_found(request, exc: HTTPException):
        return ErrorResponse({"error": {"message": exc.detail, "type": "invalid_request_error", "param": None,
                                        "code": None}}, status_code=exc.status_code)

    routes = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics_text),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


class _Shape:
    """The response bodies of one request, completion or chat; with ``logprobs`` (alternatives
    per token), each token's log-probability in OpenAI's format of the endpoint."""

    def __init__(self, ident: str, model: str, created: int, chat: bool, tokenizer=None,
                 logprobs: int | None = None, names: dict | None = None):
        self.ident, self.model, self.created, self.chat = ident, model, created, chat
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.names = names if names is not None else {}
        self.prompt_text: str | None = None    # echoed before the completion's text
        self.prompt_ids: list[int] = []
        self.prompt_scores: list | None = None
        self.offsets: dict[int, int] = {}      # choice → the text_offset of its next token (completions)

    def echo(self, prompt, ids: list[int]) -> None:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        self.prompt_ids = ids
        if isinstance(prompt, str):
            self.prompt_text = prompt
        else:
            self.prompt_text = self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""

    def _head(self, kind: str) -> dict:
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.model}

    def _name(self, token: int) -> str:
        name = self.names.get(token)
        if name is None:
            name = self.names[token] = (f"token_id:{token}" if self.tokenizer is None
                                        else self.tokenizer.decode([token], skip_special_tokens=False))
        return name

    def _echoed(self) -> list:
        """The prompt's entries: its first token's logprob null (nothing predicts it)."""
        if self.prompt_scores is None or self.logprobs is None:
            return []
        return [(self.prompt_ids[0], None, None)] + list(self.prompt_scores)

    def _logprobs(self, scores: list, index: int = 0) -> dict | None:
        if self.logprobs is None:
            return None
        scores = [s for s in scores if s is not None]
        if self.chat:
            def entry(token, logprob):
                name = self._name(token)
                return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}
            return {"content": [{**entry(token, logprob), "top_logprobs": [entry(i, v) for i, v in top]}
                                for token, logprob, top in scores]}
        found = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in scores:
            name = self._name(token)
            found["tokens"].append(name)
            found["token_logprobs"].append(logprob)
            found["top_logprobs"].append(None if top is None else {self._name(i): v for i, v in top})
            found["text_offset"].append(self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(name)
        return found

    def whole(self, choices: list[tuple[str, list[int], str, list]], usage: dict) -> dict:
        """The body of a request answered whole: ``choices`` (text, ids, finish reason,
        scores) in their order."""
        if self.chat:
            found = [{"index": i, "message": {"role": "assistant", "content": text},
                      "logprobs": self._logprobs(list(scores), i), "finish_reason": reason, "token_ids": ids}
                     for i, (text, ids, reason, scores) in enumerate(choices)]
            return {**self._head("chat.completion"), "choices": found, "usage": usage}
        found = [{"index": i, "text": (self.prompt_text or "") + text,
                  "logprobs": self._logprobs(self._echoed() + list(scores), i), "finish_reason": reason,
                  "token_ids": ids}
                 for i, (text, ids, reason, scores) in enumerate(choices)]
        return {**self._head("text_completion"), "choices": found, "usage": usage}

    def chunk(self, text: str | None, ids: list[int], reason: str | None, first: bool = False,
              scores: list = (), index: int = 0) -> dict:
        logprobs = self._logprobs(list(scores), index) if scores else None
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                      "token_ids": ids}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        return {**self._head("text_completion"),
                "choices": [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason,
                             "token_ids": ids}]}

    def usage(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage}


async def _read_body(request) -> bytes:
    """The request body, refused (413) past ``MAX_BODY_BYTES``; read to its end all the same,
    so that the connection stays usable for the client's next request."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            chunks.append(chunk)
    if size > MAX_BODY_BYTES:
        raise BadRequest(f"the request body has {size} bytes: at most {MAX_BODY_BYTES}", status=413)
    return b"".join(chunks)


def _emitter(loop, events: asyncio.Queue, index: int = 0):
    """The engine's events for choice ``index`` of one request, as (index, event), handed to
    the HTTP thread's loop (dropped once that loop has closed: the engine must not fail
    because a front is gone)."""
    def emit(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
        except RuntimeError:
            pass
    return emit


async def _disconnected(request) -> None:
    """Returns when the client disconnects (the body was read: what comes next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _maybe(value):
    """A value, or what it gives where it is awaitable (the engine in another process)."""
    return await value if asyncio.iscoroutine(value) else value


class _Choices:
    """The choices of one request as the engine's events come: each one's text and how it
    ended; a stop string ends a choice here, and the engine is told to stop it."""

    def __init__(self, engine, works: list[Work], tokenizer, stop: list[str]):
        self.engine, self.works = engine, works
        self.texts = [ChoiceText(tokenizer, stop) for _ in works]
        self.failed = False

    def take(self, index: int, event) -> tuple[str, list[int], list, str | None] | None:
        """A token or done event of choice ``index`` as (text, ids, scores, finish reason);
        None for what comes after its end."""
        choice = self.texts[index]
        if choice.reason is not None:
            return None
        if event[0] == "token":
            _, token, score, end = event
            text = choice.token(token, end)
            if choice.reason is not None:   # a stop string: the engine need not go on
                self.engine.cancel(self.works[index], "stop")
            return text, [token], [score], choice.reason
        return choice.done(event[1]), [], [], choice.reason

    @property
    def ended(self) -> bool:
        return all(t.reason is not None for t in self.texts)

    def usage(self) -> dict:
        prompt, completion = len(self.works[0].prompt), sum(len(t.ids) for t in self.texts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def cancel(self) -> None:
        """What has not ended is cancelled (the client went away, or the response ended)."""
        for work, text in zip(self.works, self.texts):
            if text.reason is None and not self.failed:
                text.reason = "cancelled"
                self.engine.cancel(work)


async def _stream(choices: _Choices, events: asyncio.Queue, shape: _Shape, include_usage: bool):
    try:
        if shape.chat:
            for index in range(len(choices.works)):
                yield _sse(shape.chunk("", [], None, first=True, index=index))
        while True:
            index, event = await events.get()
            if event[0] == "prompt":   # the echoed prompt, with its scores
                shape.prompt_scores = event[1]
                yield _sse(shape.chunk(shape.prompt_text, [], None, scores=shape._echoed(), index=index))
                continue
            if event[0] == "error":
                choices.failed = True
                yield _sse({"error": {"message": event[1], "type": "server_error", "param": None, "code": None}})
                return
            piece = choices.take(index, event)
            if piece is None:
                continue
            text, ids, scores, reason = piece
            if ids:
                yield _sse(shape.chunk(text, ids, None, scores=scores, index=index))
                text = None
            if reason is not None:
                yield _sse(shape.chunk(text or None, [], reason, index=index))
            if choices.ended:
                if include_usage:
                    yield _sse(shape.usage(choices.usage()))
                yield _sse("[DONE]")
                return
    finally:   # the client went away (the generator is closed) or the stream ended
        choices.cancel()
