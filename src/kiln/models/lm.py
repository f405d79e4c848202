"""What causal language models share: the training loss and evaluation in bits per byte."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kiln.labels import IGNORE_INDEX


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Which document of its row each token is in [B, T], from its position in it [B, T] (a
    document starts where the position is 0), as ``transformers`` reads packed rows' position_ids."""
    return (positions == 0).cumsum(1)


def document_mask(queries: torch.Tensor, keys: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The boolean attention mask [B, 1, Q, K] of queries in documents ``queries`` [B, Q] at
    sequence positions ``at`` [Q] over keys 0..K - 1 in documents ``keys`` [B, K]: each sees the
    keys of its own document up to itself."""
    causal = at[:, None] >= torch.arange(keys.size(1), device=keys.device)
    return ((queries[:, :, None] == keys[:, None, :]) & causal).unsqueeze(1)


def lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean next-token loss of ``(inputs, targets)``, or of a batch of ``inputs``, ``targets`` and
    ``positions`` (``kiln.data.batch.TextBatch``: each row's documents attending only to
    themselves); the model computes it given targets (kiln's GPT fuses it with its output layer,
    in fp32)."""
    if packed(batch):
        return model(batch.inputs, batch.targets, positions=batch.positions)
    x, y = batch
    return model(x, y)


def packed(batch: Any) -> bool:
    """Whether ``batch`` is text whose rows pack documents (a ``TextBatch``, told by its fields:
    the data layer is beside this one, not below it)."""
    return hasattr(batch, "positions") and hasattr(batch, "targets")


def targets_of(batch: Any) -> torch.Tensor:
    return batch.targets if packed(batch) else batch[1]


@torch.no_grad()
def evaluate_lm(
    model: nn.Module, batches, token_bytes: torch.Tensor, device: torch.device, loss: Callable = lm_loss
) -> dict[str, float]:
    """Mean loss, perplexity and bits per byte over fixed batches.

    Bits per byte divides the summed loss (in bits) by the UTF-8 bytes the target tokens stand
    for, so models with different tokenizers are compared on the same scale. The model computes
    each batch's mean loss itself, as in training (kiln's GPT without ever holding the logits of
    the whole batch; a pipeline returns it from its last stage to every rank), by ``loss`` (the
    family's training loss)."""
    nats = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.int64)
    nbytes = torch.zeros((), device=device, dtype=torch.int64)
    token_bytes = token_bytes.to(device)
    for batch in batches:
        batch = batch.to(device) if packed(batch) else tuple(t.to(device, non_blocking=True) for t in batch)
        y = targets_of(batch)
        keep = y != IGNORE_INDEX  # targets of -100 (padding) are left out of the mean and the bytes
        kept = keep.sum()
        nats += loss(model, batch).double() * kept
        tokens += kept
        nbytes += (token_bytes[y.clamp(min=0)] * keep).sum()
    mean = nats.item() / tokens.item()
    return {
        "val_loss": mean,
        "val_ppl": math.exp(min(mean, 50.0)),
        "val_bpb": nats.item() / (math.log(2) * max(1, nbytes.item())),
    }
