"""Tokenize a corpus once into memory-mappable token files, cached by corpus and tokenizer.

Layout: ``<cache>/prepared/<key>/`` holds ``train.bin`` and ``val.bin`` (raw little-endian
uint16 or uint32 token ids, every document followed by the end-of-text token), a copy of
``tokenizer.json`` and ``manifest.json``. The key hashes the corpus fingerprint, the tokenizer
and FORMAT_VERSION, so any change to the data or tokenizer prepares a new directory. A directory
is built under a temporary name and renamed into place, so one that exists is complete.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from kiln.data.corpus import SPLITS, Corpus, DataError, open_corpus
from kiln.data.tokenizer import (
    TrainingText,
    bpe_cache_path,
    eot_id,
    load_or_train_tokenizer,
    load_tokenizer,
    token_byte_lengths,
    tokenizer_hash,
)

# Bump when the file layout or manifest changes, so old prepared directories are not reused.
FORMAT_VERSION = 2
# Characters of text per task sent to a worker: large enough to amortise pickling, small
# enough to keep every worker busy and memory bounded.
_CHUNK_CHARS = 1 << 20


def cache_root(data_cfg) -> Path:
    """data.cache_dir if set, else $KILN_CACHE, else ~/.cache/kiln."""
    if data_cfg.cache_dir:
        return Path(data_cfg.cache_dir).expanduser()
    if os.environ.get("KILN_CACHE"):
        return Path(os.environ["KILN_CACHE"]).expanduser()
    return Path.home() / ".cache" / "kiln"


@dataclass
class PreparedData:
    dir: Path
    manifest: dict
    tokenizer: Tokenizer
    vocab_size: int
    eot_id: int
    tokenized: bool
    """True if the call that returned this did the tokenization (False: found in the cache)."""

    def tokens(self, split: str) -> np.memmap:
        """The split's token stream, memory-mapped read-only."""
        info = self.manifest["splits"][split]
        return np.memmap(
            self.dir / info["file"], dtype=np.dtype(self.manifest["dtype"]), mode="r", shape=(info["tokens"],)
        )

    def token_bytes(self) -> np.ndarray:
        return token_byte_lengths(self.tokenizer)


def open_prepared(directory: str | os.PathLike) -> PreparedData:
    directory = Path(directory)
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        raise DataError(f"{directory}: not a prepared data directory (no manifest.json); run prepare first")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{manifest_path}: format version {manifest.get('format_version')}, this kiln reads "
            f"{FORMAT_VERSION}; delete the directory and prepare again"
        )
    tok = load_tokenizer(directory / "tokenizer.json")
    return PreparedData(directory, manifest, tok, tok.get_vocab_size(), manifest["eot_id"], tokenized=False)


def verify(prepared: PreparedData) -> None:
    """Check every file against the manifest's sha256; DataError naming the first that differs."""
    files = {info["file"]: info["sha256"] for info in prepared.manifest["splits"].values()}
    files["tokenizer.json"] = prepared.manifest["tokenizer_hash"]
    for name, expected in files.items():
        path = prepared.dir / name
        if not path.is_file() or _sha256_file(path) != expected:
            raise DataError(f"{path}: checksum does not match manifest.json; delete {prepared.dir} and prepare again")


def prepare(data_cfg, progress: bool = True) -> PreparedData:
    """Tokenized train/val streams for ``data_cfg``, built once and then found in the cache.

    A cache hit reads the corpus only to fingerprint it, loads the cached tokenizer and checks
    file sizes against the manifest; it neither trains nor tokenizes.
    """
    report = _Reporter(progress)
    corpus = _open(data_cfg, data_cfg.source, data_cfg.text_field, report)
    return _prepare(corpus, _tokenizer(corpus, data_cfg, report), data_cfg, report)


def prepare_mix(data_cfg, progress: bool = True) -> dict[str, PreparedData]:
    """Each source of the mixture ``data_cfg.mix`` prepared as ``prepare`` does one corpus (its own
    train/val split and cache entry), all with one tokenizer trained on their train splits
    together; by the sources' names."""
    report = _Reporter(progress)
    corpora = [_open(data_cfg, m.source, m.text_field or data_cfg.text_field, report) for m in data_cfg.mix]
    tok = _tokenizer(Corpora(corpora), data_cfg, report)
    return {m.label: _prepare(c, tok, data_cfg, report) for m, c in zip(data_cfg.mix, corpora, strict=True)}


class Corpora:
    """Several corpora as one text to train a tokenizer on."""

    def __init__(self, corpora: list[Corpus]):
        self.corpora = corpora

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256("\0".join(c.fingerprint for c in self.corpora).encode()).hexdigest()

    def documents(self, split: str) -> Iterator[tuple[str, str]]:
        for corpus in self.corpora:
            yield from corpus.documents(split)

    def count(self, split: str) -> int:
        return sum(c.count(split) for c in self.corpora)


def _open(data_cfg, source: str, text_field: str, report: _Reporter) -> Corpus:
    corpus = open_corpus(
        source,
        text_field,
        data_cfg.val_fraction,
        val_source=data_cfg.val_source,
        position_split_chars=data_cfg.position_split_chars,
    )
    report.line(f"kiln: fingerprinting {len(corpus.files)} files of {corpus.source!r} ...")
    corpus.fingerprint  # noqa: B018 (computed here, after its message, and cached)
    return corpus


def _tokenizer(text: TrainingText, data_cfg, report: _Reporter) -> Tokenizer:
    root = cache_root(data_cfg)
    if data_cfg.tokenizer == "bpe" and not bpe_cache_path(text, data_cfg, root).is_file():
        report.line(f"kiln: training a byte-level BPE tokenizer (vocab {data_cfg.vocab_size}) on the train split ...")
    return load_or_train_tokenizer(text, data_cfg, root)


def _prepare(corpus: Corpus, tok: Tokenizer, data_cfg, report: _Reporter) -> PreparedData:
    """``corpus`` tokenized with ``tok`` into the cache, or found there."""
    root, fingerprint = cache_root(data_cfg), corpus.fingerprint
    tok_hash = tokenizer_hash(tok)
    key = hashlib.sha256(f"{fingerprint}\0{tok_hash}\0{FORMAT_VERSION}".encode()).hexdigest()
    final = root / "prepared" / key[:32]

    if (final / "manifest.json").is_file():
        prepared = open_prepared(final)
        problem = _size_problem(prepared)
        if problem is None:
            report.line(f"kiln: using prepared data in {final} ({describe_split(prepared.manifest)})")
            return prepared
        report.line(f"kiln: {problem}; preparing again")
        shutil.rmtree(final)
    elif final.exists():  # no manifest: left by something other than prepare; never complete
        shutil.rmtree(final)

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{key[:8]}-"))
    try:
        manifest = _build(corpus, tok, tok_hash, data_cfg, tmp, report)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "manifest.json").is_file():
                raise
            # Another process finished the same preparation first; theirs is identical.
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.line(
        f"kiln: prepared {manifest['splits']['train']['tokens']:,} train and "
        f"{manifest['splits']['val']['tokens']:,} val tokens in {final} ({describe_split(manifest)})"
    )
    return dataclasses.replace(open_prepared(final), tokenized=True)


def describe_split(manifest: dict) -> str:
    """The split and what deduplication removed, in words, from a manifest."""
    stats = manifest["corpus"]
    parts = [stats["split"]]
    if stats.get("duplicates_removed"):
        parts.append(f"{stats['duplicates_removed']:,} duplicate documents removed (kept once)")
    if stats.get("removed_as_in_val"):
        parts.append(f"{stats['removed_as_in_val']:,} training documents left out as they are also in val")
    return "; ".join(parts)


def _size_problem(prepared: PreparedData) -> str | None:
    itemsize = np.dtype(prepared.manifest["dtype"]).itemsize
    for info in prepared.manifest["splits"].values():
        path = prepared.dir / info["file"]
        expected = info["tokens"] * itemsize
        if not path.is_file() or path.stat().st_size != expected:
            return f"{path} is not {expected} bytes as manifest.json says"
    return None


def _build(corpus: Corpus, tok: Tokenizer, tok_hash: str, data_cfg, out: Path, report: _Reporter) -> dict:
    vocab_size = tok.get_vocab_size()
    # Token ids run from 0 to vocab_size - 1.
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    eot = eot_id(tok)
    workers = data_cfg.prepare_workers or os.cpu_count() or 1
    splits = {}
    for split in SPLITS:
        total = corpus.count(split)
        report.line(f"kiln: tokenizing {total} {split} documents with {workers} worker{'s' * (workers > 1)} ...")
        chunks = _chunks(text for _, text in corpus.documents(split))
        sha = hashlib.sha256()
        tokens = nbytes = documents = 0
        with open(out / f"{split}.bin", "wb") as f, report.bar(f"tokenizing {split}", total) as advance:
            for ids, chunk_bytes, docs in _encode_all(chunks, tok.to_str(), eot, dtype, workers):
                data = ids.tobytes()
                f.write(data)
                sha.update(data)
                tokens += len(ids)
                nbytes += chunk_bytes
                documents += docs
                advance(docs)
        splits[split] = {
            "documents": documents,
            "tokens": tokens,
            "bytes": nbytes,
            "file": f"{split}.bin",
            "sha256": sha.hexdigest(),
        }
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": corpus.source,
        "text_field": corpus.text_field,
        "val_source": corpus.val.source if corpus.val else None,
        "val_fraction": corpus.val_fraction,
        "corpus": corpus.stats,
        "corpus_fingerprint": corpus.fingerprint,
        "tokenizer_hash": tok_hash,
        "vocab_size": vocab_size,
        "eot_id": eot,
        "dtype": dtype.name,
        "splits": splits,
    }
    # Written last: its presence marks the directory complete.
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# Per-worker state, set once by _init_worker so the tokenizer is not sent with every task.
_worker: dict = {}


def _init_worker(tok_json: str, eot: int, dtype: str) -> None:
    tok = Tokenizer.from_str(tok_json)
    # A document that merely mentions "<|endoftext|>" (tokenizer code does) must not gain a
    # document boundary: special tokens are only ever the ones appended here.
    tok.encode_special_tokens = True
    _worker.update(tok=tok, eot=eot, dtype=np.dtype(dtype))


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, int, int]:
    """(token ids with EOT after each document, UTF-8 bytes of the texts, number of documents)."""
    encodings = _worker["tok"].encode_batch(texts, add_special_tokens=False)
    ids = np.fromiter(
        (i for enc in encodings for i in (*enc.ids, _worker["eot"])),
        dtype=_worker["dtype"],
    )
    return ids, sum(len(t.encode("utf-8")) for t in texts), len(texts)


def _encode_all(chunks: Iterator[list[str]], tok_json: str, eot: int, dtype: np.dtype, workers: int):
    """Encoded chunks in input order, from ``workers`` processes (in-process for one)."""
    if workers == 1:
        _init_worker(tok_json, eot, dtype.name)
        try:
            yield from map(_encode_chunk, chunks)
        finally:
            _worker.clear()
        return
    with (
        _tokenizers_single_threaded(),
        ProcessPoolExecutor(
            workers, mp_context=_mp_context(), initializer=_init_worker, initargs=(tok_json, eot, dtype.name)
        ) as pool,
    ):
        # A bounded window of in-flight chunks, consumed in submission order: output order does
        # not depend on the worker count, and memory stays bounded (Executor.map would read the
        # whole corpus up front).
        pending: collections.deque[Future[tuple[np.ndarray, int, int]]] = collections.deque()
        for chunk in chunks:
            pending.append(pool.submit(_encode_chunk, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _mp_context():
    # fork starts workers at once without re-importing the program (and torch). The workers only
    # run the tokenizer, whose own fork handling is made quiet by _tokenizers_single_threaded.
    if sys.platform == "linux":
        return multiprocessing.get_context("fork")
    return None


@contextmanager
def _tokenizers_single_threaded():
    """Workers are the parallelism: turn off the tokenizers library's thread pool in them.

    Forking after the library used its pool (e.g. to train the BPE) makes it print a warning and
    disable the pool unless TOKENIZERS_PARALLELISM is set; setting it while workers start keeps
    them quiet and avoids oversubscribing the cores.
    """
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class _Reporter:
    """A rich progress bar on a terminal, else one-line messages on stderr; silent if not wanted."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()

    def line(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    @contextmanager
    def bar(self, description: str, total: int):
        """Yields ``advance(n)``; a live bar only on a terminal."""
        if not self.tty:
            yield lambda n: None
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        started = time.monotonic()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)
        self.line(f"kiln: {description} took {time.monotonic() - started:.1f}s")
