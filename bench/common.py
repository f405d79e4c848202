"""Pieces shared by the bench scripts: synthetic token data and reading kiln's own throughput."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kiln.data import TokenSequences


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
