"""Log-probabilities of labelled tokens under a causal LM, in fp32: what the preference and
reinforcement-learning objectives compare. Rows are token ids with ``labels`` aligned with them
(-100 where a token is not scored: the prompt, padding); the model is a causal LM in kiln's
convention that gives them for ``model(input_ids, labels=..., ..., token_logps=True)`` (kiln's
Hugging Face ``CausalLM``)."""

from __future__ import annotations

import torch
from torch import nn

from kiln.data.batch import TokenBatch
from kiln.labels import IGNORE_INDEX


def token_logps(model: nn.Module, rows: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each scored token's log-probability [rows, length - 1] (0 where not scored), and the mask
    of the scored ones: through the model's chunked output projection (no [tokens, vocabulary]
    logits held whole) where it has one."""
    logps = model(
        rows.input_ids,
        labels=rows.labels,
        attention_mask=rows.attention_mask,
        position_ids=rows.position_ids,
        token_logps=True,
    )
    return logps, rows.labels[:, 1:] != IGNORE_INDEX


def completion_logps(model: nn.Module, rows: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities [rows] of each row's scored tokens, and how many there are."""
    logps, scored = token_logps(model, rows)
    return logps.sum(1), scored.sum(1)
