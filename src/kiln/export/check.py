"""What an export is checked on: real validation inputs of the run, the largest logit difference
between an artifact and the PyTorch model, the task's metric (perplexity, or a classifier's
accuracy), and CPU latency per token.

Every artifact is seen the same way, as a function from token ids [B, T] to logits (``Logits``):
an exported program, an AOTInductor package, an ONNX Runtime session or a ``transformers`` model.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import Config
from kiln.data import DataError, TokenSequences, prepare

# Defined below the exporters, where a model family can raise it too.
from kiln.models.family import ExportError as ExportError

Logits = Callable[[torch.Tensor], torch.Tensor | np.ndarray]  # ONNX Runtime gives NumPy arrays


class AsLogits(nn.Module):
    """A model whose forward takes token ids [B, T] alone and returns its logits: kiln's GPT and
    the hf family's wrappers already do; this gives the exporters one positional input."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


@dataclasses.dataclass
class Inputs:
    """Validation inputs of a run: ``rows`` of token ids (each [1, T]: records are unpadded so that
    no attention mask is needed), ``labels`` for a classifier, and where they came from."""

    rows: list[torch.Tensor]
    labels: list[int] | None
    source: str
    seq_len: int

    def halves(self) -> tuple[Inputs, list[torch.Tensor]]:
        """The first half of the rows, to measure on, and the other half, to calibrate with."""
        half = len(self.rows) // 2
        measured = dataclasses.replace(
            self,
            rows=self.rows[:half],
            labels=self.labels[:half] if self.labels else None,
            source=f"{self.source}; the metric on {half} of them, the others calibrated the int8 model",
        )
        return measured, self.rows[half:]

    def batch(self, n: int, length: int | None = None) -> torch.Tensor:
        """n rows cut to one length (the shortest of them, or ``length``), as [n, length]."""
        rows = self.rows[:n]
        length = min([length or self.seq_len, *(r.size(1) for r in rows)])
        return torch.cat([r[:, :length] for r in rows])


def validation_inputs(cfg: Config, tokenizer: Any, run_dir: Path, rows: int = 32) -> Inputs:
    """Up to ``rows`` validation rows of the run of ``cfg`` in ``run_dir``: token sequences of
    data.seq_len from its val split (a language model trained on text), or its validation records
    (a fine-tuning run), tokenized by its ``tokenizer``."""
    if hasattr(tokenizer, "save_pretrained"):
        val, labels = _validation_records(cfg, tokenizer, rows)
        if not val:
            raise DataError(f"{cfg.data.source}: no validation records to check the export on")
        ids = [torch.tensor([r]) for r in val]
        return Inputs(ids, labels, f"{len(val)} validation records of {cfg.data.source}", cfg.data.seq_len)
    data_cfg = dataclasses.replace(cfg.data, tokenizer=str(run_dir / "tokenizer.json"))
    sequences = TokenSequences(prepare(data_cfg, progress=False).tokens("val"), cfg.data.seq_len)
    n = min(rows, len(sequences))
    if n == 0:
        raise DataError(f"{cfg.data.source}: the validation split is shorter than data.seq_len={cfg.data.seq_len}")
    # Spread over the split, not its first documents only.
    picks = [int(i * len(sequences) / n) for i in range(n)]
    ids = [torch.as_tensor(sequences[i][0], dtype=torch.long)[None] for i in picks]
    return Inputs(ids, None, f"{n} sequences of {cfg.data.seq_len} tokens from the val split", cfg.data.seq_len)


def _validation_records(cfg: Config, tokenizer: Any, rows: int) -> tuple[list[list[int]], list[int] | None]:
    """Token ids of up to ``rows`` validation records of a fine-tuning run, as its objective reads
    them (a preference pair: its prompt and chosen answer; GRPO: its prompt), and their class ids
    for a classifier."""
    objective = cfg.train.objective
    if objective == "grpo":
        from kiln.data.prompts import prepare_prompts

        prompts = prepare_prompts(cfg.data, tokenizer, cfg.data.seq_len).val.rows[:rows]
        return [r["prompt_ids"] for r in prompts], None
    if objective != "sft":
        from kiln.data.preference import prepare_preference

        pairs = prepare_preference(cfg.data, tokenizer, cfg.data.seq_len, kto=objective == "kto").val.rows[:rows]
        return [r["prompt_ids"] + r["chosen_ids"] for r in pairs], None
    from kiln.data.finetune import prepare_finetune

    val = prepare_finetune(cfg.data, cfg.model.task, tokenizer, cfg.data.seq_len).val.rows[:rows]
    labels = [int(r["labels"]) for r in val] if cfg.model.task == "sequence_classification" else None
    return [r["input_ids"] for r in val], labels


@torch.no_grad()
def logit_difference(
    reference: Callable[[torch.Tensor], torch.Tensor], artifact: Logits, batches: list[torch.Tensor]
) -> dict[str, float]:
    """The largest absolute difference of the logits over ``batches``, and the same relative to the
    largest logit magnitude (an element-wise ratio explodes where a logit is near zero)."""
    worst, scale = 0.0, 0.0
    for ids in batches:
        expected, got = reference(ids).float(), torch.as_tensor(artifact(ids)).float()
        worst = max(worst, (got - expected).abs().max().item())
        scale = max(scale, expected.abs().max().item())
    return {"max_abs_diff": worst, "max_rel_diff": worst / max(scale, 1e-12)}


@torch.no_grad()
def task_metric(logits: Logits, inputs: Inputs) -> dict[str, float]:
    """A classifier's accuracy, or a language model's perplexity of next tokens, over the rows."""
    if inputs.labels is not None:
        pairs = zip(inputs.rows, inputs.labels, strict=True)
        right = sum(int(torch.as_tensor(logits(ids)).argmax(-1).item() == y) for ids, y in pairs)
        return {"accuracy": right / len(inputs.rows)}
    total, count = 0.0, 0
    for ids in inputs.rows:
        out = torch.as_tensor(logits(ids)).float()[:, :-1]
        total += F.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids.size(1) - 1
    return {"perplexity": math.exp(total / count)}


@torch.no_grad()
def latency_per_token(logits: Logits, ids: torch.Tensor, repeats: int = 10) -> float:
    """Seconds per token of one batch-1 forward over ``ids`` [1, T] (the median of ``repeats``,
    after a warm-up), on the CPU threads torch is set to use."""
    logits(ids)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logits(ids)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / ids.size(1)
