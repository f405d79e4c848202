"""``kiln doctor``: a preflight that finds data, gradient and setup problems before a long run.

It checks kiln's built-in job from the config, or a user's own model, loss and datasets
(``run_doctor``), in five areas: the environment (versions, device features, disk), the data
(checksums, token ids, documents, duplicates, train/val leakage, a decoded sample), the model
and optimizer (initial loss, gradient flow and norms, overfitting one batch), the input pipeline
(time waiting for data) and determinism. Every check is small and bounded, so the whole doctor
takes seconds on the default config.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from kiln.checkpoint import capture_rng, restore_rng
from kiln.config import Config, load_config, validate
from kiln.doctor import data as data_checks
from kiln.doctor import environment as environment_checks
from kiln.doctor import model as model_checks
from kiln.doctor.job import Subject, build_job
from kiln.doctor.report import GROUPS, Check, DoctorReport, first_line
from kiln.train.step import LossFn

CHECKS = [*environment_checks.CHECKS, *data_checks.CHECKS, *model_checks.CHECKS]


def run_doctor(
    cfg: Config,
    *,
    model: nn.Module | None = None,
    loss_fn: LossFn | None = None,
    train_data: Dataset | None = None,
    val_data: Dataset | None = None,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    groups: Iterable[str] | None = None,
    progress: bool = False,
) -> DoctorReport:
    """Check a training setup; by default kiln's built-in job from ``cfg``.

    ``model``, ``loss_fn`` (``loss_fn(model, batch)`` -> mean loss, as for ``Trainer``),
    ``train_data`` and ``val_data`` replace the built-in pieces; the model is copied, never
    trained itself. ``tokenizer`` (a ``tokenizers.Tokenizer``) lets the data checks split token
    streams into documents at its end-of-text token and decode a sample; ``vocab_size`` is read
    from the model (``config.vocab_size``, or its largest ``nn.Embedding``) when not given.
    ``groups`` limits the checks to some of environment, data, model, pipeline, determinism.
    """
    validate(cfg)  # a Config built in Python has not been through load_config
    wanted = _groups(groups)
    started = time.perf_counter()
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    rng = capture_rng()  # the checks seed and draw; the caller's random state is left as it was
    try:
        subject = build_job(cfg, model, loss_fn, train_data, val_data, tokenizer, vocab_size, progress)
        report = DoctorReport()
        for group, name, check in (c for c in CHECKS if c[0] in wanted):
            if progress and (not report.checks or report.checks[-1].group != group):
                print(f"kiln doctor: checking {group} ...", file=sys.stderr, flush=True)
            report.checks.append(_run_check(group, name, check, subject))
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


def _groups(groups: Iterable[str] | None) -> set[str]:
    if groups is None:
        return set(GROUPS)
    wanted = set(groups)
    unknown = wanted - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown doctor groups {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    return wanted


def _run_check(group: str, name: str, check: Callable, subject: Subject) -> Check:
    """One check, timed; a check that raises is a failure that shows the error, not a crash."""
    started = time.perf_counter()
    try:
        status, evidence, fix = check(subject)
    except Exception as e:  # noqa: BLE001 - any error inside a check is a finding about the setup
        status, evidence = "fail", f"the check raised {type(e).__name__}: {first_line(e)}"
        fix = "the setup cannot run this step; the error above names the cause"
    return Check(name, group, status, evidence, fix, round(time.perf_counter() - started, 3))
