"""Prompts for reinforcement learning (GRPO): records with a ``prompt`` (text, or a chat rendered
with the tokenizer's chat template and its generation prompt, as TRL renders them) and any other
fields, which the reward function receives beside the completions (an ``answer`` to check
against, say). A batch is a ``PromptBatch``: the completions are sampled in the loss, so its rows
are prompts, and each prompt's group of completions stays in one micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.data.batch import RowBatch
from kiln.data.corpus import DataError
from kiln.data.finetune import Examples, split_records, split_rows
from kiln.data.records import Record


@dataclass
class PromptBatch(RowBatch):
    """Prompts as token ids (host-side lists: each is sampled from on its own), their text and
    each record's other fields."""

    prompt_ids: list[list[int]]
    prompts: list[Any]
    fields: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def count(self) -> int:
        return len(self)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.prompt_ids))

    def to(self, device: torch.device, non_blocking: bool = True) -> PromptBatch:
        return self

    def pin_memory(self) -> PromptBatch:
        return self

    def split_rows(self, size: int) -> list[PromptBatch]:
        return [
            PromptBatch(self.prompt_ids[i : i + size], self.prompts[i : i + size], self.fields[i : i + size])
            for i in range(0, len(self), size)
        ]


@dataclass
class PromptData:
    train: Examples
    val: Examples
    collate: Callable[[list[dict[str, Any]]], PromptBatch]
    manifest: dict[str, Any]


def prompt_row(record: Record, tokenizer, max_len: int) -> tuple[dict[str, Any], bool]:
    """A record as (row, truncated): its prompt's token ids (the last ``max_len``, so that the
    prompt's end, where the completion starts, is kept), the prompt itself and the other fields."""
    prompt = record.get("prompt", "the prompt field")
    if isinstance(prompt, str):
        ids = list(tokenizer(text=prompt)["input_ids"])
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                f"{record.where}: field 'prompt' is a chat, but the model's tokenizer has no chat template; "
                "give text prompts instead"
            )
        ids = list(
            tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )
    else:
        raise DataError(
            f"{record.where}: field 'prompt' must be a string or a list of {{role, content}} messages, "
            f"got {type(prompt).__name__}"
        )
    fields = {k: v for k, v in record.fields.items() if k != "prompt"}
    return {"prompt_ids": ids[-max_len:], "prompt": prompt, "fields": fields}, len(ids) > max_len


def prompt_collate(rows: list[dict[str, Any]]) -> PromptBatch:
    return PromptBatch([r["prompt_ids"] for r in rows], [r["prompt"] for r in rows], [r["fields"] for r in rows])


def prepare_prompts(data_cfg, tokenizer, max_len: int) -> PromptData:
    """Read, split and tokenize the prompts of ``data_cfg.source``; DataError on the first bad
    record, naming its file, line and field. ``max_len`` is what the prompt may take of the
    context (the rest is the completions')."""
    records, is_val, split = split_records(data_cfg)
    made = [prompt_row(r, tokenizer, max_len) for r in records]
    rows, manifest = split_rows(made, is_val, "prompts", split, data_cfg, max_len)
    return PromptData(Examples(rows["train"]), Examples(rows["val"]), prompt_collate, manifest)
