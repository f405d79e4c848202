import json
import sysconfig

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.config import DataConfig
from kiln.data import shards
from kiln.data import tokenizer as tokmod
from kiln.data.corpus import DataError
from kiln.data.shards import cache_root, open_prepared, prepare, verify


@pytest.fixture
def source(tmp_path):
    """A few dozen synthetic documents across .txt, .jsonl and .parquet."""
    root = tmp_path / "corpus"
    root.mkdir()
    words = ["def", "return", "tensor", "café", "naïve", "x = 1", "日本", "🚀", "loop", "class"]
    docs = [" ".join(words[(i * j) % len(words)] for j in range(5 + i % 17)) + f" #{i}\n" for i in range(60)]
    docs[5] += "mentions <|endoftext|> without ending\n"  # must not add a document boundary
    for i, doc in enumerate(docs[:20]):
        (root / f"doc{i:02d}.txt").write_text(doc)
    (root / "records.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[20:40]))
    pq.write_table(pa.table({"text": docs[40:]}), root / "rows.parquet")
    return str(root)


def config(source, cache, **kw):
    return DataConfig(source=source, cache_dir=str(cache), vocab_size=300, val_fraction=0.2, **kw)


def test_prepare_writes_consistent_files(source, tmp_path):
    p = prepare(config(source, tmp_path / "cache", prepare_workers=1), progress=False)
    assert p.tokenized and p.dir.parent == tmp_path / "cache" / "prepared"
    m = p.manifest
    assert m["dtype"] == "uint16" and m["vocab_size"] == p.vocab_size == p.tokenizer.get_vocab_size()
    assert m["source"] == source and m["eot_id"] == p.eot_id
    verify(p)
    total_docs = 0
    for split in ("train", "val"):
        tokens = p.tokens(split)
        info = m["splits"][split]
        assert isinstance(tokens, np.memmap) and not tokens.flags.writeable
        assert tokens.dtype == np.uint16 and len(tokens) == info["tokens"]
        assert tokens[-1] == p.eot_id and (tokens == p.eot_id).sum() == info["documents"]
        assert p.token_bytes()[tokens].sum() == info["bytes"]
        total_docs += info["documents"]
    assert total_docs == 60
    text = p.tokenizer.decode(list(p.tokens("train")), skip_special_tokens=True)
    assert "café" in text and "🚀" in text


def test_second_prepare_reuses_everything(source, tmp_path, monkeypatch, capsys):
    cfg = config(source, tmp_path / "cache", prepare_workers=1)
    first = prepare(cfg)
    assert "kiln: tokenizing" in capsys.readouterr().err
    mtimes = {f: f.stat().st_mtime_ns for f in first.dir.iterdir()}

    def forbidden(*args, **kwargs):
        raise AssertionError("must not run on a cache hit")

    monkeypatch.setattr(shards, "_build", forbidden)
    monkeypatch.setattr(tokmod, "_train_bpe", forbidden)
    second = prepare(cfg)
    assert not second.tokenized and second.dir == first.dir and second.manifest == first.manifest
    # Nothing rewritten; the first reuse marks the files verified against their digests.
    assert {f: f.stat().st_mtime_ns for f in second.dir.iterdir() if f.name != shards.VERIFIED} == mtimes
    assert (second.dir / shards.VERIFIED).is_file()
    assert "using prepared data" in capsys.readouterr().err


def test_worker_count_does_not_change_output(source, tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "_CHUNK_CHARS", 300)  # many chunks, so workers interleave
    one = prepare(config(source, tmp_path / "one", prepare_workers=1), progress=False)
    two = prepare(config(source, tmp_path / "two", prepare_workers=2), progress=False)
    assert one.manifest == two.manifest
    for name in ("train-00000.bin", "val-00000.bin", "tokenizer.json"):
        assert (one.dir / name).read_bytes() == (two.dir / name).read_bytes()


def test_stdlib_slice_with_two_workers(tmp_path):
    stdlib = sysconfig.get_paths()["stdlib"]
    p = prepare(config(f"{stdlib}/json/*.py", tmp_path / "cache", prepare_workers=2), progress=False)
    assert p.manifest["splits"]["val"]["documents"] >= 1
    assert "import" in p.tokenizer.decode(list(p.tokens("train")))


def test_verify_names_corrupted_file(source, tmp_path):
    p = prepare(config(source, tmp_path / "cache", prepare_workers=1), progress=False)
    data = bytearray((p.dir / "val-00000.bin").read_bytes())
    data[0] ^= 1
    (p.dir / "val-00000.bin").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"val-00000\.bin: checksum does not match"):
        verify(open_prepared(p.dir))


def test_wrong_size_prepares_again(source, tmp_path):
    cfg = config(source, tmp_path / "cache", prepare_workers=1)
    p = prepare(cfg, progress=False)
    expected = (p.dir / "train-00000.bin").read_bytes()
    (p.dir / "train-00000.bin").write_bytes(expected[:-2])
    again = prepare(cfg, progress=False)
    assert again.tokenized and (again.dir / "train-00000.bin").read_bytes() == expected


def test_the_first_reuse_checks_every_digest_and_other_bytes_prepare_again(source, tmp_path, capsys):
    """Sizes right, bytes changed (a crash after the rename, a hand edit): the first reuse reads
    every file against its digest and prepares again; once verified, reuses check sizes only."""
    cfg = config(source, tmp_path / "cache", prepare_workers=1)
    p = prepare(cfg, progress=False)
    assert not (p.dir / shards.VERIFIED).exists()
    expected = (p.dir / "train-00000.bin").read_bytes()
    changed = bytearray(expected)
    changed[5] ^= 1
    (p.dir / "train-00000.bin").write_bytes(bytes(changed))
    capsys.readouterr()
    again = prepare(cfg)
    assert again.tokenized and (again.dir / "train-00000.bin").read_bytes() == expected
    assert "train-00000.bin: checksum does not match manifest.json; preparing again" in capsys.readouterr().err
    reused = prepare(cfg, progress=False)
    assert not reused.tokenized and (reused.dir / shards.VERIFIED).is_file()


def test_interrupted_prepare_leaves_nothing_complete(source, tmp_path, monkeypatch):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards, "_encode_chunk", killed)
    cfg = config(source, tmp_path / "cache", prepare_workers=1)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, progress=False)
    assert list((tmp_path / "cache" / "prepared").iterdir()) == []
    monkeypatch.undo()
    assert prepare(cfg, progress=False).tokenized


def test_open_prepared_needs_a_manifest(tmp_path):
    with pytest.raises(DataError, match="no manifest.json"):
        open_prepared(tmp_path)


def test_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "env"))
    assert cache_root(DataConfig()) == tmp_path / "env"
    assert cache_root(DataConfig(cache_dir=str(tmp_path / "cfg"))) == tmp_path / "cfg"
    monkeypatch.delenv("KILN_CACHE")
    assert cache_root(DataConfig()).parts[-2:] == (".cache", "kiln")
