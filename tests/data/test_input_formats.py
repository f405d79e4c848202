"""The same records as .jsonl, .jsonl.gz, .jsonl.zst, Hub-layout .parquet shards and a ``datasets``
save give the same documents, split and tokens; broken inputs are one-line errors naming the file."""

import gzip
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.config import DataConfig
from kiln.data.corpus import DataError, open_corpus
from kiln.data.shards import prepare

from kilnrun import in_process

WORDS = ["tensor", "gradient", "café", "naïve", "loop", "日本", "return", "batch", "🚀", "shard"]
# 50 records: distinct texts of varied length, one empty (skipped, but it keeps its number).
TEXTS = [" ".join(WORDS[(i * j + j) % len(WORDS)] for j in range(4 + i % 13)) + f" #{i}\n" for i in range(50)]
TEXTS[17] = ""


def jsonl_bytes(texts=TEXTS, field="text") -> bytes:
    return "".join(json.dumps({field: t, "id": i}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)).encode()


def zstd(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data)


def write(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def hub_parquet(directory: Path, texts=TEXTS, shards: int = 2, column="text") -> None:
    """Parquet shards as the Hub lays them out: data/train-0000K-of-0000N.parquet."""
    per = -(-len(texts) // shards)
    for k in range(shards):
        (directory / "data").mkdir(parents=True, exist_ok=True)
        chunk = texts[k * per : (k + 1) * per]
        table = pa.table({column: chunk, "id": list(range(k * per, k * per + len(chunk)))})
        pq.write_table(table, directory / "data" / f"train-{k:05d}-of-{shards:05d}.parquet")


def datasets_save(path: Path, texts=TEXTS, shards: int = 2) -> str:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))}).save_to_disk(
        str(path), num_shards=shards
    )
    return str(path)


def documents(source: str, **kw) -> tuple[list, list]:
    corpus = open_corpus(source, val_fraction=0.2, **kw)
    return list(corpus.documents("train")), list(corpus.documents("val"))


def test_every_format_gives_the_same_documents_and_tokens(tmp_path):
    datasets = pytest.importorskip("datasets")
    raw = jsonl_bytes()
    sources = {
        "jsonl": write(tmp_path / "jsonl" / "train.jsonl", raw),
        "gz": write(tmp_path / "gz" / "train.jsonl.gz", gzip.compress(raw)),
        "zst": write(tmp_path / "zst" / "train.jsonl.zst", zstd(raw)),
        "parquet": str(tmp_path / "train.parquet"),
        "hub": str(tmp_path / "hub" / "data"),
        "hub-glob": str(tmp_path / "hub" / "data" / "train-*.parquet"),
        "save": datasets_save(tmp_path / "save" / "train"),
        "dict-split": str(tmp_path / "dict" / "train"),
    }
    pq.write_table(pa.table({"text": TEXTS}), sources["parquet"])
    hub_parquet(tmp_path / "hub")
    train = datasets.Dataset.from_dict({"text": TEXTS})
    datasets.DatasetDict(train=train, test=train.select(range(5))).save_to_disk(str(tmp_path / "dict"))

    expected = documents(sources["jsonl"])
    names = [name for split in expected for name, _ in split]
    assert sorted(names, key=lambda n: int(n.split(":")[1])) == [f"train:{i + 1}" for i in range(50) if i != 17]
    assert expected[0] and expected[1]
    for kind, source in sources.items():
        assert documents(source) == expected, kind

    outputs = {}
    for kind, source in sources.items():
        cfg = DataConfig(
            source=source, cache_dir=str(tmp_path / "cache" / kind), vocab_size=300, val_fraction=0.2, prepare_workers=1
        )
        prepared = prepare(cfg, progress=False)
        names = ("train-00000.bin", "val-00000.bin", "tokenizer.json")
        outputs[kind] = [(prepared.dir / f).read_bytes() for f in names]
    assert all(out == outputs["jsonl"] for out in outputs.values())
    assert all(len(b) > 0 for b in outputs["jsonl"])


def test_names_are_record_numbers_whatever_the_container(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "first"}\n\n{"text": "third"}\n')  # a blank line counts
    pq.write_table(pa.table({"text": ["row one", None, "row three"]}), tmp_path / "d.parquet")
    write(tmp_path / "e.jsonl.gz", gzip.compress(b'{"text": "gz one"}\n'))
    corpus = open_corpus(str(tmp_path), val_fraction=0.3)
    docs = dict(d for s in ("train", "val") for d in corpus.documents(s))
    assert docs == {"c:1": "first", "c:3": "third", "d:1": "row one", "d:3": "row three", "e:1": "gz one"}


def test_hub_layout_is_found_recursively_in_sorted_order(tmp_path):
    texts = [f"record {i}\n" for i in range(12)]
    for config, split, k, n in [("b", "train", 1, 2), ("a", "test", 0, 1), ("b", "train", 0, 2), ("a", "train", 0, 1)]:
        part = texts[(k * 6) : (k * 6 + 6)] if config == "b" else [f"{config} {split} {i}\n" for i in range(3)]
        path = tmp_path / "hub" / config / "data" / f"{split}-{k:05d}-of-{n:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": part}), path)
    # An incomplete set of shards (one of three): named as a file of its own.
    (tmp_path / "hub" / "c").mkdir()
    pq.write_table(pa.table({"text": ["lone shard\n"]}), tmp_path / "hub" / "c" / "x-00001-of-00003.parquet")
    corpus = open_corpus(str(tmp_path / "hub"))
    files = [corpus.name_of(p) for p in corpus.files]
    assert files == sorted(files) and len(files) == 5
    assert [part.name for part in corpus.train.parts] == [
        "a/data/test",
        "a/data/train",
        "b/data/train",
        "c/x-00001-of-00003",
    ]
    names = [name for s in ("train", "val") for name, _ in corpus.documents(s)]
    # The two shards of b's train split are numbered on as one file.
    assert sorted(n for n in names if n.startswith("b/")) == sorted(f"b/data/train:{i}" for i in range(1, 13))
    assert "c/x-00001-of-00003:1" in names


def test_save_is_numbered_in_the_dataset_order_and_fingerprinted(tmp_path):
    save = tmp_path / "corpus" / "wiki"
    datasets_save(save, texts=[f"text {i}\n" for i in range(30)], shards=3)
    (tmp_path / "corpus" / "more.jsonl").write_text('{"text": "beside the save"}\n')
    corpus = open_corpus(str(tmp_path / "corpus"), val_fraction=0.2)
    docs = dict(d for s in ("train", "val") for d in corpus.documents(s))
    assert {n: t for n, t in docs.items() if n.startswith("wiki:")} == {
        f"wiki:{i + 1}": f"text {i}\n" for i in range(30)
    }
    assert docs["more:1"] == "beside the save"

    fingerprints = [corpus.fingerprint]
    state = json.loads((save / "state.json").read_text())
    state["_data_files"].reverse()  # another dataset order: other names
    (save / "state.json").write_text(json.dumps(state))
    fingerprints.append(open_corpus(str(tmp_path / "corpus"), val_fraction=0.2).fingerprint)
    write(tmp_path / "corpus" / "new.jsonl.zst", zstd(b'{"text": "new"}\n'))
    fingerprints.append(open_corpus(str(tmp_path / "corpus"), val_fraction=0.2).fingerprint)
    assert len(set(fingerprints)) == 3


def test_multi_frame_zstd_is_read_whole(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    raw = jsonl_bytes()
    half = raw.index(b"\n", len(raw) // 2) + 1
    compressor = zstandard.ZstdCompressor()
    path = write(tmp_path / "train.jsonl.zst", compressor.compress(raw[:half]) + compressor.compress(raw[half:]))
    assert documents(path) == documents(write(tmp_path / "plain" / "train.jsonl", raw))


# -- bad input -------------------------------------------------------------------------------------

BIG = jsonl_bytes([f"line {i} " * 40 for i in range(3000)])


def half(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    "name, data, expected",
    [
        (
            "t.jsonl.gz",
            lambda: half(gzip.compress(BIG)),
            r"t\.jsonl\.gz: truncated or corrupt gzip data after line [1-9]",
        ),
        (
            "t.jsonl.gz",
            lambda: b"not gzip at all\n" * 100,
            r"t\.jsonl\.gz: truncated or corrupt gzip data after line 0",
        ),
        ("t.jsonl.zst", lambda: half(zstd(BIG)), r"t\.jsonl\.zst: truncated or corrupt zstd data after line [1-9]"),
        (
            "t.jsonl.zst",
            lambda: b"not zstd at all\n" * 100,
            r"t\.jsonl\.zst: truncated or corrupt zstd data after line 0",
        ),
        ("b.jsonl.gz", lambda: gzip.compress(b'{"text": "fine"}\n{"text": oops}\n'), r"b\.jsonl\.gz:2: not valid JSON"),
        ("b.jsonl.zst", lambda: zstd(b'{"text": "fine"}\n{"text": oops}\n'), r"b\.jsonl\.zst:2: not valid JSON"),
        ("f.jsonl.zst", lambda: zstd(b'{"text": "x"}\n{"body": "y"}\n'), r"f\.jsonl\.zst:2: no string field 'text'"),
    ],
)
def test_bad_compressed_jsonl_names_file_and_line(tmp_path, name, data, expected):
    path = write(tmp_path / name, data())
    with pytest.raises(DataError, match=expected) as info:
        documents(path)
    assert "\n" not in str(info.value)


def test_zst_without_zstandard_says_what_to_install(tmp_path, monkeypatch):
    path = write(tmp_path / "t.jsonl.zst", zstd(b'{"text": "x"}\n'))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    with pytest.raises(DataError, match=r"t\.jsonl\.zst: reading \.zst files needs .*pip install 'kiln\[data\]'"):
        open_corpus(path)


def test_arrow_files_outside_a_save_are_refused(tmp_path):
    save = tmp_path / "save"
    datasets_save(save, shards=2)
    # Arrow files beside no state.json (as in a datasets cache directory).
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "x-train.arrow").write_bytes((save / "data-00000-of-00002.arrow").read_bytes())
    with pytest.raises(DataError, match=r"cache: holds \.arrow files \(x-train\.arrow\) but no state\.json"):
        documents(str(tmp_path / "cache"))
    # One .arrow file of a save: a save is read whole.
    with pytest.raises(DataError, match=r"a save is read whole"):
        documents(str(save / "data-00000-of-00002.arrow"))
    # A state.json that does not list a file beside it.
    (save / "data-00002-of-00002.arrow").write_bytes(b"stray")
    with pytest.raises(
        DataError, match=r"data-00002-of-00002\.arrow: not one of the \.arrow files that .*state\.json lists"
    ):
        documents(str(save))
    (save / "data-00002-of-00002.arrow").unlink()
    (save / "state.json").write_text(json.dumps({"_fingerprint": "x"}))
    with pytest.raises(DataError, match=r"state\.json: no _data_files list of \.arrow files"):
        documents(str(save))


def test_missing_text_column_of_a_save_and_of_hub_shards(tmp_path):
    datasets_save(tmp_path / "save")
    with pytest.raises(DataError, match=r"data-00000-of-00002\.arrow: no column 'body'; columns are text, id"):
        documents(str(tmp_path / "save"), text_field="body")
    hub_parquet(tmp_path / "hub", column="content")
    with pytest.raises(DataError, match=r"train-00000-of-00002\.parquet: no column 'text'; columns are content, id"):
        documents(str(tmp_path / "hub"))


def test_truncated_arrow_names_the_file(tmp_path):
    save = tmp_path / "save"
    datasets_save(save, shards=1)
    arrow = save / "data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[:-200])
    with pytest.raises(DataError, match=r"data-00000-of-00001\.arrow: (truncated or corrupt|not a readable)"):
        documents(str(save))


def test_a_dataset_dict_is_refused_naming_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": TEXTS})
    datasets.DatasetDict(train=ds, validation=ds.select(range(5))).save_to_disk(str(tmp_path / "dd"))
    match = r"dd: a DatasetDict .*splits: train, validation.*point data\.source at one split, e\.g\. .*dd/train"
    for source in (tmp_path / "dd", tmp_path):  # named, or found in a directory searched
        with pytest.raises(DataError, match=match):
            documents(str(source))


def test_cli_exits_2_on_a_corrupt_file_and_prepares_nothing(tmp_path):
    path = write(tmp_path / "data" / "t.jsonl.gz", half(gzip.compress(BIG)))
    cache = tmp_path / "cache"
    proc = in_process("prepare", "--set", f"data.source={path}", "--set", f"data.cache_dir={cache}", check=False)
    assert proc.returncode == 2
    assert "t.jsonl.gz: truncated or corrupt gzip data after line" in proc.stderr
    assert not (cache / "prepared").exists() or not any((cache / "prepared").iterdir())
