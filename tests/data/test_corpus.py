import json
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data.corpus import DataError, open_corpus, split_of


def write_mixed(root: Path) -> None:
    """Two .txt files (one empty), a .jsonl with a blank line and a .parquet with a null."""
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha document\n")
    (root / "sub" / "b.txt").write_text("   \n")
    (root / "c.jsonl").write_text(
        json.dumps({"text": "first record", "id": 1}) + "\n\n" + json.dumps({"text": "third line"}) + "\n"
    )
    pq.write_table(pa.table({"text": ["row zero", None, "row two"]}), root / "d.parquet")
    (root / "notes.md").write_text("ignored: unsupported extension inside a directory")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("ignored: hidden")


def all_docs(corpus):
    return list(corpus.documents("train")) + list(corpus.documents("val"))


def test_stdlib_split_is_disjoint_and_reproducible():
    corpus = open_corpus("stdlib", val_fraction=0.05)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = [corpus.name_of(p) for p in corpus.files]
    assert len(names) > 300 and names == sorted(names)
    assert all(p.is_relative_to(stdlib) for p in corpus.files)
    assert not any({"site-packages", "test", "tests", "idle_test"} & set(n.split("/")[:-1]) for n in names)

    train = [name for name, _ in corpus.documents("train")]
    val = [name for name, _ in corpus.documents("val")]
    assert train and val and not set(train) & set(val)
    assert set(train) | set(val) <= set(names)
    assert (len(train), len(val)) == (corpus.count("train"), corpus.count("val"))
    # With hundreds of documents no fix-up is needed: the split is exactly the name hash.
    assert all(split_of(n, 0.05) == "val" for n in val) and all(split_of(n, 0.05) == "train" for n in train)
    assert [name for name, _ in open_corpus("stdlib").documents("val")] == val


def test_split_of_is_a_stable_fraction():
    names = [f"doc{i}.txt" for i in range(4000)]
    share = sum(split_of(n, 0.1) == "val" for n in names) / len(names)
    assert 0.08 < share < 0.12
    assert split_of("doc0.txt", 0.1) == split_of("doc0.txt", 0.1)
    assert split_of("doc0.txt", 0.999999) == "val"


def test_mixed_directory_names_order_and_skipping(tmp_path):
    write_mixed(tmp_path)
    corpus = open_corpus(str(tmp_path), val_fraction=0.3)
    assert [corpus.name_of(p) for p in corpus.files] == ["a.txt", "c.jsonl", "d.parquet", "sub/b.txt"]
    docs = dict(all_docs(corpus))
    assert docs == {
        "a.txt": "alpha document\n",
        "c.jsonl:1": "first record",
        "c.jsonl:3": "third line",
        "d.parquet:0": "row zero",
        "d.parquet:2": "row two",
    }
    assert all_docs(corpus) == all_docs(open_corpus(str(tmp_path), val_fraction=0.3))


def test_fingerprint_tracks_content_and_settings(tmp_path):
    write_mixed(tmp_path)
    fp = open_corpus(str(tmp_path)).fingerprint
    assert open_corpus(str(tmp_path)).fingerprint == fp
    assert open_corpus(str(tmp_path), val_fraction=0.2).fingerprint != fp
    assert open_corpus(str(tmp_path), text_field="body").fingerprint != fp
    (tmp_path / "a.txt").write_text("alpha document, edited\n")
    assert open_corpus(str(tmp_path)).fingerprint != fp


def test_jsonl_custom_field_and_glob(tmp_path):
    lines = [json.dumps({"body": f"doc number {i}", "text": 5}) for i in range(20)]
    (tmp_path / "part1.jsonl").write_text("\n".join(lines[:10]))
    (tmp_path / "part2.jsonl").write_text("\n".join(lines[10:]))
    corpus = open_corpus(str(tmp_path / "part*.jsonl"), text_field="body", val_fraction=0.2)
    docs = all_docs(corpus)
    assert sorted(text for _, text in docs) == sorted(f"doc number {i}" for i in range(20))
    assert {name.split(":")[0] for name, _ in docs} == {"part1.jsonl", "part2.jsonl"}


def test_stdlib_files_through_a_glob():
    stdlib = sysconfig.get_paths()["stdlib"]
    corpus = open_corpus(f"{stdlib}/json/*.py")
    assert "__init__.py" in [name for name, _ in all_docs(corpus)]


def test_tiny_corpus_gets_one_val_document(tmp_path):
    (tmp_path / "one.txt").write_text("one")
    (tmp_path / "two.txt").write_text("two")
    corpus = open_corpus(str(tmp_path), val_fraction=1e-9)
    assert (corpus.count("train"), corpus.count("val")) == (1, 1)
    assert len(list(corpus.documents("train"))) == len(list(corpus.documents("val"))) == 1
    corpus = open_corpus(str(tmp_path), val_fraction=1 - 1e-9)
    assert (corpus.count("train"), corpus.count("val")) == (1, 1)


@pytest.mark.parametrize(
    "setup, source, expected",
    [
        (lambda d: None, "missing.txt", "no such file or directory"),
        (lambda d: None, "nothing-*.txt", "matched nothing"),
        (lambda d: (d / "data.csv").write_text("a,b"), "data.csv", "unsupported file type '.csv'"),
        (lambda d: (d / "empty").mkdir(), "empty", "holds no .txt"),
        (lambda d: (d / "one.txt").write_text("only"), "one.txt", "only one non-empty document"),
        (lambda d: (d / "blank.txt").write_text("  "), "blank.txt", "no non-empty documents"),
    ],
)
def test_bad_sources(tmp_path, setup, source, expected):
    setup(tmp_path)
    with pytest.raises(DataError, match=expected):
        open_corpus(str(tmp_path / source)).count("train")


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        all_docs(open_corpus(str(path)))


def test_missing_jsonl_field_names_field_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"content": "x"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2: no string field 'text' \(fields: content\)"):
        all_docs(open_corpus(str(path)))


def test_missing_parquet_column_lists_columns(tmp_path):
    pq.write_table(pa.table({"body": ["a", "b"], "id": [1, 2]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: no column 'text'; columns are body, id"):
        all_docs(open_corpus(str(tmp_path / "t.parquet")))
