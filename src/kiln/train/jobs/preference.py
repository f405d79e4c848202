"""The preference job: a fine-tuning run (a model with its own tokenizer, records) whose objective
is DPO, IPO, SimPO or ORPO on ``{prompt, chosen, rejected}`` records, or KTO on ``{prompt,
completion, label}`` ones (``kiln.data.preference``), the loss and the reference model from
``kiln.train.preference``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from kiln.config import ConfigError
from kiln.data.finetune import truncation
from kiln.data.preference import PreferenceData, prepare_preference
from kiln.distributed.world import World
from kiln.train.jobs.base import EvalContext, LoadedRun, ValidationRows
from kiln.train.jobs.finetune import FineTuneJob
from kiln.train.preference import UNPAIRED, WITH_REFERENCE, AdaptersOff, Precomputed, PreferenceLoss


class PreferenceJob(FineTuneJob):
    pairs: PreferenceData

    @property
    def manifest(self) -> dict[str, Any]:
        return self.pairs.manifest

    def prepare(self, world: World, console: bool) -> None:
        cfg = self.cfg
        if cfg.data.packing:
            raise ConfigError(["data.packing: preference pairs are padded, not packed; set data.packing=false"])
        self.resolve_model()
        self.pairs = data = prepare_preference(cfg.data, self.tokenizer, cfg.data.seq_len, kto=cfg.run.job in UNPAIRED)
        self.train_data, self.collate_fn = data.train, data.collate
        # A pair is two sequences.
        self.tokens_per_sample = 2 * cfg.data.seq_len
        self.flops_per_token = self.family.flops_per_token(self.args, cfg.data.seq_len)
        self.plan = self.family.parallel_plan(self.args)
        self.objective = PreferenceLoss(cfg, self._reference(world))
        self.loss_fn = self.objective

    def _reference(self, world: World, computes: bool = True) -> AdaptersOff | Precomputed | None:
        cfg = self.cfg
        if cfg.run.job not in WITH_REFERENCE:
            return None
        if cfg.lora.rank:
            return AdaptersOff()
        if not cfg.preference.precompute_reference:
            raise ConfigError(
                [
                    f"preference.precompute_reference: {cfg.run.job} without LoRA compares with the initial "
                    "model's log-probabilities, computed once before the first step; set it to true (a frozen "
                    "second copy of the model is not kept), or train LoRA adapters (lora.rank)"
                ]
            )
        fingerprint = {
            "model": cfg.model.source,
            "seed": cfg.train.seed,
            "precision": cfg.train.precision,
            "data": self.pairs.manifest,
        }
        reference = Precomputed(
            Path(cfg.run.dir),
            fingerprint,
            {"train": self.pairs.train, "val": self.pairs.val},
            self.pairs.collate,
            cfg.train.nominal_micro_batch,
            world,
            computes=computes,
        )
        return reference

    def metrics(self, world: World) -> dict[str, float]:
        return self.objective.metrics(world)

    def evaluate(self, model: nn.Module, ctx: EvalContext) -> dict[str, Any]:
        return self.objective.evaluate(
            model, self.pairs.val.batches(self.pairs.collate, ctx.micro_batch_size), ctx.device
        )

    def describe(self, model: nn.Module) -> list[str]:
        m, cfg = self.pairs.manifest, self.cfg
        parts = [f"{m['records']['train']:,} train / {m['records']['val']:,} val pairs ({m['split']})"]
        if cut := truncation(m):
            parts.append(cut)
        reference = {AdaptersOff: "the model with its adapters off", Precomputed: "the initial model, precomputed"}
        ref = self.objective.reference
        said = f", reference: {reference[type(ref)]}" if ref is not None else ""
        return [
            f"model {self.family.describe(cfg.model, self.args, model)}",
            f"{cfg.run.job} (beta {cfg.preference.beta}{said}): " + "; ".join(parts),
        ]

    def validation_rows(self, tokenizer: Any, run_dir: Path, rows: int) -> ValidationRows:
        """Each pair's prompt and chosen answer."""
        cfg = self.cfg
        pairs = prepare_preference(cfg.data, tokenizer, cfg.data.seq_len, kto=cfg.run.job in UNPAIRED).val.rows[:rows]
        ids = [r["prompt_ids"] + r["chosen_ids"] for r in pairs]
        return ValidationRows(ids, None, f"{len(ids)} validation records of {cfg.data.source}")

    def evaluate_saved(
        self, run: LoadedRun, *, source: str | None, max_batches: int | None, batch_size: int | None
    ) -> dict[str, Any]:
        """The objective's metrics on the run's own validation pairs."""
        cfg = self.cfg
        if source is not None:
            raise ConfigError(
                ["kiln eval --data: a preference run is scored on its own validation pairs; leave it out"]
            )
        self.tokenizer, self.args = run.tokenizer, run.args
        self.pairs = prepare_preference(cfg.data, run.tokenizer, cfg.data.seq_len, kto=cfg.run.job in UNPAIRED)
        # The saved model has trained: a precomputed reference can only be read back, not redone.
        self.objective = PreferenceLoss(cfg, self._reference(World(), computes=False))
        device = next(run.model.parameters()).device
        batches = self.pairs.val.batches(self.pairs.collate, batch_size or cfg.train.nominal_micro_batch)
        return {**self.objective.evaluate(run.model, batches[:max_batches], device), "step": run.step}
