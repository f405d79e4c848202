"""Features applied to a plain model from outside: the model file knows nothing of them."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln.models.family import ParallelPlan


def apply_activation_checkpointing(model: nn.Module, plan: ParallelPlan | None = None) -> nn.Module:
    """Recompute each repeated layer's activations during backward instead of keeping them.

    The layers are the plan's (by default: the model's ``blocks``). Each one's ``forward`` is
    replaced on the instance, so parameter names and state dicts stay exactly those of the plain
    model (checkpoints stay interchangeable with and without it).
    """
    blocks = (plan or ParallelPlan.infer(model)).repeated_blocks(model)
    if not blocks:
        raise ValueError(
            "train.activation_checkpointing: the model must expose its repeated layers as an "
            f"nn.ModuleList named `blocks` (or a model family's plan must name them); {type(model).__name__} has none"
        )
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def apply_compile(fn: Callable) -> Callable:
    """Compile ``fn`` (a model, or a loss function that calls one) with torch.compile."""
    return torch.compile(fn)
