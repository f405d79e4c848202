"""Batches as the loop handles them: moved to the device, built from dataset items outside a
DataLoader, and cut into micro-batches. A batch is a tensor, a tuple, list or dict of them, or a
``RowBatch``: a ``TokenBatch`` (variable-length token rows that know their real lengths and loss
tokens), a ``TextBatch`` (windows of a token stream whose documents attend only within
themselves) or a ``PairBatch`` (preference pairs, a chosen and a rejected row each)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from kiln.labels import IGNORE_INDEX


class RowBatch(ABC):
    """A batch that moves, pins and cuts itself, and knows on the host what its loss averages over
    and how many real tokens it holds; the helpers below treat every kind alike through it."""

    @abstractmethod
    def __len__(self) -> int:
        """Rows: what a micro-batch size counts."""

    @property
    @abstractmethod
    def count(self) -> int:
        """What the batch's mean loss averages over."""

    @property
    @abstractmethod
    def tokens(self) -> int:
        """Real (not padding) tokens of the batch."""

    @abstractmethod
    def to(self, device: torch.device, non_blocking: bool = True) -> RowBatch: ...

    @abstractmethod
    def pin_memory(self) -> RowBatch: ...

    @abstractmethod
    def split_rows(self, size: int) -> Sequence[RowBatch]:
        """Micro-batches of ``size`` rows each (the last may have fewer)."""


@dataclass
class TokenBatch(RowBatch):
    """Rows of token ids, padded on the right to the longest row. ``labels`` are the targets of
    the loss (IGNORE_INDEX where none is wanted, e.g. prompt and padding); ``attention_mask``
    marks real tokens (None when packed rows carry ``position_ids`` that restart at each
    document instead). Host-side, per row: its real length, its loss tokens and the UTF-8
    bytes its targets stand for, so the loop weighs micro-batches and counts throughput without
    asking the device."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    token_type_ids: torch.Tensor | None = None
    lengths: list[int] = field(default_factory=list)
    loss_tokens: list[int] = field(default_factory=list)
    target_bytes: list[int] = field(default_factory=list)
    fixed: bool = False  # padded to a width that its micro-batches keep (pipeline stages need one shape)

    _TENSORS = ("input_ids", "labels", "attention_mask", "position_ids", "token_type_ids")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def count(self) -> int:
        """Loss tokens (or items) of the whole batch: what its mean loss averages over."""
        return sum(self.loss_tokens)

    @property
    def tokens(self) -> int:
        """Real (not padding) tokens of the batch."""
        return sum(self.lengths)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor], rows: slice = slice(None)) -> TokenBatch:
        tensors: dict[str, Any] = {
            name: None if (t := getattr(self, name)) is None else fn(t) for name in self._TENSORS
        }
        hosts: dict[str, Any] = {name: getattr(self, name)[rows] for name in ("lengths", "loss_tokens", "target_bytes")}
        return TokenBatch(**tensors, **hosts, fixed=self.fixed)

    def to(self, device: torch.device, non_blocking: bool = True) -> TokenBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TokenBatch:
        return self._map(torch.Tensor.pin_memory)

    def split_rows(self, size: int) -> list[TokenBatch]:
        """Micro-batches of ``size`` rows, each cut to its own longest row unless ``fixed`` (views, no copies)."""
        out = []
        for start in range(0, len(self), size):
            rows = slice(start, start + size)
            cuts = self.lengths and self.attention_mask is not None and not self.fixed
            width = max(self.lengths[rows]) if cuts else None

            def cut(t: torch.Tensor, r: slice = rows, w: int | None = width) -> torch.Tensor:
                return t[r, :w] if t.dim() > 1 else t[r]

            out.append(self._map(cut, rows))
        return out


@dataclass
class TextBatch(RowBatch):
    """Windows of a token stream whose documents attend only within themselves
    (``data.document_mask``): ``inputs`` [B, T], their ``targets`` (IGNORE_INDEX where an input
    ends a document: the next document's first token is not predicted across the boundary), each
    token's ``positions`` in its document (0 where one starts), and per row, on the host, its loss
    tokens."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    loss_tokens: list[int]

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def count(self) -> int:
        return sum(self.loss_tokens)

    @property
    def tokens(self) -> int:
        return self.inputs.numel()

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor], rows: slice = slice(None)) -> TextBatch:
        return TextBatch(fn(self.inputs), fn(self.targets), fn(self.positions), self.loss_tokens[rows])

    def to(self, device: torch.device, non_blocking: bool = True) -> TextBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TextBatch:
        return self._map(torch.Tensor.pin_memory)

    def split_rows(self, size: int) -> list[TextBatch]:
        out = []
        for start in range(0, len(self), size):
            rows = slice(start, start + size)

            def cut(t: torch.Tensor, r: slice = rows) -> torch.Tensor:
                return t[r]

            out.append(self._map(cut, rows))
        return out

    @staticmethod
    def collate(items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> TextBatch:
        """Items ``(inputs, targets, positions)`` of a ``DocumentSequences`` as one batch."""
        inputs, targets, positions = (torch.stack(t) for t in zip(*items, strict=True))
        return TextBatch(inputs, targets, positions, (targets != IGNORE_INDEX).sum(1).tolist())


@dataclass
class PairBatch(RowBatch):
    """Preference pairs: row i of ``chosen`` and of ``rejected`` answer the same prompt, and
    ``index`` (host-side) is each pair's index in its dataset. A row of this batch is a pair, so
    micro-batches never part a pair's two halves, and the loss (one term a pair) averages over pairs."""

    chosen: TokenBatch
    rejected: TokenBatch
    index: list[int] = field(default_factory=list)
    # KTO's: ``chosen`` holds each record's answer, labelled desirable or not here, and ``rejected``
    # its prompt with another record's answer (the rows its KL baseline is estimated from).
    desirable: list[bool] | None = None

    def __len__(self) -> int:
        return len(self.chosen)

    @property
    def count(self) -> int:
        return len(self)

    @property
    def tokens(self) -> int:
        return self.chosen.tokens + self.rejected.tokens

    def to(self, device: torch.device, non_blocking: bool = True) -> PairBatch:
        halves = self.chosen.to(device, non_blocking), self.rejected.to(device, non_blocking)
        return PairBatch(*halves, self.index, self.desirable)

    def pin_memory(self) -> PairBatch:
        return PairBatch(self.chosen.pin_memory(), self.rejected.pin_memory(), self.index, self.desirable)

    def split_rows(self, size: int) -> list[PairBatch]:
        """Micro-batches of ``size`` pairs, each half cut to its own longest row."""
        labels = self.desirable
        return [
            PairBatch(chosen, rejected, self.index[start : start + size], labels and labels[start : start + size])
            for start, chosen, rejected in zip(
                range(0, len(self), size), self.chosen.split_rows(size), self.rejected.split_rows(size), strict=True
            )
        ]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a (nested) batch; non_blocking overlaps the copy from pinned memory with compute."""
    if isinstance(batch, (torch.Tensor, RowBatch)):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def collate(
    dataset: Dataset, indices: Iterable[int], device: torch.device, collate_fn: Callable[[list], Any] = default_collate
) -> Any:
    """Items ``indices`` of ``dataset`` as one batch on ``device``, outside any DataLoader."""
    return to_device(collate_fn([dataset[i] for i in indices]), device)


def split_batch(batch: Any, size: int) -> list[Any]:
    """Cut a (nested) batch into micro-batches of ``size`` rows (views, no copies)."""
    if isinstance(batch, RowBatch):
        return list(batch.split_rows(size))
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
    if isinstance(batch, (torch.Tensor, RowBatch)):
        return len(batch)
    return batch_rows(next(iter(batch.values() if isinstance(batch, dict) else batch)))


def loss_count(batch: Any) -> int | None:
    """What a batch's mean loss averages over, where the batch knows it (a ``RowBatch``); None
    for batches whose micro-batches weigh the same."""
    return batch.count if isinstance(batch, RowBatch) else None


def pad_id(tokenizer: Any) -> int:
    """The token a ``transformers`` tokenizer's rows are padded with: its padding token, else its
    end of sequence, else 0 (padding is masked out and never a target, so any id of the
    vocabulary serves where the tokenizer names neither)."""
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    return 0


def next_labels(labels: torch.Tensor) -> torch.Tensor:
    """The targets of rows labelled as ``transformers`` labels them (aligned with the inputs):
    each input's next label, and none for the last."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], 1)


def pad_rows(rows: Sequence[Sequence[int]], value: int, width: int = 0) -> torch.Tensor:
    """Rows of different lengths as one [rows, longest] int64 tensor (or as wide as ``width``, if
    wider), padded on the right."""
    width = max(width, *(len(r) for r in rows)) if rows else width
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out
