"""Preference pairs for DPO-style training: records of a prompt, a chosen and a rejected answer,
tokenized exactly as TRL's DPOTrainer does, so a model tuned here sees the tokens it would there.

A record is text (``{"prompt": str, "chosen": str, "rejected": str}``) or a chat (each field a
list of ``{role, content}`` messages, rendered with the tokenizer's chat template). Text answers
end with the tokenizer's eos token (added when missing); prompt, prompt+chosen and prompt+rejected
are tokenized whole, and the answers start where the prompt's tokens and each whole's first
differ (a template may render the prompt alone differently, and tokens may merge across the
boundary). A row longer than ``max_len`` keeps its start; a pair whose answer would then keep no
token to learn from is an error naming its file, line and field, never a silent drop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.data.batch import PairBatch, TokenBatch, pad_id, pad_rows
from kiln.data.corpus import DataError
from kiln.data.finetune import Examples, split_records, split_rows
from kiln.data.records import Record
from kiln.labels import IGNORE_INDEX

# The fields of a pair (TRL's names), and what each holds, for errors about them.
FIELDS = {
    "prompt": "the prompt of a preference pair",
    "chosen": "the preferred answer",
    "rejected": "the other answer",
    "completion": "the answer",
    "label": "whether the answer is desirable",
}
ANSWERS = ("chosen", "rejected")
# KTO's records (TRL's unpaired preference format): one answer, labelled desirable or not.
KTO_ANSWERS = ("completion",)


@dataclass
class PreferenceData:
    train: Examples
    val: Examples
    collate: Callable[[list[dict[str, Any]]], PairBatch]
    manifest: dict[str, Any] = field(default_factory=dict)


def prepare_preference(data_cfg, tokenizer, max_len: int, *, kto: bool = False) -> PreferenceData:
    """Read, split and tokenize the pairs of ``data_cfg.source`` (``kto``: its labelled answers);
    DataError on the first bad record, naming its file, line and field."""
    records, is_val, split = split_records(data_cfg)
    # Rows are made in file order, so an error names the first bad record whatever its split.
    made = [kto_row(r, tokenizer, max_len) if kto else preference_row(r, tokenizer, max_len) for r in records]
    rows, manifest = split_rows(made, is_val, "kto" if kto else "preference", split, data_cfg, max_len)
    for part in rows.values():
        for i, row in enumerate(part):
            row["index"] = i
            if kto:
                # TRL's KL rows: each prompt with the answer before it in its split (the first with
                # the last), so the baseline sees the same answers as the rewards, mismatched.
                row["rejected_ids"] = part[i - 1]["chosen_ids"][: max(0, max_len - len(row["prompt_ids"]))]
                row["rejected_bytes"] = 0
    answers = ("chosen",) if kto else ANSWERS
    manifest["loss_tokens"] = {
        name: {answer: sum(_targets(r, answer) for r in rs) for answer in answers} for name, rs in rows.items()
    }
    return PreferenceData(Examples(rows["train"]), Examples(rows["val"]), PairCollate(tokenizer), manifest)


def kto_row(record: Record, tokenizer, max_len: int) -> tuple[dict[str, Any], bool]:
    """A KTO record ``{prompt, completion, label}`` as (row, truncated), tokenized as TRL's
    KTOTrainer does: the answer in ``chosen_ids``/``chosen_bytes``, the label in ``desirable``
    (true or false; 1 or 0 and "true"/"false" as a CSV gives them)."""
    row, cut = preference_row(record, tokenizer, max_len, KTO_ANSWERS)
    label = record.get("label", FIELDS["label"])
    truth = {True: True, False: False, "true": True, "false": False}  # 1 and 0 are True and False as keys
    key = label.strip().lower() if isinstance(label, str) else label
    if isinstance(key, float) or key not in truth:
        raise DataError(f"{record.where}: field 'label' must be true or false, got {label!r}")
    return {
        "prompt_ids": row["prompt_ids"],
        "chosen_ids": row["completion_ids"],
        "chosen_bytes": row["completion_bytes"],
        "desirable": truth[key],
    }, cut


def preference_row(
    record: Record, tokenizer, max_len: int, answers: tuple[str, ...] = ANSWERS
) -> tuple[dict[str, Any], bool]:
    """A record as (row, truncated): ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` cut so
    that prompt + answer keeps its first ``max_len`` tokens, and the UTF-8 bytes each answer's
    targets stand for (``chosen_bytes``, ``rejected_bytes``). ``prepare_preference`` adds the
    row's ``index`` in its split."""
    values = {name: record.get(name, FIELDS[name]) for name in ("prompt", *answers)}
    if isinstance(values["prompt"], list):
        whole = _chat_ids(record, values, tokenizer, answers)
    elif isinstance(values["prompt"], str):
        whole = _text_ids(record, values, tokenizer, answers)
    else:
        raise DataError(
            f"{record.where}: field 'prompt' must be a string or a list of {{role, content}} messages, "
            f"got {type(values['prompt']).__name__}"
        )
    prompt_ids = whole["prompt"]
    prompt_len = min(_common_prefix(prompt_ids, whole[answer]) for answer in answers)
    row: dict[str, Any] = {"prompt_ids": prompt_ids[:prompt_len]}
    cut = False
    for answer in answers:
        ids = whole[answer][prompt_len:]
        kept = ids[: max(0, max_len - prompt_len)]
        cut |= len(kept) < len(ids)
        row[f"{answer}_ids"] = kept
        # The first token of a row is no target (nothing precedes it), as in the model's shifted loss.
        targets = kept[1:] if prompt_len == 0 else kept
        if not targets:
            why = (
                f"its first {max_len} tokens (data.seq_len) are all prompt"
                if len(kept) < len(ids)
                else "it adds no token to the prompt"
            )
            raise DataError(f"{record.where}: field {answer!r} gives no token to learn from: {why}")
        row[f"{answer}_bytes"] = len(tokenizer.decode(targets).encode())
    return row, cut


def _text_ids(record: Record, values: dict[str, Any], tokenizer, answers: tuple[str, ...]) -> dict[str, list[int]]:
    """Token ids of the prompt and of prompt + each answer, text as TRL tokenizes it: special
    tokens added, each answer ending with the eos token."""
    for name in answers:
        if not isinstance(values[name], str):
            kind = type(values[name]).__name__
            raise DataError(f"{record.where}: field {name!r} must be a string, as field 'prompt' is; got {kind}")
    eos = tokenizer.eos_token
    ids = {"prompt": list(tokenizer(text=values["prompt"])["input_ids"])}
    for name in answers:
        answer = values[name] if not eos or values[name].endswith(eos) else values[name] + eos
        ids[name] = list(tokenizer(text=values["prompt"] + answer)["input_ids"])
    return ids


def _chat_ids(record: Record, values: dict[str, Any], tokenizer, answers: tuple[str, ...]) -> dict[str, list[int]]:
    """Token ids of the prompt (with the generation prompt) and of prompt + each answer, rendered
    with the chat template as TRL renders them."""
    from jinja2 import TemplateError

    for name in values:
        messages = values[name]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DataError(f"{record.where}: field {name!r} must be a list of {{role, content}} messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{record.where}: field 'prompt' is a chat, but the model's tokenizer has no chat template; "
            "give text records instead"
        )
    ids = {}
    for name, messages, generation in (
        ("prompt", values["prompt"], True),
        *((name, values["prompt"] + values[name], False) for name in answers),
    ):
        try:
            encoded = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=generation
            )
        except TemplateError as e:
            raise DataError(f"{record.where}: field {name!r}: the chat template cannot render it: {e}") from None
        ids[name] = list(encoded["input_ids"])
    return ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _targets(row: dict[str, Any], answer: str) -> int:
    """Tokens of ``answer`` the loss covers: all of it, but the row's first token."""
    return len(row[f"{answer}_ids"]) - (not row["prompt_ids"])


class PairCollate:
    """Rows into one ``PairBatch``: each half's rows are prompt + answer, padded on the right to
    the half's longest, labelled on the answer only (a picklable callable, so DataLoader workers
    can use it)."""

    def __init__(self, tokenizer):
        self.pad_id = pad_id(tokenizer)

    def __call__(self, rows: list[dict[str, Any]]) -> PairBatch:
        desirable = [r["desirable"] for r in rows] if rows and "desirable" in rows[0] else None
        return PairBatch(
            self._half(rows, "chosen"), self._half(rows, "rejected"), [r["index"] for r in rows], desirable
        )

    def _half(self, rows: list[dict[str, Any]], answer: str) -> TokenBatch:
        ids = [r["prompt_ids"] + r[f"{answer}_ids"] for r in rows]
        lengths = [len(i) for i in ids]
        return TokenBatch(
            input_ids=pad_rows(ids, self.pad_id),
            labels=pad_rows([[IGNORE_INDEX] * len(r["prompt_ids"]) + r[f"{answer}_ids"] for r in rows], IGNORE_INDEX),
            attention_mask=pad_rows([[1] * n for n in lengths], 0),
            lengths=lengths,
            loss_tokens=[_targets(r, answer) for r in rows],
            target_bytes=[r[f"{answer}_bytes"] for r in rows],
        )
