"""Tokenize a corpus once into memory-mappable token files, cached by corpus and tokenizer.

Layout: ``<cache>/prepared/<key>/`` holds each split's token stream (raw little-endian uint16 or
uint32 token ids, every document followed by the end-of-text token) in shards of at most
``data.shard_bytes`` bytes, ``train-00000.bin``, ``train-00001.bin``, ..., ``val-00000.bin``, ...
(the stream is cut every shard_bytes, inside a document where it falls there), a copy of
``tokenizer.json`` and ``manifest.json``, which lists each split's shards in order with their
token counts and sha256. The key hashes the corpus fingerprint, the tokenizer, the shard size and
FORMAT_VERSION, so any change to the data or tokenizer prepares a new directory. A directory is
built under a temporary name and renamed into place, so one that exists is complete.

Memory stays bounded whatever the corpus size: documents are read one at a time, tokenized by a
pool of processes a chunk at a time with a bounded number of chunks in flight, and written out as
each chunk comes back.
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
from typing import BinaryIO

import numpy as np
from tokenizers import Tokenizer

from kiln.data.corpus import SPLITS, Corpus, DataError, open_corpus
from kiln.data.loader import TokenShards
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
# 3: each split in shards of at most data.shard_bytes, listed in the manifest.
FORMAT_VERSION = 3
# Characters of text per task sent to a worker: large enough to amortise pickling, small
# enough to keep every worker busy and memory bounded.
_CHUNK_CHARS = 1 << 20
# Chunks in flight per worker: enough that a worker never waits for the next, few enough that
# memory stays bounded (about this many chunks of text and of token ids per worker).
_IN_FLIGHT = 2


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

    def tokens(self, split: str) -> np.ndarray | TokenShards:
        """The split's whole token stream, memory-mapped read-only: one ``np.memmap`` when it is
        in one shard, else ``TokenShards`` over its shards (sliced like an array)."""
        shards = self.manifest["splits"][split]["shards"]
        dtype = np.dtype(self.manifest["dtype"])
        if len(shards) == 1:
            [shard] = shards
            if shard["tokens"] == 0:  # an empty file cannot be mapped
                return np.empty(0, dtype)
            return np.memmap(self.dir / shard["file"], dtype=dtype, mode="r", shape=(shard["tokens"],))
        return TokenShards([self.dir / s["file"] for s in shards], [s["tokens"] for s in shards], dtype)

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


def shard_files(manifest: dict) -> list[str]:
    """Every token shard a manifest lists: each split's, in order."""
    return [shard["file"] for info in manifest["splits"].values() for shard in info["shards"]]


def verify(prepared: PreparedData) -> None:
    """Check every file against the manifest's sha256; DataError naming the first that differs."""
    files = {s["file"]: s["sha256"] for info in prepared.manifest["splits"].values() for s in info["shards"]}
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
    if data_cfg.tokenizer != "bpe" or bpe_cache_path(text, data_cfg, root).is_file():
        return load_or_train_tokenizer(text, data_cfg, root)
    sample = data_cfg.tokenizer_sample_bytes
    on = f"a sample of up to {sample:,} bytes of the train split" if sample else "the train split"
    report.line(f"kiln: training a byte-level BPE tokenizer (vocab {data_cfg.vocab_size}) on {on} ...")
    started = time.monotonic()
    tok = load_or_train_tokenizer(text, data_cfg, root)
    report.line(f"kiln: trained the tokenizer in {time.monotonic() - started:.1f}s")
    return tok


def _prepare(corpus: Corpus, tok: Tokenizer, data_cfg, report: _Reporter) -> PreparedData:
    """``corpus`` tokenized with ``tok`` into the cache, or found there."""
    root, fingerprint = cache_root(data_cfg), corpus.fingerprint
    tok_hash = tokenizer_hash(tok)
    shard_bytes = data_cfg.shard_bytes
    key = hashlib.sha256(f"{fingerprint}\0{tok_hash}\0{shard_bytes}\0{FORMAT_VERSION}".encode()).hexdigest()
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
    splits = manifest["splits"]
    report.line(
        f"kiln: prepared {splits['train']['tokens']:,} train and {splits['val']['tokens']:,} val tokens "
        f"({len(shard_files(manifest))} shards) in {final} ({describe_split(manifest)})"
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
        for shard in info["shards"]:
            path = prepared.dir / shard["file"]
            expected = shard["tokens"] * itemsize
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
        started = time.monotonic()
        chunks = _chunks(text for _, text in corpus.documents(split))
        nbytes = documents = 0
        with (
            _ShardWriter(out, split, dtype, data_cfg.shard_bytes) as writer,
            report.bar(f"tokenizing {split}", total) as advance,
        ):
            for ids, chunk_bytes, docs in _encode_all(chunks, tok.to_str(), eot, dtype, workers):
                writer.write(ids)
                nbytes += chunk_bytes
                documents += docs
                advance(docs)
        seconds = time.monotonic() - started
        report.line(
            f"kiln: tokenized {split}: {documents:,} documents, {nbytes:,} bytes, {writer.tokens:,} tokens "
            f"in {seconds:.1f}s ({nbytes / 1e6 / max(seconds, 1e-9):.2f} MB/s, "
            f"{writer.tokens / max(seconds, 1e-9):,.0f} tokens/s), {len(writer.shards)} "
            f"shard{'s' * (len(writer.shards) > 1)}"
        )
        splits[split] = {"documents": documents, "tokens": writer.tokens, "bytes": nbytes, "shards": writer.shards}
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
        "shard_bytes": data_cfg.shard_bytes,
        "splits": splits,
    }
    # Written last: its presence marks the directory complete.
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


class _ShardWriter:
    """A split's token stream written to ``SPLIT-00000.bin``, ``SPLIT-00001.bin``, ..., each of
    ``shard_bytes`` (rounded down to whole tokens) but the last; ``shards`` lists them for the
    manifest. A split always has one file, perhaps empty."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_bytes: int):
        self.out, self.split = out, split
        self.per_shard = max(1, shard_bytes // dtype.itemsize)
        self.shards: list[dict] = []
        self.tokens = 0
        self._file: BinaryIO | None = None
        self._name = ""
        self._sha = hashlib.sha256()
        self._count = 0  # tokens in the open file

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            if self._file is not None:
                self._file.close()
            return
        if self._file is None and not self.shards:
            self._open()
        if self._file is not None:
            self._finish()

    def write(self, ids: np.ndarray) -> None:
        pos = 0
        while pos < len(ids):
            if self._file is None:
                self._open()
            assert self._file is not None
            take = min(len(ids) - pos, self.per_shard - self._count)
            data = np.ascontiguousarray(ids[pos : pos + take]).data
            self._file.write(data)
            self._sha.update(data)
            self._count += take
            self.tokens += take
            pos += take
            if self._count == self.per_shard:
                self._finish()

    def _open(self) -> None:
        self._name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.out / self._name, "wb")  # noqa: SIM115 (closed by _finish or __exit__)
        self._sha, self._count = hashlib.sha256(), 0

    def _finish(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        self.shards.append({"file": self._name, "tokens": self._count, "sha256": self._sha.hexdigest()})


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
    eot = np.array([_worker["eot"]], dtype=_worker["dtype"])
    # One array per document and one join: no Python-level loop over the tokens.
    parts = [part for enc in encodings for part in (np.array(enc.ids, dtype=_worker["dtype"]), eot)]
    ids = np.concatenate(parts) if parts else np.empty(0, _worker["dtype"])
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
            if len(pending) >= _IN_FLIGHT * workers:
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
