"""What causal language models share: the training loss and evaluation in bits per byte."""

from __future__ import annotations

import math

import torch
from torch import nn

from kiln.models.fused_loss import IGNORE_INDEX


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss of ``(inputs, targets)``; the model computes it given targets (kiln's
    GPT fuses it with its output layer, in fp32)."""
    x, y = batch
    return model(x, y)


@torch.no_grad()
def evaluate_lm(model: nn.Module, batches, token_bytes: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Mean loss, perplexity and bits per byte over fixed batches.

    Bits per byte divides the summed loss (in bits) by the UTF-8 bytes the target tokens stand
    for, so models with different tokenizers are compared on the same scale. The model computes
    each batch's mean loss itself, as in training (kiln's GPT without ever holding the logits of
    the whole batch; a pipeline returns it from its last stage to every rank)."""
    nats = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.int64)
    nbytes = torch.zeros((), device=device, dtype=torch.int64)
    token_bytes = token_bytes.to(device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        keep = y != IGNORE_INDEX  # targets of -100 (padding) are left out of the mean and the bytes
        kept = keep.sum()
        nats += model(x, targets=y).double() * kept
        tokens += kept
        nbytes += (token_bytes[y.clamp(min=0)] * keep).sum()
    loss = nats.item() / tokens.item()
    return {
        "val_loss": loss,
        "val_ppl": math.exp(min(loss, 50.0)),
        "val_bpb": nats.item() / (math.log(2) * max(1, nbytes.item())),
    }
