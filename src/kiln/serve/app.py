"""The HTTP side of ``kiln serve``: a FastAPI app with OpenAI's endpoints over one ``Engine``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as e:
    raise ImportError(f"kiln serve needs fastapi and uvicorn ({e}): pip install 'kiln[serve]'") from None

from kiln.serve.engine import Engine, GenerationRequest, Score
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


def create_app(run: LoadedRun, model_name: str, *, parallel: int = 8) -> FastAPI:
    """The app serving ``run``'s model as ``model_name``; its worker runs while the app does (its
    lifespan). ``parallel``: requests decoded at once, the others wait their turn.

    Any ``model`` in a request is answered by this model, as llama.cpp's server does."""
    engine = Engine(run, parallel)
    started = int(time.time())

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
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = f"{e.detail} ({request.method} {request.url.path})"
        return await api_error(request, ApiError(message, status=e.status_code))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        return await api_error(request, ApiError(str(e), status=500, kind="server_error"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "kiln"}
        return {"object": "list", "data": [{**card, "max_model_len": engine.context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(await request.body())
        completion = completion_request(body, engine.codec, engine.context)
        if completion.plain:
            return await _answer(engine, completion.jobs[0], body, Reply(model_name, False))
        if streaming(body)[0]:
            raise ApiError("stream=true takes one prompt, without echo or logprobs, in kiln serve", "stream")
        return await _complete(engine, completion, Reply(model_name, False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(await request.body())
        return await _answer(engine, chat_job(body, engine.codec, engine.context), body, Reply(model_name, True))

    return app


def run_server(app: FastAPI, sock: socket.socket) -> None:
    """Serve the app on a listening socket until Ctrl-C (or SIGTERM): uvicorn then stops taking
    connections and lets the requests in flight finish; a second Ctrl-C quits at once."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn passes the Ctrl-C on once it has shut down
        server.run(sockets=[sock])


async def _answer(engine: Engine, job: GenerationRequest, body: dict, reply: Reply):
    stream, include_usage = streaming(body)
    if stream:
        return StreamingResponse(
            _events(engine, job, reply, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    pieces, last = [], None
    async for last in engine.generate(job):
        pieces.append(last.text)
    assert last is not None  # generate yields up to an update with a finish_reason, or raises
    return reply.whole("".join(pieces), last.finish_reason, usage(len(job.prompt), last.completion_tokens))


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


async def _events(engine: Engine, job: GenerationRequest, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, the finish_reason in the last, then [DONE]."""
    if reply.chat:
        yield _sse(reply.chunk("", first=True))
    try:
        async for update in engine.generate(job):
            yield _sse(reply.chunk(update.text, update.finish_reason))
        if include_usage:
            yield _sse(reply.usage_chunk(usage(len(job.prompt), update.completion_tokens)))
    except RuntimeError as e:  # the status line has gone out: the error travels in the stream
        log.warning("stream ended by an error: %s", e)
        yield _sse(ApiError(str(e), status=500, kind="server_error").body())
    yield "data: [DONE]\n\n"


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
