"""Log-probabilities of labelled tokens under a causal LM, in fp32: what the preference and
reinforcement-learning objectives compare. Rows are token ids with ``labels`` aligned with them
(-100 where a token is not scored: the prompt, padding); the model's convention is kiln's
(``model(input_ids, attention_mask=..., position_ids=...)`` gives logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.data.batch import IGNORE_INDEX, TokenBatch


def token_logps(model: nn.Module, rows: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each scored token's log-probability [rows, length - 1] (0 where not scored), and the mask
    of the scored ones."""
    logits = model(rows.input_ids, attention_mask=rows.attention_mask, position_ids=rows.position_ids)
    targets = rows.labels[:, 1:]
    nll = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return -nll.view(targets.shape), targets != IGNORE_INDEX


def completion_logps(model: nn.Module, rows: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities [rows] of each row's scored tokens, and how many there are."""
    logps, scored = token_logps(model, rows)
    return logps.sum(1), scored.sum(1)
