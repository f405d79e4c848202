"""Preference pairs: rows equal to what TRL's DPOTrainer makes of the same records (text and chats),
their truncation equal to TRL's collator, PairBatch as the loop handles it (pairs never parted),
and errors that name file, line and field."""

import re
from pathlib import Path

import pytest
import torch

from kiln.config import DataConfig
from kiln.data.batch import PairBatch, batch_rows, loss_count, split_batch, to_device
from kiln.data.corpus import DataError
from kiln.data.preference import PairCollate, preference_row, prepare_preference
from kiln.data.records import Record
from kiln.labels import IGNORE_INDEX

from conftest import write_jsonl

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

TEXT = [
    {"prompt": "Add 2 and 3. ", "chosen": "It is 5.", "rejected": "It is 6."},
    # The prompt's last word and the answer's first merge into other tokens when tokenized whole.
    {"prompt": "x = sel", "chosen": "f.x", "rejected": "f()"},
    {"prompt": "Say hi.", "chosen": " hi</s>", "rejected": " no"},  # already ends with the eos token
    {"prompt": "Count: 1 2 3", "chosen": " 4 5 6 7 8 9 10 11 12", "rejected": " 5"},
]
CHATS = [
    {
        "prompt": [{"role": "user", "content": "Add 2 and 3."}],
        "chosen": [{"role": "assistant", "content": "5"}],
        "rejected": [{"role": "assistant", "content": "6"}],
    },
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another."},
        ],
        "chosen": [{"role": "assistant", "content": "Blue, a colour of the sky."}],
        "rejected": [{"role": "assistant", "content": "No."}],
    },
]
# A template whose generation prompt the whole conversation does not repeat (an empty thought
# block, as some do): the answer starts where the two renderings part.
WHERE = Path("pairs.jsonl")
THINKING = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think></think>{% endif %}"
)


@pytest.fixture(scope="module")
def tok(hf_llama):
    return transformers.AutoTokenizer.from_pretrained(hf_llama)


@pytest.fixture(scope="module")
def thinking_tok(hf_llama):
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_llama)
    tokenizer.chat_template = THINKING
    return tokenizer


@pytest.fixture(scope="module")
def no_template_tok(hf_llama):
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_llama)
    tokenizer.chat_template = None
    return tokenizer


@pytest.fixture(scope="module")
def model(hf_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(hf_llama)


def trl_rows(records, tokenizer, model, tmp_path):
    """What TRL's DPOTrainer makes of ``records``: its own preprocessing, run by the trainer."""
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=None)
    trainer = trl.DPOTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer
    )
    return [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in trainer.train_dataset]


def ours(records, tokenizer, max_len=10_000):
    return [preference_row(Record(r, WHERE, i + 1), tokenizer, max_len)[0] for i, r in enumerate(records)]


def _ids(row):
    return {k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}


def cfg(source, **kw):
    return DataConfig(source=str(source), seq_len=kw.pop("seq_len", 128), **kw)


@pytest.mark.parametrize(
    ("records", "which"), [(TEXT, "tok"), (CHATS, "tok"), (CHATS, "thinking_tok")], ids=["text", "chat", "thinking"]
)
def test_rows_are_what_trl_makes_of_the_records(records, which, model, tmp_path, request):
    tokenizer = request.getfixturevalue(which)
    assert [_ids(r) for r in ours(records, tokenizer)] == trl_rows(records, tokenizer, model, tmp_path)


def test_the_answer_starts_where_prompt_and_whole_part(tok, thinking_tok):
    row = ours(TEXT[1:2], tok)[0]
    prompt = tok("x = sel")["input_ids"]
    assert row["prompt_ids"] == prompt[:-1]  # "l" and "f" merge into "lf"
    assert tok.decode(row["chosen_ids"]) == "lf.x</s>"
    chat = ours(CHATS[:1], thinking_tok)[0]
    assert thinking_tok.decode(chat["prompt_ids"]).endswith("<|assistant|>")
    assert thinking_tok.decode(chat["chosen_ids"]) == "5</s>"


def test_truncation_keeps_the_start_as_trls_collator_does(tok, model, tmp_path):
    full = trl_rows(TEXT, tok, model, tmp_path)
    max_len = max(len(r["prompt_ids"]) for r in full) + 2
    rows = []
    cut = 0
    for i, record in enumerate(TEXT):
        row, truncated = preference_row(Record(record, WHERE, i + 1), tok, max_len)
        rows.append({**row, "index": i})
        cut += truncated
    assert cut >= 2
    batch = PairCollate(tok)(rows)
    theirs = trl.trainer.dpo_trainer.DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=max_len)(full)
    n = len(rows)
    for half, offset in ((batch.chosen, 0), (batch.rejected, n)):
        for i in range(n):
            real = theirs["attention_mask"][offset + i].bool()
            assert half.input_ids[i, : half.lengths[i]].tolist() == theirs["input_ids"][offset + i][real].tolist()
            learned = (half.labels[i, : half.lengths[i]] != IGNORE_INDEX).long()
            assert learned.tolist() == theirs["completion_mask"][offset + i][real].tolist()


def test_the_collated_pair_batch(tok):
    rows = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10], "chosen_bytes": 4, "rejected_bytes": 2},
        {"prompt_ids": [11], "chosen_ids": [12], "rejected_ids": [13, 14, 15], "chosen_bytes": 1, "rejected_bytes": 3},
    ]
    rows = [{**r, "index": i + 7} for i, r in enumerate(rows)]
    batch = PairCollate(tok)(rows)
    pad, no = tok.pad_token_id, IGNORE_INDEX
    assert batch.chosen.input_ids.tolist() == [[5, 6, 7, 8, 9], [11, 12, pad, pad, pad]]
    assert batch.chosen.labels.tolist() == [[no, no, no, 8, 9], [no, 12, no, no, no]]
    assert batch.chosen.attention_mask.tolist() == [[1] * 5, [1, 1, 0, 0, 0]]
    assert batch.rejected.input_ids.tolist() == [[5, 6, 7, 10], [11, 13, 14, 15]]
    assert batch.rejected.labels.tolist() == [[no, no, no, 10], [no, 13, 14, 15]]
    assert batch.rejected.attention_mask.tolist() == [[1] * 4, [1] * 4]
    assert (batch.chosen.lengths, batch.rejected.lengths) == ([5, 2], [4, 4])
    assert (batch.chosen.loss_tokens, batch.rejected.loss_tokens) == ([2, 1], [1, 3])
    assert (batch.chosen.target_bytes, batch.rejected.target_bytes) == ([4, 1], [2, 3])
    assert batch.index == [7, 8]
    assert (len(batch), batch.count, batch.tokens) == (2, 2, 15)


def test_target_bytes_are_the_decoded_answer(tok):
    row = ours(TEXT[:1], tok)[0]
    assert row["chosen_bytes"] == len(tok.decode(row["chosen_ids"]).encode())
    assert tok.decode(row["chosen_ids"]).endswith("It is 5.</s>")


def test_micro_batches_keep_each_pair_whole(tok):
    records = [{"prompt": f"Q{i}: ", "chosen": "yes " * (i + 1), "rejected": "no"} for i in range(5)]
    rows = [{**row, "index": i} for i, row in enumerate(ours(records, tok))]
    batch = PairCollate(tok)(rows)
    parts = split_batch(batch, 2)
    assert [type(p) for p in parts] == [PairBatch] * 3
    assert [p.index for p in parts] == [[0, 1], [2, 3], [4]]
    assert [batch_rows(p) for p in parts] == [2, 2, 1]
    assert [loss_count(p) for p in parts] == [2, 2, 1]
    for part in parts:
        for k, i in enumerate(part.index):
            for half, answer in ((part.chosen, "chosen_ids"), (part.rejected, "rejected_ids")):
                ids = rows[i]["prompt_ids"] + rows[i][answer]
                assert half.input_ids[k, : len(ids)].tolist() == ids
                # Each half is cut to its own longest row.
                assert half.input_ids.size(1) == max(half.lengths)
    assert sum(p.tokens for p in parts) == batch.tokens
    moved = to_device({"pairs": batch}, torch.device("cpu"))["pairs"]
    assert isinstance(moved, PairBatch) and moved.index == batch.index
    assert torch.equal(moved.rejected.labels, batch.rejected.labels)
    assert batch_rows(batch) == loss_count(batch) == 5


def test_prepare_splits_and_indexes_within_each_split(tok, tmp_path):
    records = [{"prompt": f"Add {i} and 1. ", "chosen": f"It is {i + 1}.", "rejected": "No."} for i in range(20)]
    data = prepare_preference(cfg(write_jsonl(tmp_path / "p.jsonl", records), val_fraction=0.2), tok, 128)
    assert len(data.train) + len(data.val) == 20 and len(data.val) > 0
    for split in (data.train, data.val):
        assert [split[i]["index"] for i in range(len(split))] == list(range(len(split)))
    m = data.manifest
    assert m["records"] == {"train": len(data.train), "val": len(data.val)}
    assert m["truncated"] == {"train": 0, "val": 0}
    assert m["loss_tokens"]["train"]["chosen"] == sum(len(r["chosen_ids"]) for r in data.train.rows)
    batch = data.collate([data.train[0], data.train[1]])
    assert isinstance(batch, PairBatch) and batch.index == [0, 1]


BAD = [
    ({"prompt": "Hi", "rejected": "x"}, "chosen", r"no field 'chosen'"),
    ({"prompt": "Hi", "chosen": "", "rejected": "x"}, "chosen", r"field 'chosen' .*is empty"),
    ({"prompt": "Hi", "chosen": "a", "rejected": 3}, "rejected", r"field 'rejected' must be a string"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, "prompt", r"field 'prompt' must be a string or a list"),
    (
        {"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"content": "a"}], "rejected": CHATS[0]["rejected"]},
        "chosen",
        r"field 'chosen' must be a list of \{role, content\} messages",
    ),
    (
        {"prompt": [{"role": "user", "content": "Hi"}], "chosen": "a", "rejected": "b"},
        "chosen",
        r"field 'chosen' must be a list of \{role, content\} messages",
    ),
    (
        {"prompt": "Count: " + "1 " * 40, "chosen": "a", "rejected": "b"},
        "chosen",
        r"field 'chosen' gives no token to learn from: its first 16 tokens \(data.seq_len\) are all prompt",
    ),
]


@pytest.mark.parametrize(("record", "field", "message"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_records_name_file_line_and_field(tok, tmp_path, record, field, message):
    good = TEXT[0]
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, good | {"prompt": "Other. "}, record])
    with pytest.raises(DataError, match=re.escape(f"{path}:3: ") + message):
        prepare_preference(cfg(path, seq_len=16), tok, 16)


def test_a_chat_without_a_template_names_its_record(no_template_tok, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [CHATS[0]])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: field 'prompt' is a chat") + ".*no chat template"):
        preference_row(Record(CHATS[0], path, 1), no_template_tok, 128)


def test_an_answer_that_adds_nothing_to_the_prompt_is_named(tok):
    record = {"prompt": CHATS[0]["prompt"], "chosen": [], "rejected": CHATS[0]["rejected"]}
    with pytest.raises(DataError, match=r"pairs.jsonl:1: field 'chosen' gives no token to learn from"):
        ours([record], tok)
