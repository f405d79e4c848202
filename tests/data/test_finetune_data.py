"""Fine-tuning records: what the loss covers (by construction), chats with and without
{% generation %} markers, labels, the split, packing, and errors that name file, line and field."""

import csv
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.config import DataConfig
from kiln.data.corpus import DataError
from kiln.data.finetune import causal_row, pack, prepare_finetune
from kiln.data.records import Record, read_records
from kiln.labels import IGNORE_INDEX

from conftest import sft_records, write_jsonl

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(hf_llama):
    return transformers.AutoTokenizer.from_pretrained(hf_llama)


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    """The same tokenizer with a chat template that does not mark assistant turns."""
    from hf_models import CHAT_PLAIN, bpe_tokenizer

    return bpe_tokenizer(tmp_path_factory.mktemp("plain"), chat_template=CHAT_PLAIN)


def cfg(source, **kw):
    return DataConfig(source=str(source), seq_len=kw.pop("seq_len", 128), **kw)


def _record(fields, tmp_path, line=1):
    return Record(fields, tmp_path / "r.jsonl", line)


def test_prompt_tokens_get_no_loss_by_construction(tok, tmp_path):
    row, cut = causal_row(
        _record({"prompt": "Add 2 and 3. ", "completion": "It is 5."}, tmp_path), tok, cfg(tmp_path), 128
    )
    prompt = tok("Add 2 and 3. ")["input_ids"]
    completion = tok("It is 5.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row["input_ids"] == prompt + completion and not cut
    assert row["labels"] == [IGNORE_INDEX] * len(prompt) + completion
    assert row["target_bytes"] == len(b"It is 5.") + len(tok.decode([tok.eos_token_id]).encode())
    everything, _ = causal_row(
        _record({"prompt": "Add 2 and 3. ", "completion": "It is 5."}, tmp_path),
        tok,
        cfg(tmp_path, train_on_prompt=True),
        128,
    )
    assert everything["labels"] == everything["input_ids"]


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "double 21"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "and 5?"},
    {"role": "assistant", "content": "10"},
]


@pytest.mark.parametrize("which", ["tok", "plain_tok"])
def test_chats_train_only_the_assistant_turns(which, request, tmp_path):
    tokenizer = request.getfixturevalue(which)
    row, _ = causal_row(_record({"messages": CHAT}, tmp_path), tokenizer, cfg(tmp_path), 256)
    learned = [t for t in row["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(learned) == "42</s>10</s>"
    # Everything else (system, user turns, role headers) is masked, and the ids are the rendered chat.
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(CHAT, tokenize=False)


def test_both_template_kinds_mark_the_same_tokens(tok, plain_tok, tmp_path):
    marked, _ = causal_row(_record({"messages": CHAT}, tmp_path), tok, cfg(tmp_path), 256)
    found, _ = causal_row(_record({"messages": CHAT}, tmp_path), plain_tok, cfg(tmp_path), 256)
    assert marked == found


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"prompt": "Add 2. ", "completion": ""}, "r.jsonl:7: field 'completion' (data.completion_field) is empty"),
        ({"prompt": "Add 2. "}, "r.jsonl:7: no field 'completion' (data.completion_field); its fields are prompt"),
        (
            {"prompt": "x " * 300, "completion": "y"},
            "r.jsonl:7: field 'completion' gives no token to learn from: its first "
            "128 tokens (data.seq_len) are all prompt",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "r.jsonl:7: field 'messages' has no assistant turn"),
        ({"messages": "hi"}, "r.jsonl:7: field 'messages' must be a list of {role, content} messages"),
    ],
)
def test_a_record_without_anything_to_learn_is_a_named_error(tok, tmp_path, fields, message):
    with pytest.raises(DataError) as e:
        causal_row(_record(fields, tmp_path, line=7), tok, cfg(tmp_path), 128)
    assert message in str(e.value)


def test_records_from_jsonl_csv_and_parquet(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "one", "label": "x"}, {"text": "two", "label": 1}])
    with open(tmp_path / "b.csv", "w", newline="") as f:
        csv.writer(f).writerows([["text", "label"], ["three", "x"]])
    pq.write_table(pa.table({"text": ["four"], "label": ["y"]}), tmp_path / "c.parquet")
    records = read_records(str(tmp_path))
    assert [(r.fields["text"], r.where.split("/")[-1]) for r in records] == [
        ("one", "a.jsonl:1"),
        ("two", "a.jsonl:2"),
        ("three", "b.csv row 1"),
        ("four", "c.parquet row 1"),
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "bad.jsonl: no records (the file is empty)"),
        ('{"text": "a"}\n{"text": \n', "bad.jsonl:2: not valid JSON"),
        ('["a list"]\n', "bad.jsonl:1: a record must be a JSON object, got list"),
    ],
)
def test_unreadable_records_name_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(DataError, match=re.escape(message)):
        read_records(str(tmp_path / "bad.jsonl"))


def _classes(tmp_path, labels, name="train.jsonl"):
    return write_jsonl(tmp_path / name, [{"text": f"sample {i}", "label": label} for i, label in enumerate(labels)])


def test_label_names_map_to_ids_in_a_stable_order(hf_bert, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(hf_bert)
    data = prepare_finetune(cfg(_classes(tmp_path, ["pos", "neg", "mid"] * 10)), "sequence_classification", tok, 64)
    assert data.labels == ("mid", "neg", "pos")
    numeric = prepare_finetune(cfg(_classes(tmp_path, [10, 2, 1] * 10, "n.jsonl")), "sequence_classification", tok, 64)
    assert numeric.labels == ("1", "2", "10")
    assert sum(numeric.manifest["labels"].values()) == numeric.manifest["records"]["train"]
    row = data.train.rows[0]
    assert isinstance(row["labels"], int) and row["input_ids"][0] == tok.cls_token_id


def test_a_val_label_outside_the_training_labels_names_its_record(hf_bert, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(hf_bert)
    val = _classes(tmp_path, ["pos", "maybe"], "val.jsonl")
    with pytest.raises(DataError, match=r"val.jsonl:2: field 'label': label 'maybe' is not one of the training labels"):
        prepare_finetune(
            cfg(_classes(tmp_path, ["pos", "neg"] * 5), val_source=str(val)), "sequence_classification", tok, 64
        )


def test_split_by_content_keeps_copies_together_and_val_source_takes_over(tok, tmp_path):
    records = sft_records(200)
    records += records[:50]  # copies of the first fifty
    source = write_jsonl(tmp_path / "sft.jsonl", records)
    data = prepare_finetune(cfg(source, val_fraction=0.2), "causal_lm", tok, 128)
    train = {json.dumps(r["input_ids"]) for r in data.train.rows}
    val = {json.dumps(r["input_ids"]) for r in data.val.rows}
    assert not train & val and data.val.rows and len(data.val.rows) < 80
    held_out = sft_records(10, seed=1)
    other = write_jsonl(tmp_path / "val.jsonl", held_out)
    named = prepare_finetune(cfg(source, val_source=str(other)), "causal_lm", tok, 128)
    also_in_val = sum(r in held_out for r in records)  # left out of training
    assert also_in_val and len(named.train.rows) == 250 - also_in_val and len(named.val.rows) == 10
    assert named.manifest["split"] == f"val from {other}; {also_in_val} training records also in val left out"
    val = {json.dumps(r["input_ids"]) for r in named.val.rows}
    assert not val & {json.dumps(r["input_ids"]) for r in named.train.rows}


def test_truncation_is_counted(tok, tmp_path):
    records = sft_records(40) + [{"prompt": "Add 1. ", "completion": "many " * 100}]
    data = prepare_finetune(cfg(write_jsonl(tmp_path / "t.jsonl", records), val_fraction=0.01), "causal_lm", tok, 128)
    assert sum(data.manifest["truncated"].values()) == 1
    assert all(len(r["input_ids"]) <= 128 for r in data.train.rows + data.val.rows)


def test_best_fit_decreasing_packs_whole_records(tok, tmp_path):
    rows = [
        {"input_ids": list(range(n)), "labels": list(range(n)), "target_bytes": n}
        for n in (50, 40, 30, 30, 20, 20, 10, 10, 5)
    ]
    packs = pack(rows, 64)
    assert all(len(p["input_ids"]) <= 64 for p in packs)
    assert sorted(p["records"] for p in packs) and sum(p["records"] for p in packs) == len(rows)
    assert sum(len(p["input_ids"]) for p in packs) == sum(len(r["input_ids"]) for r in rows)
    # Best fit decreasing: 50+10, 40+20, 30+30, 20+10+5 -> 4 packs (a first-fit of the input order needs 5).
    assert len(packs) == 4
    for p in packs:
        starts = [i for i, pos in enumerate(p["position_ids"]) if pos == 0]
        assert len(starts) == p["records"]
        assert all(p["labels"][i] == IGNORE_INDEX for i in starts)  # a record's first token is no target


def test_packed_batches_carry_positions_and_no_attention_mask(tok, tmp_path):
    source = write_jsonl(tmp_path / "sft.jsonl", sft_records(60))
    data = prepare_finetune(cfg(source, seq_len=64, packing=True), "causal_lm", tok, 64)
    assert data.manifest["packing"]["rows"] < data.manifest["records"]["train"]
    batch = data.collate(data.train.rows[:3])
    assert batch.attention_mask is None and batch.position_ids.shape == batch.input_ids.shape
    assert batch.count == sum((batch.labels[:, 1:] != IGNORE_INDEX).sum(1).tolist())
    unpacked = data.collate(data.val.rows[:3])
    assert unpacked.position_ids is None and unpacked.attention_mask.sum().item() == unpacked.tokens
