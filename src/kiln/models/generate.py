"""Autoregressive sampling with a KV cache: the prompt is processed once, then one token per step.

Any model that offers ``new_kv_cache`` and takes ``kv_cache``/``start_pos`` in its forward (as
kiln's GPT does) can be sampled this way: ``stream`` yields each step's tokens as they are made
(for a server), ``generate`` returns them all."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any, Protocol, cast

import torch
from torch import nn


class _Config(Protocol):
    @property
    def max_seq_len(self) -> int: ...


class _Cached(Protocol):
    """A model ``stream`` can sample: its config's ``max_seq_len``, and ``new_kv_cache``."""

    @property
    def config(self) -> _Config: ...

    def new_kv_cache(self, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype) -> Any: ...


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row [B] from next-token logits [B, V]; temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # Nucleus: keep the most likely tokens until their probabilities sum to top_p. A token is
        # dropped when the tokens ranked above it already reach top_p, so the first always stays.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_drop = mass_above >= top_p
        drop = torch.zeros_like(sorted_drop).scatter(-1, order, sorted_drop)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def stream(
    model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, **sampling: Any
) -> Generator[torch.Tensor, None, None]:
    """The tokens [B] that continue prompt [B, T], one step at a time (see ``decode``).

    The prompt is cut to the model's last max_seq_len tokens; decoding then goes on as long as
    asked, each token seeing the max_seq_len before it (the cache is a ring, never rebuilt).
    """
    cached = cast(_Cached, model)
    max_len = cached.config.max_seq_len
    param = next(model.parameters())
    cache = cached.new_kv_cache(prompt.size(0), max_len, param.device, param.dtype)
    window = prompt[:, -max_len:]
    pos = window.size(1)

    def step(token: torch.Tensor) -> torch.Tensor:
        nonlocal pos
        pos += 1
        return model(token[:, None], kv_cache=cache, start_pos=pos - 1)[:, -1]

    return decode(model, lambda: model(window, kv_cache=cache)[:, -1], step, max_new_tokens, **sampling)


def decode(
    model: nn.Module,
    prefill: Callable[[], torch.Tensor],
    step: Callable[[torch.Tensor], torch.Tensor],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Generator[torch.Tensor, None, None]:
    """Sampled tokens [B], one step at a time, up to max_new_tokens: ``prefill()`` gives the
    next-token logits [B, V] after the prompt, ``step(tokens)`` those after feeding the tokens.

    Rows that produced eos_id keep emitting it; the stream ends once every row has. The model is
    in eval mode while the stream is open and gets its own mode back when it ends or is closed.
    """
    was_training = model.training
    model.eval()
    # no_grad, not inference_mode: a run samples from the model it trains, whose float8 training
    # layers (train.precision=fp8) refuse inference-mode tensors.
    try:
        with torch.no_grad():
            logits = prefill()
            done = torch.zeros(logits.size(0), dtype=torch.bool, device=logits.device)
        for i in range(max_new_tokens):
            with torch.no_grad():
                token = sample_next(logits, temperature, top_k, top_p, generator)
                if eos_id is not None:
                    token = token.masked_fill(done, eos_id)
                    done |= token == eos_id
            yield token
            if i == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
                return
            with torch.no_grad():
                logits = step(token)
    finally:
        model.train(was_training)


def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
    """Continue prompt [B, T] by up to max_new_tokens tokens (see ``stream``): [B, T + new]."""
    return collect(prompt, stream(model, prompt, max_new_tokens, **sampling))


def collect(prompt: torch.Tensor, tokens: Iterable[torch.Tensor]) -> torch.Tensor:
    """The prompt [B, T] with a stream's tokens appended: [B, T + new]."""
    return torch.cat([prompt, *(token[:, None] for token in tokens)], dim=1)
