"""Data readers do not trust their input: a line longer than data.max_record_bytes (one huge
line, a decompression bomb) is an error naming file and line before it is held whole; bytes
that are not UTF-8 are an error naming file:line in fine-tuning records and a counted warning in
a corpus; a ``**`` glob does not follow a symbolic link into a loop."""

from __future__ import annotations

import json
import os
import time

import pytest

from kiln.data import DataError
from kiln.data.corpus import open_corpus
from kiln.data.records import read_records

from kilnrun import in_process, peak_rss_of, sets


def _documents(corpus) -> list[str]:
    return [text for split in ("train", "val") for _, text in corpus.documents(split)]


def test_a_line_longer_than_the_limit_is_an_error_naming_its_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 2000}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:2: a line longer than data.max_record_bytes \(1,000 bytes\)"):
        _documents(open_corpus(str(path), max_record_bytes=1000))
    assert _documents(open_corpus(str(path), max_record_bytes=3000))  # within it: read
    with pytest.raises(DataError, match=rf"{path}:2: a line longer than data.max_record_bytes"):
        read_records(str(path), max_record_bytes=1000)


@pytest.mark.parametrize("kind", ["one huge line", "zstd bomb"])
def test_a_huge_line_or_a_zstd_bomb_stops_the_preparation_with_one_line_and_bounded_memory(tmp_path, kind):
    """1 GiB without a newline: a sparse file, or 1 GiB of zeros compressed to a few hundred kB.
    `kiln prepare` stops at the default limit (64 MiB) with exit 2, its memory measured from
    outside, and the cache is left untouched."""
    if kind == "one huge line":
        path = tmp_path / "huge.jsonl"
        with open(path, "wb") as f:
            f.truncate(1 << 30)
    else:
        zstandard = pytest.importorskip("zstandard")
        path = tmp_path / "bomb.jsonl.zst"
        zeros = bytes(8 << 20)
        with open(path, "wb") as f, zstandard.ZstdCompressor(level=1).stream_writer(f) as w:
            for _ in range(128):
                w.write(zeros)
        assert path.stat().st_size < 1 << 20
    cache = tmp_path / "cache"
    peak, err = peak_rss_of("prepare", *sets([f"data.source={path}", f"data.cache_dir={cache}"]), expect=2)
    [line] = [line for line in err.splitlines() if "error" in line]
    assert line == (
        f"kiln: error: {path}:1: a line longer than data.max_record_bytes (67,108,864 bytes); "
        "raise data.max_record_bytes if the record is meant to be that long"
    )
    assert peak < 900 << 20, f"the preparation peaked at {peak / 2**20:.0f} MiB"
    assert not (cache / "prepared").exists() or not any((cache / "prepared").iterdir())


def test_records_that_are_not_utf8_are_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"}).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + good.replace(b'"b"', b'"\xff"') + b"\n")
    with pytest.raises(DataError, match=rf"{path}:3: not UTF-8 \(byte 32 of the line is b'\\xff'\)"):
        read_records(str(path))
    table = tmp_path / "cls.csv"
    table.write_bytes(b"text,label\nfine,a\nbad \xfe,b\n")
    with pytest.raises(DataError, match=rf"{table}:3: not UTF-8"):
        read_records(str(table))


def test_a_corpus_that_is_not_utf8_is_read_with_the_replaced_bytes_counted(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 au lait\n" * 3)
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "na\xefve"}\n')
    texts = _documents(open_corpus(str(tmp_path)))
    assert any("caf\ufffd au lait" in t for t in texts) and any("na\ufffdve" in t for t in texts)
    err = capsys.readouterr().err
    assert f"kiln: warning: {tmp_path / 'a.txt'}: 3 invalid UTF-8 sequences read as U+FFFD" in err
    assert f"kiln: warning: {tmp_path / 'b.jsonl'}: 1 invalid UTF-8 sequences read as U+FFFD (lines 2)" in err


def test_a_glob_does_not_follow_symbolic_links_into_a_loop(tmp_path):
    inner = tmp_path / "data" / "inner"
    inner.mkdir(parents=True)
    (inner / "doc.txt").write_text("the only document\n" * 20)
    os.symlink("../..", inner / "up")  # data/inner/up -> data: ** through it would never end
    os.symlink("..", inner / "back")
    started = time.perf_counter()
    corpus = open_corpus(str(tmp_path / "data" / "**" / "*.txt"))
    assert [p.name for p in corpus.train.files] == ["doc.txt"] and time.perf_counter() - started < 5
    run = tmp_path / "run"
    items = [f"data.source={tmp_path / 'data' / '**' / '*.txt'}", f"run.dir={run}", "train.max_steps=1"]
    in_process("prepare", *sets(items + ["data.vocab_size=300"]))
