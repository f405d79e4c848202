"""Batches as the loop handles them: moved to the device, built from dataset items outside a
DataLoader, and cut into micro-batches. A batch is a tensor, or a tuple, list or dict of them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a (nested) batch; non_blocking overlaps the copy from pinned memory with compute."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def collate(dataset: Dataset, indices: Iterable[int], device: torch.device) -> Any:
    """Items ``indices`` of ``dataset`` as one batch on ``device``, outside any DataLoader."""
    return to_device(default_collate([dataset[i] for i in indices]), device)


def split_batch(batch: Any, size: int) -> list[Any]:
    """Cut a (nested) batch into micro-batches of ``size`` rows (views, no copies)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(size))
    if isinstance(batch, (list, tuple)):
        return [type(batch)(parts) for parts in zip(*(split_batch(b, size) for b in batch), strict=True)]
    if isinstance(batch, dict):
        return [
            dict(zip(batch, parts, strict=True))
            for parts in zip(*(split_batch(v, size) for v in batch.values()), strict=True)
        ]
    raise TypeError(
        f"cannot split a batch of type {type(batch).__name__} into micro-batches; "
        "use tensors, or tuples, lists or dicts of them"
    )


def batch_rows(batch: Any) -> int:
    """Rows (sequences, samples) of a batch: the length of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    return batch_rows(next(iter(batch.values() if isinstance(batch, dict) else batch)))
