"""Data checks of ``kiln doctor``: checksums, token ids, documents, duplicates, train/val
leakage and a decoded sample.

A token stream (kiln's prepared data, or any ``TokenSequences``) is cut into documents at the
end-of-text token, and documents are compared by a hash of their tokens, so the same text under
two names counts as the same document. A dataset of other items is compared item by item. The
work is bounded: at most SCAN_TOKENS tokens per split (evenly spaced windows of a longer
stream) or ITEM_SAMPLE items within ITEM_SECONDS, and the evidence says when it sampled.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from kiln.data import DataError, TokenSequences, verify
from kiln.data.loader import TokenShards, dataset_len
from kiln.data.shards import shard_files
from kiln.doctor.job import Subject
from kiln.doctor.report import fmt_bytes

SCAN_TOKENS = 50_000_000
SCAN_WINDOWS = 16
ITEM_SAMPLE = 4096
ITEM_SECONDS = 10.0
TINY_DOC_TOKENS = 16
TINY_WARN_SHARE = 0.05  # of documents
DUPLICATE_WARN_SHARE = 0.01  # of tokens held by repeated copies
LEAK_FAIL_SHARE = 0.01  # of val tokens in documents that are also in train
SAMPLE_CHARS = 200
SAMPLE_ITEMS = 16
SAMPLE_TOKENS = 512  # per item, enough for SAMPLE_CHARS and bounded for a long data.seq_len
REPLACEMENT_WARN_SHARE = 0.01
TRUNCATED_WARN_SHARE = 0.05  # of fine-tuning records cut to data.seq_len
MIN_LABEL_RECORDS = 5  # a label with fewer training records than this is barely learnable
LABEL_IMBALANCE = 10.0  # the most frequent label this many times the rarest one


@dataclass
class TokenRange:
    """The largest token id of a split, the ids at or above the vocabulary and where the first is."""

    top: int
    over: int
    first: int  # stream position of the first id out of range; -1 if none or unknown
    scanned: str


@dataclass
class Records:
    """Hashes of a split's documents (or items), as far as they were scanned."""

    kind: str  # "documents" or "items"
    hashes: list[bytes]
    sizes: list[int]  # tokens per document; 1 per item
    spans: list[tuple[int, int]]  # stream positions of each document (empty for items)
    scanned: str  # how much of the split was read, in words


class DataScan:
    """Statistics of the job's datasets, computed on first use and shared by the checks."""

    def __init__(self, job: Subject):
        self.job = job
        self.datasets = {s: d for s, d in (("train", job.train_data), ("val", job.val_data)) if d is not None}
        self._sampled: dict[str, tuple[list[tuple[int, Any]], str]] = {}

    @cached_property
    def streams(self) -> dict[str, np.ndarray | TokenShards | None]:
        return {split: _stream_of(ds) for split, ds in self.datasets.items()}

    def windows(self, split: str) -> list[tuple[int, int]]:
        """Where to read a split's stream: all of it, or SCAN_WINDOWS evenly spaced windows."""
        stream = self.streams[split]
        assert stream is not None  # asked of token streams only
        n = len(stream)
        if n <= SCAN_TOKENS:
            return [(0, n)]
        size = SCAN_TOKENS // SCAN_WINDOWS
        return [(i * n // SCAN_WINDOWS, i * n // SCAN_WINDOWS + size) for i in range(SCAN_WINDOWS)]

    def window_note(self, split: str) -> str:
        stream = self.streams[split]
        assert stream is not None  # asked of token streams only
        n = len(stream)
        if n <= SCAN_TOKENS:
            return f"all {n:,} tokens"
        return f"{SCAN_TOKENS:,} of {n:,} tokens in {SCAN_WINDOWS} evenly spaced windows"

    @cached_property
    def token_ranges(self) -> dict[str, TokenRange | None]:
        """Per split, or None for a split that holds no token ids."""
        return {split: self._token_range(split) for split in self.datasets}

    def _token_range(self, split: str) -> TokenRange | None:
        vocab = self.job.vocab_size
        stream = self.streams[split]
        if stream is not None:
            found = TokenRange(-1, 0, -1, self.window_note(split))
            for a, b in self.windows(split):
                part = stream[a:b]
                top = int(part.max()) if len(part) else -1
                found.top = max(found.top, top)
                if vocab is not None and top >= vocab:
                    over = np.flatnonzero(part >= vocab)
                    found.over += len(over)
                    found.first = a + int(over[0]) if found.first < 0 else found.first
            return found
        items, scanned = self.items(split)
        ids = [t.flatten() for _, item in items for t in _token_ids(item)]
        if not ids:
            return None
        flat = torch.cat(ids).long()
        n_over = int((flat >= vocab).sum()) if vocab is not None else 0
        return TokenRange(int(flat.max()), n_over, -1, scanned)

    def out_of_vocab(self) -> str | None:
        """'train: max id 120 >= vocabulary 97' for each split with ids out of range, or None."""
        if self.job.vocab_size is None:
            return None
        bad = [
            f"{split}: max id {r.top} >= vocabulary {self.job.vocab_size}"
            for split, r in self.token_ranges.items()
            if r is not None and r.over
        ]
        return "; ".join(bad) or None

    @cached_property
    def records(self) -> dict[str, Records]:
        return {split: self._records(split) for split in self.datasets}

    @property
    def has_documents(self) -> bool:
        return self.job.eot is not None and all(s is not None for s in self.streams.values())

    def _records(self, split: str) -> Records:
        stream = self.streams[split]
        if self.has_documents:
            assert stream is not None and self.job.eot is not None  # has_documents
            spans = _document_spans(stream, self.job.eot, self.windows(split))
            hashes = [_digest(stream[a:b].tobytes()) for a, b in spans]
            return Records("documents", hashes, [b - a for a, b in spans], spans, self.window_note(split))
        items, note = self.items(split)
        return Records("items", [_digest(_item_bytes(item)) for _, item in items], [1] * len(items), [], note)

    def items(self, split: str) -> tuple[list[tuple[int, Any]], str]:
        """Sampled (index, item) pairs of a split, and how they were sampled."""
        if split not in self._sampled:
            self._sampled[split] = _sample_items(self.datasets[split])
        return self._sampled[split]

    def snippet(self, split: str, span: tuple[int, int], chars: int = 60) -> str:
        """The start of a document, decoded, for naming it in the evidence."""
        if self.job.tokenizer is None:
            return f"tokens {span[0]:,}..{span[1]:,}"
        stream = self.streams[split]
        assert stream is not None  # documents are spans of a token stream
        ids = stream[span[0] : min(span[1], span[0] + chars)].tolist()
        text = self.job.tokenizer.decode(ids, skip_special_tokens=False)
        return repr(text[:chars])


def data_scan(job: Subject) -> DataScan:
    """The job's data statistics, computed once for every check that needs them."""
    return job.shared(DataScan)


# -- the checks -----------------------------------------------------------------------------------


def check_source(job: Subject):
    if job.data_problem:
        return "fail", job.data_problem, "fix data.source (or the files it names) as the message says"
    empty = [s for s, d in (("train", job.train_data), ("val", job.val_data)) if d is not None and dataset_len(d) == 0]
    if empty:
        return (
            "fail",
            f"{job.source}; the {' and '.join(empty)} split has no sequence of data.seq_len + 1 = "
            f"{job.cfg.data.seq_len + 1} tokens",
            "lower data.seq_len or add data",
        )
    return "pass", job.source, ""


def check_checksums(job: Subject):
    if job.train_data is None:
        return "skip", _NO_DATA, ""
    prepared = job.prepared
    if prepared is None:
        return "skip", "not kiln's prepared data: no manifest.json with checksums to compare", ""
    started = time.perf_counter()
    try:
        verify(prepared)
    except DataError as e:
        return "fail", str(e), f"delete {prepared.dir} and run `kiln prepare` again (the cache is rebuilt)"
    shards = shard_files(prepared.manifest)
    files = [*shards, "tokenizer.json"]
    size = sum((prepared.dir / f).stat().st_size for f in files)
    named = (
        ", ".join(files)
        if len(shards) <= 4
        else f"{len(shards)} token shards ({shards[0]} ... {shards[-1]}), tokenizer.json"
    )
    return (
        "pass",
        f"{named} in {prepared.dir} match the sha256 in manifest.json "
        f"({fmt_bytes(size)} read in {time.perf_counter() - started:.1f}s)",
        "",
    )


def check_token_ids(job: Subject):
    if job.train_data is None:
        return "skip", _NO_DATA, ""
    scan, vocab = data_scan(job), job.vocab_size
    if vocab is None:
        return "skip", "the model's vocabulary size is unknown (no config.vocab_size or nn.Embedding)", ""
    ranges = {s: r for s, r in scan.token_ranges.items() if r is not None}
    if not ranges:
        return "skip", "the data holds no integer tensors to compare with the vocabulary", ""
    parts = []
    for split, r in ranges.items():
        where = f", first at token {r.first:,}" if r.first >= 0 else ""
        parts.append(
            f"{split}: max id {r.top:,}"
            + (f", {r.over:,} ids >= {vocab:,}{where}" if r.over else "")
            + f" ({r.scanned})"
        )
    evidence = f"model vocabulary {vocab:,}; " + "; ".join(parts)
    if scan.out_of_vocab():
        return (
            "fail",
            evidence,
            "the data was tokenized for a larger vocabulary than the model has: tokenize with "
            "the model's tokenizer, or give the model a vocabulary above the largest id "
            "(kiln's GPT takes it from data.tokenizer)",
        )
    return "pass", evidence, ""


def check_documents(job: Subject):
    if job.train_data is None:
        return "skip", _NO_DATA, ""
    scan = data_scan(job)
    if not scan.has_documents:
        return "skip", _no_documents(job), ""
    parts, worst, example = [], 0.0, ""
    for split, rec in scan.records.items():
        if not rec.sizes:
            parts.append(f"{split}: no complete document (no end-of-text token {job.eot}) in {rec.scanned}")
            worst = 1.0
            continue
        empty = sum(n == 0 for n in rec.sizes)
        tiny = sum(0 < n < TINY_DOC_TOKENS for n in rec.sizes)
        share = (empty + tiny) / len(rec.sizes)
        parts.append(
            f"{split}: {empty:,} empty and {tiny:,} under {TINY_DOC_TOKENS} tokens of {len(rec.sizes):,} "
            f"documents ({100 * share:.1f}%), median {int(np.median(rec.sizes)):,} tokens"
        )
        if tiny and not example:
            span = next(s for s, n in zip(rec.spans, rec.sizes, strict=True) if 0 < n < TINY_DOC_TOKENS)
            example = f"; e.g. {scan.snippet(split, span)}"
        worst = max(worst, share)
    evidence = "; ".join(parts) + example
    if worst >= TINY_WARN_SHARE:
        return (
            "warn",
            evidence,
            "look at how documents are split: a wrong data.text_field, one line per document, "
            "or files without text; filter out documents too short to teach anything",
        )
    return "pass", evidence, ""


def check_duplicates(job: Subject):
    if job.train_data is None:
        return "skip", _NO_DATA, ""
    scan = data_scan(job)
    parts, worst, example = [], 0.0, ""
    for split, rec in scan.records.items():
        seen, copies, copy_tokens = set(), 0, 0
        for i, (h, n) in enumerate(zip(rec.hashes, rec.sizes, strict=True)):
            if h in seen:
                copies += 1
                copy_tokens += n
                if not example and rec.spans:
                    example = f"; e.g. {scan.snippet(split, rec.spans[i])}"
            seen.add(h)
        share = copy_tokens / max(1, sum(rec.sizes))
        worst = max(worst, share)
        parts.append(
            f"{split}: {copies:,} of {len(rec.hashes):,} {rec.kind} repeat an earlier one "
            f"({100 * share:.2f}% of {'tokens' if rec.kind == 'documents' else 'items'}; {rec.scanned})"
        )
    evidence = "; ".join(parts) + example
    if worst > DUPLICATE_WARN_SHARE:
        return (
            "warn",
            evidence,
            (
                "deduplicate the corpus (exact copies are seen several times per epoch and "
                "inflate how well the model seems to do)"
            ),
        )
    return "pass", evidence, ""


def check_overlap(job: Subject):
    if job.train_data is None:
        return "skip", _NO_DATA, ""
    scan = data_scan(job)
    if "val" not in scan.records or "train" not in scan.records:
        return "skip", "no validation set to compare with the training set", ""
    train, val = scan.records["train"], scan.records["val"]
    in_train = set(train.hashes)
    shared = [i for i, h in enumerate(val.hashes) if h in in_train]
    shared_size = sum(val.sizes[i] for i in shared)
    share = shared_size / max(1, sum(val.sizes))
    unit = "tokens" if val.kind == "documents" else "items"
    evidence = (
        f"{len(shared):,} of {len(val.hashes):,} val {val.kind} also appear in train "
        f"({100 * share:.2f}% of val {unit}; compared with {len(train.hashes):,} train {train.kind}, "
        f"{train.scanned})"
    )
    if shared and val.spans:
        evidence += f"; e.g. {scan.snippet('val', val.spans[shared[0]])}"
    fix = f"remove from val the {val.kind} that are also in train; validation loss is optimistic until then"
    if share >= LEAK_FAIL_SHARE:
        return "fail", evidence, fix
    return ("warn", evidence, fix) if shared else ("pass", evidence, "")


def check_sample(job: Subject):
    data, tok = job.train_data, job.tokenizer
    if data is None or dataset_len(data) == 0:
        return "skip", _NO_DATA, ""
    if tok is None:
        return "skip", "no tokenizer to decode with (run_doctor takes tokenizer=)", ""
    first = _token_ids(data[0])
    if not first:
        return "skip", "a training item holds no token ids", ""

    def decode(ids: torch.Tensor) -> str:
        return tok.decode(ids.flatten()[:SAMPLE_TOKENS].tolist(), skip_special_tokens=False)

    sample = decode(first[0])
    items = [data[i] for i in range(min(SAMPLE_ITEMS, dataset_len(data)))]
    text = "".join(decode(_token_ids(item)[0]) for item in items)
    bad = text.count("\ufffd") / max(1, len(text))
    evidence = (
        f"{sample[:SAMPLE_CHARS]!r}; {100 * bad:.2f}% of {len(text):,} decoded characters (the first "
        f"{len(items)} sequences, up to {SAMPLE_TOKENS} tokens each) are U+FFFD"
    )
    if bad > REPLACEMENT_WARN_SHARE:
        return (
            "warn",
            evidence,
            (
                "undecodable bytes: the files are not UTF-8 (convert them), or the tokenizer does "
                "not match the one the data was tokenized with"
            ),
        )
    return "pass", evidence, ""


def check_records(job: Subject):
    """Fine-tuning records: how many were cut to data.seq_len, how many tokens the loss covers,
    how full packed rows are, and how balanced a classifier's labels are."""
    data = job.finetune
    if data is None:
        return "skip", "not fine-tuning records", ""
    m, seq = data.manifest, job.cfg.data.seq_len
    records = m["records"]["train"] + m["records"]["val"]
    cut = m["truncated"]["train"] + m["truncated"]["val"]
    parts = [f"{cut:,} of {records:,} records ({cut / records:.1%}) truncated to data.seq_len={seq}"]
    problems, fixes = [], []
    if cut / records > TRUNCATED_WARN_SHARE:
        problems.append("many records are truncated")
        fixes.append("raise data.seq_len or shorten the records (truncation cuts completions and texts)")
    if data.task == "causal_lm":
        rows = data.train.rows
        tokens = sum(len(r["input_ids"]) for r in rows)
        parts.append(
            f"the loss covers {m['loss_tokens']['train']:,} of {tokens:,} training tokens "
            f"({m['loss_tokens']['train'] / max(1, tokens):.0%})"
        )
        if m.get("packing"):
            parts.append(f"packed into {m['packing']['rows']:,} rows, {m['packing']['fill']:.0%} full")
    else:
        counts = m["labels"]
        parts.append("training labels " + ", ".join(f"{k}: {v:,}" for k, v in counts.items()))
        few, many = min(counts.values()), max(counts.values())
        if few < MIN_LABEL_RECORDS or many > LABEL_IMBALANCE * few:
            problems.append(f"labels are unbalanced ({many:,} against {few:,} records)")
            fixes.append(
                "collect more records of the rare labels, or weigh them (kiln's loss weighs every record the same)"
            )
    evidence = "; ".join(parts) + (": " + "; ".join(problems) if problems else "")
    return ("warn", evidence, "; ".join(fixes)) if problems else ("pass", evidence, "")


_NO_DATA = "no data to check; see data source"

CHECKS = [
    ("data", "data source", check_source),
    ("data", "checksums", check_checksums),
    ("data", "token ids", check_token_ids),
    ("data", "documents", check_documents),
    ("data", "duplicates", check_duplicates),
    ("data", "train/val overlap", check_overlap),
    ("data", "decoded sample", check_sample),
    ("data", "fine-tuning records", check_records),
]


# -- helpers --------------------------------------------------------------------------------------


def _stream_of(ds: Dataset) -> np.ndarray | TokenShards | None:
    """The 1-D token stream behind a TokenSequences (memory-mapped; ``TokenShards`` when prepared in
    several files, whose slices join the files: the checks read at most SCAN_TOKENS at a time), or
    None for other datasets."""
    return ds.tokens if isinstance(ds, TokenSequences) else None


def _document_spans(
    stream: np.ndarray | TokenShards, eot: int, windows: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """(start, end) of every document wholly inside the windows; end is its EOT's position."""
    spans = []
    for a, b in windows:
        # Documents lie between cuts. A window that starts mid-stream starts mid-document, so
        # its text before the first EOT is not a whole document.
        cuts = ([a - 1] if a == 0 else []) + (a + np.flatnonzero(stream[a:b] == eot)).tolist()
        spans += [(s + 1, e) for s, e in zip(cuts, cuts[1:], strict=False)]
        if b == len(stream) and cuts and cuts[-1] < b - 1:
            spans.append((cuts[-1] + 1, b))  # the stream ends without an EOT after its last document
    return spans


def _sample_items(ds: Dataset) -> tuple[list[tuple[int, Any]], str]:
    """Up to ITEM_SAMPLE evenly spaced items, read for at most ITEM_SECONDS."""
    n = dataset_len(ds)
    k = min(n, ITEM_SAMPLE)
    deadline = time.perf_counter() + ITEM_SECONDS
    items = []
    for j in range(k):
        i = j * n // k
        items.append((i, ds[i]))
        if time.perf_counter() > deadline:
            return items, f"{len(items):,} of {n:,} items (stopped after {ITEM_SECONDS:g}s)"
    return items, f"all {n:,} items" if k == n else f"{k:,} of {n:,} items, evenly spaced"


def _leaves(item: Any) -> list[torch.Tensor]:
    if isinstance(item, torch.Tensor):
        return [item]
    if isinstance(item, np.ndarray):
        return [torch.from_numpy(item)]
    if isinstance(item, dict):
        return [t for v in item.values() for t in _leaves(v)]
    if isinstance(item, (list, tuple)):
        if item and all(isinstance(v, int) for v in item):  # a row of token ids (fine-tuning records)
            return [torch.tensor(item)]
        return [t for v in item for t in _leaves(v)]
    return []


def _token_ids(item: Any) -> list[torch.Tensor]:
    """The integer tensors of an item (token ids, targets, labels)."""
    return [t for t in _leaves(item) if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]


def _item_bytes(item: Any) -> bytes:
    return b"".join(str(tuple(t.shape)).encode() + t.contiguous().cpu().numpy().tobytes() for t in _leaves(item))


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _no_documents(job: Subject) -> str:
    if job.eot is None:
        return "no end-of-text token known (run_doctor takes tokenizer=) to split the data into documents"
    return "documents are known only in token streams (TokenSequences)"
