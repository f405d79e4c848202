"""Training sequences from a token stream, in an order that is a pure function of (seed, step).

Resuming at step k therefore needs no saved loader state: a fresh sampler started at k yields
exactly what an uninterrupted run would have yielded from step k on.
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from kiln.data.batch import collate
from kiln.data.batch_schedule import BatchSchedule
from kiln.data.corpus import DataError
from kiln.labels import IGNORE_INDEX


class TokenShards:
    """One token stream stored in several files (a prepared split's shards), read as one 1-D array.

    It has ``len()``, ``dtype``, ``ndim`` and ``shape``; an integer index gives one token, and a
    slice (step 1) gives a NumPy array: a view of one file's memmap when the slice lies in one
    shard, else the parts joined across the shard boundaries. ``np.asarray`` reads the whole
    stream into memory (for small streams and tests). The memmaps are opened lazily, and it
    pickles by paths, so a DataLoader worker reopens the files itself.
    """

    ndim = 1

    def __init__(self, paths: Sequence[str | os.PathLike], counts: Sequence[int], dtype: np.dtype | str):
        if len(paths) != len(counts) or not paths:
            raise ValueError(f"need one token count per shard, got {len(paths)} paths and {len(counts)} counts")
        self.paths = [os.fspath(p) for p in paths]
        self.counts = [int(n) for n in counts]
        self.dtype = np.dtype(dtype)
        # starts[k] is the stream position of shard k's first token; starts[-1] the length.
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])
        self._maps: list[np.ndarray | None] = [None] * len(self.paths)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard(self, k: int) -> np.ndarray:
        """Shard ``k``'s tokens, memory-mapped read-only."""
        found = self._maps[k]
        if found is None:
            if self.counts[k] == 0:  # an empty file cannot be mapped
                found = np.empty(0, self.dtype)
            else:
                found = np.memmap(self.paths[k], dtype=self.dtype, mode="r", shape=(self.counts[k],))
            self._maps[k] = found
        return found

    def _shard_of(self, position: int) -> int:
        return int(np.searchsorted(self.starts, position, side="right")) - 1

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError(f"{type(self).__name__} takes slices with step 1, got step {step}")
            if stop <= start:
                return np.empty(0, self.dtype)
            first, last = self._shard_of(start), self._shard_of(stop - 1)
            parts = [
                self.shard(k)[max(start, int(self.starts[k])) - int(self.starts[k]) : stop - int(self.starts[k])]
                for k in range(first, last + 1)
            ]
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"index {int(key)} out of range for {len(self)} tokens")
            k = self._shard_of(i)
            return self.shard(k)[i - int(self.starts[k])]
        raise TypeError(f"{type(self).__name__} indices are integers or slices, not {type(key).__name__}")

    def __iter__(self) -> Iterator:
        for k in range(len(self.paths)):
            yield from self.shard(k)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate([self.shard(k) for k in range(len(self.paths))])
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = [None] * len(self.paths)
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self):,} {self.dtype.name} tokens in {len(self.paths)} files)"


class TokenSequences(Dataset):
    """Non-overlapping windows of ``seq_len`` + 1 tokens; item i is (x, y) with y = x shifted by one.

    Built from a memmap, it pickles only the file's path, dtype and length, and reopens the
    file lazily in each DataLoader worker; built from ``TokenShards`` (a stream in several
    files), it pickles those, which pickle by paths (an in-memory array is pickled as is). A
    window that crosses a shard boundary is read from both shards.
    """

    def __init__(self, tokens: np.ndarray | TokenShards, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        self.seq_len = seq_len
        self.num_tokens = len(tokens)
        self.dtype = tokens.dtype
        self.path: str | None
        if isinstance(tokens, np.memmap) and tokens.filename is not None:
            self.path, self.offset = tokens.filename, tokens.offset
        else:
            self.path, self.offset = None, 0
        self._tokens: np.ndarray | TokenShards | None = tokens

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    @property
    def tokens(self) -> np.ndarray | TokenShards:
        """The whole 1-D token stream (memory-mapped when it came from files)."""
        if self._tokens is None:
            assert self.path is not None  # only a stream read from a file is dropped when pickled
            self._tokens = np.memmap(
                self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.num_tokens,)
            )
        return self._tokens

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        start = i * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self.path is not None:
            state["_tokens"] = None
        return state


class DocumentSequences(Dataset):
    """The windows of ``sequences`` as items ``(inputs, targets, positions)`` whose documents
    attend only within themselves (``data.document_mask``; ``TextBatch.collate`` batches them):
    an end-of-text token ``eot`` ends its document, the positions restart after it, and its
    target, the next document's first token, is left out of the loss (IGNORE_INDEX)."""

    def __init__(self, sequences: TokenSequences, eot: int):
        self.sequences, self.eot, self.seq_len = sequences, eot, sequences.seq_len
        self.num_tokens = sequences.num_tokens

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = self.sequences[i]
        ends = x == self.eot
        return x, y.masked_fill(ends, IGNORE_INDEX), document_positions(ends)


def document_positions(ends: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document [T], from where documents end ``ends`` [T] (a
    document starts after each end; the window's first one at its first token)."""
    at = torch.arange(len(ends))
    starts = torch.zeros_like(at)
    starts[1:] = torch.where(ends[:-1], at[1:], 0)
    return at - starts.cummax(0).values


def hashed_generator(*parts: object) -> torch.Generator:
    """A generator seeded by a hash of ``parts`` (seed, epoch, ...): nearby seeds or epochs give
    unrelated streams."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "big") >> 1)


class Order(Protocol):
    """A data order: the dataset item at each position g of the run's sequences."""

    def item(self, g: int) -> int: ...


class Shuffled:
    """The data order of one dataset of ``num_items``: position g is item ``perm_e[g %
    num_items]``, where e = g // num_items is its epoch and perm_e a permutation seeded by (seed,
    e). Every item appears once per epoch."""

    def __init__(self, num_items: int, seed: int):
        if num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {num_items}")
        self.num_items, self.seed = num_items, seed
        self._perm: torch.Tensor | None
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = hashed_generator(self.seed, epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_items, generator=gen)
        assert self._perm is not None  # set for every epoch >= 0 (self._epoch starts at -1)
        return self._perm

    def item(self, g: int) -> int:
        return int(self.permutation(g // self.num_items)[g % self.num_items])


def data_order(dataset: Dataset, seed: int) -> Order:
    """The order the run reads ``dataset`` in: its own where it has one (a ``Mixture``), else shuffled."""
    return cast(Order, dataset) if callable(getattr(dataset, "item", None)) else Shuffled(dataset_len(dataset), seed)


class StepSampler(Sampler):
    """An endless stream of batches of item indices for this rank, one per optimizer step.

    The j-th sequence of step s has global position g = B(d) + j, where d = s // ``repeat`` is
    the batch the step reads (each batch serves ``repeat`` consecutive steps), B(d) counts the
    sequences of all batches before d (the schedule's ``samples_before``), and is the item the
    data order gives g (``items``: an ``Order``, or a number of items, read ``Shuffled`` by
    ``seed``). Rank r of world_size W takes the contiguous share j in [r*b/W, (r+1)*b/W) of each
    global batch of b sequences.
    """

    def __init__(
        self,
        items: int | Order,
        schedule: BatchSchedule | int,
        seed: int,
        start_step: int = 0,
        rank: int = 0,
        world_size: int = 1,
        repeat: int = 1,
    ):
        self.order = Shuffled(items, seed) if isinstance(items, int) else items
        self.schedule = schedule if isinstance(schedule, BatchSchedule) else BatchSchedule(schedule)
        uneven = [b for b in self.schedule.sizes() if b % world_size]
        if uneven:
            raise ValueError(f"global batch size {uneven[0]} is not divisible by world_size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.start_step = start_step
        self.rank, self.world_size, self.repeat = rank, world_size, repeat

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            drawn = step // self.repeat
            per_rank = self.schedule.batch_size(drawn) // self.world_size
            base = self.schedule.samples_before(drawn) + self.rank * per_rank
            yield [self.order.item(g) for g in range(base, base + per_rank)]
            step += 1


def dataset_len(dataset: Dataset) -> int:
    """``len(dataset)`` of a map-style dataset: torch's ``Dataset`` declares no ``__len__``."""
    return len(cast(Sized, dataset))


def make_train_loader(
    dataset: Dataset,
    *,
    schedule: BatchSchedule | int,
    seed: int,
    start_step: int,
    num_workers: int,
    pin_memory: bool,
    rank: int = 0,
    world_size: int = 1,
    collate_fn: Callable[[list], Any] = default_collate,
    repeat: int = 1,
) -> DataLoader:
    """An endless DataLoader of this rank's share of each step's global batch, collated (each
    batch for ``repeat`` consecutive steps: see ``StepSampler``).

    The loop splits it into micro-batches itself, so the micro-batch size can change between
    steps (or within a retried one) without touching the data order."""
    if dataset_len(dataset) == 0:
        num_tokens, seq_len = getattr(dataset, "num_tokens", 0), getattr(dataset, "seq_len", 0)
        raise DataError(
            f"the training split has {num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "lower data.seq_len or use more data"
        )
    sampler = StepSampler(data_order(dataset, seed), schedule, seed, start_step, rank, world_size, repeat)
    workers = num_workers > 0
    return _ForkingLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        # Its own generator for the workers' seeds: drawing them from the global one would move
        # the dropout masks of a resumed run (the loader starts after the RNG state is restored).
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=2 if workers else None,
        # fork starts workers without re-importing the program (Python 3.14 made forkserver the
        # default); workers only slice a memmap and never touch CUDA, so forking is safe.
        multiprocessing_context="fork" if workers and sys.platform == "linux" else None,
    )


class _ForkingLoader(DataLoader):
    """A DataLoader whose forked workers never collect the parent's garbage: a cycle holding a
    CUDA tensor (an exception's traceback, say) freed in a worker aborts it, since a forked
    process cannot use CUDA. The objects alive at the fork are frozen for the children and
    unfrozen again for the parent."""

    def __iter__(self):
        gc.freeze()
        try:
            return super().__iter__()
        finally:
            gc.unfreeze()


class StepBatches:
    """This rank's batches in the run's data order: a loader from any step on, and any one step's
    batch rebuilt on its own (to run it again, or to say which sequences it held). Steps are
    1-based, as logged. Each batch serves ``repeat`` consecutive steps (see ``StepSampler``)."""

    def __init__(
        self,
        dataset: Dataset,
        schedule: BatchSchedule,
        seed: int,
        *,
        num_workers: int,
        pin_memory: bool,
        rank: int = 0,
        world_size: int = 1,
        collate_fn: Callable[[list], Any] = default_collate,
        repeat: int = 1,
    ):
        self.dataset, self.schedule, self.seed, self.collate_fn = dataset, schedule, seed, collate_fn
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.rank, self.world_size, self.repeat = rank, world_size, repeat

    def loader(self, done: int) -> Iterator:
        """Batches of the steps after the first ``done``."""
        return iter(
            make_train_loader(
                self.dataset,
                schedule=self.schedule,
                seed=self.seed,
                start_step=done,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                rank=self.rank,
                world_size=self.world_size,
                collate_fn=self.collate_fn,
                repeat=self.repeat,
            )
        )

    def items(self, step: int) -> list[int]:
        """This rank's dataset items of ``step``."""
        order = data_order(self.dataset, self.seed)
        sampler = StepSampler(order, self.schedule, self.seed, step - 1, self.rank, self.world_size, self.repeat)
        return next(iter(sampler))

    def batch(self, step: int, device: torch.device):
        return self.collate(self.items(step), device)

    def collate(self, indices: Iterable[int], device: torch.device):
        """Dataset items ``indices`` as one batch on ``device``, collated as the loader does."""
        return collate(self.dataset, indices, device, self.collate_fn)

    def positions(self, step: int) -> list[int]:
        """[first, end) positions of ``step``'s sequences in the run's data order (all ranks)."""
        drawn = (step - 1) // self.repeat
        start = self.schedule.samples_before(drawn)
        return [start, start + self.schedule.batch_size(drawn)]

    def describe(self, step: int) -> str:
        first, end = self.positions(step)
        items = self.items(step)
        shown = ", ".join(map(str, items[:8])) + (", ..." if len(items) > 8 else "")
        return f"sequences {first}..{end - 1} of the data order (this rank's dataset items {shown})"

    def position(self, done: int) -> dict[str, int]:
        """Where the data order stands after ``done`` steps: all a resume needs to go on. The
        sequences seen are those of the batches read so far, the one a cycle of ``repeat``
        steps is still training on included."""
        drawn = -(-done // self.repeat)
        return {"seed": self.seed, "step": done, "samples_seen": self.schedule.samples_before(drawn)}


def val_batches(
    dataset: TokenSequences | DocumentSequences,
    micro_batch_size: int,
    num_batches: int,
    collate: Callable[[list], Any] | None = None,
) -> list[Any]:
    """A fixed validation sample: up to num_batches * micro_batch_size sequences evenly spaced over
    the set, as ``(x, y)`` pairs or, given ``collate``, as it batches the items."""
    total = len(dataset)
    if total == 0:
        raise DataError(
            f"the validation split has {dataset.num_tokens} tokens, fewer than seq_len + 1 = {dataset.seq_len + 1}; "
            "raise data.val_fraction, lower data.seq_len or use more data"
        )
    n = min(num_batches * micro_batch_size, total)
    indices = [k * total // n for k in range(n)]
    batches = []
    for start in range(0, n, micro_batch_size):
        items = [dataset[i] for i in indices[start : start + micro_batch_size]]
        if collate is not None:
            batches.append(collate(items))
            continue
        xs, ys = zip(*items, strict=True)
        batches.append((torch.stack(xs), torch.stack(ys)))
    return batches


def document_windows(
    tokens: np.ndarray | TokenShards, eot: int, seq_len: int, micro_batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every token of every document of a token stream (documents each followed by ``eot``) as a
    target once, each document scored on its own from its start, conditioned on the end-of-text
    token before it, in windows of ``seq_len`` inputs; a document's last window, if shorter, takes
    the ``seq_len`` tokens before its end as context and keeps only its new targets. These are
    lm-evaluation-harness's rolling windows (``loglikelihood_rolling``), so a document's total loss
    is the one lm-eval computes. Batches of up to ``micro_batch_size`` windows, padded on the
    right; targets are -100 where none is wanted."""
    tokens = np.asarray(tokens)
    windows: list[tuple[np.ndarray, np.ndarray]] = []
    start = 0
    for end in [*np.flatnonzero(tokens == eot).tolist(), len(tokens)]:
        doc, start = tokens[start:end], end + 1
        if not len(doc):
            continue
        s = np.concatenate([[eot], doc]).astype(np.int64)
        n = len(doc)
        for p in range(0, n, seq_len):
            b = min(p + seq_len, n)
            if p == 0 or b - p == seq_len:
                windows.append((s[p:b], s[p + 1 : b + 1]))
            else:  # the last, shorter window: full context, only the tokens not yet scored
                y = s[b - seq_len + 1 : b + 1].copy()
                y[: seq_len - (b - p)] = IGNORE_INDEX
                windows.append((s[b - seq_len : b], y))
    batches = []
    for at in range(0, len(windows), micro_batch_size):
        group = windows[at : at + micro_batch_size]
        width = max(len(x) for x, _ in group)
        x = torch.full((len(group), width), eot, dtype=torch.long)
        y = torch.full((len(group), width), IGNORE_INDEX, dtype=torch.long)
        for row, (xs, ys) in enumerate(group):
            x[row, : len(xs)], y[row, : len(ys)] = torch.from_numpy(xs), torch.from_numpy(ys)
        batches.append((x, y))
    return batches
