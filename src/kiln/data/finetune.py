"""Fine-tuning examples: records tokenized with the model's own tokenizer into rows whose labels
say exactly which tokens the loss covers; the train/val split; packing; and their batches.

causal_lm records are prompt/completion pairs or chats (``messages``, rendered with the
tokenizer's chat template). The loss covers the completion, or the assistant turns: the template's
``{% generation %}`` markers find them when it has them, else the conversation is rendered one
prefix at a time and the characters each assistant turn adds are mapped to tokens. A record whose
loss would cover no token is an error naming its file and line, never a silent zero.
sequence_classification records are a text (and optionally a second text) and a label.

Labels are aligned with the inputs (``labels[t]`` is token t, -100 where no loss is wanted); the
model shifts them. Packing puts whole records into rows of ``seq_len`` tokens, best-fit
decreasing; each record's positions restart at 0, which the model turns into a block-diagonal
causal mask, and each record's first token is no target (nothing of its own precedes it).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset

from kiln.data.batch import TokenBatch, pad_id, pad_rows
from kiln.data.corpus import DataError
from kiln.data.records import Record, read_records
from kiln.labels import IGNORE_INDEX

TASKS = ("causal_lm", "sequence_classification")


class Examples(Dataset):
    """Tokenized rows: ``input_ids``, ``labels`` (a list aligned with the inputs, or one class
    id), ``target_bytes``, and for packed rows ``position_ids``; for pairs ``token_type_ids``."""

    def __init__(self, rows: list[dict[str, Any]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def batches(self, collate: Callable[[list[dict[str, Any]]], Any], size: int) -> list[Any]:
        """Every row in order, ``size`` rows to a batch made by ``collate`` (the last may be smaller)."""
        return [collate(self.rows[i : i + size]) for i in range(0, len(self.rows), size)]


@dataclass
class FineTuneData:
    task: str
    train: Examples
    val: Examples
    collate: Callable[[list[dict[str, Any]]], TokenBatch]
    labels: tuple[str, ...] = ()  # sequence_classification: class id -> name
    manifest: dict[str, Any] = field(default_factory=dict)


def prepare_finetune(data_cfg, task: str, tokenizer, max_len: int, width: int = 0) -> FineTuneData:
    """Read, split, tokenize (and pack) ``data_cfg.source`` for ``task``; DataError on the first
    bad record, naming its file, line and field. ``width``: every batch padded to this many
    tokens (``Collate``)."""
    if task not in TASKS:
        raise DataError(f"model.task: {task!r} has no fine-tuning records; choose one of {', '.join(TASKS)}")
    records, is_val, split = split_records(data_cfg)
    labels: tuple[str, ...] = ()
    if task == "sequence_classification":
        labels = _label_set([r for r, v in zip(records, is_val, strict=True) if not v], data_cfg.label_field)
    # Rows are made in file order, so an error names the first bad record whatever its split.
    made = _rows(records, task, tokenizer, data_cfg, max_len, labels)
    rows, manifest = split_rows(made, is_val, task, split, data_cfg, max_len)
    packed = task == "causal_lm" and data_cfg.packing
    train_rows = pack(rows["train"], data_cfg.seq_len) if packed else rows["train"]
    manifest["loss_tokens"] = {name: sum(_loss_tokens(r, task) for r in rs) for name, rs in rows.items()}
    manifest["packing"] = {"rows": len(train_rows), "fill": _fill(train_rows, data_cfg.seq_len)} if packed else None
    if labels:
        counts = Counter(r["labels"] for r in rows["train"])
        manifest["labels"] = {name: counts[i] for i, name in enumerate(labels)}
    return FineTuneData(
        task, Examples(train_rows), Examples(rows["val"]), Collate(task, tokenizer, width), labels, manifest
    )


def split_rows(
    made: list[tuple[dict[str, Any], bool]], is_val: list[bool], task: str, split: str, data_cfg, max_len: int
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Each record's (row, truncated), in file order, into the train and val rows, and the start
    of the data's manifest (what data.json records)."""
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
    truncated = {"train": 0, "val": 0}
    for (row, cut), val in zip(made, is_val, strict=True):
        rows["val" if val else "train"].append(row)
        truncated["val" if val else "train"] += cut
    manifest = {
        "task": task,
        "source": data_cfg.source,
        "val_source": data_cfg.val_source or None,
        "split": split,
        "records": {name: len(r) for name, r in rows.items()},
        "truncated": truncated,
        "max_len": max_len,
    }
    return rows, manifest


def truncation(manifest: dict[str, Any]) -> str | None:
    """What the console says of the records cut to fit (SFT rows, preference pairs), or None."""
    cut = manifest["truncated"]
    if not (cut["train"] or cut["val"]):
        return None
    return f"{cut['train']:,} train / {cut['val']:,} val truncated to data.seq_len={manifest['max_len']}"


def prepare_eval(source: str, data_cfg, task: str, tokenizer, max_len: int, labels: tuple[str, ...]) -> FineTuneData:
    """Every record of ``source`` as validation rows, for a model that knows its ``labels``."""
    rows = [
        row
        for row, _ in _rows(read_records(source, data_cfg.max_record_bytes), task, tokenizer, data_cfg, max_len, labels)
    ]
    return FineTuneData(task, Examples([]), Examples(rows), Collate(task, tokenizer), labels, {"records": len(rows)})


def _rows(records: list[Record], task: str, tokenizer, data_cfg, max_len: int, labels: tuple[str, ...]) -> list:
    """(row, truncated) of each record."""
    if task == "sequence_classification":
        ids = {name: i for i, name in enumerate(labels)}
        return [classification_row(r, tokenizer, data_cfg, max_len, ids) for r in records]
    return [causal_row(r, tokenizer, data_cfg, max_len) for r in records]


# -- records to rows ---------------------------------------------------------------------------------


def causal_row(record: Record, tokenizer, data_cfg, max_len: int) -> tuple[dict[str, Any], bool]:
    """A causal_lm record as (row, truncated): a chat if it has the messages field, else a
    prompt/completion pair."""
    if data_cfg.messages_field in record.fields:
        ids, learn = _chat(record, tokenizer, data_cfg.messages_field)
        field_name = data_cfg.messages_field
    else:
        prompt = tokenizer(str(record.get(data_cfg.prompt_field, "data.prompt_field")), add_special_tokens=True)
        completion = tokenizer(
            str(record.get(data_cfg.completion_field, "data.completion_field")), add_special_tokens=False
        )["input_ids"]
        if tokenizer.eos_token_id is not None:
            completion = [*completion, tokenizer.eos_token_id]
        ids = [*prompt["input_ids"], *completion]
        learn = [False] * len(prompt["input_ids"]) + [True] * len(completion)
        field_name = data_cfg.completion_field
    if data_cfg.train_on_prompt:
        learn = [True] * len(ids)
    cut = len(ids) > max_len
    ids, learn = ids[:max_len], learn[:max_len]
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids, learn, strict=True)]
    if not any(label != IGNORE_INDEX for label in labels[1:]):
        why = f"its first {max_len} tokens (data.seq_len) are all prompt" if cut else "it is empty"
        raise DataError(f"{record.where}: field {field_name!r} gives no token to learn from: {why}")
    targets = [t for t in labels[1:] if t != IGNORE_INDEX]
    return {"input_ids": ids, "labels": labels, "target_bytes": len(tokenizer.decode(targets).encode())}, cut


def _chat(record: Record, tokenizer, field_name: str) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered chat, and which of them the assistant says."""
    messages = record.get(field_name, "data.messages_field")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"{record.where}: field {field_name!r} must be a list of {{role, content}} messages")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"{record.where}: field {field_name!r} has no assistant turn: nothing to learn")
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{record.where}: field {field_name!r} is a chat, but the model's tokenizer has no chat "
            "template; give prompt/completion records instead"
        )
    marked = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    if any(marked["assistant_masks"]):
        return list(marked["input_ids"]), [bool(m) for m in marked["assistant_masks"]]
    # No {% generation %} markers: find each assistant turn as the text it adds to the prefix before it.
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i in turns:
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise DataError(
                f"{record.where}: the chat template does not render message {i + 1} of field "
                f"{field_name!r} as a continuation of the ones before, so its tokens cannot be found; "
                "use a template with {% generation %} markers"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    learn = [any(a <= start < b for a, b in spans) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), learn


def classification_row(record: Record, tokenizer, data_cfg, max_len: int, label_ids: dict[str, int]):
    text = str(record.get(data_cfg.text_field, "data.text_field"))
    pair = record.fields.get(data_cfg.text_pair_field)
    pair = None if pair in (None, "") else str(pair)
    label = _label_name(record.get(data_cfg.label_field, "data.label_field"))
    if label not in label_ids:
        shown = ", ".join(list(label_ids)[:10]) + (", ..." if len(label_ids) > 10 else "")
        raise DataError(
            f"{record.where}: field {data_cfg.label_field!r}: label {label!r} is not one of the training "
            f"labels ({shown})"
        )
    full = tokenizer(text, pair)["input_ids"]
    encoded = tokenizer(text, pair, truncation=True, max_length=max_len)
    row = {"input_ids": list(encoded["input_ids"]), "labels": label_ids[label], "target_bytes": 0}
    if "token_type_ids" in encoded:
        row["token_type_ids"] = list(encoded["token_type_ids"])
    return row, len(full) > max_len


def _label_name(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _label_set(records: Sequence[Record], field_name: str) -> tuple[str, ...]:
    """The training labels, in a stable order: numerically if they are all integers."""
    names = {_label_name(r.get(field_name, "data.label_field")) for r in records}
    if len(names) < 2:
        raise DataError(
            f"{records[0].file}: field {field_name!r} has {len(names)} distinct label(s) in the training "
            "split; classification needs at least 2"
        )
    numeric = all(n.lstrip("-").isdigit() for n in names)
    return tuple(sorted(names, key=int if numeric else str))


# -- the split ---------------------------------------------------------------------------------------


def split_records(data_cfg) -> tuple[list[Record], list[bool], str]:
    """(records, which are val, how): val from data.val_source (training records with the same
    content left out), else the records whose content hash falls below data.val_fraction, so
    copies of one record always land on the same side."""
    records = read_records(data_cfg.source, data_cfg.max_record_bytes)
    if data_cfg.val_source:
        val = read_records(data_cfg.val_source, data_cfg.max_record_bytes)
        in_val = {r.digest() for r in val}
        train = [r for r in records if r.digest() not in in_val]
        if not train:
            raise DataError(f"{data_cfg.source}: every record is also in data.val_source {data_cfg.val_source}")
        how = f"val from {data_cfg.val_source}"
        if len(train) < len(records):
            how += f"; {len(records) - len(train)} training records also in val left out"
        return train + val, [False] * len(train) + [True] * len(val), how
    unit = [int.from_bytes(r.digest()[:8], "big") / 2**64 for r in records]
    is_val = [u < data_cfg.val_fraction for u in unit]
    if all(is_val) or not any(is_val):
        # Too few records for the fraction to give both splits one: the extreme hash moves over.
        if len(records) < 2:
            raise DataError(
                f"{data_cfg.source}: {len(records)} record; a train/val split needs at least 2 (or set data.val_source)"
            )
        extreme = max if any(is_val) else min
        moved = extreme(range(len(records)), key=unit.__getitem__)
        is_val[moved] = not is_val[moved]
    return records, is_val, f"{data_cfg.val_fraction:g} of the records by content hash"


# -- packing -----------------------------------------------------------------------------------------


def pack(rows: list[dict[str, Any]], seq_len: int) -> list[dict[str, Any]]:
    """Whole rows into packs of at most ``seq_len`` tokens, best-fit decreasing: longest first,
    each into the fullest pack it still fits (ties: the earliest pack), else a new one."""
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i]["input_ids"]), i))
    packs: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, pack), sorted
    for i in order:
        n = len(rows[i]["input_ids"])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            space, p = free.pop(k)
            packs[p].append(i)
            bisect.insort(free, (space - n, p))
        else:
            packs.append([i])
            bisect.insort(free, (seq_len - n, len(packs) - 1))
    return [_concat([rows[i] for i in members]) for members in packs]


def _concat(members: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"input_ids": [], "labels": [], "position_ids": [], "target_bytes": 0, "records": 0}
    for row in members:
        out["input_ids"] += row["input_ids"]
        # A record's first token is no target: what precedes it belongs to another record.
        out["labels"] += [IGNORE_INDEX, *row["labels"][1:]]
        out["position_ids"] += list(range(len(row["input_ids"])))
        out["target_bytes"] += row["target_bytes"]
        out["records"] += 1
    return out


def _fill(rows: list[dict[str, Any]], seq_len: int) -> float:
    return sum(len(r["input_ids"]) for r in rows) / max(1, len(rows) * seq_len)


def _loss_tokens(row: dict[str, Any], task: str) -> int:
    if task == "sequence_classification":
        return 1
    return sum(label != IGNORE_INDEX for label in row["labels"][1:])


# -- batches -----------------------------------------------------------------------------------------


class Collate:
    """Rows into one ``TokenBatch``, padded on the right to the longest row, or to ``width``
    tokens (pipeline stages exchange activations of one shape every step); a picklable
    callable, so DataLoader workers can use it."""

    def __init__(self, task: str, tokenizer, width: int = 0):
        self.task, self.width = task, width
        self.pad_id = pad_id(tokenizer)

    def __call__(self, rows: list[dict[str, Any]]) -> TokenBatch:
        import torch

        lengths = [len(r["input_ids"]) for r in rows]
        packed = "position_ids" in rows[0]
        batch = TokenBatch(
            input_ids=pad_rows([r["input_ids"] for r in rows], self.pad_id, self.width),
            labels=(
                torch.tensor([r["labels"] for r in rows])
                if self.task == "sequence_classification"
                else pad_rows([r["labels"] for r in rows], IGNORE_INDEX, self.width)
            ),
            lengths=lengths,
            loss_tokens=[_loss_tokens(r, self.task) for r in rows],
            target_bytes=[r["target_bytes"] for r in rows],
            fixed=bool(self.width),
        )
        if packed:
            # Padding after a pack is one more "record" of its own: positions restart there too.
            width = max(self.width, *lengths)
            batch.position_ids = pad_rows(
                [r["position_ids"] + list(range(width - len(r["position_ids"]))) for r in rows], 0
            )
        else:
            batch.attention_mask = pad_rows([[1] * n for n in lengths], 0, self.width)
        if "token_type_ids" in rows[0]:
            batch.token_type_ids = pad_rows([r["token_type_ids"] for r in rows], 0, self.width)
        return batch
