"""The fine-tuning job: a model that comes with its own tokenizer (a Hugging Face causal LM or
classifier, ``model.source = "hf:PATH"``) trained on records (``kiln.data.finetune``), with its
loss normalised over exactly the counted tokens of each global batch, evaluation per task, and
LoRA when asked for.

Everything is checked before the run directory is touched: the model directory, the records
(each problem names its file, line and field), the labels.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.config import Config, ConfigError
from kiln.data.corpus import find_files
from kiln.data.finetune import FineTuneData, prepare_eval, prepare_finetune, truncation
from kiln.data.records import RECORD_EXTENSIONS
from kiln.distributed.world import World
from kiln.io import write_atomic
from kiln.models.family import ModelFamily
from kiln.train.evaluate import evaluate_causal_lm, evaluate_classifier
from kiln.train.jobs.base import EvalContext, FamilyJob, LoadedRun, ValidationRows


def uses_records(cfg: Config) -> bool:
    """Is ``data.source`` fine-tuning records? ``data.format``, or for auto: a model.source and
    nothing but .jsonl, .csv and .parquet files."""
    if cfg.data.format != "auto":
        return cfg.data.format == "records"
    if not cfg.model.source or cfg.data.source == "stdlib":
        return False
    try:
        _, files = find_files(cfg.data.source, RECORD_EXTENSIONS, "")
    except ValueError:
        return False
    return bool(files)


class FineTuneJob(FamilyJob):
    data: FineTuneData

    def prepare(self, world: World, console: bool) -> None:
        """Resolve the model and tokenize its records (every rank: they are held in memory)."""
        cfg, family = self.cfg, self.family
        self.resolve_model()
        # Pipeline stages exchange activations of one shape every step: rows padded to seq_len.
        width = cfg.data.seq_len if cfg.parallel.pp > 1 else 0
        self.data = data = prepare_finetune(cfg.data, cfg.model.task, self.tokenizer, cfg.data.seq_len, width)
        if data.labels:
            self.args = dataclasses.replace(self.args, labels=data.labels)
        self.train_data, self.collate_fn = data.train, data.collate
        self.tokens_per_sample = cfg.data.seq_len
        self.flops_per_token = family.flops_per_token(self.args, cfg.data.seq_len)
        self.plan = family.parallel_plan(self.args)
        self.loss_fn = family.loss

    def resolve_model(self) -> None:
        """The model's arguments and its tokenizer (ConfigError if it has none, or if the data is
        text, which a language model trains on)."""
        cfg, family = self.cfg, self.family
        source = cfg.data.source
        if not uses_records(cfg) and (source == "stdlib" or Path(source).exists()):
            raise ConfigError(
                [
                    f"run.job: {cfg.run.job} trains on records (.jsonl, .csv or .parquet) with a model that has its "
                    f"own tokenizer (model.source = hf:PATH); data.source={source!r} with model.source="
                    f"{cfg.model.source!r} is text for a language model (run.job = lm)"
                ]
            )
        self.args = family.resolve(cfg.model, vocab_size=0, seq_len=cfg.data.seq_len)
        if cfg.data.packing and cfg.model.task == "causal_lm" and not family.keeps_packed_records_apart(self.args):
            raise ConfigError(
                [
                    f"data.packing: the model of {cfg.model.source} lets records packed into one row attend to each "
                    "other; set data.packing=false"
                ]
            )
        self.tokenizer = family.tokenizer(self.args)
        if self.tokenizer is None:
            raise ConfigError(
                [
                    "data.format: fine-tuning records need a model that comes with its own tokenizer "
                    "(model.source = hf:PATH)"
                ]
            )

    def model(self) -> nn.Module:
        """Pretrained (or random) weights, with LoRA adapters if asked for."""
        return self.family_model(self.args)

    def evaluate(self, model: nn.Module, ctx: EvalContext) -> dict[str, Any]:
        return evaluate(self.family, model, self.data, ctx.micro_batch_size, ctx.device)

    def describe(self, model: nn.Module) -> list[str]:
        m = self.data.manifest
        parts = [f"{m['records']['train']:,} train / {m['records']['val']:,} val records ({m['split']})"]
        if cut := truncation(m):
            parts.append(cut)
        if m.get("packing"):
            parts.append(f"packed into {m['packing']['rows']:,} rows, {m['packing']['fill']:.0%} full")
        if self.data.labels:
            parts.append("labels " + ", ".join(f"{name} ({n})" for name, n in m["labels"].items()))
        return [
            f"model {self.family.describe(self.cfg.model, self.args, model)}",
            f"{self.data.task} data: " + "; ".join(parts),
        ]

    @property
    def manifest(self) -> dict[str, Any]:
        """What data.json records of the prepared data."""
        return self.data.manifest

    def write_files(self, run_dir: Path) -> None:
        write_atomic(run_dir / "model.json", json.dumps(self.family.args_to_dict(self.args), indent=2))
        write_atomic(run_dir / "data.json", json.dumps(self.manifest, indent=2))
        self.tokenizer.save_pretrained(run_dir / "tokenizer")

    # -- a saved run -----------------------------------------------------------------------------

    def saved_tokenizer(self, directory: Path) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory / "tokenizer"), local_files_only=True)

    def validation_rows(self, tokenizer: Any, run_dir: Path, rows: int) -> ValidationRows:
        cfg = self.cfg
        val = prepare_finetune(cfg.data, cfg.model.task, tokenizer, cfg.data.seq_len).val.rows[:rows]
        labels = [int(r["labels"]) for r in val] if cfg.model.task == "sequence_classification" else None
        return ValidationRows(
            [r["input_ids"] for r in val], labels, f"{len(val)} validation records of {cfg.data.source}"
        )

    def evaluate_saved(
        self, run: LoadedRun, *, source: str | None, max_batches: int | None, batch_size: int | None
    ) -> dict[str, Any]:
        """The task's metrics on the run's own validation records, or on every record of ``source``."""
        cfg, task, seq_len = self.cfg, self.cfg.model.task, self.cfg.data.seq_len
        if source is None:
            data = prepare_finetune(cfg.data, task, run.tokenizer, seq_len)
        else:
            data = prepare_eval(source, cfg.data, task, run.tokenizer, seq_len, tuple(run.args.labels))
        device = next(run.model.parameters()).device
        metrics = evaluate(self.family, run.model, data, batch_size or cfg.train.nominal_micro_batch, device)
        return {**metrics, "step": run.step, "records": len(data.val.rows)}


def evaluate(
    family: ModelFamily, model: nn.Module, data: FineTuneData, batch_size: int, device: torch.device
) -> dict[str, Any]:
    """The task's metrics over the whole validation split, ``batch_size`` rows at a time."""
    batches = data.val.batches(data.collate, batch_size)
    if data.task == "sequence_classification":
        return evaluate_classifier(model, batches, device, data.labels)
    return evaluate_causal_lm(model, family.loss, batches, device)
