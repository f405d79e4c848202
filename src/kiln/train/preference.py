"""Preference objectives: DPO (sigmoid, hinge, robust), IPO, SimPO and ORPO on pairs of completions,
and KTO on answers labelled desirable or not.

A micro-batch is a ``PairBatch``: pair i's chosen and rejected completions sit in the same
micro-batch, and the loss is the mean over its pairs, so the loop's token-exact weighing (by
pairs here) makes accumulation and the number of ranks leave the gradient unchanged. A
completion's log-probability is the sum over exactly its labelled tokens (prompt and padding are
-100), computed in fp32.

The reference model of DPO, IPO and KTO is either the trained model with its LoRA adapters off (no
second copy), or the initial model's log-probabilities of every pair, computed once before the
first step in the run's own layout (every rank computes all pairs in one order, so sharded
forwards stay in step) and kept in the run directory for a resumed run. Formulas follow the
papers as TRL 1.16 writes them (``DPOTrainer``; SimPO is its ``CPOTrainer`` with ``cpo_alpha=0``),
and the logged metrics carry TRL's names. ORPO's likelihood term is the paper's, over the chosen
completion only (the mean over pairs of each one's per-token mean, exact under accumulation);
TRL's ``ORPOTrainer`` takes it over the prompt's tokens too.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import Config
from kiln.data.batch import PairBatch, TokenBatch, next_labels
from kiln.data.finetune import Examples
from kiln.distributed.parallel import Staged
from kiln.distributed.world import World
from kiln.io import write_atomic
from kiln.labels import IGNORE_INDEX
from kiln.train.logps import completion_logps

REFERENCE_FILE = "reference_logps.pt"
# The preference objectives (each a run.job), and those that compare the policy with a reference model.
OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "kto")
WITH_REFERENCE = ("dpo", "ipo", "kto")
UNPAIRED = ("kto",)  # on {prompt, completion, label} records: one answer, labelled desirable or not
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def pair_logps(model: nn.Module, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probabilities and their token counts, one forward for both:
    the halves are padded to one width and stacked, as TRL does."""
    width = max(batch.chosen.input_ids.size(1), batch.rejected.input_ids.size(1))
    both = TokenBatch(
        input_ids=torch.cat([pad_to(batch.chosen.input_ids, width, 0), pad_to(batch.rejected.input_ids, width, 0)]),
        labels=torch.cat(
            [pad_to(batch.chosen.labels, width, IGNORE_INDEX), pad_to(batch.rejected.labels, width, IGNORE_INDEX)]
        ),
        attention_mask=torch.cat(
            [pad_to(batch.chosen.attention_mask, width, 0), pad_to(batch.rejected.attention_mask, width, 0)]
        ),
    )
    logps, counts = completion_logps(model, both)
    n = len(batch)
    return logps[:n], logps[n:], counts[:n], counts[n:]


def _interleaved(batch: PairBatch, width: int) -> TokenBatch:
    """Pair i's chosen row at 2i and its rejected row at 2i + 1, padded to ``width``."""

    def rows(name: str, value: int) -> torch.Tensor:
        halves = [pad_to(getattr(half, name), width, value) for half in (batch.chosen, batch.rejected)]
        return torch.stack(halves, 1).flatten(0, 1)

    return TokenBatch(rows("input_ids", 0), rows("labels", IGNORE_INDEX), rows("attention_mask", 0))


def pad_to(t: torch.Tensor | None, width: int, value: int) -> torch.Tensor:
    """Rows [B, T] padded on the right with ``value`` to ``width`` (what pipeline stages take: one
    shape every step)."""
    assert t is not None  # preference and sampled rows are padded, never packed: they carry an attention mask
    return F.pad(t, (0, width - t.size(1)), value=value)


class PreferenceLoss:
    """``loss(model, batch)``: the mean preference loss of a micro-batch's pairs. Also sums, on
    the device, what the log reports (``metrics``), without a host sync. Compiled, its model's
    layers are (``ParallelModel.compile``), as it runs the reference's forward too."""

    compiled_by_layer = True

    def __init__(self, cfg: Config, reference: AdaptersOff | Precomputed | None):
        self.objective, self.p = cfg.run.job, cfg.preference
        self.reference = reference
        self.width = cfg.data.seq_len  # of the rows pipeline stages exchange
        self.sums: torch.Tensor | None = None  # the stats' sums over the interval, and its pairs

    def __call__(self, model: nn.Module, batch: PairBatch) -> torch.Tensor:
        return self._counted(*self.per_pair(model, batch))

    def _counted(self, losses: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """The mean of ``losses``, with each column of ``stats`` summed and their number counted
        over the interval."""
        sums = torch.cat([stats.sum(0), torch.tensor([len(stats)], device=stats.device, dtype=stats.dtype)])
        self.sums = sums if self.sums is None else self.sums + sums
        return losses.mean()

    def per_pair(self, model: nn.Module, batch: PairBatch, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss [pairs] and what the metrics sum [pairs, columns] (detached)."""
        if self.objective == "kto":
            return self._kto(model, batch, split)
        chosen, rejected, n_chosen, n_rejected = pair_logps(model, batch)
        reference = self.reference.logps(model, batch, split) if self.reference is not None else None
        return self._pairs(chosen, rejected, n_chosen, n_rejected, reference)

    def staged(self, model: nn.Module, batch: PairBatch) -> Staged:
        """The micro-batch as pipeline stages take it: each pair's chosen and rejected rows next to
        each other (the schedule's pieces keep pairs whole), padded to ``data.seq_len`` (one
        shape every step), the last stage giving each token's log-probability; the target holds
        each row's scored tokens and its reference log-probability, computed first with
        ``model``, the pipeline's forward."""
        if self.sums is None:  # every rank's, for the mean of metrics only the last stage counts
            self.sums = torch.zeros(len(METRICS) + 1 + (self.objective == "kto"), device=batch.chosen.input_ids.device)
        if self.objective == "kto":
            return self._staged_kto(model, batch)
        both = _interleaved(batch, self.width)
        zeros = torch.zeros(len(batch), device=both.input_ids.device)
        reference = self.reference.logps(model, batch, "train") if self.reference is not None else (zeros, zeros)
        counts = (both.labels[:, 1:] != IGNORE_INDEX).sum(1)
        target = torch.stack([counts.float(), torch.stack(reference, 1).flatten().float()], 1)
        keywords = {"targets": next_labels(both.labels), "attention_mask": both.attention_mask, "token_logps": True}

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logps, counts, reference = output.sum(1), target[:, 0], target[:, 1]
            paired = (reference[0::2], reference[1::2]) if self.reference is not None else None
            return self._counted(*self._pairs(logps[0::2], logps[1::2], counts[0::2], counts[1::2], paired))

        return Staged(both.input_ids, target, keywords, loss, count=lambda target: target.new_tensor(len(target) // 2))

    def _staged_kto(self, model: nn.Module, batch: PairBatch) -> Staged:
        """KTO's answers as pipeline stages take them, with the micro-batch's KL baseline computed
        first (``model``: the pipeline's forward) and carried in the target."""
        rows = batch.chosen
        ref, kl, good = self._kto_baseline(model, batch, "train")
        target = torch.stack([ref.float(), kl.float().expand_as(ref), good.float()], 1)
        keywords = {
            "targets": next_labels(pad_to(rows.labels, self.width, IGNORE_INDEX)),
            "attention_mask": pad_to(rows.attention_mask, self.width, 0),
            "token_logps": True,
        }

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return self._counted(*self._kto_losses(output.sum(1), target[:, 0], target[0, 1], target[:, 2].bool()))

        inputs = pad_to(rows.input_ids, self.width, 0)
        return Staged(inputs, target, keywords, loss, count=lambda target: target.new_tensor(len(target)))

    def _pairs(
        self,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        n_chosen: torch.Tensor,
        n_rejected: torch.Tensor,
        reference: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss and metrics from its completions' summed log-probabilities, their
        token counts and (DPO, IPO) the reference's log-probabilities."""
        p = self.p
        if self.objective in ("simpo", "orpo"):
            # Per-token mean log-probabilities, and no reference.
            mean_chosen, mean_rejected = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
            if self.objective == "simpo":
                losses = _smoothed(p.beta * (mean_chosen - mean_rejected - p.gamma / p.beta), p.label_smoothing)
            else:
                # The chosen completion's likelihood, and the log odds ratio of chosen over rejected
                # (odds p / (1 - p) of the mean token probability p), as TRL's ORPOTrainer writes it.
                log_odds = (mean_chosen - mean_rejected) - (_log1mexp(mean_chosen) - _log1mexp(mean_rejected))
                losses = -mean_chosen - p.beta * F.logsigmoid(log_odds)
            reward_chosen, reward_rejected = p.beta * mean_chosen, p.beta * mean_rejected
        else:
            assert reference is not None  # dpo and ipo are given one
            ref_chosen, ref_rejected = reference
            chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
            delta = chosen_ratio - rejected_ratio
            if self.objective == "ipo":
                # TRL's (and the IPO authors') normalisation: per completion token.
                avg = chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1)
                losses = (avg - 1 / (2 * p.beta)) ** 2
            elif p.loss_type == "hinge":
                losses = torch.relu(1 - p.beta * delta)
            elif p.loss_type == "robust":
                ls = p.label_smoothing
                losses = (-(1 - ls) * F.logsigmoid(p.beta * delta) + ls * F.logsigmoid(-p.beta * delta)) / (1 - 2 * ls)
            else:
                losses = _smoothed(p.beta * delta, p.label_smoothing)
            reward_chosen, reward_rejected = p.beta * chosen_ratio, p.beta * rejected_ratio
        reward_chosen, reward_rejected = reward_chosen.detach(), reward_rejected.detach()
        stats = torch.stack(
            [
                reward_chosen,
                reward_rejected,
                (reward_chosen > reward_rejected).to(reward_chosen.dtype),
                reward_chosen - reward_rejected,
                chosen.detach(),
                rejected.detach(),
            ],
            dim=1,
        )
        return losses, stats

    def _kto(self, model: nn.Module, batch: PairBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """KTO (Ethayarajh et al. 2024), as TRL's KTOTrainer computes it: each answer's reward is
        beta times its log-ratio to the reference; a desirable answer's loss is 1 - sigmoid(reward -
        beta z), an undesirable one's 1 - sigmoid(beta z - reward), with z the micro-batch's mean
        log-ratio of its mismatched prompt + answer rows (``batch.rejected``), clamped at 0 and not
        differentiated."""
        logps, _ = completion_logps(model, batch.chosen)
        ref, kl, good = self._kto_baseline(model, batch, split)
        return self._kto_losses(logps, ref, kl, good)

    def _kto_baseline(self, model: nn.Module, batch: PairBatch, split: str) -> tuple[torch.Tensor, ...]:
        """The reference's log-probabilities of the answers, the KL baseline (clamped at 0, not
        differentiated) and which answers are desirable."""
        assert self.reference is not None and batch.desirable is not None  # kto is given both
        with torch.no_grad():
            kl_logps, _ = completion_logps(model, batch.rejected)
        ref, ref_kl = self.reference.logps(model, batch, split)
        kl = (kl_logps - ref_kl).mean().clamp(min=0)
        return ref, kl, torch.as_tensor(batch.desirable, device=ref.device)

    def _kto_losses(
        self, logps: torch.Tensor, ref: torch.Tensor, kl: torch.Tensor, good: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.p
        ratio = logps - ref
        losses = torch.where(
            good,
            p.desirable_weight * (1 - torch.sigmoid(p.beta * (ratio - kl))),
            p.undesirable_weight * (1 - torch.sigmoid(p.beta * (kl - ratio))),
        )
        reward, logps = p.beta * ratio.detach(), logps.detach()
        d = good.to(reward.dtype)
        stats = torch.stack([reward * d, reward * (1 - d), d, 1 - d, logps * d, logps * (1 - d), kl.expand_as(d)], 1)
        return losses, stats

    def _finish(self, sums: list[float], prefix: str = "") -> dict[str, float]:
        """The metrics from their sums over examples (the last sum: how many)."""
        n = max(sums[-1], 1e-12)
        if self.objective != "kto":
            return {f"{prefix}{name}": value / n for name, value in zip(METRICS, sums, strict=False)}
        good, bad = max(sums[2], 1e-12), max(sums[3], 1e-12)
        out = {"rewards/chosen": sums[0] / good, "rewards/rejected": sums[1] / bad}
        out |= {"rewards/margins": out["rewards/chosen"] - out["rewards/rejected"]}
        out |= {"logps/chosen": sums[4] / good, "logps/rejected": sums[5] / bad, "kl": sums[6] / n}
        return {f"{prefix}{name}": value for name, value in out.items()}

    def metrics(self, world: World) -> dict[str, float]:
        """The interval's means (over its pairs, on every rank), and a new interval."""
        if self.sums is None:
            return {}
        sums, self.sums = world.mean(self.sums), None
        return self._finish(sums.tolist())

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Sequence[PairBatch], device: torch.device) -> dict[str, float]:
        """``val_loss`` (the objective's, over the validation pairs) and the metrics as ``val_``."""
        total: torch.Tensor | None = None
        loss = torch.zeros((), device=device, dtype=torch.float64)
        pairs = 0
        for batch in batches:
            batch = batch.to(device)
            losses, stats = self.per_pair(model, batch, "val")
            loss += losses.double().sum()
            total = stats.double().sum(0) if total is None else total + stats.double().sum(0)
            pairs += len(batch)
        if total is None:
            return {}
        return {"val_loss": loss.item() / pairs, **self._finish([*total.tolist(), pairs], "val_")}


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _smoothed(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid, with the preference flipped with probability ``label_smoothing`` (cDPO)."""
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


class AdaptersOff:
    """The reference is the trained model with its LoRA adapters switched off: at the start the
    adapters add exactly nothing, so this is the initial model, without a copy of it."""

    def logps(self, model: nn.Module, batch: PairBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), adapters_disabled(model):
            chosen, rejected, _, _ = pair_logps(model, batch)
        return chosen, rejected


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Every PEFT adapter layer of ``model`` off for the block (PEFT's own switch, per layer, so it
    works on a PEFT model and on layers injected into kiln's GPT alike)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class Precomputed:
    """The initial model's log-probabilities of every train and val pair, looked up by the pair's
    index. Computed at the first use (before the first step: the probe of the micro-batch or the
    first forward), by every rank over all pairs in one order, under the run's precision; rank 0
    keeps them in the run directory (when there is one) with a fingerprint of what they depend
    on, and a resumed run (whose model has moved on) reads them back from there."""

    def __init__(
        self,
        run_dir: Path,
        fingerprint: dict[str, Any],
        splits: dict[str, Examples],
        collate: Callable[[list[dict[str, Any]]], PairBatch],
        batch_size: int,
        world: World,
        *,
        computes: bool = True,
    ):
        self.path, self.world, self.computes = run_dir / REFERENCE_FILE, world, computes
        self.fingerprint = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
        self.splits, self.collate, self.batch_size = splits, collate, batch_size
        self.table: dict[str, torch.Tensor] | None = None  # split -> [pairs, 2] (chosen, rejected)

    def logps(self, model: nn.Module, batch: PairBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is None:
            self.table = self._load()
        if self.table is None:
            if not self.computes:
                raise FileNotFoundError(
                    f"{self.path}: the reference log-probabilities of this run are missing or belong to other data; "
                    "they are computed only at the start of training"
                )
            self.table = self._compute(model)
        rows = self.table[split][torch.as_tensor(batch.index)].to(batch.chosen.input_ids.device)
        return rows[:, 0], rows[:, 1]

    def _load(self) -> dict[str, torch.Tensor] | None:
        if not self.path.exists():
            return None
        saved = torch.load(self.path, map_location="cpu", weights_only=True)
        sizes = {split: len(data) for split, data in self.splits.items()}
        if saved.get("fingerprint") != self.fingerprint or {k: len(v) for k, v in saved["logps"].items()} != sizes:
            return None
        return saved["logps"]

    @torch.no_grad()
    def _compute(self, model: nn.Module) -> dict[str, torch.Tensor]:
        device = next(p.device for p in model.parameters())
        training = model.training
        model.eval()  # the reference is the model itself, not a draw of its dropout
        table = {}
        for split, data in self.splits.items():
            parts = []
            for batch in data.batches(self.collate, self.batch_size):
                chosen, rejected, _, _ = pair_logps(model, batch.to(device))
                parts.append(torch.stack([chosen, rejected], dim=1).float().cpu())
            table[split] = torch.cat(parts) if parts else torch.zeros(0, 2)
        model.train(training)
        # Kept where the run is (a check before one, kiln doctor's, writes nothing).
        if self.world.is_main and self.path.parent.is_dir():
            buffer = io.BytesIO()
            torch.save({"fingerprint": self.fingerprint, "logps": table}, buffer)
            write_atomic(self.path, buffer.getvalue())
        return table
