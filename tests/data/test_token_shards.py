"""A split's token stream in shards of bounded size: written, listed, verified and read as one stream."""

import hashlib
import itertools
import json
import pickle

import numpy as np
import pytest
import torch

from kiln.config import DataConfig
from kiln.data.corpus import DataError
from kiln.data.loader import TokenSequences, TokenShards, document_windows, make_train_loader, val_batches
from kiln.data.shards import (
    FORMAT_VERSION,
    _assemble,
    _Preparation,
    _Reporter,
    open_prepared,
    prepare,
    shard_files,
    verify,
)
from kiln.data.team import ALONE
from kiln.doctor.data import _document_spans

SHARD_BYTES = 256  # 128 uint16 tokens a shard


@pytest.fixture
def source(tmp_path):
    """A .jsonl of a few dozen documents of different lengths."""
    words = ["alpha", "beta", "gamma", "delta", "café", "naïve", "日本", "🚀", "loop", "class", "tensor"]
    docs = [" ".join(words[(i * j) % len(words)] for j in range(3 + (i * 7) % 40)) + f" #{i}\n" for i in range(80)]
    path = tmp_path / "corpus" / "docs.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def config(source, cache, **kw):
    return DataConfig(source=source, cache_dir=str(cache), vocab_size=300, val_fraction=0.2, prepare_workers=1, **kw)


@pytest.fixture
def both(source, tmp_path):
    """The same corpus prepared in one shard a split and in shards of SHARD_BYTES."""
    one = prepare(config(source, tmp_path / "one"), progress=False)
    many = prepare(config(source, tmp_path / "many", shard_bytes=SHARD_BYTES), progress=False)
    return one, many


def test_shards_hold_the_same_stream_byte_for_byte(both):
    one, many = both
    assert one.manifest["format_version"] == many.manifest["format_version"] == FORMAT_VERSION
    assert many.dir != one.dir  # the shard size is part of the cache key
    for split in ("train", "val"):
        single, sharded = one.manifest["splits"][split], many.manifest["splits"][split]
        assert [s["file"] for s in single["shards"]] == [f"{split}-00000.bin"]
        shards = sharded["shards"]
        assert len(shards) == -(-single["tokens"] * 2 // SHARD_BYTES) > 2
        assert [s["file"] for s in shards] == [f"{split}-{k:05d}.bin" for k in range(len(shards))]
        for s in shards:
            data = (many.dir / s["file"]).read_bytes()
            assert len(data) == 2 * s["tokens"] <= SHARD_BYTES
            assert hashlib.sha256(data).hexdigest() == s["sha256"]
        assert all(s["tokens"] == SHARD_BYTES // 2 for s in shards[:-1])  # full but the last
        assert sum(s["tokens"] for s in shards) == sharded["tokens"] == single["tokens"]
        assert {k: v for k, v in sharded.items() if k != "shards"} == {k: v for k, v in single.items() if k != "shards"}
        joined = b"".join((many.dir / s["file"]).read_bytes() for s in shards)
        assert joined == (one.dir / f"{split}-00000.bin").read_bytes()
    assert sorted(p.name for p in many.dir.glob("*.bin")) == sorted(shard_files(many.manifest))
    verify(many)
    verify(open_prepared(many.dir))


def test_tokens_read_across_shard_boundaries(both):
    one, many = both
    for split in ("train", "val"):
        flat, stream = one.tokens(split), many.tokens(split)
        assert isinstance(flat, np.memmap) and isinstance(stream, TokenShards)
        assert len(stream) == len(flat) and stream.shape == flat.shape and stream.dtype == flat.dtype
        assert stream.ndim == 1
        assert np.array_equal(np.asarray(stream), flat)
        assert list(stream) == flat.tolist()
        n, per = len(flat), SHARD_BYTES // 2
        for a, b in [(0, n), (per - 3, per + 3), (per, 2 * per), (per - 1, 3 * per + 1), (5, 5), (n - 2, n + 10)]:
            assert np.array_equal(stream[a:b], flat[a:b]), (a, b)
        assert np.array_equal(stream[-7:], flat[-7:]) and np.array_equal(stream[: per + 1], flat[: per + 1])
        for i in (0, per - 1, per, per + 1, n - 1, -1, -per):
            assert stream[i] == flat[i]
        with pytest.raises(IndexError):
            stream[n]
        with pytest.raises(IndexError, match="step 1"):
            stream[::2]


def test_token_sequences_windows_across_shards(both):
    one, many = both
    seq_len = 10  # windows of 11 tokens cross the boundaries every 128 tokens
    flat, sharded = TokenSequences(one.tokens("train"), seq_len), TokenSequences(many.tokens("train"), seq_len)
    assert len(flat) == len(sharded) > 3 * (SHARD_BYTES // 2) // seq_len
    for i in range(len(flat)):
        assert all(torch.equal(a, b) for a, b in zip(flat[i], sharded[i], strict=True)), i
    blob = pickle.dumps(sharded)
    assert len(blob) < 4000  # paths and counts, not tokens
    clone = pickle.loads(blob)
    assert all(torch.equal(a, b) for a, b in zip(clone[len(flat) - 1], flat[len(flat) - 1], strict=True))

    kw = dict(schedule=4, seed=1, start_step=2, pin_memory=False)
    expected = list(itertools.islice(make_train_loader(flat, num_workers=0, **kw), 5))
    got = list(itertools.islice(make_train_loader(sharded, num_workers=2, **kw), 5))  # workers reopen the files
    for (x0, y0), (x1, y1) in zip(expected, got, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)

    val_flat, val_sharded = TokenSequences(one.tokens("val"), 7), TokenSequences(many.tokens("val"), 7)
    for got_batches, want in [
        (val_batches(val_sharded, 4, 3), val_batches(val_flat, 4, 3)),
        (document_windows(many.tokens("val"), 0, 7, 4), document_windows(one.tokens("val"), 0, 7, 4)),
    ]:
        assert len(got_batches) == len(want)
        for (x0, y0), (x1, y1) in zip(got_batches, want, strict=True):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_doctor_reads_documents_across_shards(both):
    one, many = both
    flat, stream = one.tokens("train"), many.tokens("train")
    n = len(flat)
    for windows in ([(0, n)], [(0, n // 3), (n // 2, n // 2 + 200)]):
        spans = _document_spans(stream, one.eot_id, windows)
        assert spans == _document_spans(flat, one.eot_id, windows) and spans
        assert [stream[a:b].tobytes() for a, b in spans] == [flat[a:b].tobytes() for a, b in spans]


def test_truncated_or_corrupt_shard_is_detected(source, tmp_path):
    cfg = config(source, tmp_path / "cache", shard_bytes=SHARD_BYTES)
    p = prepare(cfg, progress=False)
    middle = p.dir / "train-00001.bin"
    data = middle.read_bytes()
    middle.write_bytes(data[:-2])
    again = prepare(cfg, progress=False)  # a size that differs from the manifest: prepared again
    assert again.tokenized and middle.read_bytes() == data

    flipped = bytearray(data)
    flipped[3] ^= 1
    middle.write_bytes(bytes(flipped))  # same size: only the checksum can tell
    with pytest.raises(DataError, match=r"train-00001\.bin: checksum does not match"):
        verify(open_prepared(p.dir))
    middle.unlink()
    with pytest.raises(DataError, match=r"train-00001\.bin: checksum does not match"):
        verify(open_prepared(p.dir))


@pytest.mark.parametrize("parts", [[10], [3, 3, 3, 1], [4, 4], [1] * 9, [20, 1], [0], [0, 4, 0, 5], [4, 0]])
def test_parts_are_cut_into_shards_every_shard_bytes(tmp_path, parts):
    """The ranks' parts, joined in rank order, cut every 19 bytes (4 uint32 tokens): a part that
    is exactly one shard is renamed, the others copied; none is left over, none empty."""
    dtype = np.dtype(np.uint32)
    stream = np.arange(sum(parts), dtype=dtype)
    for r, (a, b) in enumerate(itertools.pairwise([0, *np.cumsum(parts).tolist()])):
        (tmp_path / f"rank-{r:05d}.train.bin").write_bytes(stream[a:b].tobytes())
    job = _Preparation(DataConfig(shard_bytes=4 * 4 + 3), ALONE, _Reporter(False), 0.0)
    shards = _assemble(job, tmp_path, "train", parts, dtype, [0])
    counts = [s["tokens"] for s in shards]
    assert counts == ([4] * (len(stream) // 4) + ([len(stream) % 4] if len(stream) % 4 else []) or [0])
    assert [s["file"] for s in shards] == [f"train-{k:05d}.bin" for k in range(len(counts))]
    joined = b"".join((tmp_path / s["file"]).read_bytes() for s in shards)
    assert joined == stream.tobytes()
    for s in shards:
        assert hashlib.sha256((tmp_path / s["file"]).read_bytes()).hexdigest() == s["sha256"]
    if len(shards) > 1:
        tokens = TokenShards([tmp_path / s["file"] for s in shards], counts, dtype)
        assert np.array_equal(np.asarray(tokens), stream)


def test_empty_split_reads_as_no_tokens(tmp_path):
    tokens = TokenShards([tmp_path / "none.bin"], [0], np.uint16)
    assert len(tokens) == 0 and np.asarray(tokens).shape == (0,) and tokens[0:5].shape == (0,)


def test_config_keys_are_checked():
    assert DataConfig().shard_bytes == 1 << 30 and DataConfig().tokenizer_sample_bytes == 0
    assert any("data.shard_bytes" in e and "1 MiB" in e for e in DataConfig(shard_bytes=1000).errors())
    assert not [e for e in DataConfig(shard_bytes=1 << 20).errors() if "shard_bytes" in e]
    assert any("data.tokenizer_sample_bytes" in e for e in DataConfig(tokenizer_sample_bytes=-1).errors())
