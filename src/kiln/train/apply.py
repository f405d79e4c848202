"""Features applied to a plain model from outside: the model file knows nothing of them."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def repeated_blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(
            "train.activation_checkpointing: the model must expose its repeated layers as an "
            f"nn.ModuleList named `blocks`; {type(model).__name__} has none"
        )
    return blocks


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each block's activations during backward instead of keeping them.

    The block's ``forward`` is replaced on the instance, so parameter names and state dicts stay
    exactly those of the plain model (checkpoints stay interchangeable with and without it).
    """
    for block in repeated_blocks(model):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def apply_compile(fn: Callable) -> Callable:
    """Compile ``fn`` (a model, or a loss function that calls one) with torch.compile."""
    return torch.compile(fn)
