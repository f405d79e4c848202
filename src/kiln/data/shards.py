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
import contextlib
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from tokenizers import Tokenizer

from kiln.data.corpus import SPLITS, Corpus, DataError, open_corpus
from kiln.data.loader import TokenShards
from kiln.data.team import ALONE, Team, share_of
from kiln.data.tokenizer import (
    TrainingText,
    bpe_cache_path,
    eot_id,
    load_or_train_tokenizer,
    load_tokenizer,
    token_byte_lengths,
    tokenizer_hash,
)
from kiln.io import fsync_dir, fsync_tree, write_atomic

VERIFIED = "verified"  # in a prepared directory: its files matched their digests once
# Bump when the file layout or manifest changes, so old prepared directories are not reused.
# 3: each split in shards of at most data.shard_bytes, listed in the manifest.
FORMAT_VERSION = 3
# Characters of text per task sent to a worker: large enough to amortise pickling, small
# enough to keep every worker busy and memory bounded.
_CHUNK_CHARS = 1 << 20
# Chunks in flight per worker: enough that a worker never waits for the next, few enough that
# memory stays bounded (about this many chunks of text and of token ids per worker).
_IN_FLIGHT = 2
# Bytes of a part sent from rank to rank in one broadcast, and copied into a shard in one read.
_SEND_BYTES = 64 << 20
_COPY_BYTES = 16 << 20
T = TypeVar("T")


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


def prepare(data_cfg, progress: bool = True, team: Team = ALONE, slow_seconds: float = 0.0) -> PreparedData:
    """Tokenized train/val streams for ``data_cfg``, built once and then found in the cache.

    A cache hit reads the corpus only to fingerprint it, loads the cached tokenizer and checks
    file sizes against the manifest; it neither trains nor tokenizes. With a ``team`` (the ranks
    of a launched job, every one calling this), each rank hashes, reads and tokenizes its share of
    the files and the shards come out as one process writes them (see :func:`_prepare`);
    ``slow_seconds`` delays rank 0's tokenization (a test's stand-in for a large corpus).
    """
    job = _Preparation(data_cfg, team, _Reporter(progress and team.rank == 0), slow_seconds)
    corpus = _open(job, data_cfg.source, data_cfg.text_field)
    return _prepare(job, corpus, _tokenizer(job, [corpus]))


def prepare_mix(
    data_cfg, progress: bool = True, team: Team = ALONE, slow_seconds: float = 0.0
) -> dict[str, PreparedData]:
    """Each source of the mixture ``data_cfg.mix`` prepared as ``prepare`` does one corpus (its own
    train/val split and cache entry), all with one tokenizer trained on their train splits
    together; by the sources' names."""
    job = _Preparation(data_cfg, team, _Reporter(progress and team.rank == 0), slow_seconds)
    corpora = [_open(job, m.source, m.text_field or data_cfg.text_field) for m in data_cfg.mix]
    tok = _tokenizer(job, corpora)
    return {m.label: _prepare(job, c, tok) for m, c in zip(data_cfg.mix, corpora, strict=True)}


@dataclass
class _Preparation:
    cfg: Any  # DataConfig
    team: Team
    report: _Reporter
    slow_seconds: float
    hosts: list[str] = dataclasses.field(default_factory=list)
    """Each rank's host name (from the first source opened)."""

    def here(self, work: Callable[[], T], what: str) -> T:
        """``work()``'s result on this rank, every rank running its own (see Team.each)."""
        mine: list[T] = []
        self.team.each(lambda: mine.append(work()), what)
        return mine[0]


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


def _open(job: _Preparation, source: str, text_field: str) -> Corpus:
    """The corpus ``source`` names, the same on every rank (DataError naming the rank, host and
    file where one sees other files), fingerprinted."""
    cfg, opened = job.cfg, []

    def look() -> tuple[str, str | list[tuple[str, int]]]:
        try:
            corpus = open_corpus(
                source,
                text_field,
                cfg.val_fraction,
                val_source=cfg.val_source,
                position_split_chars=cfg.position_split_chars,
                max_record_bytes=cfg.max_record_bytes,
            )
        except DataError as e:
            return socket.gethostname(), str(e)
        opened.append(corpus)
        return socket.gethostname(), _listing(corpus)

    views = job.team.each(look, "listing the data")
    job.hosts = job.hosts or [host for host, _ in views]
    for rank, (host, view) in enumerate(views):
        if isinstance(view, str):
            raise DataError(view if job.team.size == 1 else f"{view} (on rank {rank}, host {host})")
    listings = [dict(view) for _, view in views if not isinstance(view, str)]
    for rank, (host, listing) in enumerate(zip(job.hosts, listings, strict=True)):
        if listing != listings[0]:
            raise DataError(
                f"{source}: rank {rank} (host {host}) does not see the same files as rank 0 (host {job.hosts[0]}): "
                f"{_difference(listings[0], listing)}; every node must hold the same data"
            )
    corpus = opened[0]
    job.report.line(f"kiln: fingerprinting {len(corpus.files)} files of {corpus.source!r} ...")
    corpus.fingerprint_with(job.team)
    return corpus


def _listing(corpus: Corpus) -> list[tuple[str, int]]:
    """Each file of the corpus by its name under its source's root (those of the validation
    source marked so), with its size: what every node must see alike."""
    listing = []
    for role, files in (("", corpus.train), ("data.val_source ", corpus.val)):
        if files is not None:
            listing += [(role + files.name_of(path), path.stat().st_size) for path in files.files]
    return listing


def _difference(ours: dict[str, int], theirs: dict[str, int]) -> str:
    for path in sorted(ours.keys() - theirs.keys()):
        return f"{path} is missing there"
    for path in sorted(theirs.keys() - ours.keys()):
        return f"{path} is there but not on rank 0"
    path = next(p for p in ours if ours[p] != theirs[p])
    return f"{path} is {theirs[path]:,} bytes there, {ours[path]:,} on rank 0"


def _tokenizer(job: _Preparation, corpora: list[Corpus]) -> Tokenizer:
    """The tokenizer data.tokenizer names; a BPE is trained by rank 0 (the split of every corpus
    decided by all ranks first) and sent to the others, which cache it too."""
    cfg, team, root = job.cfg, job.team, cache_root(job.cfg)
    text: TrainingText = corpora[0] if len(corpora) == 1 else Corpora(corpora)
    if cfg.tokenizer != "bpe" or all(team.each(bpe_cache_path(text, cfg, root).is_file, "finding the tokenizer")):
        return job.here(lambda: load_or_train_tokenizer(text, cfg, root), "loading the tokenizer")
    for corpus in corpora:
        corpus.plan_with(team)
    sample = cfg.tokenizer_sample_bytes
    on = f"a sample of up to {sample:,} bytes of the train split" if sample else "the train split"
    job.report.line(f"kiln: training a byte-level BPE tokenizer (vocab {cfg.vocab_size}) on {on} ...")
    started = time.monotonic()

    def train() -> str | None:
        return load_or_train_tokenizer(text, cfg, root).to_str() if team.rank == 0 else None

    trained = team.each(train, "training the tokenizer")[0]
    assert trained is not None  # rank 0's
    job.report.line(f"kiln: trained the tokenizer in {time.monotonic() - started:.1f}s")
    path = bpe_cache_path(text, cfg, root)
    if not path.is_file():  # a node of its own, without a shared file system
        write_atomic(path, trained)
    return Tokenizer.from_str(trained)


def _prepare(job: _Preparation, corpus: Corpus, tok: Tokenizer) -> PreparedData:
    """``corpus`` tokenized with ``tok`` into the cache, or found there.

    With several ranks: the ranks that see one directory as the cache (a shared file system, or
    each node's own disk) form a site. Every rank tokenizes its share of the files (a contiguous
    run, :func:`kiln.data.team.share_of`) into a part file of its own; where there are several
    sites, each part is sent to the sites that lack it; then each site cuts the parts, joined in
    rank order, into the shards one process would have written (its ranks sharing the work), and
    its first rank writes the manifest and renames the directory into place. So the token streams
    and the manifest do not depend on the number of ranks or nodes.
    """
    cfg, team = job.cfg, job.team
    root, fingerprint = cache_root(cfg), corpus.fingerprint
    tok_hash = tokenizer_hash(tok)
    key = hashlib.sha256(f"{fingerprint}\0{tok_hash}\0{cfg.shard_bytes}\0{FORMAT_VERSION}".encode()).hexdigest()
    final = root / "prepared" / key[:32]

    def look() -> str | None:
        if not (final / "manifest.json").is_file():
            return "missing"
        prepared = open_prepared(final)
        return _size_problem(prepared) or _digest_problem(prepared)

    problems = team.each(look, "finding the prepared data")
    if not any(problems):
        prepared = open_prepared(final)
        job.report.line(f"kiln: using prepared data in {final} ({describe_split(prepared.manifest)})")
        return prepared
    if problems[0] and problems[0] != "missing":
        job.report.line(f"kiln: {problems[0]}; preparing again")

    corpus.plan_with(team)
    final.parent.mkdir(parents=True, exist_ok=True)
    nonce = team.share(secrets.token_hex(6) if team.rank == 0 else "", 0)
    tmp = final.parent / f".tmp-{key[:8]}-{nonce}"
    site, sites = _site(job, tmp)
    try:
        manifest = _build(job, corpus, tok, tok_hash, tmp, site, sites)

        def publish() -> None:
            if team.rank != site[0]:
                return
            fsync_tree(tmp)
            damaged = not (final / "manifest.json").is_file() or look() is not None
            if final.exists() and damaged:
                shutil.rmtree(final)  # incomplete or damaged: never a complete preparation
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "manifest.json").is_file():
                    raise
                # Another process finished the same preparation first; theirs is identical.
                shutil.rmtree(tmp)
            fsync_dir(final.parent)

        team.each(publish, "publishing the prepared data")
    except BaseException:
        if team.rank == site[0]:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    splits = manifest["splits"]
    job.report.line(
        f"kiln: prepared {splits['train']['tokens']:,} train and {splits['val']['tokens']:,} val tokens "
        f"({len(shard_files(manifest))} shards) in {final} ({describe_split(manifest)})"
    )
    return dataclasses.replace(open_prepared(final), tokenized=True)


def _site(job: _Preparation, tmp: Path) -> tuple[list[int], int]:
    """The ranks that see ``tmp`` (this rank's view of the shared temporary directory) as this
    rank does, and how many such sites there are: each rank leaves a mark there, then each says
    whose marks it sees."""
    team = job.team
    tmp.mkdir(parents=True, exist_ok=True)
    mark = tmp / f"rank-{team.rank:05d}.here"
    job.here(mark.touch, "marking the cache")
    sites = team.each(lambda: sorted(int(p.name[5:10]) for p in tmp.glob("rank-*.here")), "finding the cache")
    job.here(mark.unlink, "marking the cache")
    return sites[team.rank], len({tuple(site) for site in sites})


def describe_split(manifest: dict) -> str:
    """The split and what deduplication removed, in words, from a manifest."""
    stats = manifest["corpus"]
    parts = [stats["split"]]
    if stats.get("duplicates_removed"):
        parts.append(f"{stats['duplicates_removed']:,} duplicate documents removed (kept once)")
    if stats.get("removed_as_in_val"):
        parts.append(f"{stats['removed_as_in_val']:,} training documents left out as they are also in val")
    return "; ".join(parts)


def _digest_problem(prepared: PreparedData) -> str | None:
    """The first reuse of prepared data checks every file's digest (a cache written by a crashed
    machine, or changed by hand, may have the right sizes and other bytes); then it is marked
    verified, and later reuses check sizes only."""
    marker = prepared.dir / VERIFIED
    if marker.is_file():
        return None
    try:
        verify(prepared)
    except DataError as e:
        return str(e).split(";")[0]
    with contextlib.suppress(OSError):  # a cache this user may read but not write is checked each time
        write_atomic(marker, "")
    return None


def _size_problem(prepared: PreparedData) -> str | None:
    itemsize = np.dtype(prepared.manifest["dtype"]).itemsize
    for info in prepared.manifest["splits"].values():
        for shard in info["shards"]:
            path = prepared.dir / shard["file"]
            expected = shard["tokens"] * itemsize
            if not path.is_file() or path.stat().st_size != expected:
                return f"{path} is not {expected} bytes as manifest.json says"
    return None


def _build(
    job: _Preparation, corpus: Corpus, tok: Tokenizer, tok_hash: str, out: Path, site: list[int], sites: int
) -> dict:
    cfg, team = job.cfg, job.team
    vocab_size = tok.get_vocab_size()
    # Token ids run from 0 to vocab_size - 1.
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    eot = eot_id(tok)
    # The cores of a host are shared by the ranks on it.
    workers = cfg.prepare_workers or max(1, (os.cpu_count() or 1) // job.hosts.count(job.hosts[team.rank]))
    on = f" on each of {team.size} ranks" if team.size > 1 else ""
    splits = {}
    for split in SPLITS:
        mine = share_of(corpus.pieces(split), team.size, team.rank)
        part = out / f"rank-{team.rank:05d}.{split}.bin"
        job.report.line(
            f"kiln: tokenizing {corpus.count(split)} {split} documents "
            f"with {workers} worker{'s' * (workers > 1)}{on} ..."
        )
        started = time.monotonic()

        tokenize = functools.partial(_tokenize, job, corpus, split, mine, tok.to_str(), eot, dtype, workers, part)
        counts = team.each(tokenize, f"tokenizing {split}")
        documents, nbytes, tokens = (sum(c[k] for c in counts) for k in range(3))
        seconds = time.monotonic() - started
        parts = [c[2] for c in counts]
        if sites > 1:
            _exchange(job, out, split, parts, dtype, site)
        shards = _assemble(job, out, split, parts, dtype, site)
        job.report.line(
            f"kiln: tokenized {split}: {documents:,} documents, {nbytes:,} bytes, {tokens:,} tokens "
            f"in {seconds:.1f}s ({nbytes / 1e6 / max(seconds, 1e-9):.2f} MB/s, "
            f"{tokens / max(seconds, 1e-9):,.0f} tokens/s), {len(shards)} shard{'s' * (len(shards) > 1)}"
        )
        splits[split] = {"documents": documents, "tokens": tokens, "bytes": nbytes, "shards": shards}
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
        "shard_bytes": cfg.shard_bytes,
        "splits": splits,
    }

    def finish() -> None:
        if team.rank == site[0]:
            for leftover in out.glob("rank-*"):
                leftover.unlink()
            (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
            # Written last: its presence marks the directory complete.
            (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    team.each(finish, "writing the manifest")
    return manifest


def _tokenize(
    job: _Preparation,
    corpus: Corpus,
    split: str,
    pieces: range,
    tok_json: str,
    eot: int,
    dtype: np.dtype,
    workers: int,
    out: Path,
) -> tuple[int, int, int]:
    """This rank's ``pieces`` of ``split`` tokenized into ``out``: (documents, bytes, tokens)."""
    if job.team.rank == 0 and job.slow_seconds and split == SPLITS[0]:
        time.sleep(job.slow_seconds)
    chunks = _chunks(text for _, text in corpus.documents(split, pieces))
    documents = nbytes = tokens = 0
    with open(out, "wb") as f, job.report.bar(f"tokenizing {split}", corpus.count(split, pieces)) as advance:
        for ids, chunk_bytes, docs in _encode_all(chunks, tok_json, eot, dtype, workers):
            f.write(ids.data)
            nbytes += chunk_bytes
            documents += docs
            tokens += len(ids)
            advance(docs)
    return documents, nbytes, tokens


def _exchange(job: _Preparation, out: Path, split: str, parts: list[int], dtype: np.dtype, site: list[int]) -> None:
    """Every rank's part of ``split`` copied to the sites that do not see it, in pieces of
    _SEND_BYTES from its rank to all; the first rank of each such site writes it."""
    team = job.team
    for rank, tokens in enumerate(parts):
        path, size = out / f"rank-{rank:05d}.{split}.bin", tokens * dtype.itemsize
        with contextlib.ExitStack() as files:
            source = files.enter_context(open(path, "rb")) if team.rank == rank else None
            writes = team.rank == site[0] and rank not in site
            sink = files.enter_context(open(path, "wb")) if writes else None
            for _ in range(0, size, _SEND_BYTES):
                piece = team.share(source.read(_SEND_BYTES) if source else b"", rank)
                if sink:
                    sink.write(piece)


def _assemble(
    job: _Preparation, out: Path, split: str, parts: list[int], dtype: np.dtype, site: list[int]
) -> list[dict]:
    """The parts of ``split`` (token counts by rank), joined in rank order, cut every
    data.shard_bytes (rounded down to whole tokens) into ``SPLIT-00000.bin``, ...; each site's
    ranks write its shards in turn. Their manifest entries; a split always has one shard,
    perhaps empty."""
    team = job.team
    per = max(1, job.cfg.shard_bytes // dtype.itemsize)
    total = sum(parts)
    cuts = [(k, start, min(start + per, total)) for k, start in enumerate(range(0, total, per))] or [(0, 0, 0)]
    mine = [cut for cut in cuts if site[cut[0] % len(site)] == team.rank]
    written = team.each(
        lambda: [_write_shard(out, split, cut, parts, dtype) for cut in mine], f"writing {split} shards"
    )
    shards: dict[int, dict] = {}
    for k, entry in (item for rank in written for item in rank):
        if shards.setdefault(k, entry) != entry:
            raise DataError(f"{out}: shard {entry['file']} came out different on two nodes; prepare again")
    return [shards[k] for k in range(len(cuts))]


def _write_shard(
    out: Path, split: str, cut: tuple[int, int, int], parts: list[int], dtype: np.dtype
) -> tuple[int, dict]:
    """Shard ``cut`` = (index, first token, end) of ``split``, from the parts that hold its
    tokens (a part that is exactly the shard is renamed, not copied)."""
    k, start, end = cut
    name = f"{split}-{k:05d}.bin"
    size = dtype.itemsize
    bounds = np.concatenate([[0], np.cumsum(parts, dtype=np.int64)])
    whole = [r for r in range(len(parts)) if bounds[r] == start and bounds[r + 1] == end and parts[r]]
    if whole:
        (out / f"rank-{whole[0]:05d}.{split}.bin").rename(out / name)
        return k, {"file": name, "tokens": end - start, "sha256": _sha256_file(out / name)}
    sha = hashlib.sha256()
    with open(out / name, "wb") as f:
        for r in range(len(parts)):
            a, b = max(start, int(bounds[r])), min(end, int(bounds[r + 1]))
            if a >= b:
                continue
            with open(out / f"rank-{r:05d}.{split}.bin", "rb") as part:
                part.seek((a - int(bounds[r])) * size)
                left = (b - a) * size
                while left:
                    data = part.read(min(left, _COPY_BYTES))
                    f.write(data)
                    sha.update(data)
                    left -= len(data)
    return k, {"file": name, "tokens": end - start, "sha256": sha.hexdigest()}


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
