"""Evaluation of fine-tuned models, streaming: each batch is reduced to sums (loss, tokens, bytes,
a confusion matrix) on the device and dropped, so no logits outlive their batch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kiln.data.batch import TokenBatch

LossFn = Callable[[nn.Module, TokenBatch], torch.Tensor]


@torch.no_grad()
def evaluate_causal_lm(
    model: nn.Module, loss_fn: LossFn, batches: Sequence[TokenBatch], device: torch.device
) -> dict[str, float]:
    """Loss per counted token, perplexity, and bits per byte of the targets' text."""
    nats = torch.zeros((), device=device, dtype=torch.float64)
    tokens = nbytes = 0
    for batch in batches:
        if batch.count:
            nats += loss_fn(model, batch.to(device)).double() * batch.count
        tokens += batch.count
        nbytes += sum(batch.target_bytes)
    loss = nats.item() / max(1, tokens)
    out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
    if nbytes:
        out["val_bpb"] = nats.item() / (math.log(2) * nbytes)
    return out


@torch.no_grad()
def evaluate_classifier(
    model: nn.Module, batches: Sequence[TokenBatch], device: torch.device, labels: Sequence[str]
) -> dict:
    """Loss, accuracy, macro-F1, per-class precision/recall/F1 and the confusion matrix (rows: the
    true class, columns: the predicted one)."""
    k = len(labels)
    confusion = torch.zeros(k, k, dtype=torch.int64, device=device)
    nats = torch.zeros((), device=device, dtype=torch.float64)
    for batch in batches:
        batch = batch.to(device)
        logits = model(batch.input_ids, attention_mask=batch.attention_mask, token_type_ids=batch.token_type_ids)
        nats += F.cross_entropy(logits.float(), batch.labels, reduction="sum").double()
        confusion.view(-1).index_add_(0, batch.labels * k + logits.argmax(-1), torch.ones_like(batch.labels))
    counts = confusion.tolist()
    total = sum(map(sum, counts))
    out: dict = {"val_loss": nats.item() / max(1, total), **classification_metrics(counts, labels)}
    out["val_confusion"] = counts
    return out


def classification_metrics(confusion: list[list[int]], labels: Sequence[str]) -> dict[str, float]:
    """Accuracy and, as scikit-learn computes them, macro-F1 over the classes that occur as a true or
    a predicted label, and each class's precision, recall and F1 (0 where undefined)."""
    k = len(labels)
    total = sum(map(sum, confusion))
    true = [sum(confusion[i]) for i in range(k)]
    predicted = [sum(confusion[i][j] for i in range(k)) for j in range(k)]
    out = {"val_accuracy": sum(confusion[i][i] for i in range(k)) / max(1, total)}
    f1s = []
    for i, name in enumerate(labels):
        tp = confusion[i][i]
        precision = tp / predicted[i] if predicted[i] else 0.0
        recall = tp / true[i] if true[i] else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        out.update({f"val_precision/{name}": precision, f"val_recall/{name}": recall, f"val_f1/{name}": f1})
        if true[i] or predicted[i]:
            f1s.append(f1)
    out["val_macro_f1"] = sum(f1s) / max(1, len(f1s))
    return out
