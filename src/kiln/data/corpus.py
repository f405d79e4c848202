"""Text corpora: the embedded Python standard library or user files, split into train and val.

A document is ``(name, text)``. Its name is stable across machines and runs (a path relative to
the corpus root, plus ``:LINE`` for .jsonl records and ``:ROW`` for .parquet rows), because the
train/val split is a hash of the name: adding or removing files never moves other documents
between splits.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

# Bump when the meaning of names, splits or reading changes, so fingerprints (and caches) change.
CORPUS_VERSION = 1
# Plain-text files (.txt, and .py since source code is a natural corpus) are one document each.
TEXT_EXTENSIONS = (".txt", ".py")
EXTENSIONS = (*TEXT_EXTENSIONS, ".jsonl", ".parquet")
SPLITS = ("train", "val")
_STDLIB_EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test"}
_SOURCE_HELP = "data.source takes 'stdlib', or a file, directory or glob of .txt, .py, .jsonl and .parquet files"


class DataError(ValueError):
    """Bad training data: the message names the file (and line) and what would work."""


def split_of(name: str, val_fraction: float) -> str:
    """'val' or 'train' for a document name: a stable hash (unlike ``hash()``, not salted per process)."""
    return "val" if _hash_unit(name) < val_fraction else "train"


def _hash_unit(name: str) -> float:
    """The name's hash mapped uniformly to [0, 1)."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "big") / 2**64


class Corpus:
    """Documents from a list of files, read lazily; see :func:`open_corpus`.

    Split rule: a document goes to val when the hash of its name maps below ``val_fraction``
    (:func:`split_of`). A corpus too small for that to give both splits a document is fixed up
    deterministically: if val came out empty, the document with the smallest hash moves to val;
    if train came out empty, the one with the largest hash moves to train. So any corpus with at
    least two non-empty documents has both splits; fewer is a DataError.
    """

    def __init__(self, source: str, root: Path, files: list[Path], text_field: str, val_fraction: float):
        self.source = source
        self.root = root
        self.files = files
        self.text_field = text_field
        self.val_fraction = val_fraction

    def name_of(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over every file's relative name and bytes, the text field, val fraction and version."""
        h = hashlib.sha256(f"kiln-corpus-v{CORPUS_VERSION}\0{self.text_field}\0{self.val_fraction!r}\0".encode())
        for path in self.files:
            name = self.name_of(path).encode("utf-8")
            # Length prefixes keep (name, content) boundaries unambiguous.
            h.update(len(name).to_bytes(8, "big") + name + path.stat().st_size.to_bytes(8, "big"))
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        return h.hexdigest()

    def documents(self, split: str) -> Iterator[tuple[str, str]]:
        """Non-empty documents of ``split`` ('train' or 'val'), in file order then record order."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        moved = self._split_plan["moved"]
        for name, text in self._all_documents():
            if moved.get(name, split_of(name, self.val_fraction)) == split:
                yield name, text

    def count(self, split: str) -> int:
        """Number of documents in ``split`` (reads the corpus once, then cached)."""
        return self._split_plan["counts"][split]

    @cached_property
    def _split_plan(self) -> dict:
        """One pass over all names to apply the small-corpus fix-up described in the class docstring."""
        names = [name for name, _ in self._all_documents()]
        units = [_hash_unit(name) for name in names]
        if len(units) < 2:
            found = "no non-empty documents" if not units else "only one non-empty document"
            raise DataError(
                f"{self.source}: {found}; at least two are needed so that train and val each get one "
                "(split a large .txt into several files, or use .jsonl with one document per line)"
            )
        n_val = sum(u < self.val_fraction for u in units)
        moved = {}
        if n_val == 0:
            moved[names[units.index(min(units))]] = "val"
            n_val = 1
        elif n_val == len(units):
            moved[names[units.index(max(units))]] = "train"
            n_val -= 1
        return {"moved": moved, "counts": {"train": len(units) - n_val, "val": n_val}}

    def _all_documents(self) -> Iterator[tuple[str, str]]:
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


def open_corpus(source: str, text_field: str = "text", val_fraction: float = 0.05) -> Corpus:
    """Resolve ``source`` ('stdlib', a file, a directory or a glob) to a Corpus; DataError if unusable.

    Directories are searched recursively for .txt, .py, .jsonl and .parquet files (hidden files and
    folders skipped); so are directories a glob matches. Names are relative to the directory,
    to a file's parent, or to the glob's leading folder without wildcards.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [
            p
            for p in root.rglob("*.py")
            if p.is_file() and not _STDLIB_EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
        ]
        return _corpus(source, root, files, text_field, val_fraction)
    root, files = find_files(source, EXTENSIONS, _SOURCE_HELP)
    return _corpus(source, root, files, text_field, val_fraction)


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


def _corpus(source: str, root: Path, files: list[Path], text_field: str, val_fraction: float) -> Corpus:
    # abspath, not resolve: following symlinks could lead outside the root and change names.
    root = Path(os.path.abspath(root))
    unique = {Path(os.path.abspath(p)) for p in files}  # a glob like **/* can match a file directly and via its folder
    ordered = sorted(unique, key=lambda p: p.relative_to(root).as_posix())
    return Corpus(source, root, ordered, text_field, val_fraction)


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
