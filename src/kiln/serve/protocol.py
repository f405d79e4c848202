"""OpenAI's API as ``kiln serve`` speaks it: request bodies checked and turned into jobs, and the
JSON of responses, stream chunks and errors."""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from kiln.data.tokenizer import Codec
from kiln.serve.engine import Job

# OpenAI's default for /v1/completions; chat gets the rest of the context.
DEFAULT_MAX_TOKENS = 16
# Fields of OpenAI's API that kiln does not implement, with the value that asks for nothing: any
# other value is refused, so that no client silently gets something other than it asked for.
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "suffix": "",
    "logprobs": False,
    "top_logprobs": 0,
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0,
}


class ApiError(Exception):
    """A request that cannot be served, answered with OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def completion_job(body: dict[str, Any], codec: Codec, context: int | None) -> Job:
    """The job of a /v1/completions request: ``prompt`` is a string or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one, as some clients send every prompt
    if isinstance(prompt, str):
        ids = codec.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t < codec.vocab_size for t in prompt):
            raise ApiError(f"prompt: token ids must be in [0, {codec.vocab_size})", "prompt")
        ids = prompt
    elif prompt is None:
        raise ApiError("prompt is required", "prompt")
    else:
        raise ApiError("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise ApiError("prompt is empty and this tokenizer has no end-of-text token to start from", "prompt")
    return _job(body, ids, "prompt", context, DEFAULT_MAX_TOKENS)


def chat_job(body: dict[str, Any], codec: Codec, context: int | None) -> Job:
    """The job of a /v1/chat/completions request: ``messages`` rendered by the chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", "messages")
    turns = [_turn(m, i) for i, m in enumerate(messages)]
    if not codec.has_chat_template:
        raise ApiError(
            "this model's tokenizer has no chat template, so it cannot render messages; "
            "send the text to /v1/completions instead",
            "messages",
        )
    from jinja2 import TemplateError

    try:
        ids = codec.chat(turns)
    except TemplateError as e:
        raise ApiError(f"the model's chat template refused these messages: {e}", "messages") from None
    return _job(body, ids, "messages", context, None)


def _turn(message: Any, i: int) -> dict[str, str]:
    """One message as the chat template takes it; a list of text parts is joined into one text."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(f"{where} must be an object with a string role", where)
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(f"{where}.content: only text parts ({{type: text, text}}) are supported", where)
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise ApiError(f"{where}.content must be a string or a list of text parts", where)
    return {"role": message["role"], "content": content or ""}


def _job(body: dict[str, Any], ids: list[int], param: str, context: int | None, default_max: int | None) -> Job:
    """The sampling fields of a request, checked; ``default_max`` None: up to the end of the context.

    The prompt and the tokens asked for must fit in the model's context together, as in vLLM."""
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) not in (None, neutral):
            raise ApiError(f"{name}={json.dumps(body[name])} is not supported by kiln serve", name)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError("model must be a string", "model")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, max_name, None, lambda v: v >= 1, "an integer >= 1", integer=True)
    temperature = _number(body, "temperature", 1.0, lambda v: v >= 0, "a number >= 0 (0 is greedy)")
    top_p = _number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _number(body, "top_k", 0, lambda v: v >= 0, "an integer >= 0 (0: every token)", integer=True)
    seed = _number(body, "seed", None, lambda v: -(2**63) <= v < 2**64, "a 64-bit integer", integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError("stop must be a non-empty string or a list of them", "stop")

    if context is not None:
        room = context - len(ids)
        if room < 1:
            raise ApiError(
                f"the prompt is {len(ids)} tokens and the model's context is {context}: no room is left to generate",
                param,
            )
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise ApiError(
                f"{max_name}={max_tokens} and the prompt's {len(ids)} tokens exceed the model's context of "
                f"{context} tokens: at most {room} new tokens fit",
                max_name,
            )
    elif max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS  # the context is unknown, so there is no end of it to fill
    return Job(
        prompt=ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p if top_p < 1 else None,
        top_k=top_k or None,
        stop=stop,
        seed=seed,
    )


def streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream``, and whether a last chunk carries the usage (``stream_options.include_usage``)."""
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise ApiError("stream must be true or false", "stream")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError("stream_options must be an object like {include_usage: true}", "stream_options")
    return stream, bool(options.get("include_usage"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str, default, ok, rule: str, integer: bool = False):
    """``body[name]`` if it is a number satisfying ``ok``, ``default`` if absent or null; else a 400."""
    value = body.get(name)
    if value is None:
        return default
    typed = _is_int(value) if integer else (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if not typed or not ok(value):
        raise ApiError(f"{name} must be {rule}, not {json.dumps(value)}", name)
    return value


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Reply:
    """The JSON of one answer, whole or as stream chunks: completions and chat differ only in
    their names and in where the text goes."""

    def __init__(self, model: str, chat: bool):
        self.chat = chat
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def whole(self, text: str, finish_reason: str | None, counts: dict[str, int]) -> dict[str, Any]:
        said = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choice = {"index": 0, **said, "logprobs": None, "finish_reason": finish_reason}
        return {**self.head, "choices": [choice], "usage": counts}

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False) -> dict[str, Any]:
        """A stream chunk; a chat stream's first one names the assistant's role."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
            said: dict[str, Any] = {"delta": delta}
        else:
            said = {"text": text}
        choice = {"index": 0, **said, "logprobs": None, "finish_reason": finish_reason}
        return {**self._chunk_head(), "choices": [choice]}

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        """The last chunk when the client asked for the usage: no choices."""
        return {**self._chunk_head(), "choices": [], "usage": counts}

    def _chunk_head(self) -> dict[str, Any]:
        return {**self.head, "object": "chat.completion.chunk"} if self.chat else self.head
