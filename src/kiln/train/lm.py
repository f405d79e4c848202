"""The built-in job: a causal language model trained on a text corpus. It asks the model family
(``model.family``, kiln's GPT by default) for the model, its loss, evaluation, FLOPs and parallel
plan, wires them and the data into the generic ``Trainer``, and adds what only a language model
has: bits per byte and text samples.

A run directory holds everything needed to use the run later without the data cache:
``config.toml``, ``model.json`` (the resolved architecture), ``tokenizer.json`` and checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from torch import nn

from kiln.config import Config, ConfigError
from kiln.data import TokenSequences, prepare, val_batches
from kiln.data.batch import split_batch
from kiln.data.loader import covering_batches
from kiln.data.tokenizer import Codec
from kiln.distributed.world import init_world
from kiln.models.family import ModelFamily, family_of
from kiln.models.hf.loading import model_dir
from kiln.train.apply import apply_lora
from kiln.train.run import load_run
from kiln.train.trainer import FitResult, Trainer


def rebatch(batches: list, size: int) -> list:
    """The same batches, each cut into pieces of at most ``size`` rows."""
    return [piece for batch in batches for piece in split_batch(batch, size)]


def sample_text(
    family: ModelFamily,
    model: nn.Module,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 0,
    device: torch.device | None = None,
) -> str | None:
    """``prompt`` continued by the model, as text; None if its family cannot sample. The tokenizer
    is kiln's own (a ``tokenizers.Tokenizer``) or a model's ``transformers`` tokenizer."""
    device = device or next(model.parameters()).device
    codec = Codec(tokenizer)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = family.generate(
        model,
        torch.tensor([codec.encode(prompt)], device=device),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=codec.eos_id,
        generator=generator,
    )
    return None if out is None else codec.decode(out[0].tolist())


def _with_model_tokenizer(cfg: Config):
    """The data config, tokenizing with the model's own tokenizer when the model comes from a
    Hugging Face directory (continued pretraining on text)."""
    if not cfg.model.source:
        return cfg.data
    path = model_dir(cfg.model.source) / "tokenizer.json"
    if cfg.data.tokenizer != "bpe":
        raise ConfigError(
            [f"data.tokenizer: a model from model.source={cfg.model.source} reads text with its own tokenizer"]
        )
    if not path.is_file():
        raise ConfigError(
            [
                f"model.source: {path.parent} has no tokenizer.json (a fast tokenizer), which kiln needs to "
                "tokenize text; fine-tune on records instead (data.format=records)"
            ]
        )
    return dataclasses.replace(cfg.data, tokenizer=str(path))


def build_trainer(cfg: Config, *, console: bool = True) -> Trainer:
    world = init_world(cfg.run.device, cfg.parallel, cfg.run.dir)
    console = console and world.is_main
    family = family_of(cfg.model)
    data_cfg = _with_model_tokenizer(cfg)
    # Rank 0 fills the cache (tokenizer, shards); the others then find it there.
    with world.main_first():
        prepared = prepare(data_cfg, progress=console)
    args = family.resolve(cfg.model, vocab_size=prepared.vocab_size, seq_len=cfg.data.seq_len)
    # Initialised on the CPU on every rank and device alike: the same seed, the same weights.
    model = apply_lora(family.create(args, "cpu", cfg.train.seed), cfg, family.lora_targets(args))
    if console:
        print(f"kiln: model {family.describe(cfg.model, args, model)}", flush=True)
    seq_len = cfg.data.seq_len
    train_data = TokenSequences(prepared.tokens("train"), seq_len)
    val_data = TokenSequences(prepared.tokens("val"), seq_len)
    if len(train_data) < 1 or len(val_data) < 1:
        raise ConfigError(
            [
                f"data.seq_len: {seq_len} is longer than the corpus allows "
                f"(train {len(train_data)} / val {len(val_data)} sequences); lower data.seq_len"
            ]
        )
    # A fixed validation sample, scored in chunks of the micro-batch in use at the time (the
    # out-of-memory ladder may lower it); with "auto", sized as if the micro-batch were 8.
    micro = cfg.train.micro_batch_size
    fixed_val = val_batches(val_data, 8 if micro == "auto" else micro, cfg.eval.batches)
    token_bytes = torch.from_numpy(prepared.token_bytes())
    tokenizer = prepared.tokenizer
    trainer = Trainer(
        model,
        train_data,
        family.loss,
        cfg,
        eval_fn=lambda m: family.evaluate(m, rebatch(fixed_val, trainer.micro_batch_size), token_bytes, trainer.device),
        sample_fn=(
            lambda m, step: sample_text(
                family, m, tokenizer, cfg.eval.prompt, cfg.eval.sample_tokens, seed=cfg.train.seed + step
            )
        )
        if cfg.eval.sample_tokens
        else None,
        tokens_per_sample=seq_len,
        flops_per_token=family.flops_per_token(args, seq_len),
        plan=family.parallel_plan(args),
        console=console,
    )
    run_dir = Path(cfg.run.dir)
    if not world.is_main:
        return trainer
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(prepared.dir / "tokenizer.json", run_dir / "tokenizer.json")
    (run_dir / "model.json").write_text(json.dumps(family.args_to_dict(args), indent=2))
    # The corpus fingerprint, token counts and checksums of the data this run trained on.
    (run_dir / "data.json").write_text(json.dumps(prepared.manifest, indent=2))
    return trainer


def train(cfg: Config, *, console: bool = True) -> FitResult:
    return build_trainer(cfg, console=console).fit()


# -- using a finished (or running) run directory --------------------------------------------------


def evaluate_run(
    run_dir: str | Path,
    *,
    source: str | None = None,
    checkpoint: str | Path | None = None,
    max_batches: int | None = None,
    micro_batch_size: int | None = None,
    device: str = "auto",
) -> dict[str, float]:
    """Validation metrics of a run's checkpoint: on the run's own val split (at most
    ``max_batches`` batches, 100 by default, spread over it), or on every token of every document
    of ``source``, tokenized with the run's tokenizer (the first ``max_batches`` if given)."""
    run = load_run(run_dir, checkpoint, device)
    data_cfg = dataclasses.replace(run.cfg.data, tokenizer=str(Path(run_dir) / "tokenizer.json"))
    if source:  # no training source: every document of ``source`` is val
        data_cfg = dataclasses.replace(data_cfg, source="", val_source=source)
    prepared = prepare(data_cfg)
    seq_len = run.cfg.data.seq_len
    batch = micro_batch_size or run.cfg.train.micro_batch_size
    val = TokenSequences(prepared.tokens("val"), seq_len)
    if source:
        batches = covering_batches(val, batch)[:max_batches]
        if not batches:
            raise ConfigError([f"--data: {source} holds fewer than 2 tokens"])
    else:
        batches = val_batches(val, batch, max_batches or 100)
    dev = next(run.model.parameters()).device
    metrics = run.family.evaluate(run.model, batches, torch.from_numpy(prepared.token_bytes()), dev)
    metrics.update(step=run.step, tokens=sum(y.numel() for _, y in batches))
    return metrics
