"""Weighted mixtures of corpora: which source each sequence of the data order comes from.

The data order numbers the sequences of a run by position g (``StepSampler``: the j-th sequence
of step s is at the sequences of the steps before s, plus j). In a mixture, the positions are cut
into blocks of ``BLOCK``; each block holds each source's quota (its weight's share of the block,
rounded by largest remainder so the quotas fill it) in an order shuffled by (seed, block). Over
every whole block the shares are exact, and which source a position draws from is a pure
function of (seed, g): resuming, or another number of ranks, changes nothing. The n-th sequence
a source gives is its item perm_e[n % size] (epoch e = n // size, the permutation seeded by the
seed, the source's name and e), as a single corpus's are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from kiln.data.loader import DocumentSequences, TokenSequences, hashed_generator

BLOCK = 1000


def quotas(weights: Sequence[float], block: int = BLOCK) -> list[int]:
    """Each weight's share of ``block`` positions, in whole positions that sum to ``block``:
    rounded down, then the largest remainders rounded up (ties to the earlier source)."""
    total = sum(weights)
    exact = [block * w / total for w in weights]
    out = [int(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: out[i] - exact[i])[: block - sum(out)]:
        out[i] += 1
    return out


class Mixture(Dataset):
    """The sequences of several sources as one dataset (source i's items follow those of the
    sources before it), with the data order of their weighted mixture (``item``)."""

    def __init__(
        self,
        names: Sequence[str],
        sources: Sequence[TokenSequences | DocumentSequences],
        weights: Sequence[float],
        seed: int,
    ):
        self.names, self.sources, self.seed = list(names), list(sources), seed
        self.sizes = [len(s) for s in sources]
        self.offsets = np.cumsum([0, *self.sizes[:-1]]).tolist()
        self.quotas = quotas(weights)
        self.seq_len = sources[0].seq_len
        self._block: tuple[int, np.ndarray, np.ndarray] = (-1, np.empty(0), np.empty(0))
        self._perms: dict[int, tuple[int, torch.Tensor]] = {}

    def __len__(self) -> int:
        return sum(self.sizes)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        source = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.sources[source][i - self.offsets[source]]

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """For each position of block ``b``: its source, and how many positions of the block
        before it draw from the same source."""
        if self._block[0] != b:
            slots = np.repeat(np.arange(len(self.quotas)), self.quotas)
            sources = slots[torch.randperm(BLOCK, generator=hashed_generator(self.seed, "block", b)).numpy()]
            before = np.empty(BLOCK, dtype=np.int64)
            for s in range(len(self.quotas)):
                where = np.flatnonzero(sources == s)
                before[where] = np.arange(len(where))
            self._block = (b, sources, before)
        return self._block[1], self._block[2]

    def draw(self, g: int) -> tuple[int, int]:
        """The source of position ``g`` of the data order, and how many sequences it gave before."""
        b, p = divmod(g, BLOCK)
        sources, before = self.block(b)
        source = int(sources[p])
        return source, b * self.quotas[source] + int(before[p])

    def item(self, g: int) -> int:
        """The dataset item at position ``g`` of the data order."""
        source, n = self.draw(g)
        size = self.sizes[source]
        epoch = n // size
        cached = self._perms.get(source)
        if cached is None or cached[0] != epoch:
            perm = torch.randperm(size, generator=hashed_generator(self.seed, self.names[source], epoch))
            self._perms[source] = cached = (epoch, perm)
        return self.offsets[source] + int(cached[1][n % size])

    def drawn(self, positions: int) -> list[int]:
        """Sequences each source gave to the first ``positions`` positions of the data order."""
        b, p = divmod(positions, BLOCK)
        sources, _ = self.block(b)
        partial = np.bincount(sources[:p], minlength=len(self.quotas))
        return [b * q + int(n) for q, n in zip(self.quotas, partial, strict=True)]
