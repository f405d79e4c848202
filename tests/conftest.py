"""Shared fixtures: a small text corpus and a private data cache, so tests never touch the
user's cache and train in seconds."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

TINY_MODEL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=128"]


def tiny_overrides(run_dir: Path, corpus: Path, **extra: object) -> list[str]:
    """--set items for a model and run small enough to train in a few seconds on CPU."""
    items = {
        "run.dir": run_dir,
        "data.source": corpus,
        "data.vocab_size": 512,
        "data.seq_len": 32,
        "data.num_workers": 0,
        "train.max_steps": 12,
        "train.micro_batch_size": 4,
        "train.global_batch_size": 8,
        "train.lr": 1e-2,
        "train.warmup_steps": 2,
        "train.log_every": 1,
        "eval.every": 0,
        "eval.batches": 2,
        "eval.sample_tokens": 8,
        "checkpoint.every": 4,
        "checkpoint.keep": 10,
    }
    items.update({k.replace("__", "."): v for k, v in extra.items()})
    return TINY_MODEL + [f"{k}={v}" for k, v in items.items()]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """Forty real documents (standard-library sources saved as .txt), the same every run."""
    out = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:40]:
        (out / f"{path.stem}.txt").write_text(path.read_text(encoding="utf-8", errors="replace")[:20000])
    return out


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("KILN_CACHE", str(tmp_path_factory.mktemp("kiln-cache")))
    yield
    mp.undo()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
