"""Text corpora: the embedded Python standard library or user files, split into train and val.

A document is ``(name, text)``. Its name is stable across machines and runs, because the
train/val split is a hash of the name: adding or removing files never moves other documents
between splits. A text file's name is its path relative to the corpus root. A record's name does
not depend on the container: it is ``NAME:N``, NAME the path of its file without the format
suffix (.jsonl, .jsonl.gz, .jsonl.zst, .parquet) and N its 1-based number (a .jsonl's line
number, blank lines counted; a row number otherwise), so the same records as .jsonl, compressed
.jsonl, .parquet or a ``datasets`` save give the same documents and the same split. The complete
shards of a Hugging Face Hub split (``data/train-00000-of-00002.parquet``, ...) are numbered on as
one file ``data/train``; a ``datasets.Dataset.save_to_disk`` directory as one file named after
the directory. Exact copies are kept once, so no text is on both sides; a document too large to
go to one side whole (a book, a dump) is split by position. See :class:`Corpus`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import gzip
import hashlib
import io
import json
import os
import re
import sys
import sysconfig
import zlib
from array import array
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np

from kiln.data.team import ALONE, Team, share_of

# Bump when the meaning of names, splits or reading changes, so fingerprints (and caches) change.
# 3: records are named without their format suffix and numbered from 1 (parquet rows too); Hub
# shards and datasets saves are numbered as one file; .jsonl.gz, .jsonl.zst and .arrow are read.
# 4: the fingerprint hashes each file's digest (so ranks can hash their shares of the files).
CORPUS_VERSION = 4
# Plain-text files (.txt, and .py since source code is a natural corpus) are one document each.
TEXT_EXTENSIONS = (".txt", ".py")
# Record files: one document per line or row. Longest suffixes first, so .jsonl.gz is not .gz.
RECORD_FORMATS = {
    ".jsonl.gz": "jsonl",
    ".jsonl.zst": "jsonl",
    ".jsonl": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",  # only as part of a datasets save_to_disk directory
}
EXTENSIONS = (*TEXT_EXTENSIONS, *RECORD_FORMATS)
SPLITS = ("train", "val")
MAX_RECORD_BYTES = 64 << 20  # data.max_record_bytes's default
_STDLIB_EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test"}
_KINDS = (
    "'stdlib', or a file, directory or glob of .txt, .py, .jsonl, .jsonl.gz, .jsonl.zst and .parquet "
    "files, or a directory written by datasets' save_to_disk"
)
# A Hub shard's name without its format suffix: NAME-00000-of-00002, perhaps with a hash after.
Y = TypeVar("Y")
R = TypeVar("R")
_SHARD = re.compile(r"(?P<stem>.+)-(?P<index>\d+)-of-(?P<count>\d+)(?:-[0-9a-f]{8,})?")


class DataError(ValueError):
    """Bad training data: the message names the file (and line) and what would work."""


def split_of(name: str, val_fraction: float) -> str:
    """'val' or 'train' for a document name: a stable hash (unlike ``hash()``, not salted per process)."""
    return "val" if _hash_unit(name) < val_fraction else "train"


def _hash_unit(name: str) -> float:
    """The name's hash mapped uniformly to [0, 1)."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "big") / 2**64


def _content_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def position_cut(text: str, val_fraction: float) -> int | None:
    """Where the validation tail of ``text`` starts when it is split by position: at the start of
    the line nearest to the last ``val_fraction`` of its characters, else (one long line) at the
    nearest whitespace, so no word is cut in two; None if no such cut leaves text on both sides."""
    target = round(len(text) * (1 - val_fraction))
    for boundary in ("\n", " "):
        after = text.find(boundary, target)
        before = text.rfind(boundary, 0, target)
        cuts = [i + 1 if boundary == "\n" else i for i in (after, before) if i >= 0]
        for cut in sorted(cuts, key=lambda c: abs(c - target)):
            if text[:cut].strip() and text[cut:].strip():
                return cut
    return None


@dataclass(frozen=True)
class Part:
    """Files read as one: a text file (one document, named by its path), or record files whose
    records are numbered on from file to file, 1-based, and named ``NAME:N`` (a .jsonl, .jsonl.gz,
    .jsonl.zst or .parquet file; the complete shards ``NAME-00000-of-0000M`` of a Hugging Face
    Hub split; or a directory written by ``datasets.Dataset.save_to_disk``)."""

    name: str
    paths: tuple[Path, ...]
    records: bool


class Files:
    """The files one source names, read as documents ``(name, text)`` in part order, then file,
    then line or row order; empty documents are skipped. Names are relative to ``root``."""

    def __init__(
        self, source: str, root: Path, parts: list[Part], text_field: str, max_record_bytes: int = MAX_RECORD_BYTES
    ):
        self.source, self.root, self.parts, self.text_field = source, root, parts, text_field
        self.max_record_bytes = max_record_bytes

    @property
    def files(self) -> list[Path]:
        return [path for part in self.parts for path in part.paths]

    @cached_property
    def entries(self) -> list[tuple[Part, Path]]:
        """Every file with its part, in reading order: the units that ranks share."""
        return [(part, path) for part in self.parts for path in part.paths]

    def name_of(self, path: Path) -> str:
        """A file's path relative to the root (a record's name is its part's name plus ``:N``)."""
        return path.relative_to(self.root).as_posix()

    def digest(self, index: int) -> str:
        """sha256 of file ``index``'s size and bytes."""
        path = self.entries[index][1]
        h = hashlib.sha256(path.stat().st_size.to_bytes(8, "big"))
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()

    def hash_into(self, h, digests: list[str]) -> None:
        """The parts, the files' names and ``digests`` (of each entry, as :meth:`digest` says) into ``h``."""
        at = 0
        for part in self.parts:
            # Length prefixes keep (name, content) boundaries unambiguous; the part's name and its
            # files in reading order fix every record's name.
            _hash_field(h, f"{part.name}\0{int(part.records)}\0{len(part.paths)}".encode())
            for path in part.paths:
                _hash_field(h, self.name_of(path).encode("utf-8"))
                h.update(bytes.fromhex(digests[at]))
                at += 1

    def documents(self) -> Iterator[tuple[str, str]]:
        offset = 0  # records of the part's earlier files
        for index, (part, path) in enumerate(self.entries):
            if path == part.paths[0]:
                offset = 0
            records: list[int] = []
            for number, text in returning(self.read(index), records):
                yield document_name(part, offset + number), text
            offset += records[0]

    def read(self, index: int) -> Generator[tuple[int, str], None, int]:
        """The non-empty documents of file ``index`` as (its number in the file, text): a text
        file is one document (number 0), a record file's are numbered from 1 by line or row.
        Returns how many records the file holds (blank lines and empty rows counted)."""
        part, path = self.entries[index]
        if not part.records:
            text, replaced = _decoded(path.read_bytes())
            if replaced:
                _warn_replaced(path, replaced)
            if text.strip():
                yield 0, text
            return 0
        if _record_format(path.name) == "jsonl":
            return (yield from self._read_jsonl(path))
        return (yield from self._read_columnar(path))

    def _read_jsonl(self, path: Path) -> Generator[tuple[int, str], None, int]:
        """Documents of a .jsonl, .jsonl.gz or .jsonl.zst file by line number (blank lines count);
        returns its number of lines."""
        field = self.text_field
        lines = 0
        for lineno, line in read_lines(path, self.max_record_bytes):
            lines = lineno
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); .jsonl needs one JSON object per line"
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}:{lineno}: expected a JSON object with a string field {field!r}, "
                    f"got a JSON {type(record).__name__}"
                )
            text = record.get(field)
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: no string field {field!r} (fields: {', '.join(record)}); "
                    "set data.text_field to the field that holds the text"
                )
            if text.strip():
                yield lineno, text
        return lines

    def _read_columnar(self, path: Path) -> Generator[tuple[int, str], None, int]:
        """Documents of a .parquet file, or an .arrow file of a datasets save (an Arrow IPC
        stream), one record batch at a time, by row number; returns its number of rows."""
        import pyarrow as pa

        parquet = _record_format(path.name) == "parquet"
        what = "Parquet file" if parquet else "Arrow IPC stream (as datasets' save_to_disk writes)"
        with contextlib.ExitStack() as stack:
            try:
                if parquet:
                    import pyarrow.parquet as pq

                    pf = stack.enter_context(pq.ParquetFile(path))
                    schema = pf.schema_arrow
                else:
                    reader = stack.enter_context(pa.ipc.open_stream(stack.enter_context(pa.memory_map(str(path)))))
                    schema = reader.schema
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"{path}: not a readable {what} ({e})") from None
            if not schema.names:
                raise DataError(f"{path}: not a readable {what} (its schema has no columns)")
            column = self._text_column(path, schema)
            batches = iter(pf.iter_batches(columns=[self.text_field]) if parquet else reader)
            rows = 0
            while True:
                try:
                    batch = next(batches, None)
                except (pa.ArrowException, OSError) as e:
                    raise DataError(f"{path}: truncated or corrupt {what} after row {rows} ({e})") from None
                if batch is None:
                    return rows
                for text in batch.column(0 if parquet else column).to_pylist():
                    rows += 1
                    # Nulls are treated like empty documents: skipped.
                    if text is not None and text.strip():
                        yield rows, text

    def _text_column(self, path: Path, schema) -> int:
        import pyarrow as pa

        field = self.text_field
        if field not in schema.names:
            raise DataError(
                f"{path}: no column {field!r}; columns are {', '.join(schema.names)}; "
                "set data.text_field to the column that holds the text"
            )
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(
                f"{path}: column {field!r} has type {kind}, not string; "
                "set data.text_field to the column that holds the text"
            )
        return schema.get_field_index(field)


def document_name(part: Part, number: int) -> str:
    """The name of document ``number`` (over the part's files) of ``part``: a text file's is its
    part's name, a record's ``NAME:N``."""
    return f"{part.name}:{number}" if part.records else part.name


def _hash_field(h, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "big") + data)


def _record_format(filename: str) -> str | None:
    """'jsonl', 'parquet' or 'arrow' for a record file's name, else None."""
    suffix = _record_suffix(filename)
    return None if suffix is None else RECORD_FORMATS[suffix]


def _record_suffix(filename: str) -> str | None:
    lower = filename.lower()
    return next((s for s in RECORD_FORMATS if lower.endswith(s)), None)


_warned: set[Path] = set()  # files whose bytes that are not UTF-8 this process has told of


def read_lines(path: Path, limit: int = MAX_RECORD_BYTES, strict: bool = False) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a text file, plain, gzip- or zstd-compressed, never holding more
    than one line of at most ``limit`` bytes (a longer one, a decompression bomb's included, is a
    DataError naming the file and line; data.max_record_bytes). Bytes that are not UTF-8 are a
    DataError naming file:line with ``strict`` (records), else replaced by U+FFFD and counted in
    one warning for the file (corpora). A corrupt or truncated compressed file is a DataError
    naming the last line read whole."""
    lower = path.name.lower()
    compression = "gzip" if lower.endswith(".gz") else "zstd" if lower.endswith(".zst") else None
    lineno, replaced, where = 0, 0, []
    try:
        with contextlib.ExitStack() as stack:
            f: io.BufferedIOBase
            if compression == "gzip":
                f = stack.enter_context(gzip.open(path, "rb"))
            elif compression == "zstd":
                raw = stack.enter_context(open(path, "rb"))
                f = io.BufferedReader(_ZstdFrames(raw, _zstandard(path)), buffer_size=1 << 16)
            else:
                f = stack.enter_context(open(path, "rb"))
            while data := f.readline(limit + 1):
                lineno += 1
                if len(data) > limit and not (len(data) == limit + 1 and data.endswith(b"\n")):
                    raise DataError(
                        f"{path}:{lineno}: a line longer than data.max_record_bytes ({limit:,} bytes); "
                        "raise data.max_record_bytes if the record is meant to be that long"
                    )
                line, bad = _decoded(data, None if not strict else f"{path}:{lineno}")
                if bad:
                    replaced += bad
                    where.append(lineno)
                yield lineno, line
    except (OSError, EOFError, zlib.error) as e:
        if compression is None:
            raise
        raise DataError(
            f"{path}: truncated or corrupt {compression} data after line {lineno} ({e}); "
            f"check the file, e.g. with `{'gzip' if compression == 'gzip' else 'zstd'} -t`"
        ) from None
    if replaced:
        _warn_replaced(path, replaced, where)


def _decoded(data: bytes, strict: str | None = None) -> tuple[str, int]:
    """``data`` read as UTF-8, and how many invalid sequences were read as U+FFFD; with ``strict``
    (where the bytes come from, "file:line") an invalid sequence is a DataError naming it."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if strict is not None:
            raise DataError(
                f"{strict}: not UTF-8 (byte {e.start + 1} of the line is {data[e.start : e.start + 1]!r})"
            ) from None
    text = data.decode("utf-8", errors="replace")
    return text, text.count("\ufffd")


def _warn_replaced(path: Path, count: int, lines: list[int] | None = None) -> None:
    if path in _warned:
        return
    _warned.add(path)
    at = f" (lines {', '.join(map(str, lines[:5]))}{', ...' if len(lines) > 5 else ''})" if lines else ""
    print(f"kiln: warning: {path}: {count:,} invalid UTF-8 sequences read as U+FFFD{at}", file=sys.stderr)


def _zstandard(path: Path):
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path}: reading .zst files needs the zstandard package: pip install 'kiln[data]'") from None
    return zstandard


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a zstd file, frame after frame (skippable frames and the frames
    of parallel compressors included), a chunk at a time. Unlike zstandard's ``stream_reader``,
    which ends quietly where a file was cut short, a frame cut short is an EOFError."""

    # Compressed bytes read at a time: zstd's output of one call is unbounded, so a small input
    # bounds it (to 64 MiB at most, zstd's largest ratio being that of 128 KiB blocks of one byte).
    _CHUNK = 1 << 11

    def __init__(self, raw, zstandard):
        super().__init__()
        self._raw = raw
        self._error = zstandard.ZstdError
        # A window of up to 2 GiB, so files written with `zstd --long=31` decompress too.
        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._frame = None  # the decompressor of the current frame; None before the first
        self._out = memoryview(b"")  # decompressed, not yet read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            if self._frame is None or self._frame.eof:
                data = (self._frame.unused_data if self._frame is not None else b"") or self._raw.read(self._CHUNK)
                if not data:
                    return 0  # the end of the file, between frames
                self._frame = self._dctx.decompressobj()
            else:
                data = self._raw.read(self._CHUNK)
                if not data:
                    raise EOFError("the file ends inside a zstd frame")
            try:
                self._out = memoryview(self._frame.decompress(data))
            except self._error as e:
                raise OSError(str(e)) from None
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


# What becomes of each document of the training source.
_TRAIN, _VAL, _BOTH, _DROP = 0, 1, 2, 3


class Corpus:
    """Training and validation documents; see :func:`open_corpus`.

    Exact duplicates (by content hash) are kept once, at their first place in file order. Then,
    without a validation source, each document goes to val when the hash of its name maps below
    ``val_fraction`` (:func:`split_of`), except a document of at least ``position_split_chars``
    characters, and a corpus's only document, which are split by position: the last
    ``val_fraction`` of the text (from a line start, :func:`position_cut`) is val, the rest train.
    A corpus too small for the hash to give both splits a document is fixed up deterministically:
    if val came out empty, the document with the smallest hash moves to val; if train came out
    empty, the one with the largest hash moves to train.

    With a validation source, the training source is not split; its documents whose content is
    also in val are removed from train, so val stays exactly what was named. Without a training
    source (``train`` None: ``kiln eval --data``), every document of the validation source is val,
    duplicates included: what was given is scored whole.
    """

    def __init__(
        self, train: Files | None, val: Files | None, val_fraction: float, position_split_chars: int = 1_000_000
    ):
        if train is None and val is None:
            raise ValueError("a corpus needs a training or a validation source")
        self.train, self.val = train, val
        self.val_fraction, self.position_split_chars = val_fraction, position_split_chars

    @property
    def _named(self) -> Files:
        """The training source, else the validation source (the constructor wants one of them)."""
        named = self.train or self.val
        assert named is not None
        return named

    @property
    def source(self) -> str:
        return self._named.source

    @property
    def files(self) -> list[Path]:
        return [*(self.train.files if self.train else []), *(self.val.files if self.val else [])]

    @property
    def text_field(self) -> str:
        return self._named.text_field

    def name_of(self, path: Path) -> str:
        return self._named.name_of(path)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over every file's relative name, size and bytes, the text field, the split
        settings and the version."""
        return self._fingerprint(ALONE)

    def fingerprint_with(self, team: Team) -> str:
        """The fingerprint, each rank of ``team`` hashing its share of the files (all call this)."""
        if "fingerprint" not in self.__dict__:
            self.__dict__["fingerprint"] = self._fingerprint(team)
        return self.fingerprint

    def plan_with(self, team: Team) -> None:
        """Decide the split, each rank of ``team`` reading its share of the training files (all
        call this; without it the split is decided by this process alone when first needed)."""
        if "_plan" not in self.__dict__:
            self.__dict__["_plan"] = self._make_plan(team)

    def pieces(self, split: str) -> list[int]:
        """The sizes in bytes of the pieces ``documents(split, ...)`` reads in turn: each file of
        the training source, or the validation source whole when ``split`` comes from it."""
        if split == "val" and self.val is not None:
            return [sum(path.stat().st_size for path in self.val.files)]
        return [path.stat().st_size for _, path in self.train.entries] if self.train else []

    def documents(self, split: str, pieces: range | None = None) -> Iterator[tuple[str, str]]:
        """Documents of ``split`` ('train' or 'val'), in file order then record order (of the
        ``pieces``, indices into :meth:`pieces`, if given, else all). A document split by position
        is named ``NAME[:CUT]`` in train and ``NAME[CUT:]`` in val."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split == "val" and self.val is not None:
            if pieces is None or 0 in pieces:
                yield from self._val_documents()
            return
        if self.train is None:
            return
        plan = self._plan
        wanted = _TRAIN if split == "train" else _VAL
        for i in range(len(self.train.entries)) if pieces is None else pieces:
            part = self.train.entries[i][0]
            index, offset = int(plan["starts"][i]), int(plan["offsets"][i])
            for number, text in self.train.read(i):
                fate = plan["fate"][index]
                index += 1
                if fate == wanted:
                    yield document_name(part, offset + number), text
                elif fate == _BOTH:
                    name, cut = document_name(part, offset + number), int(plan["cuts"][index - 1])
                    yield (f"{name}[:{cut}]", text[:cut]) if split == "train" else (f"{name}[{cut}:]", text[cut:])

    def count(self, split: str, pieces: range | None = None) -> int:
        """Number of documents in ``split`` (of the ``pieces``, if given; reads the corpus once,
        then cached)."""
        if pieces is None:
            return self._plan["counts"][split]
        if split == "val" and self.val is not None:
            return self._plan["counts"][split] if 0 in pieces else 0
        if self.train is None or not pieces:
            return 0
        starts = self._plan["starts"]
        fate = self._plan["fate"][starts[pieces.start] : starts[pieces.stop]]
        return int(((fate == (_TRAIN if split == "train" else _VAL)) | (fate == _BOTH)).sum())

    @property
    def stats(self) -> dict:
        """How the documents were split, and what was removed: for data.json and the console."""
        return self._plan["stats"]

    def _fingerprint(self, team: Team) -> str:
        settings = f"{self.text_field}\0{self.val_fraction!r}\0{self.position_split_chars}"
        h = hashlib.sha256(f"kiln-corpus-v{CORPUS_VERSION}\0{settings}\0".encode())
        sources = [(role, files) for role, files in (("train", self.train), ("val", self.val)) if files is not None]
        entries = [(files, i) for _, files in sources for i in range(len(files.entries))]
        mine = share_of([files.entries[i][1].stat().st_size for files, i in entries], team.size, team.rank)
        shares = team.each(lambda: [files.digest(i) for files, i in (entries[j] for j in mine)], "hashing the data")
        digests = iter(d for share in shares for d in share)
        for role, files in sources:
            h.update(f"\0{role}\0".encode())
            files.hash_into(h, [next(digests) for _ in files.entries])
        return h.hexdigest()

    def _val_documents(self) -> Iterator[tuple[str, str]]:
        assert self.val is not None  # only called with a validation source
        seen: set[int] = set()
        for name, text in self.val.documents():
            if self.train is not None:  # a validation set of a training run: each text once
                key = _content_hash(text)
                if key in seen:
                    continue
                seen.add(key)
            yield name, text

    @cached_property
    def _plan(self) -> dict:
        return self._make_plan(ALONE)

    def _make_plan(self, team: Team) -> dict:
        if self.train is None:
            assert self.val is not None  # the constructor wants a training or a validation source
            n = sum(1 for _ in self.val.documents())
            if not n:
                raise DataError(f"{self.val.source}: no non-empty documents")
            stats = {"split": f"every document of {self.val.source} is val"}
            return {"counts": {"train": 0, "val": n}, "stats": stats}
        if self.val is not None:
            return self._plan_with_val_source(team)
        return self._plan_by_hash(team)

    def _scan(self, team: Team) -> dict:
        """One pass over the training source, each rank of ``team`` reading its share of the
        files: per document its name's hash unit, its content hash, its length and its position
        cut (-1 where it has none); per file the index of its first document and the number of
        records before it in its part. Arrays, not lists, so millions of documents stay small."""
        train = self.train
        assert train is not None  # only called with a training source
        mine = share_of(self.pieces("train"), team.size, team.rank)
        shares = team.each(lambda: [_scan_file(train, i, self.val_fraction) for i in mine], "reading the data")
        scans = [scan for share in shares for scan in share]
        units, offsets, offset = array("d"), array("q"), 0
        for (part, path), scan in zip(train.entries, scans, strict=True):
            offset = 0 if path == part.paths[0] else offset
            offsets.append(offset)
            units.extend(_hash_unit(document_name(part, offset + int(n))) for n in scan.numbers)
            offset += scan.records
        starts = np.concatenate([[0], np.cumsum([len(scan.numbers) for scan in scans], dtype=np.int64)])

        def column(name: str, dtype: type) -> np.ndarray:
            return (
                np.concatenate([getattr(scan, name) for scan in scans]).astype(dtype) if scans else np.empty(0, dtype)
            )

        hashes, lengths, cuts = column("hashes", np.uint64), column("lengths", np.int64), column("cuts", np.int64)
        return {
            "units": np.asarray(units),
            "hashes": hashes,
            "lengths": lengths,
            "cuts": cuts,
            "starts": starts,
            "offsets": np.asarray(offsets),
        }

    def _plan_by_hash(self, team: Team) -> dict:
        scan = self._scan(team)
        units, hashes, lengths, cuts = scan["units"], scan["hashes"], scan["lengths"], scan["cuts"]
        n = len(units)
        keep = _first_copies(hashes)
        kept = int(keep.sum())
        if kept == 0:
            raise DataError(f"{self.source}: no non-empty documents")
        fate = np.where(units < self.val_fraction, _VAL, _TRAIN).astype(np.int8)
        large = keep & (lengths >= self.position_split_chars) if self.position_split_chars else np.zeros(n, bool)
        if kept == 1:
            large = keep.copy()
            if cuts[keep][0] < 0:
                raise DataError(
                    f"{self.source}: only one non-empty document, too short to split into train and val "
                    "(it has no line or word boundary to cut at); give more text or name a validation "
                    "file with data.val_source"
                )
        large &= cuts >= 0
        fate[large] = _BOTH
        fate[~keep] = _DROP
        whole = keep & ~large
        if not large.any() and not (fate == _VAL).any():
            fate[np.flatnonzero(whole)[np.argmin(units[whole])]] = _VAL
        elif not large.any() and not (fate == _TRAIN).any():
            fate[np.flatnonzero(whole)[np.argmax(units[whole])]] = _TRAIN
        split = f"{self.val_fraction:g} of the documents by name hash"
        if large.any():
            split += f"; {int(large.sum())} split by position (the last {self.val_fraction:g} of the text is val)"
        stats = {"split": split, "documents": n, "duplicates_removed": n - kept, "split_by_position": int(large.sum())}
        counts = {
            "train": int(((fate == _TRAIN) | (fate == _BOTH)).sum()),
            "val": int(((fate == _VAL) | (fate == _BOTH)).sum()),
        }
        return {
            "fate": fate,
            "cuts": cuts,
            "starts": scan["starts"],
            "offsets": scan["offsets"],
            "counts": counts,
            "stats": stats,
        }

    def _plan_with_val_source(self, team: Team) -> dict:
        assert self.val is not None  # only called with a validation source
        val_hashes = {_content_hash(text) for _, text in self.val.documents()}
        if not val_hashes:
            raise DataError(f"data.val_source: {self.val.source}: no non-empty documents")
        scan = self._scan(team)
        hashes = scan["hashes"]
        keep = _first_copies(hashes)
        in_val = np.fromiter((int(h) in val_hashes for h in hashes), bool, len(hashes))
        fate = np.where(keep & ~in_val, _TRAIN, _DROP).astype(np.int8)
        if not (fate == _TRAIN).any():
            raise DataError(f"{self.source}: no non-empty documents that are not also in data.val_source")
        stats = {
            "split": f"val from {self.val.source}",
            "documents": len(hashes),
            "duplicates_removed": int((~keep).sum()),
            "removed_as_in_val": int((keep & in_val).sum()),
        }
        counts = {"train": int((fate == _TRAIN).sum()), "val": len(val_hashes)}
        return {
            "fate": fate,
            "cuts": scan["cuts"],
            "starts": scan["starts"],
            "offsets": scan["offsets"],
            "counts": counts,
            "stats": stats,
        }


class _FileScan(NamedTuple):
    """A file's documents as arrays, and its number of records."""

    numbers: np.ndarray  # of each document in the file
    hashes: np.ndarray  # of the content
    lengths: np.ndarray  # in characters
    cuts: np.ndarray  # position cuts, -1 where there is none
    records: int


def _scan_file(files: Files, index: int, val_fraction: float) -> _FileScan:
    numbers, hashes, lengths, cuts = array("q"), array("Q"), array("q"), array("q")
    records: list[int] = []
    for number, text in returning(files.read(index), records):
        numbers.append(number)
        hashes.append(_content_hash(text))
        lengths.append(len(text))
        cut = position_cut(text, val_fraction)
        cuts.append(-1 if cut is None else cut)
    return _FileScan(
        np.asarray(numbers), np.asarray(hashes, np.uint64), np.asarray(lengths), np.asarray(cuts), records[0]
    )


def returning(generator: Generator[Y, None, R], result: list[R]) -> Iterator[Y]:
    """``generator``'s items; its return value is appended to ``result`` when it ends."""
    result.append((yield from generator))


def _first_copies(hashes: np.ndarray) -> np.ndarray:
    """True at the first occurrence of each content hash."""
    keep = np.zeros(len(hashes), bool)
    keep[np.unique(hashes, return_index=True)[1]] = True
    return keep


def open_corpus(
    source: str,
    text_field: str = "text",
    val_fraction: float = 0.05,
    *,
    val_source: str = "",
    position_split_chars: int = 1_000_000,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> Corpus:
    """Resolve ``source`` ('stdlib', a file, a directory or a glob; '' for none) and ``val_source``
    (the same kinds, '' for none) to a Corpus; DataError if unusable.

    Directories are searched recursively for .txt, .py, .jsonl, .jsonl.gz, .jsonl.zst and .parquet
    files and ``datasets`` save_to_disk directories (hidden files and folders skipped); so are
    directories a glob matches. Names are relative to the directory, to a file's parent, or to
    the glob's leading folder without wildcards; a save named as the source is named after its
    directory. A ``datasets`` DatasetDict (dataset_dict.json) is refused: its splits are not mixed,
    the source names one split directory.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    train = _files(source, text_field, f"data.source takes {_KINDS}", max_record_bytes) if source else None
    val = (
        _files(val_source, text_field, f"a validation source takes {_KINDS}", max_record_bytes) if val_source else None
    )
    return Corpus(train, val, val_fraction, position_split_chars)


def _files(source: str, text_field: str, help: str, max_record_bytes: int) -> Files:
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [
            p
            for p in root.rglob("*.py")
            if p.is_file() and not _STDLIB_EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
        ]
    else:
        path = Path(source).expanduser()
        if path.is_dir() and (path / "dataset_dict.json").is_file():
            raise _dataset_dict_error(path)
        root, files = find_files(source, EXTENSIONS, help)
    # abspath, not resolve: following symlinks could lead outside the root and change names.
    root = Path(os.path.abspath(root))
    unique = {Path(os.path.abspath(p)) for p in files}  # a glob like **/* can match a file directly and via its folder
    ordered = sorted(unique, key=lambda p: p.relative_to(root).as_posix())
    zst = next((p for p in ordered if p.name.lower().endswith(".zst")), None)
    if zst is not None:
        _zstandard(zst)  # before fingerprinting a large corpus, not after
    return Files(source, root, _parts(root, ordered), text_field, max_record_bytes)


def _parts(root: Path, files: list[Path]) -> list[Part]:
    """``files`` (sorted by relative path) as parts, in the order of their first files: a part per
    text or record file, except that a datasets save, and the complete set of a Hub split's shards,
    are one part each."""
    rel = {p: p.relative_to(root).as_posix() for p in files}
    parts: list[tuple[str, Part]] = []  # (sort key, part)
    saves: dict[Path, list[Path]] = {}
    shards: dict[tuple[str, str, int], list[tuple[int, Path]]] = {}
    for path in files:
        suffix = _record_suffix(path.name)
        if suffix is None:
            parts.append((rel[path], Part(rel[path], (path,), records=False)))
        elif suffix == ".arrow":
            saves.setdefault(path.parent, []).append(path)
        else:
            name = rel[path][: -len(suffix)]
            shard = _SHARD.fullmatch(name)
            if shard is None:
                parts.append((rel[path], Part(name, (path,), records=True)))
            else:
                key = (shard["stem"], suffix, int(shard["count"]))
                shards.setdefault(key, []).append((int(shard["index"]), path))
    for (stem, suffix, count), indexed in shards.items():
        indexed.sort()
        if [index for index, _ in indexed] == list(range(count)):
            paths = tuple(path for _, path in indexed)
            parts.append((rel[paths[0]], Part(stem, paths, records=True)))
        else:  # not exactly one file per shard: each is a file of its own
            parts.extend((rel[p], Part(rel[p][: -len(suffix)], (p,), records=True)) for _, p in indexed)
    for directory, arrows in saves.items():
        paths = _save_files(directory, arrows, root)
        name = directory.relative_to(root).as_posix() if directory != root else directory.name
        parts.append((min(rel[p] for p in paths), Part(name, paths, records=True)))
    parts.sort(key=lambda item: item[0])
    return [part for _, part in parts]


def _save_files(directory: Path, found: list[Path], root: Path) -> tuple[Path, ...]:
    """The .arrow files of a directory written by ``datasets.Dataset.save_to_disk``, in the
    dataset's order (its state.json's ``_data_files``); DataError unless ``found`` (the .arrow
    files the source named there) is exactly those."""
    state_path = directory / "state.json"
    save = "a directory written by datasets' Dataset.save_to_disk (state.json listing its .arrow files)"
    if not state_path.is_file():
        raise DataError(
            f"{directory}: holds .arrow files ({found[0].name}) but no state.json; .arrow files are read "
            f"only as {save}; convert other Arrow data to .parquet or .jsonl"
        )
    if directory != root and (directory.parent / "dataset_dict.json").is_file():
        raise _dataset_dict_error(directory.parent)
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{state_path}: not valid JSON ({e}); .arrow files are read only as {save}") from None
    listed = state.get("_data_files") if isinstance(state, dict) else None
    if not (
        isinstance(listed, list)
        and listed
        and all(isinstance(entry, dict) and isinstance(entry.get("filename"), str) for entry in listed)
    ):
        raise DataError(f"{state_path}: no _data_files list of .arrow files; {directory} is not {save}")
    paths = tuple(directory / entry["filename"] for entry in listed)
    for path in paths:
        if not path.is_file() or _record_suffix(path.name) != ".arrow":
            raise DataError(f"{state_path}: lists {path.name}, which is not an .arrow file in {directory}")
    unlisted = sorted(set(found) - set(paths))
    if unlisted:
        raise DataError(
            f"{unlisted[0]}: not one of the .arrow files that {state_path} lists; {directory} is not {save}"
        )
    if len(set(found)) != len(set(paths)):
        raise DataError(
            f"{directory}: the source names some of the .arrow files of this datasets save; a save is read "
            f"whole: name its directory"
        )
    return paths


def _dataset_dict_error(directory: Path) -> DataError:
    try:
        splits = [str(s) for s in json.loads((directory / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]]
    except (OSError, ValueError, KeyError, TypeError):
        splits = sorted(p.name for p in directory.iterdir() if (p / "state.json").is_file())
    train = "train" if "train" in splits else (splits or ["SPLIT"])[0]
    others = [s for s in ("validation", "valid", "val", "test") if s in splits]
    val = f", and data.val_source at {directory / others[0]} to validate on that split" if others else ""
    return DataError(
        f"{directory}: a DatasetDict written by datasets' save_to_disk (splits: {', '.join(splits) or 'none'}); "
        f"kiln does not mix its splits: point data.source at one split, e.g. {directory / train}{val}"
    )


def find_files(source: str, extensions: tuple[str, ...], help: str) -> tuple[Path, list[Path]]:
    """The files of ``extensions`` (name endings, matched without case) that ``source`` names (a
    file, a directory searched recursively without hidden files and folders, or a glob), and the
    folder names are relative to (the directory, a file's parent, or the glob's leading folder
    without wildcards); DataError naming the source when there are none. ``help`` says what a
    source may be."""
    kinds = ", ".join(extensions[:-1]) + f" or {extensions[-1]}" if len(extensions) > 1 else extensions[0]
    path = Path(source).expanduser()
    if glob.has_magic(source):
        matches = sorted(_glob(Path(os.path.expanduser(source))))
        if not matches:
            raise DataError(f"{source}: the glob matched nothing; {help}")
        files = []
        for m in map(Path, matches):
            files.extend(_walk(m, extensions) if m.is_dir() else [m] if _has_extension(m, extensions) else [])
        if not files:
            raise DataError(f"{source}: the glob matched {len(matches)} paths but no {kinds} files")
        return _glob_root(path), files
    if path.is_dir():
        files = _walk(path, extensions)
        if not files:
            raise DataError(f"{path}: the directory holds no {kinds} files; {help}")
        return path, files
    if path.is_file():
        if not _has_extension(path, extensions):
            raise DataError(f"{path}: unsupported file type {path.suffix or '(none)'!r}; {help}")
        return path.parent, [path]
    raise DataError(f"{path}: no such file or directory; {help}")


def _has_extension(path: Path, extensions: tuple[str, ...]) -> bool:
    return path.name.lower().endswith(extensions)


def _walk(directory: Path, extensions: tuple[str, ...]) -> list[Path]:
    return [
        p
        for p in directory.rglob("*")
        if _has_extension(p, extensions)
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    ]


def _glob(pattern: Path) -> set[Path]:
    """What ``glob.glob(pattern, recursive=True)`` matches, except that ``**`` descends only into
    real directories, not symbolic links to them: glob follows those, and a link to a folder
    above it makes it endless. A symlinked directory named in the pattern (not by ``**``) is
    read as any other; names starting with a dot match only a part that starts with one."""
    root = _glob_root(pattern)
    parts = pattern.parts[len(root.parts) :]
    found: set[Path] = set()

    def names(folder: Path, part: str) -> list[os.DirEntry]:
        try:
            with os.scandir(folder) as entries:
                return [
                    e for e in entries if fnmatch.fnmatchcase(e.name, part) and (part[0] == "." or e.name[0] != ".")
                ]
        except OSError:  # not a directory, or not readable: nothing under it, as for glob
            return []

    def visit(path: Path, i: int) -> None:
        if i == len(parts):
            found.add(path)
        elif parts[i] == "**":
            visit(path, i + 1)  # no folder
            for entry in names(path, "*"):
                if entry.is_dir(follow_symlinks=False):
                    visit(Path(entry.path), i)  # one folder more
                elif i == len(parts) - 1:  # a trailing ** matches files too
                    found.add(Path(entry.path))
        else:
            last = i == len(parts) - 1
            for entry in names(path, parts[i]):
                if last or entry.is_dir():
                    visit(Path(entry.path), i + 1)

    visit(root, 0)
    return found


def _glob_root(pattern: Path) -> Path:
    parts = []
    for part in pattern.parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")
