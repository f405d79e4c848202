"""The HTTP side of ``kiln serve``: a FastAPI app with OpenAI's endpoints over one ``Engine``."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as e:
    raise ImportError(f"kiln serve needs fastapi and uvicorn ({e}): pip install 'kiln[serve]'") from None

from kiln.serve.engine import Engine, GenerationRequest, QueueFullError, Score
from kiln.serve.protocol import (
    ApiError,
    Completion,
    Reply,
    chat_job,
    completion_request,
    logprobs_json,
    parse_body,
    streaming,
    usage,
)
from kiln.train.run import LoadedRun

log = logging.getLogger("kiln.serve")
T = TypeVar("T")


# The largest request body read (413 past it, before it is read): a prompt of a 128k-token
# context is about 0.5 MB of text, a batch of such prompts a few MB.
MAX_BODY_BYTES = 8 << 20
TOO_LARGE = f"the body is larger than {MAX_BODY_BYTES:,} bytes"
INTERNAL = "internal error (see the server's log)"


def create_app(
    run: LoadedRun,
    model_name: str,
    *,
    max_batch: int = 8,
    max_batch_tokens: int = 512,
    api_key: str | None = None,
    max_model_len: int | None = None,
    max_queue: int = 256,
    timeout: float = 600.0,
    compiled: bool = False,
) -> FastAPI:
    """The app serving ``run``'s model as ``model_name``; its worker runs while the app does (its
    lifespan). ``max_batch``: requests decoded at once, in one batch, the others wait their turn;
    ``max_batch_tokens``: the tokens one step feeds the model (a token of each running request,
    the rest chunks of new prompts); ``compiled``: the decode step compiled (``CompiledDecoding``)
    before the app is made. With
    ``api_key`` every route but /health needs ``Authorization: Bearer API_KEY``;
    ``max_model_len`` caps the context a request may fill (prompt and new tokens). Past
    ``max_queue`` waiting requests a new one is answered 429; a request still running after
    ``timeout`` seconds is ended (504, or an error event ending its stream), and one whose client
    went away stops decoding.

    A request naming another ``model`` is a 404, as OpenAI's and vLLM's servers answer; a body
    must be JSON (415 otherwise) of at most MAX_BODY_BYTES (413)."""
    engine = Engine(run, max_batch, max_model_len, max_queue, max_batch_tokens, compiled)
    started = int(time.time())
    key = api_key.encode() if api_key else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="kiln serve", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _respond(e)

    @app.exception_handler(QueueFullError)
    async def busy(request: Request, e: QueueFullError) -> JSONResponse:
        return _respond(ApiError(str(e), status=429, kind="rate_limit_error", code="queue_full"), {"Retry-After": "1"})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = f"{e.detail} ({request.method} {request.url.path})"
        return await api_error(request, ApiError(message, status=e.status_code))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        # What failed stays in the server's log: an exception's text can tell a client about the machine.
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return await api_error(request, ApiError(INTERNAL, status=500, kind="server_error"))

    app.add_middleware(_Guard, key=key)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "kiln"}
        return {"object": "list", "data": [{**card, "max_model_len": engine.context}]}

    async def read(request: Request) -> dict:
        """The body (read up to MAX_BODY_BYTES, for a body sent without its length), for this model."""
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(TOO_LARGE, status=413)
        body = parse_body(bytes(raw))
        if body.get("model") not in (None, model_name):
            raise ApiError(
                f"the model {body['model']!r} does not exist here: this server serves {model_name!r}",
                "model",
                status=404,
                code="model_not_found",
            )
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read(request)
        # Tokenizing a long prompt takes a while: not on the loop that every other request shares.
        completion = await asyncio.to_thread(completion_request, body, engine.codec, engine.context)
        if completion.plain:
            return await _answer(engine, completion.jobs[0], body, Reply(model_name, False), request, timeout)
        if streaming(body)[0]:
            raise ApiError("stream=true takes one prompt, without echo or logprobs, in kiln serve", "stream")
        return await _while_connected(request, _complete(engine, completion, Reply(model_name, False)), timeout)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read(request)
        job = await asyncio.to_thread(chat_job, body, engine.codec, engine.context)
        return await _answer(engine, job, body, Reply(model_name, True), request, timeout)

    return app


def _respond(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error JSON for ``error``, with its status."""
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class _Guard:
    """The API key, and a POST body's type and announced size, checked before a route reads
    anything. A plain ASGI middleware: FastAPI's http middleware would sit between a route and
    its client, and hide from it that the client went away."""

    def __init__(self, app: Any, key: bytes | None):
        self.app, self.key = app, key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (refused := self._refusal(scope)) is not None:
            await refused(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _refusal(self, scope: dict) -> JSONResponse | None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        if self.key is not None and scope["path"] != "/health":
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.key):
                error = ApiError(
                    "missing or incorrect API key (Authorization: Bearer KEY)", status=401, code="invalid_api_key"
                )
                return _respond(error, {"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return _respond(
                    ApiError(
                        f"the body must be JSON (Content-Type: application/json), not {kind or 'unnamed'}", status=415
                    )
                )
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
                # Answered from the headers: the body is not read, so the connection closes after.
                return _respond(ApiError(TOO_LARGE, status=413), {"Connection": "close"})
        return None


def run_server(app: FastAPI, sock: socket.socket) -> None:
    """Serve the app on a listening socket until Ctrl-C (or SIGTERM): uvicorn then stops taking
    connections and lets the requests in flight finish; a second Ctrl-C quits at once."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn passes the Ctrl-C on once it has shut down
        server.run(sockets=[sock])


async def _answer(engine: Engine, job: GenerationRequest, body: dict, reply: Reply, request: Request, timeout: float):
    stream, include_usage = streaming(body)
    if stream:
        engine.check_room()  # a 429 now: once the stream's status line is out, it cannot be one
        return StreamingResponse(
            _events(engine, job, reply, include_usage, time.monotonic() + timeout),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def whole() -> dict:
        pieces, last = [], None
        async for last in engine.generate(job):
            pieces.append(last.text)
        assert last is not None  # generate yields up to an update with a finish_reason, or raises
        return reply.whole("".join(pieces), last.finish_reason, usage(len(job.prompt), last.completion_tokens))

    return await _while_connected(request, whole(), timeout)


async def _while_connected(request: Request, answer: Coroutine[Any, Any, T], timeout: float) -> T:
    """``answer``, cancelled (and with it its decoding: ``Engine.generate`` cancels the job it
    leaves) when the client goes away first, or past ``timeout`` seconds (504)."""
    task = asyncio.ensure_future(answer)
    deadline = time.monotonic() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=min(0.25, max(0.0, deadline - time.monotonic())))
            if done:
                return task.result()
            if time.monotonic() >= deadline:
                raise ApiError(f"the request ran past the server's {timeout:g} s limit", status=504, kind="timeout")
            if await request.is_disconnected():  # nobody to answer (nginx's 499)
                raise ApiError("the client closed the request", status=499)
    finally:
        task.cancel()


async def _complete(engine: Engine, completion: Completion, reply: Reply) -> dict:
    """The answer to several prompts, or with the prompt echoed or log-probabilities: each prompt
    generated as alone, then, for log-probabilities, every prompt with what it generated scored
    in one turn of the worker."""

    async def generate(job: GenerationRequest) -> tuple[str, str, list[int]]:
        if job.max_tokens == 0:  # echo=true, max_tokens=0: the prompt scored, nothing generated
            return "", "length", []
        pieces, last = [], None
        async for last in engine.generate(job):
            pieces.append(last.text)
        assert last is not None and last.finish_reason is not None
        return "".join(pieces), last.finish_reason, list(last.token_ids)

    jobs = completion.jobs
    answers = await asyncio.gather(*(generate(job) for job in jobs))
    scored = []
    if completion.logprobs is not None:
        scores = [
            Score(job.prompt + ids, 1 if completion.echo else len(job.prompt), completion.logprobs)
            for job, (_, _, ids) in zip(jobs, answers, strict=True)
        ]
        scored = await engine.score(scores)
    decode = engine.codec.decode
    choices = []
    for i, (job, (text, finish, ids)) in enumerate(zip(jobs, answers, strict=True)):
        echoed = "" if not completion.echo else completion.texts[i] or decode(job.prompt)
        logprobs = None
        if scored:
            logprobs = await asyncio.to_thread(
                logprobs_json, decode, job.prompt, ids, completion.echo, scored[i], len(echoed), completion.token_ids
            )
        choices.append({"index": i, "text": echoed + text, "logprobs": logprobs, "finish_reason": finish})
    counts = usage(sum(len(job.prompt) for job in jobs), sum(len(ids) for _, _, ids in answers))
    return reply.choices(choices, counts)


async def _events(
    engine: Engine, job: GenerationRequest, reply: Reply, include_usage: bool, deadline: float
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, the finish_reason in the last, then [DONE].
    (A client that goes away closes this generator, and with it the decoding.)"""
    if reply.chat:
        yield _sse(reply.chunk("", first=True))
    try:
        async for update in engine.generate(job):
            yield _sse(reply.chunk(update.text, update.finish_reason))
            if time.monotonic() > deadline and not update.finish_reason:
                yield _sse(ApiError("the request ran past the server's time limit", status=504, kind="timeout").body())
                break
        if include_usage:
            yield _sse(reply.usage_chunk(usage(len(job.prompt), update.completion_tokens)))
    except RuntimeError as e:  # the status line has gone out: the error travels in the stream
        log.error("a stream ended by an error", exc_info=e)
        yield _sse(ApiError(INTERNAL, status=500, kind="server_error").body())
    yield "data: [DONE]\n\n"


# Characters JSON leaves as they are that Python's str.splitlines (and clients reading events
# with it, such as httpx's iter_lines) takes for line ends: escaped, each event stays one line.
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False).translate(_LINE_ENDS)}\n\n"
