"""Autoregressive sampling with a KV cache: the prompt is processed once, then one token per step.

Any model that offers ``new_kv_cache`` and takes ``kv_cache``/``start_pos`` in its forward (as
kiln's GPT does) can be sampled this way."""

from __future__ import annotations

import torch
from torch import nn


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


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue prompt [B, T] by up to max_new_tokens tokens: returns [B, T + new].

    The model sees at most its last max_seq_len tokens. Rows that produced eos_id keep emitting
    it; generation stops early once every row has. The model's train/eval mode is restored.
    """
    was_training = model.training
    model.eval()
    try:
        max_len = model.config.max_seq_len
        param = next(model.parameters())
        cache = model.new_kv_cache(prompt.size(0), max_len, param.device, param.dtype)
        out = prompt
        window = prompt[:, -max_len:]
        logits = model(window, kv_cache=cache)[:, -1]
        pos = window.size(1)
        done = torch.zeros(prompt.size(0), dtype=torch.bool, device=prompt.device)
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_id is not None:
                token = token.masked_fill(done, eos_id)
                done |= token == eos_id
            out = torch.cat((out, token[:, None]), dim=1)
            if step == max_new_tokens - 1 or (eos_id is not None and done.all()):
                break
            if pos < max_len:
                logits = model(token[:, None], kv_cache=cache, start_pos=pos)[:, -1]
                pos += 1
            else:
                # The context is full: slide it by one token, which changes every position, so
                # the cache is rebuilt from the window (as slow as generating without a cache).
                logits = model(out[:, -max_len:], kv_cache=cache)[:, -1]
        return out
    finally:
        model.train(was_training)
