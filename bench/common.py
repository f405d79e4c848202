"""Pieces shared by the bench scripts: synthetic token data, reading kiln's own throughput, and
counting the activations autograd saves."""

from __future__ import annotations

import ctypes
import gc
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kiln.data import TokenSequences


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s data on this rank: a DTensor's local shard; a functional
    collective's result (a wrapper around the tensor it will hold) its tensor."""
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return _local(t.elem) if type(t).__name__ == "AsyncCollectiveTensor" else t


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """While entered, the bytes of the storages autograd saves for backward, each counted once
    (a DTensor by its local shard); the model's parameters and buffers are state, not
    activations, and are left out."""

    def __init__(self, model: torch.nn.Module):
        with torch.no_grad():
            held = [_local(t) for t in (*model.parameters(), *model.buffers())]
        self.state = {t.untyped_storage().data_ptr() for t in held}
        self.storages: dict[int, int] = {}
        super().__init__(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            storage = _local(t).untyped_storage()
        if storage.data_ptr() not in self.state:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t


_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2.split(" ")]


def allocated_bytes() -> int:
    """The bytes this process has allocated from the C heap and not freed (glibc's ``mallinfo2``:
    the heap's chunks in use plus the mmapped ones), after a garbage collection. PyTorch's CPU
    tensors come from malloc without a cache, so the difference across a forward pass is what the
    forward left alive for the backward: saved tensors, the inputs an activation checkpoint holds,
    autograd's nodes. Linux with glibc only."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    gc.collect()
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def random_tokens(path: Path, vocab: int, n: int, seq_len: int) -> TokenSequences:
    """``n`` uniformly random token ids as a memmapped stream of ``seq_len`` windows."""
    np.random.default_rng(0).integers(0, vocab, n).astype(np.uint16).tofile(path)
    return TokenSequences(np.memmap(path, dtype=np.uint16, mode="r"), seq_len)


def kiln_tokens_per_s(run_dir: Path, after_step: int) -> float:
    """Tokens/s of a finished kiln run from its metrics.jsonl, over the intervals after ``after_step``.

    Intervals are equal in steps, so the harmonic mean of their rates is total tokens / total time."""
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rates = [record["tokens_per_s"] for record in lines if "tokens_per_s" in record and record["step"] > after_step]
    return len(rates) / sum(1 / r for r in rates)


def alternating_rounds(
    rounds: int, measure: Callable[[str, int], float], other: str, label: str
) -> tuple[list[float], list[float], list[float]]:
    """Tokens/s of "kiln" and of ``other`` (``measure(name, round)``), a warm-up round that is not
    counted and then ``rounds`` rounds, alternating which goes first; each round is printed, the
    other side called ``label``. Returns kiln's rates, the other's and their ratios."""
    kiln_rates, other_rates, ratios = [], [], []
    for r in range(rounds + 1):
        rates = {name: measure(name, r) for name in (("kiln", other) if r % 2 else (other, "kiln"))}
        k, o = rates["kiln"], rates[other]
        title = "warm-up round (not counted)" if r == 0 else f"round {r}"
        print(f"{title}: kiln {k:,.0f} tok/s, {label} {o:,.0f} tok/s, ratio {k / o:.3f}", flush=True)
        if r:
            kiln_rates.append(k)
            other_rates.append(o)
            ratios.append(k / o)
    return kiln_rates, other_rates, ratios
