"""The language-model job: a causal language model trained on a text corpus. The model comes from
its family (``model.family``, kiln's GPT by default, or a Hugging Face causal LM that continues
pretraining on text); the job adds what only a language model has: bits per byte and text samples.

A run directory holds everything needed to use the run later without the data cache:
``config.toml``, ``model.json`` (the resolved architecture), ``tokenizer.json`` and checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.config import ConfigError, DataConfig
from kiln.data import DataError, PreparedData, TokenSequences, prepare, prepare_mix, val_batches
from kiln.data.batch import TextBatch, split_batch
from kiln.data.loader import DocumentSequences, document_windows
from kiln.data.mixture import Mixture
from kiln.data.tokenizer import Codec
from kiln.distributed.world import World
from kiln.labels import IGNORE_INDEX
from kiln.models.family import ModelFamily
from kiln.models.hf.loading import model_dir
from kiln.models.lm import targets_of
from kiln.train.jobs.base import EvalContext, FamilyJob, LoadedRun, ValidationRows


class LMJob(FamilyJob):
    def prepare(self, world: World, console: bool) -> None:
        cfg, family = self.cfg, self.family
        self.sources = self.prepare_data(world, console)
        prepared = self.prepared = next(iter(self.sources.values()))  # the sources share one tokenizer
        self.tokenizer = prepared.tokenizer
        seq_len = cfg.data.seq_len
        self.args = family.resolve(cfg.model, vocab_size=prepared.vocab_size, seq_len=seq_len)
        train = {name: self.sequences(p, "train") for name, p in self.sources.items()}
        val = {name: self.sequences(p, "val") for name, p in self.sources.items()}
        if cfg.data.document_mask:
            self.collate_fn = TextBatch.collate
        for name in train:
            if len(train[name]) < 1 or len(val[name]) < 1:
                of = f" of data.mix source {name!r}" if cfg.data.mix else ""
                raise ConfigError(
                    [
                        f"data.seq_len: {seq_len} is longer than the corpus{of} allows "
                        f"(train {len(train[name])} / val {len(val[name])} sequences); lower data.seq_len"
                    ]
                )
        self.weights = {m.label: m.weight for m in cfg.data.mix}
        self.train_data = (
            Mixture(list(train), list(train.values()), list(self.weights.values()), cfg.train.seed)
            if cfg.data.mix
            else train[""]
        )
        # A fixed validation sample (of each source), scored in chunks of the micro-batch in use at
        # the time (the out-of-memory ladder may lower it); with "auto", sized as if it were 8.
        self.fixed_val = {
            name: val_batches(data, cfg.train.nominal_micro_batch, cfg.eval.batches, self.val_collate)
            for name, data in val.items()
        }
        self.token_bytes = torch.from_numpy(prepared.token_bytes())
        self.tokens_per_sample = seq_len
        self.flops_per_token = family.flops_per_token(self.args, seq_len)
        self.plan = family.parallel_plan(self.args)
        self.loss_fn = family.loss

    def sequences(self, prepared: PreparedData, split: str) -> TokenSequences | DocumentSequences:
        """The windows of ``split``; with data.document_mask, each knowing where its documents start."""
        windows = TokenSequences(prepared.tokens(split), self.cfg.data.seq_len)
        return DocumentSequences(windows, prepared.eot_id) if self.cfg.data.document_mask else windows

    @property
    def val_collate(self) -> Callable[[list], Any] | None:
        return TextBatch.collate if self.cfg.data.document_mask else None

    def prepare_data(self, world: World, console: bool) -> dict[str, PreparedData]:
        """With the model's own tokenizer where it comes from a Hugging Face directory."""
        data_cfg, slow = self._data_config(), self.cfg.debug.slow_prepare_seconds
        if data_cfg.mix:
            return prepare_mix(data_cfg, console, world, slow)
        return {"": prepare(data_cfg, console, world, slow)}

    def model(self) -> nn.Module:
        return self.family_model(self.args)

    def evaluate(self, model: nn.Module, ctx: EvalContext) -> dict[str, Any]:
        scores = {
            name: self.family.evaluate(model, rebatch(batches, ctx.micro_batch_size), self.token_bytes, ctx.device)
            for name, batches in self.fixed_val.items()
        }
        return by_source(scores, self.weights)

    def sample(self, model: nn.Module, ctx: EvalContext) -> str | None:
        e = self.cfg.eval
        if not e.sample_tokens:
            return None
        tokenizer = self.tokenizer
        return sample_text(
            self.family, model, tokenizer, e.prompt, e.sample_tokens, seed=self.cfg.train.seed + ctx.step
        )

    def describe(self, model: nn.Module) -> list[str]:
        return [f"model {self.family.describe(self.cfg.model, self.args, model)}"]

    def write_files(self, run_dir: Path) -> None:
        shutil.copyfile(self.prepared.dir / "tokenizer.json", run_dir / "tokenizer.json")
        (run_dir / "model.json").write_text(json.dumps(self.family.args_to_dict(self.args), indent=2))
        # The corpus fingerprint, token counts and checksums of the data this run trained on.
        manifests = {name: p.manifest for name, p in self.sources.items()}
        (run_dir / "data.json").write_text(json.dumps(manifests.get("", manifests), indent=2))

    def _data_config(self) -> DataConfig:
        """The data config, tokenizing with the model's own tokenizer when the model comes from a
        Hugging Face directory (continued pretraining on text)."""
        cfg = self.cfg
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

    # -- a saved run -----------------------------------------------------------------------------

    def validation_rows(self, tokenizer: Any, run_dir: Path, rows: int) -> ValidationRows:
        """Sequences of data.seq_len spread over the val split (not its first documents only)."""
        seq_len = self.cfg.data.seq_len
        data_cfg = dataclasses.replace(self.cfg.data, tokenizer=str(run_dir / "tokenizer.json"))
        sequences = TokenSequences(prepare(data_cfg, progress=False).tokens("val"), seq_len)
        n = min(rows, len(sequences))
        if n == 0:
            raise DataError(f"{self.cfg.data.source}: the validation split is shorter than data.seq_len={seq_len}")
        ids = [[int(t) for t in sequences[int(i * len(sequences) / n)][0]] for i in range(n)]
        return ValidationRows(ids, None, f"{n} sequences of {seq_len} tokens from the val split")

    def saved_tokenizer(self, directory: Path) -> Any:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(directory / "tokenizer.json"))

    def evaluate_saved(
        self, run: LoadedRun, *, source: str | None, max_batches: int | None, batch_size: int | None
    ) -> dict[str, Any]:
        """On the run's own val split (at most ``max_batches`` batches, 100 by default, spread
        over it), or on every token of every document of ``source``, tokenized with the run's
        tokenizer, each document scored on its own as lm-evaluation-harness's rolling
        log-likelihood scores it (``document_windows``; the first ``max_batches`` if given)."""
        cfg = self.cfg
        data_cfg = dataclasses.replace(cfg.data, tokenizer=str(run.directory / "tokenizer.json"))
        if source:  # no training source: every document of ``source`` is val
            data_cfg = dataclasses.replace(data_cfg, source="", val_source=source, mix=())
        sources = prepare_mix(data_cfg) if data_cfg.mix else {"": prepare(data_cfg)}
        batch = batch_size or cfg.train.nominal_micro_batch
        device = next(run.model.parameters()).device
        scores, tokens = {}, 0
        for name, prepared in sources.items():
            if source:
                batches = document_windows(prepared.tokens("val"), prepared.eot_id, cfg.data.seq_len, batch)
                batches = batches[:max_batches]
            else:
                batches = val_batches(self.sequences(prepared, "val"), batch, max_batches or 100, self.val_collate)
            token_bytes = torch.from_numpy(prepared.token_bytes())
            scores[name] = self.family.evaluate(run.model, batches, token_bytes, device)
            tokens += sum(int((targets_of(b) != IGNORE_INDEX).sum()) for b in batches)
        metrics = by_source(scores, {m.label: m.weight for m in data_cfg.mix})
        return {**metrics, "step": run.step, "tokens": tokens}


def by_source(scores: dict[str, dict[str, float]], weights: dict[str, float]) -> dict[str, float]:
    """One corpus's validation metrics (by the name ""), or a mixture's: each source's as
    ``val_loss/<name>``, and their mean weighed as the mixture draws them as ``val_loss``."""
    if list(scores) == [""]:
        return scores[""]
    total = sum(weights.values())
    out = {key: sum(weights[name] * s[key] for name, s in scores.items()) / total for key in ("val_loss", "val_bpb")}
    out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
    for name, s in scores.items():
        out.update({f"{key}/{name}": s[key] for key in ("val_loss", "val_bpb")})
    return out


def rebatch(batches: list, size: int) -> list:
    """The same batches, each cut into pieces of at most ``size`` rows."""
    return [piece for batch in batches for piece in split_batch(batch, size)]


def sample_text(
    family: ModelFamily,
    model: nn.Module,
    tokenizer: Any,
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
    out = family.generate(
        model,
        torch.tensor([codec.encode(prompt)], device=device),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=codec.eos_id,
        seed=seed,
    )
    return None if out is None else codec.decode(out[0].tolist())
