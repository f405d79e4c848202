"""Text corpora: the embedded Python standard library or user files, split into train and val.

A document is ``(name, text)``. Its name is stable across machines and runs (a path relative to
the corpus root, plus ``:LINE`` for .jsonl records and ``:ROW`` for .parquet rows), because the
train/val split is a hash of the name: adding or removing files never moves other documents
between splits. Exact copies are kept once, so no text is on both sides; a document too large to
go to one side whole (a book, a dump) is split by position. See :class:`Corpus`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from array import array
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import numpy as np

# Bump when the meaning of names, splits or reading changes, so fingerprints (and caches) change.
CORPUS_VERSION = 2
# Plain-text files (.txt, and .py since source code is a natural corpus) are one document each.
TEXT_EXTENSIONS = (".txt", ".py")
EXTENSIONS = (*TEXT_EXTENSIONS, ".jsonl", ".parquet")
SPLITS = ("train", "val")
_STDLIB_EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test"}
_KINDS = "'stdlib', or a file, directory or glob of .txt, .py, .jsonl and .parquet files"


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


class Files:
    """The files one source names, read as documents ``(name, text)`` in file order, then line or
    row order; empty documents are skipped. Names are relative to ``root``."""

    def __init__(self, source: str, root: Path, files: list[Path], text_field: str):
        self.source, self.root, self.files, self.text_field = source, root, files, text_field

    def name_of(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def hash_into(self, h) -> None:
        for path in self.files:
            name = self.name_of(path).encode("utf-8")
            # Length prefixes keep (name, content) boundaries unambiguous.
            h.update(len(name).to_bytes(8, "big") + name + path.stat().st_size.to_bytes(8, "big"))
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)

    def documents(self) -> Iterator[tuple[str, str]]:
        for path in self.files:
            yield from self._read(path)

    def _read(self, path: Path) -> Iterator[tuple[str, str]]:
        rel = self.name_of(path)
        suffix = path.suffix.lower()
        if suffix in TEXT_EXTENSIONS:
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                yield rel, text
        elif suffix == ".jsonl":
            yield from self._read_jsonl(path, rel)
        else:
            yield from self._read_parquet(path, rel)

    def _read_jsonl(self, path: Path, rel: str) -> Iterator[tuple[str, str]]:
        field = self.text_field
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
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
                    yield f"{rel}:{lineno}", text

    def _read_parquet(self, path: Path, rel: str) -> Iterator[tuple[str, str]]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
        schema = pf.schema_arrow
        field = self.text_field
        if field not in schema.names:
            raise DataError(
                f"{path}: no column {field!r}; columns are {', '.join(schema.names)}; "
                "set data.text_field to the column that holds the text"
            )
        if not (pa.types.is_string(schema.field(field).type) or pa.types.is_large_string(schema.field(field).type)):
            raise DataError(
                f"{path}: column {field!r} has type {schema.field(field).type}, not string; "
                "set data.text_field to the column that holds the text"
            )
        row = 0  # 0-based row index over the whole file
        for batch in pf.iter_batches(columns=[field]):
            for text in batch.column(0).to_pylist():
                # Nulls are treated like empty documents: skipped.
                if text is not None and text.strip():
                    yield f"{rel}:{row}", text
                row += 1


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
        """sha256 over every file's relative name and bytes, the text field, the split settings
        and the version."""
        settings = f"{self.text_field}\0{self.val_fraction!r}\0{self.position_split_chars}"
        h = hashlib.sha256(f"kiln-corpus-v{CORPUS_VERSION}\0{settings}\0".encode())
        for role, files in (("train", self.train), ("val", self.val)):
            if files is not None:
                h.update(f"\0{role}\0".encode())
                files.hash_into(h)
        return h.hexdigest()

    def documents(self, split: str) -> Iterator[tuple[str, str]]:
        """Documents of ``split`` ('train' or 'val'), in file order then record order. A document
        split by position is named ``NAME[:CUT]`` in train and ``NAME[CUT:]`` in val."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split == "val" and self.val is not None:
            yield from self._val_documents()
            return
        if self.train is None:
            return
        plan = self._plan
        wanted = _TRAIN if split == "train" else _VAL
        for i, (name, text) in enumerate(self.train.documents()):
            fate = plan["fate"][i]
            if fate == wanted:
                yield name, text
            elif fate == _BOTH:
                cut = int(plan["cuts"][i])
                yield (f"{name}[:{cut}]", text[:cut]) if split == "train" else (f"{name}[{cut}:]", text[cut:])

    def count(self, split: str) -> int:
        """Number of documents in ``split`` (reads the corpus once, then cached)."""
        return self._plan["counts"][split]

    @property
    def stats(self) -> dict:
        """How the documents were split, and what was removed: for data.json and the console."""
        return self._plan["stats"]

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
        if self.train is None:
            assert self.val is not None  # the constructor wants a training or a validation source
            n = sum(1 for _ in self.val.documents())
            if not n:
                raise DataError(f"{self.val.source}: no non-empty documents")
            stats = {"split": f"every document of {self.val.source} is val"}
            return {"counts": {"train": 0, "val": n}, "stats": stats}
        if self.val is not None:
            return self._plan_with_val_source()
        return self._plan_by_hash()

    def _scan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One pass over the training source: per document its name's hash unit, its content
        hash, its length and its position cut (-1 where it has none). Arrays, not lists, so
        millions of documents stay small in memory."""
        assert self.train is not None  # only called with a training source
        units, hashes, lengths, cuts = array("d"), array("Q"), array("q"), array("q")
        for name, text in self.train.documents():
            units.append(_hash_unit(name))
            hashes.append(_content_hash(text))
            lengths.append(len(text))
            cut = position_cut(text, self.val_fraction)
            cuts.append(-1 if cut is None else cut)
        return np.asarray(units), np.asarray(hashes, dtype=np.uint64), np.asarray(lengths), np.asarray(cuts)

    def _plan_by_hash(self) -> dict:
        units, hashes, lengths, cuts = self._scan()
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
        return {"fate": fate, "cuts": cuts, "counts": counts, "stats": stats}

    def _plan_with_val_source(self) -> dict:
        assert self.val is not None  # only called with a validation source
        val_hashes = {_content_hash(text) for _, text in self.val.documents()}
        if not val_hashes:
            raise DataError(f"data.val_source: {self.val.source}: no non-empty documents")
        _, hashes, _, cuts = self._scan()
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
        return {"fate": fate, "cuts": cuts, "counts": counts, "stats": stats}


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
) -> Corpus:
    """Resolve ``source`` ('stdlib', a file, a directory or a glob; '' for none) and ``val_source``
    (the same kinds, '' for none) to a Corpus; DataError if unusable.

    Directories are searched recursively for .txt, .py, .jsonl and .parquet files (hidden files and
    folders skipped); so are directories a glob matches. Names are relative to the directory,
    to a file's parent, or to the glob's leading folder without wildcards.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    train = _files(source, text_field, f"data.source takes {_KINDS}") if source else None
    val = _files(val_source, text_field, f"a validation source takes {_KINDS}") if val_source else None
    return Corpus(train, val, val_fraction, position_split_chars)


def _files(source: str, text_field: str, help: str) -> Files:
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [
            p
            for p in root.rglob("*.py")
            if p.is_file() and not _STDLIB_EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
        ]
    else:
        root, files = find_files(source, EXTENSIONS, help)
    # abspath, not resolve: following symlinks could lead outside the root and change names.
    root = Path(os.path.abspath(root))
    unique = {Path(os.path.abspath(p)) for p in files}  # a glob like **/* can match a file directly and via its folder
    ordered = sorted(unique, key=lambda p: p.relative_to(root).as_posix())
    return Files(source, root, ordered, text_field)


def find_files(source: str, extensions: tuple[str, ...], help: str) -> tuple[Path, list[Path]]:
    """The files of ``extensions`` that ``source`` names (a file, a directory searched recursively
    without hidden files and folders, or a glob), and the folder names are relative to (the
    directory, a file's parent, or the glob's leading folder without wildcards); DataError naming
    the source when there are none. ``help`` says what a source may be."""
    kinds = ", ".join(extensions[:-1]) + f" or {extensions[-1]}" if len(extensions) > 1 else extensions[0]
    path = Path(source).expanduser()
    if glob.has_magic(source):
        matches = sorted(glob.glob(os.path.expanduser(source), recursive=True))
        if not matches:
            raise DataError(f"{source}: the glob matched nothing; {help}")
        files = []
        for m in map(Path, matches):
            files.extend(_walk(m, extensions) if m.is_dir() else [m] if m.suffix.lower() in extensions else [])
        if not files:
            raise DataError(f"{source}: the glob matched {len(matches)} paths but no {kinds} files")
        return _glob_root(path), files
    if path.is_dir():
        files = _walk(path, extensions)
        if not files:
            raise DataError(f"{path}: the directory holds no {kinds} files; {help}")
        return path, files
    if path.is_file():
        if path.suffix.lower() not in extensions:
            raise DataError(f"{path}: unsupported file type {path.suffix or '(none)'!r}; {help}")
        return path.parent, [path]
    raise DataError(f"{path}: no such file or directory; {help}")


def _walk(directory: Path, extensions: tuple[str, ...]) -> list[Path]:
    return [
        p
        for p in directory.rglob("*")
        if p.suffix.lower() in extensions
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    ]


def _glob_root(pattern: Path) -> Path:
    parts = []
    for part in pattern.parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")
