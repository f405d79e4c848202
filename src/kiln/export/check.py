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

from kiln.data import DataError

# Defined below the exporters, where a model family can raise it too.
from kiln.models.family import ExportError as ExportError
from kiln.train.jobs import FamilyJob

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


def validation_inputs(job: FamilyJob, tokenizer: Any, run_dir: Path, rows: int = 32) -> Inputs:
    """Up to ``rows`` validation rows of the run of ``job`` in ``run_dir``, as the job reads them
    (``Job.validation_rows``: token sequences of its val split, or its validation records),
    tokenized by its ``tokenizer``."""
    val = job.validation_rows(tokenizer, run_dir, rows)
    if not val.ids:
        raise DataError(f"{job.cfg.data.source}: no validation records to check the export on")
    return Inputs([torch.tensor([r]) for r in val.ids], val.labels, val.source, job.cfg.data.seq_len)


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
