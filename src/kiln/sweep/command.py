"""``kiln sweep``: its arguments, and ``sweep``, which checks everything, opens the study and runs
it to the requested number of trials."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.config import ConfigError, load_config, tomllib
from kiln.io import directory_problem
from kiln.models.family import check_model_config
from kiln.sweep.space import Param, grid_size, load_space
from kiln.sweep.study import (
    PRUNE_AFTER_TRIALS,
    PRUNE_WARMUP_SHARE,
    claim_lock,
    import_optuna,
    make_pruner,
    make_sampler,
    open_study,
)

# --trials without a grid to bound it.
DEFAULT_TRIALS = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kiln sweep`` (besides the config file and ``--set``, which every command has)."""
    p.add_argument("--space", required=True, metavar="SPACE.toml", help="the search space: one table per config key")
    p.add_argument(
        "--trials",
        type=int,
        metavar="N",
        help="finished trials (complete, pruned or failed) the study should have; the same command run again "
        f"continues to N (default: the whole grid with --sampler grid, else {DEFAULT_TRIALS})",
    )
    p.add_argument(
        "--study-dir",
        metavar="DIR",
        help="the study: its storage, a run directory per trial, the results (default: the config's run.dir + -sweep)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="K",
        help="trials at once, each a process with its share of the CPU threads (or of the GPUs)",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="R", help="run each trial on R ranks (kiln launch)")
    p.add_argument("--objective", default="val_loss", metavar="METRIC", help="evaluation metric to optimise")
    p.add_argument("--direction", choices=["minimize", "maximize"], default="minimize")
    p.add_argument(
        "--sampler",
        choices=["tpe", "grid"],
        default="tpe",
        help="tpe (seeded) or grid: every combination once (floats need choices or a step)",
    )
    p.add_argument(
        "--pruner",
        choices=["median", "hyperband", "none"],
        default="median",
        help="stop trials whose evaluations fall behind (default median)",
    )
    p.add_argument(
        "--prune-after",
        type=int,
        default=PRUNE_AFTER_TRIALS,
        metavar="N",
        help=f"the median pruner prunes only once N trials have completed (default {PRUNE_AFTER_TRIALS})",
    )
    p.add_argument(
        "--prune-warmup",
        type=float,
        default=PRUNE_WARMUP_SHARE,
        metavar="F",
        help="the median pruner leaves a trial alone for this share of its steps (default 1/3)",
    )
    p.add_argument("--seed", type=int, help="the sampler's seed (default: the config's train.seed)")
    p.add_argument(
        "--enqueue",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="evaluate these values before the sampler's own (e.g. a known good config); repeatable",
    )


@dataclass
class SweepResult:
    study_dir: Path
    best: Path | None  # best.toml, once a trial has completed
    interrupted: bool


def sweep_command(args: argparse.Namespace) -> int:
    result = sweep(
        args.config,
        args.overrides,
        args.space,
        trials=args.trials,
        study_dir=args.study_dir,
        parallel=args.parallel,
        nproc_per_node=args.nproc_per_node,
        objective=args.objective,
        direction=args.direction,
        sampler=args.sampler,
        pruner=args.pruner,
        prune_after=args.prune_after,
        prune_warmup=args.prune_warmup,
        seed=args.seed,
        enqueue=args.enqueue,
    )
    return 130 if result.interrupted else 0


def sweep(
    config: str | Path | None,
    overrides: list[str],
    space: str | Path,
    *,
    trials: int | None = None,
    study_dir: str | Path | None = None,
    parallel: int = 1,
    nproc_per_node: int = 1,
    objective: str = "val_loss",
    direction: str = "minimize",
    sampler: str = "tpe",
    pruner: str = "median",
    prune_after: int = PRUNE_AFTER_TRIALS,
    prune_warmup: float = PRUNE_WARMUP_SHARE,
    seed: int | None = None,
    enqueue: list[str] | tuple[str, ...] = (),
) -> SweepResult:
    """Run the study in ``study_dir`` until it has ``trials`` finished trials. Everything is
    checked before anything is written: a bad config, space or option raises ConfigError."""
    from kiln.sweep.driver import Driver, Options, eval_every
    from kiln.sweep.results import format_table, trial_rows, write_results

    optuna = import_optuna()
    base = load_config(config, overrides)
    check_model_config(base)
    grid = sampler == "grid"
    params = load_space(space, config, overrides, grid=grid)
    errors = [
        f"--{name}: must be >= 1, got {value}"
        for name, value in (("parallel", parallel), ("nproc-per-node", nproc_per_node), ("trials", trials))
        if value is not None and value < 1
    ]
    if prune_after < 0:
        errors.append(f"--prune-after: must be >= 0, got {prune_after}")
    if not 0 <= prune_warmup < 1:
        errors.append(f"--prune-warmup: must be in [0, 1), got {prune_warmup}")
    if grid and enqueue:
        errors.append("--enqueue: a grid evaluates each of its points itself; --enqueue is for --sampler tpe")
    points = []
    for text in enqueue:
        try:
            points.append(_point(text, params))
        except ConfigError as e:
            errors += e.errors
    study_dir = Path(study_dir or f"{base.run.dir.rstrip('/')}-sweep")
    if problem := directory_problem(study_dir):
        errors.append(f"--study-dir: {problem}")
    if errors:
        raise ConfigError(errors)
    if grid:
        trials = min(trials or grid_size(params), grid_size(params))
    trials = trials or DEFAULT_TRIALS
    seed = base.train.seed if seed is None else seed
    setup = {
        "space": {p.key: p.to_dict() for p in params},
        "objective": objective,
        "direction": direction,
        "sampler": sampler,
        "pruner": pruner,
        "prune_after": prune_after,
        "prune_warmup": prune_warmup,
        "seed": seed,
        # What the trials train: the same config, whatever run.dir the command names.
        "config": {**base.to_dict(), "run": {k: v for k, v in base.to_dict()["run"].items() if k != "dir"}},
    }
    study_dir.mkdir(parents=True, exist_ok=True)
    steps = base.train.max_steps if isinstance(base.train.max_steps, int) else "auto"
    # The pruner decides in the trials' processes (kiln.sweep.trial); samplers look at it too.
    study_pruner = make_pruner(optuna, pruner, eval_every(base), steps, after=prune_after, warmup=prune_warmup)
    study = open_study(study_dir, setup, make_sampler(optuna, params, grid, seed), study_pruner)
    with claim_lock(study_dir):
        for point in points:
            study.enqueue_trial(point, skip_if_exists=True)
    print(
        f"kiln: sweep {study_dir}: {trials} trials over {'; '.join(p.describe() for p in params)}; "
        f"{direction} {objective}, {sampler} sampler, {pruner} pruner",
        flush=True,
    )
    options = Options(config, overrides, params, study_dir, trials, objective, grid, seed, parallel, nproc_per_node)
    interrupted = Driver(options, study, optuna).run()
    print(format_table(trial_rows(study, params, study_dir), params, objective), flush=True)
    best = write_results(study, params, study_dir, objective, seed)
    if best is not None:
        t = study.best_trial
        values = ", ".join(f"{k}={v!r}" for k, v in t.params.items())
        print(f"kiln: best: trial {t.number}, {objective} {t.value:.5g} ({values}); kiln train {best} trains it again")
    if interrupted:
        print("kiln: sweep stopped; run the same command again to continue it", flush=True)
    return SweepResult(study_dir, best, interrupted)


def _point(text: str, params: list[Param]) -> dict[str, Any]:
    """``key=value,key=value`` as values of the space's parameters."""
    by_key = {p.key: p for p in params}
    point = {}
    for item in text.split(","):
        key, _, raw = (part.strip() for part in item.partition("="))
        if key not in by_key:
            raise ConfigError([f"--enqueue {text!r}: {key!r} is not in the space ({', '.join(by_key)})"])
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare word: a string choice
        param = by_key[key]
        if not _admits(param, value):
            raise ConfigError([f"--enqueue {text!r}: {key}={raw} is not in the space ({param.describe()})"])
        point[key] = float(value) if param.type == "float" else value
    return point


def _admits(param: Param, value: Any) -> bool:
    if param.choices is not None:
        return any(type(value) is type(c) and value == c for c in param.choices) or (
            param.type == "float" and isinstance(value, (int, float)) and float(value) in param.choices
        )
    if isinstance(value, bool) or not isinstance(value, int if param.type == "int" else (int, float)):
        return False
    assert param.low is not None and param.high is not None  # a range: no choices (_param)
    return param.low <= value <= param.high
