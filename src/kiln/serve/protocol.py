"""OpenAI's API as ``kiln serve`` speaks it: request bodies checked and turned into jobs, and the
JSON of responses, stream chunks and errors."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.data.tokenizer import Codec
from kiln.serve.engine import PROMPT_CONTEXT, GenerationRequest, Scored

# OpenAI's default for /v1/completions; chat gets the rest of the context.
DEFAULT_MAX_TOKENS = 16
# The most new tokens a request may ask of a model whose context length is unknown.
UNKNOWN_CONTEXT_MAX_TOKENS = 4096
# The most alternatives ``logprobs`` asks for at each position (vLLM's default limit; OpenAI's is 5).
MAX_LOGPROBS = 20
# Fields of OpenAI's API that kiln does not implement, with the value that asks for nothing: any
# other value is refused, so that no client silently gets something other than it asked for.
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "suffix": "",
    "top_logprobs": 0,
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0,
}
# The most prompts one /v1/completions request may carry, and stop strings one request (OpenAI's 4).
MAX_PROMPTS = 256
MAX_STOP = 4
# Fields that only /v1/completions implements.
COMPLETIONS_ONLY = {"echo": False, "logprobs": False}


class ApiError(Exception):
    """A request that cannot be served, answered with OpenAI's error JSON."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


@dataclass
class Completion:
    """A /v1/completions request: a job per prompt (each answered by its own choice, in order),
    the prompts' text as sent (None: sent as token ids), and what the answers carry."""

    jobs: list[GenerationRequest]
    texts: list[str | None]
    echo: bool = False
    logprobs: int | None = None  # None: no log-probabilities; N: the N most likely tokens too
    token_ids: bool = False  # tokens named "token_id:ID" (vLLM's return_tokens_as_token_ids)

    @property
    def plain(self) -> bool:
        """One prompt continued, nothing more: the answer (streamed or not) only has the text."""
        return len(self.jobs) == 1 and not self.echo and self.logprobs is None


def completion_request(body: dict[str, Any], codec: Codec, context: int | None) -> Completion:
    """A /v1/completions request: ``prompt`` is a string, a list of token ids, or a list of
    either (one choice each); ``echo``, ``logprobs`` and ``max_tokens=0`` with ``echo`` score it."""
    _refuse(body, UNSUPPORTED)
    prompts = _prompts(body.get("prompt"), codec)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ApiError(f"echo must be true or false, not {json.dumps(echo)}", "echo")
    logprobs = _number(
        body, "logprobs", None, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]", integer=True
    )
    token_ids = body.get("return_tokens_as_token_ids")
    if token_ids is not None and not isinstance(token_ids, bool):
        raise ApiError("return_tokens_as_token_ids must be true or false", "return_tokens_as_token_ids")
    jobs = _jobs(body, [ids for ids, _ in prompts], "prompt", context, DEFAULT_MAX_TOKENS, bool(echo))
    return Completion(jobs, [text for _, text in prompts], bool(echo), logprobs, bool(token_ids))


def _refuse(body: dict[str, Any], unsupported: dict[str, Any]) -> None:
    """A 400 for the first field that asks for something kiln does not implement here."""
    for name, neutral in unsupported.items():
        if body.get(name) not in (None, neutral):
            where = " (a /v1/completions field)" if name in COMPLETIONS_ONLY else ""
            raise ApiError(f"{name}={json.dumps(body[name])} is not supported by kiln serve{where}", name)


def _prompts(prompt: Any, codec: Codec) -> list[tuple[list[int], str | None]]:
    """The token ids of each prompt, with its text when it came as a string."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]  # one prompt
    if prompt is None:
        raise ApiError("prompt is required", "prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(
            "prompt must be a string, a list of token ids, or a non-empty list of strings or of lists of token ids",
            "prompt",
        )
    if len(prompt) > MAX_PROMPTS:
        raise ApiError(f"at most {MAX_PROMPTS} prompts a request, not {len(prompt)}", "prompt")
    out: list[tuple[list[int], str | None]] = []
    for i, one in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            ids, text = codec.encode(one), one
        elif isinstance(one, list) and one and all(_is_int(t) for t in one):
            if not all(0 <= t < codec.vocab_size for t in one):
                raise ApiError(f"{where}: token ids must be in [0, {codec.vocab_size})", "prompt")
            ids, text = one, None
        else:
            raise ApiError(f"{where} must be a string or a non-empty list of token ids", "prompt")
        if not ids:
            raise ApiError(f"{where} is empty and this tokenizer has no end-of-text token to start from", "prompt")
        out.append((ids, text))
    return out


def chat_job(body: dict[str, Any], codec: Codec, context: int | None) -> GenerationRequest:
    """The job of a /v1/chat/completions request: ``messages`` rendered by the chat template."""
    _refuse(body, {**UNSUPPORTED, **COMPLETIONS_ONLY})
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
    return _jobs(body, [ids], "messages", context, None)[0]


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


def _jobs(
    body: dict[str, Any],
    prompts: list[list[int]],
    param: str,
    context: int | None,
    default_max: int | None,
    echo: bool = False,
) -> list[GenerationRequest]:
    """A job for each prompt from the sampling fields of a request, checked; ``default_max`` None:
    up to the end of the context. ``max_tokens=0`` asks for no tokens, which only an echo makes
    sense of (the prompt scored).

    The prompt and the tokens asked for must fit in the model's context together, as in vLLM."""
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError("model must be a string", "model")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    least = 0 if echo else 1
    rule = "an integer >= 0 (0: the prompt scored, nothing generated)" if echo else "an integer >= 1 (0 with echo)"
    asked = _number(body, max_name, None, lambda v: v >= least, rule, integer=True)
    temperature = _number(body, "temperature", 1.0, lambda v: v >= 0, "a number >= 0 (0 is greedy)")
    top_p = _number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _number(body, "top_k", 0, lambda v: v >= 0, "an integer >= 0 (0: every token)", integer=True)
    seed = _number(body, "seed", None, lambda v: -(2**63) <= v < 2**64, "a 64-bit integer", integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError("stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP or any(len(s) > 1000 for s in stop):
        raise ApiError(f"at most {MAX_STOP} stop strings of at most 1000 characters", "stop")

    jobs = []
    for ids in prompts:
        max_tokens = asked
        if context is not None:
            room = context - len(ids)
            if room < (0 if asked == 0 else 1):
                raise ApiError(
                    f"the prompt is {len(ids)} tokens and the model's context is {context}: "
                    + ("it does not fit" if asked == 0 else "no room is left to generate"),
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
        elif max_tokens > UNKNOWN_CONTEXT_MAX_TOKENS:
            raise ApiError(
                f"{max_name}={max_tokens}: this model's context length is unknown, so at most "
                f"{UNKNOWN_CONTEXT_MAX_TOKENS} new tokens a request (kiln serve --max-model-len sets one)",
                max_name,
            )
        jobs.append(
            GenerationRequest(
                prompt=ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p if top_p < 1 else None,
                top_k=top_k or None,
                stop=stop,
                seed=seed,
            )
        )
    return jobs


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
        return self.choices([{"index": 0, **said, "logprobs": None, "finish_reason": finish_reason}], counts)

    def choices(self, choices: list[dict[str, Any]], counts: dict[str, int]) -> dict[str, Any]:
        """The whole answer with these choices (a completion's: one per prompt)."""
        return {**self.head, "choices": choices, "usage": counts}

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


def logprobs_json(
    decode: Callable[[list[int]], str],
    prompt: list[int],
    generated: list[int],
    echo: bool,
    scored: Scored,
    echoed: int = 0,
    token_ids: bool = False,
) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` of a completion's choice: the generated tokens, after the
    prompt's with ``echo``, each with its log-probability (``scored``: those of the prompt's tokens
    from its second, with echo, then the generated ones; the first token of an echoed prompt has
    none: null) and in ``top_logprobs`` the most likely tokens at its position, and itself, with
    theirs. ``text_offset``: where each token begins in the choice's text, whose generated part
    begins at ``echoed`` (the length of the echoed prompt's text).

    A token's text is what it adds to the few tokens before it, as the whole text is decoded (a
    tokenizer that writes a token differently at the start of a text, or joins tokens, spells it
    as it reads there); ``token_ids``: "token_id:ID" instead, names that never collide."""
    tokens = prompt + generated
    shown = 0 if echo else len(prompt)
    lead: list[float | None] = [None] if echo else []  # nothing predicts the first token
    names: list[str] = []
    offsets: list[int] = []
    alternatives: list[dict[str, float] | None] = [None] * len(lead)
    at = 0
    for j in range(shown, len(tokens)):
        name = _namer(decode, tokens[max(0, j - PROMPT_CONTEXT) : j], token_ids)
        if j == len(prompt):
            at = echoed if echo else 0
        names.append(name(tokens[j]))
        offsets.append(at)
        at += len(names[-1])
        k = j - shown - len(lead)  # its place in scored
        if k >= 0:
            top = {name(t): v for t, v in zip(scored.top_ids[k], scored.top_logprobs[k], strict=True)}
            top.setdefault(names[-1], scored.logprobs[k])
            alternatives.append(top)
    return {
        "tokens": names,
        "token_logprobs": lead + list(scored.logprobs),
        "top_logprobs": alternatives,
        "text_offset": offsets,
    }


def _namer(decode: Callable[[list[int]], str], before: list[int], token_ids: bool) -> Callable[[int], str]:
    """The name of a token that follows ``before``: the text it adds to theirs (or its id)."""
    if token_ids:
        return lambda token: f"token_id:{token}"
    head = len(decode(before))
    return lambda token: decode([*before, token])[head:]
