"""The fine-tuning job: a model that comes with its own tokenizer (a Hugging Face causal LM or
classifier, ``model.source = "hf:PATH"``) trained on records (``kiln.data.finetune``) by the
generic ``Trainer``, with its loss normalised over exactly the counted tokens of each global
batch, evaluation per task, and LoRA when asked for.

Everything is checked before the run directory is touched: the model directory, the records
(each problem names its file, line and field), the labels.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kiln.config import Config, ConfigError
from kiln.data.corpus import find_files
from kiln.data.finetune import FineTuneData, prepare_eval, prepare_finetune
from kiln.data.records import RECORD_EXTENSIONS
from kiln.distributed.world import init_world
from kiln.io import write_atomic
from kiln.models.family import ModelFamily, family_of
from kiln.train.apply import apply_lora
from kiln.train.evaluate import evaluate_causal_lm, evaluate_classifier
from kiln.train.run import load_run
from kiln.train.trainer import Trainer


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


@dataclasses.dataclass
class FineTuneJob:
    """What a fine-tuning run is made of, before any model exists: the family and its arguments
    (with a classifier's labels), the model's tokenizer and the tokenized records."""

    cfg: Config
    family: ModelFamily
    args: Any
    tokenizer: Any
    data: FineTuneData

    def model(self):
        """The model to train: pretrained (or random) weights, with LoRA adapters if asked for."""
        model = self.family.create(self.args, "cpu", self.cfg.train.seed)
        model = apply_lora(model, self.cfg, self.family.lora_targets(self.args))
        return model


def prepare_job(cfg: Config) -> FineTuneJob:
    """Resolve the model and tokenize its records; ConfigError or DataError on bad input, before
    anything is written."""
    family = family_of(cfg.model)
    args = family.resolve(cfg.model, vocab_size=0, seq_len=cfg.data.seq_len)
    tokenizer = family.tokenizer(args)
    if tokenizer is None:
        raise ConfigError(
            ["data.format: fine-tuning records need a model that comes with its own tokenizer (model.source = hf:PATH)"]
        )
    data = prepare_finetune(cfg.data, cfg.model.task, tokenizer, cfg.data.seq_len)
    if data.labels:
        args = dataclasses.replace(args, labels=data.labels)
    return FineTuneJob(cfg, family, args, tokenizer, data)


def build_trainer(cfg: Config, *, console: bool = True) -> Trainer:
    world = init_world(cfg.run.device, cfg.parallel, cfg.run.dir)
    console = console and world.is_main
    job = prepare_job(cfg)
    family, args, data = job.family, job.args, job.data
    model = job.model()
    if console:
        print(f"kiln: model {family.describe(cfg.model, args, model)}", flush=True)
        _say_data(data, cfg)
    trainer = Trainer(
        model,
        data.train,
        family.loss,
        cfg,
        eval_fn=_evaluation(family, data, cfg, lambda: trainer),
        tokens_per_sample=cfg.data.seq_len,
        flops_per_token=family.flops_per_token(args, cfg.data.seq_len),
        plan=family.parallel_plan(args),
        collate_fn=data.collate,
        console=console,
    )
    if world.is_main:
        _write_run_files(Path(cfg.run.dir), family, args, job.tokenizer, data)
    return trainer


def evaluate(family: ModelFamily, model, data: FineTuneData, batch_size: int, device) -> dict[str, Any]:
    """The task's metrics over the whole validation split, ``batch_size`` rows at a time."""
    rows = data.val.rows
    batches = [data.collate(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
    if data.task == "sequence_classification":
        return evaluate_classifier(model, batches, device, data.labels)
    return evaluate_causal_lm(model, family.loss, batches, device)


def _evaluation(family: ModelFamily, data: FineTuneData, cfg: Config, trainer):
    """Evaluation in micro-batches of the size in use at the time (the memory ladder may lower it)."""

    def run(model) -> dict[str, Any]:
        t = trainer()
        return evaluate(family, model, data, t.micro_batch_size, t.device)

    return run


def evaluate_run(
    run_dir: str | Path,
    *,
    source: str | None = None,
    checkpoint: str | Path | None = None,
    micro_batch_size: int | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """The task's metrics of a fine-tuning run's checkpoint: on its own validation records, or on
    every record of ``source``."""
    run = load_run(run_dir, checkpoint, device)
    cfg = run.cfg
    if source is None:
        data = prepare_finetune(cfg.data, cfg.model.task, run.tokenizer, cfg.data.seq_len)
    else:
        data = prepare_eval(source, cfg.data, cfg.model.task, run.tokenizer, cfg.data.seq_len, tuple(run.args.labels))
    dev = next(run.model.parameters()).device
    metrics = evaluate(run.family, run.model, data, micro_batch_size or cfg.train.micro_batch_size, dev)
    return {**metrics, "step": run.step, "records": len(data.val.rows)}


def _say_data(data: FineTuneData, cfg: Config) -> None:
    m = data.manifest
    parts = [f"{m['records']['train']:,} train / {m['records']['val']:,} val records ({m['split']})"]
    cut = m["truncated"]
    if cut["train"] or cut["val"]:
        parts.append(f"{cut['train']:,} train / {cut['val']:,} val truncated to data.seq_len={cfg.data.seq_len}")
    if m.get("packing"):
        parts.append(f"packed into {m['packing']['rows']:,} rows, {m['packing']['fill']:.0%} full")
    if data.labels:
        parts.append("labels " + ", ".join(f"{name} ({n})" for name, n in m["labels"].items()))
    print(f"kiln: {data.task} data: " + "; ".join(parts), flush=True)


def _write_run_files(run_dir: Path, family: ModelFamily, args, tokenizer, data: FineTuneData) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "model.json", json.dumps(family.args_to_dict(args), indent=2))
    write_atomic(run_dir / "data.json", json.dumps(data.manifest, indent=2))
    tokenizer.save_pretrained(run_dir / "tokenizer")
