"""``kiln doctor``: a preflight that finds data, gradient and setup problems before a long run.

It runs kiln's built-in job from the config (prepared data, the GPT, the LM loss), or a user's
own model, loss and datasets through :func:`run_doctor`, and checks five areas: the environment
(versions, device features, disk), the data (checksums, token ids, documents, duplicates,
train/val leakage, a decoded sample), the model and optimizer (initial loss, gradient flow and
norms, overfitting one batch), the input pipeline (time waiting for data) and determinism. Every
check is small and bounded, so the whole doctor takes seconds on the default config.

The checks themselves live in ``doctor_env``, ``doctor_data`` and ``doctor_train``; this module
builds the job they examine and runs them.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.data import Dataset

from kiln.checkpoint import capture_rng, restore_rng
from kiln.config import Config, ConfigError, load_config, validate
from kiln.data import DataError, PreparedData, TokenSequences, prepare
from kiln.data.tokenizer import eot_id
from kiln.distributed.world import resolve_device
from kiln.models import GPT, build_gpt_config, param_count
from kiln.observe.doctor_report import GROUPS, Check, DoctorReport, first_line
from kiln.train.lm import lm_loss

__all__ = ["Check", "DoctorJob", "DoctorReport", "doctor_command", "run_doctor"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class DoctorJob:
    """Everything the checks look at. Models come from ``new_model`` so that every check starts
    from the same untrained weights and none of them changes the user's model."""

    cfg: Config
    device: torch.device
    device_problem: str | None
    new_model: Callable[[], nn.Module] | None
    loss_fn: LossFn
    train_data: Dataset | None
    val_data: Dataset | None
    tokenizer: Any
    eot: int | None
    vocab_size: int | None
    num_params: int
    head_dim: int | None
    prepared: PreparedData | None = None
    data_problem: str | None = None
    """Why there is no data to check (preparing it failed), or None."""
    source: str = ""
    """What data is checked, in words."""

    @property
    def micro_batch_size(self) -> int:
        micro = self.cfg.train.micro_batch_size
        return 8 if micro == "auto" else micro

    @cached_property
    def scan(self):
        """The data statistics several checks share (computed once, bounded; see doctor_data)."""
        from kiln.observe.doctor_data import DataScan

        return DataScan(self)

    @cached_property
    def probe(self):
        """One gradient probe shared by the initial-loss and gradient checks (see doctor_train)."""
        from kiln.observe.doctor_train import GradientProbe

        return GradientProbe(self)

    def model_blocker(self) -> str | None:
        """Why the model cannot be run on this data (then its checks are skipped), or None."""
        if self.device_problem:
            # Falling back to the CPU could take hours for a model sized for a GPU.
            return f"run.device={self.cfg.run.device} cannot be used; see environment / device & CUDA"
        if self.new_model is None:
            return "no model to check: " + (self.data_problem or "the data could not be prepared")
        if self.train_data is None:
            return "no training data: " + (self.data_problem or "the data could not be prepared")
        splits = (("train", self.train_data), ("val", self.val_data))
        empty = [split for split, data in splits if data is not None and not len(data)]
        if empty:
            # Training would refuse this data too (and a data.seq_len this long makes each step slow).
            return f"the {' and '.join(empty)} split holds no whole sequence; see data / data source"
        bad = self.scan.out_of_vocab()
        if bad:
            # On a GPU an out-of-range embedding index is a device-side assert that breaks the
            # CUDA context for everything after it, so the model is not run at all.
            return f"token ids outside the vocabulary ({bad}); see data / token ids"
        return None


def run_doctor(cfg: Config, *, model: nn.Module | None = None, loss_fn: LossFn | None = None,
               train_data: Dataset | None = None, val_data: Dataset | None = None, tokenizer: Any = None,
               vocab_size: int | None = None, groups: Iterable[str] | None = None,
               progress: bool = False) -> DoctorReport:
    """Check a training setup; by default kiln's built-in job from ``cfg``.

    ``model``, ``loss_fn`` (``loss_fn(model, batch)`` -> mean loss, as for ``Trainer``),
    ``train_data`` and ``val_data`` replace the built-in pieces; the model is copied, never
    trained itself. ``tokenizer`` (a ``tokenizers.Tokenizer``) lets the data checks split token
    streams into documents at its end-of-text token and decode a sample; ``vocab_size`` is read
    from the model (``config.vocab_size``, or its largest ``nn.Embedding``) when not given.
    ``groups`` limits the checks to some of environment, data, model, pipeline, determinism.
    """
    from kiln.observe import doctor_data, doctor_env, doctor_train

    validate(cfg)  # a Config built in Python has not been through load_config
    wanted = _groups(groups)
    started = time.perf_counter()
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    rng = capture_rng()  # the checks seed and draw; the caller's random state is left as it was
    try:
        job = _build_job(cfg, model, loss_fn, train_data, val_data, tokenizer, vocab_size, progress)
        report = DoctorReport()
        checks = [c for module in (doctor_env, doctor_data, doctor_train) for c in module.CHECKS if c[0] in wanted]
        for group, name, check in checks:
            if progress and (not report.checks or report.checks[-1].group != group):
                print(f"kiln doctor: checking {group} ...", file=sys.stderr, flush=True)
            report.checks.append(_run_check(group, name, check, job))
    finally:
        restore_rng(rng)
    report.seconds = time.perf_counter() - started
    return report


def doctor_command(config_path: str | None, overrides: list[str], as_json: bool) -> int:
    """``kiln doctor``: check the built-in job of the config, print the report, return the exit
    status (1 if a check failed, else 0). A bad config raises ConfigError for the CLI."""
    cfg = load_config(config_path, overrides)
    report = run_doctor(cfg, progress=True)
    print(json.dumps(report.to_dict()) if as_json else report.render(), flush=True)
    return report.exit_status


# -- the job ------------------------------------------------------------------------------------


def _groups(groups: Iterable[str] | None) -> set[str]:
    if groups is None:
        return set(GROUPS)
    wanted = set(groups)
    unknown = wanted - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown doctor groups {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    return wanted


def _device(cfg: Config) -> tuple[torch.device, str | None]:
    """The configured device, or the CPU and the reason the configured one cannot be used."""
    try:
        return resolve_device(cfg.run.device), None
    except (ConfigError, RuntimeError) as e:
        return torch.device("cpu"), str(e)


def _build_job(cfg, model, loss_fn, train_data, val_data, tokenizer, vocab_size, progress) -> DoctorJob:
    device, device_problem = _device(cfg)
    prepared, data_problem = None, None
    if train_data is None:
        try:
            prepared = prepare(cfg.data, progress=progress)
        except DataError as e:
            data_problem = str(e)
        if prepared is not None:
            seq_len = cfg.data.seq_len
            train_data = TokenSequences(prepared.tokens("train"), seq_len)
            val_data = val_data if val_data is not None else TokenSequences(prepared.tokens("val"), seq_len)
            tokenizer = prepared.tokenizer if tokenizer is None else tokenizer
    eot = _eot_of(tokenizer, prepared)
    if model is None:
        if prepared is not None:
            vocab = prepared.vocab_size
        else:
            vocab = vocab_size or (tokenizer.get_vocab_size() if tokenizer is not None else cfg.data.vocab_size)
        gpt_cfg = build_gpt_config(cfg.model, vocab_size=vocab, max_seq_len=cfg.data.seq_len)
        new_model = None if data_problem else _seeded_gpt(gpt_cfg, cfg.train.seed, device)
        vocab_size, num_params, head_dim = vocab, param_count(gpt_cfg), gpt_cfg.head_dim
    else:
        pristine = copy.deepcopy(model)

        def new_model() -> nn.Module:
            return copy.deepcopy(pristine).to(device)

        vocab_size = vocab_size or _model_vocab_size(model)
        num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        head_dim = None
    return DoctorJob(
        cfg=cfg, device=device, device_problem=device_problem, new_model=new_model, loss_fn=loss_fn or lm_loss,
        train_data=train_data, val_data=val_data, tokenizer=tokenizer, eot=eot, vocab_size=vocab_size,
        num_params=num_params, head_dim=head_dim, prepared=prepared, data_problem=data_problem,
        source=_describe_source(cfg, prepared, train_data, val_data),
    )


def _seeded_gpt(gpt_cfg, seed: int, device: torch.device) -> Callable[[], nn.Module]:
    def new_model() -> nn.Module:
        torch.manual_seed(seed)  # as build_trainer does: the same seed gives the same weights
        return GPT(gpt_cfg).to(device)

    return new_model


def _eot_of(tokenizer, prepared: PreparedData | None) -> int | None:
    if prepared is not None:
        return prepared.eot_id
    if tokenizer is None:
        return None
    try:
        return eot_id(tokenizer)
    except DataError:
        return None


def _model_vocab_size(model: nn.Module) -> int | None:
    """The vocabulary a model predicts over: ``config.vocab_size`` (kiln's GPT, Hugging Face
    models), else the rows of its largest ``nn.Embedding`` (position tables are smaller), else
    None."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        return vocab
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(rows) if rows else None


def _describe_source(cfg: Config, prepared, train_data, val_data) -> str:
    if prepared is not None:
        splits = prepared.manifest["splits"]
        return (f"data.source={cfg.data.source!r} prepared in {prepared.dir} "
                f"({'tokenized now' if prepared.tokenized else 'cached'}): "
                f"{splits['train']['documents']:,} train / {splits['val']['documents']:,} val documents, "
                f"{splits['train']['tokens']:,} / {splits['val']['tokens']:,} tokens, vocab {prepared.vocab_size:,}")
    if train_data is None:
        return f"data.source={cfg.data.source!r}"
    val = f"{type(val_data).__name__} of {len(val_data):,} items" if val_data is not None else "none"
    return f"train_data: {type(train_data).__name__} of {len(train_data):,} items; val_data: {val}"


def _run_check(group: str, name: str, check: Callable, job: DoctorJob) -> Check:
    """One check, timed; a check that raises is a failure that shows the error, not a crash."""
    started = time.perf_counter()
    try:
        status, evidence, fix = check(job)
    except Exception as e:  # noqa: BLE001 - any error inside a check is a finding about the setup
        status, evidence = "fail", f"the check raised {type(e).__name__}: {first_line(e)}"
        fix = "the setup cannot run this step; the error above names the cause"
    return Check(name, group, status, evidence, fix, round(time.perf_counter() - started, 3))

