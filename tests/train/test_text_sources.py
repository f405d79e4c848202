"""Training on the data people have: one large text file split by position, a named validation
source, deduplicated corpora, and ``kiln eval --data`` over every token of what it is given."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from kiln.config import load_config
from kiln.train.run import load_run
from kiln.train.trainer import train

from conftest import book_text, tiny_overrides

pytestmark = pytest.mark.e2e


def _train(run, source, **extra):
    return train(load_config(None, tiny_overrides(run, source, **extra)), console=False)


def test_one_text_file_trains_with_its_tail_as_val(tmp_path):
    text = book_text(3000, 0)
    (tmp_path / "input.txt").write_text(text)
    run = tmp_path / "run"
    result = _train(run, tmp_path / "input.txt", train__max_steps=6)
    assert result.step == 6
    data = json.loads((run / "data.json").read_text())
    assert data["corpus"]["split_by_position"] == 1
    assert data["splits"]["train"]["documents"] == data["splits"]["val"]["documents"] == 1
    # The val split is the tail: its bytes are the last ~5% of the file's.
    tail = data["splits"]["val"]["bytes"]
    assert abs(tail - 0.05 * len(text.encode())) < 100
    assert data["splits"]["train"]["bytes"] + tail == len(text.encode())


def test_eval_data_scores_every_token_of_one_file(tmp_path):
    (tmp_path / "input.txt").write_text(book_text(3000, 0))
    run = tmp_path / "run"
    _train(run, tmp_path / "input.txt", train__max_steps=2)
    val = tmp_path / "VAL.txt"
    val.write_text(book_text(97, 1))  # not a multiple of any sequence length
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    tok.encode_special_tokens = True
    expected = len(tok.encode(val.read_text(), add_special_tokens=False).ids) + 1  # and the end-of-text token
    saved = load_run(run, device="cpu")
    metrics = saved.job.evaluate_saved(saved, source=str(val), max_batches=None, batch_size=3)
    assert metrics["tokens"] == expected - 1  # every token but the first is a target
    assert metrics["val_bpb"] > 0
    assert saved.job.evaluate_saved(saved, source=str(val), max_batches=1, batch_size=3)["tokens"] == 3 * 32


def test_val_source_is_what_is_evaluated_and_nothing_of_it_trains(tmp_path, corpus_dir):
    val = tmp_path / "val"
    val.mkdir()
    names = sorted(p.name for p in corpus_dir.iterdir())
    for name in names[:3]:  # copies of training documents: left out of training
        (val / name).write_text((corpus_dir / name).read_text())
    (val / "extra.txt").write_text(book_text(200, 2))
    run = tmp_path / "run"
    _train(run, corpus_dir, data__val_source=val, train__max_steps=2)
    data = json.loads((run / "data.json").read_text())
    assert data["val_source"] == str(val) and data["splits"]["val"]["documents"] == 4
    assert data["splits"]["train"]["documents"] == len(names) - 3
    assert data["corpus"]["removed_as_in_val"] == 3
    expected_val_bytes = sum(len(p.read_bytes()) for p in val.iterdir())
    assert data["splits"]["val"]["bytes"] == expected_val_bytes


def test_a_corpus_with_copies_keeps_each_text_once(tmp_path, corpus_dir):
    src = tmp_path / "src"
    src.mkdir()
    docs = sorted(corpus_dir.iterdir())
    for p in docs:
        (src / p.name).write_text(p.read_text())
    for p in docs[:7]:
        (src / f"copy-of-{p.name}").write_text(p.read_text())
    run = tmp_path / "run"
    _train(run, src, train__max_steps=2)
    data = json.loads((run / "data.json").read_text())
    assert data["corpus"]["duplicates_removed"] == 7
    assert data["splits"]["train"]["documents"] + data["splits"]["val"]["documents"] == len(docs)


@pytest.mark.parametrize("make", ["file", "file_parent"])
def test_run_dir_that_cannot_be_a_directory_is_one_line(tmp_path, make):
    from kiln.config import ConfigError

    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    run = blocker if make == "file" else blocker / "run"
    with pytest.raises(ConfigError, match=r"run\.dir: .*blocker.* is a file, not a directory"):
        _train(run, tmp_path, train__max_steps=1)
    assert blocker.read_text() == "a file"
