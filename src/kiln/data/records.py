"""Fine-tuning records from local .jsonl, .csv and .parquet files, each knowing where it came
from (file and line or row), so that every problem with one can be named exactly."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.data.corpus import MAX_RECORD_BYTES, DataError, find_files, read_lines

RECORD_EXTENSIONS = (".jsonl", ".csv", ".parquet")
_HELP = "fine-tuning records come from a .jsonl, .csv or .parquet file, a directory of them or a glob"


@dataclass(frozen=True)
class Record:
    fields: Mapping[str, Any]
    file: Path
    index: int  # 1-based: the line of a .jsonl, the data row of a .csv (after its header) or a .parquet

    @property
    def where(self) -> str:
        return f"{self.file}:{self.index}" if self.file.suffix.lower() == ".jsonl" else f"{self.file} row {self.index}"

    def get(self, field: str, key: str) -> Any:
        """The value of ``field``; DataError naming the record and ``key`` (the config key that
        names the field) if the record has none."""
        value = self.fields.get(field)
        if value is None and field not in self.fields:
            present = ", ".join(map(str, self.fields)) or "none"
            raise DataError(f"{self.where}: no field {field!r} ({key}); its fields are {present}")
        if value is None or value == "":
            raise DataError(f"{self.where}: field {field!r} ({key}) is empty")
        return value

    def digest(self) -> bytes:
        """A hash of the content, whatever the file: the same record in two files is one record."""
        canonical = json.dumps(self.fields, sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).digest()


def read_records(source: str, max_record_bytes: int = MAX_RECORD_BYTES) -> list[Record]:
    """Every record of ``source``, in file order; DataError naming the file (and line) of the first
    that cannot be read (not UTF-8, a .jsonl line longer than ``max_record_bytes``), and of a file
    without records."""
    _, files = find_files(source, RECORD_EXTENSIONS, _HELP)
    records = []
    for path in sorted(files):
        read = {".jsonl": _jsonl, ".csv": _csv, ".parquet": _parquet}[path.suffix.lower()]
        found = list(read(path, max_record_bytes))
        if not found:
            raise DataError(f"{path}: no records (the file is empty)")
        records += found
    return records


def _jsonl(path: Path, limit: int):
    for line_no, line in read_lines(path, limit, strict=True):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(value, dict):
            raise DataError(f"{path}:{line_no}: a record must be a JSON object, got {type(value).__name__}")
        yield Record(value, path, line_no)


def _csv(path: Path, limit: int):
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte {data[e.start : e.start + 1]!r})") from None
    row_no = 0
    try:
        for row_no, row in enumerate(csv.DictReader(io.StringIO(text, newline="")), 1):
            if None in row:
                raise DataError(f"{path} row {row_no}: more values than the header has columns")
            if sum(len(v) for v in row.values() if isinstance(v, str)) > limit:
                raise DataError(f"{path} row {row_no}: longer than data.max_record_bytes ({limit:,} bytes)")
            yield Record(row, path, row_no)
    except csv.Error as e:
        raise DataError(f"{path} row {row_no + 1}: not readable CSV ({e})") from None


def _parquet(path: Path, limit: int):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable parquet file: {e}") from None
    for row_no, row in enumerate(table.to_pylist(), 1):
        yield Record(row, path, row_no)
