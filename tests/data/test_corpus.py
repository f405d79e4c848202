import json
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data.corpus import DataError, open_corpus, split_of

from conftest import book_text


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
        "c:1": "first record",
        "c:3": "third line",
        "d:1": "row zero",
        "d:3": "row two",
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
    assert {name.split(":")[0] for name, _ in docs} == {"part1", "part2"}


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


# -- one large document, duplicates, an explicit validation source --------------------------------


def test_one_file_is_split_by_position(tmp_path):
    text = book_text()
    (tmp_path / "input.txt").write_text(text)
    corpus = open_corpus(str(tmp_path / "input.txt"), val_fraction=0.1)
    (train_name, train), (val_name, val) = *corpus.documents("train"), *corpus.documents("val")
    assert train + val == text
    assert train.endswith("\n") and val == text[text.index(val.split("\n")[0] + "\n") :]  # from a line start
    assert abs(len(val) - 0.1 * len(text)) < 60  # within a line of the fraction
    assert train_name == f"input.txt[:{len(train)}]" and val_name == f"input.txt[{len(train)}:]"
    assert corpus.stats["split_by_position"] == 1


def test_one_long_line_is_cut_between_words(tmp_path):
    text = " ".join(f"word{i}" for i in range(1000))
    (tmp_path / "line.txt").write_text(text)
    [(_, train)], [(_, val)] = (list(open_corpus(str(tmp_path / "line.txt")).documents(s)) for s in ("train", "val"))
    assert train + val == text and val.startswith(" word") and train[-1] != " "


def test_large_documents_of_a_corpus_are_split_by_position(tmp_path):
    for i in range(30):
        (tmp_path / f"small{i:02d}.txt").write_text(f"small document {i}\n" * 3)
    (tmp_path / "big.txt").write_text(book_text(2000))
    corpus = open_corpus(str(tmp_path), val_fraction=0.1, position_split_chars=20_000)
    train, val = (dict(corpus.documents(s)) for s in ("train", "val"))
    [head] = [n for n in train if n.startswith("big.txt")]
    [tail] = [n for n in val if n.startswith("big.txt")]
    assert train[head] + val[tail] == book_text(2000)
    # The small ones go whole, by name hash.
    assert all(split_of(n, 0.1) == "train" for n in train if n.startswith("small"))
    assert all(split_of(n, 0.1) == "val" for n in val if n.startswith("small"))
    whole = open_corpus(str(tmp_path), val_fraction=0.1, position_split_chars=0)
    assert not any("[" in n for n, _ in all_docs(whole))
    assert corpus.fingerprint != whole.fingerprint


def test_duplicates_are_kept_once_and_never_cross_the_split(tmp_path):
    texts = [f"document number {i}\n" * (i + 1) for i in range(40)]
    for i, text in enumerate(texts):
        (tmp_path / f"a{i:02d}.txt").write_text(text)
        if i % 4 == 0:  # a quarter of them again, under other names
            (tmp_path / f"b{i:02d}.txt").write_text(text)
    corpus = open_corpus(str(tmp_path), val_fraction=0.3)
    train, val = ([t for _, t in corpus.documents(s)] for s in ("train", "val"))
    assert sorted(train + val) == sorted(texts)  # each text exactly once
    assert not set(train) & set(val)
    assert corpus.stats["duplicates_removed"] == 10
    assert (corpus.count("train"), corpus.count("val")) == (len(train), len(val))


def test_stdlib_duplicates_are_removed():
    corpus = open_corpus("stdlib")
    names = {n for n, _ in all_docs(corpus)}
    assert corpus.stats["duplicates_removed"] >= 1
    # __phello__/spam.py is a byte copy of __phello__/__init__.py: only the first is kept.
    assert "__phello__/__init__.py" in names and "__phello__/spam.py" not in names
    hashes = [hash(t) for _, t in all_docs(corpus)]
    assert len(hashes) == len(set(hashes))


def test_val_source_is_val_and_nothing_of_it_trains(tmp_path):
    (tmp_path / "train").mkdir()
    for i in range(10):
        (tmp_path / "train" / f"t{i}.txt").write_text(f"training text {i}\n")
    (tmp_path / "train" / "copy.txt").write_text("held out text 1\n")  # also in val: left out of train
    (tmp_path / "val.jsonl").write_text(
        "\n".join(json.dumps({"text": f"held out text {i}\n"}) for i in (0, 1, 2, 2)) + "\n"
    )
    corpus = open_corpus(str(tmp_path / "train"), val_source=str(tmp_path / "val.jsonl"))
    train, val = ([t for _, t in corpus.documents(s)] for s in ("train", "val"))
    assert sorted(train) == sorted(f"training text {i}\n" for i in range(10))
    assert val == [f"held out text {i}\n" for i in range(3)]  # its own copy kept once
    assert corpus.stats["removed_as_in_val"] == 1
    assert (corpus.count("train"), corpus.count("val")) == (10, 3)


def test_a_source_to_evaluate_is_all_val_and_whole(tmp_path):
    (tmp_path / "eval.txt").write_text("just one document\n")
    corpus = open_corpus("", val_source=str(tmp_path / "eval.txt"))
    assert list(corpus.documents("train")) == []
    assert list(corpus.documents("val")) == [("eval.txt", "just one document\n")]
    assert (corpus.count("train"), corpus.count("val")) == (0, 1)


def test_position_cut_boundaries():
    from kiln.data.corpus import position_cut

    assert position_cut("a\nb\nc\nd\n", 0.25) in (6, 4)
    assert position_cut("nowhitespaceatall", 0.5) is None
    assert position_cut("   \nonly\n", 0.5) is None  # no cut leaves text on both sides
