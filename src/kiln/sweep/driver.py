"""Running a study's trials: each is a ``kiln sweep-trial`` (or ``kiln launch ... -- sweep-trial``)
subprocess, an ordinary training run in its own run directory.

The sweep process asks Optuna for a trial, writes the trial's config (``trial.toml``: the base
config with the trial's values) and starts it as ``kiln sweep-trial STUDY_DIR NUMBER``
(``kiln.sweep.trial``), whose rank 0 reports each evaluation and asks the pruner (a pruned trial
stops at that step on every rank, with a checkpoint). When the run exits, the sweep records the
result.

A trial whose process is killed, or whose sweep process died (its training process then gets
SIGTERM too, and checkpoints), stays RUNNING in the study. Its lock is free once nothing runs
it, and the next sweep process on the study takes it over: same trial, same run directory, same
values, and ``kiln train`` resumes from its newest checkpoint.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.checkpoint import CheckpointError
from kiln.config import Config, ConfigError, load_config
from kiln.models.family import check_model_config
from kiln.observe.report import read_metrics
from kiln.sweep.results import CSV, trial_rows, write_csv
from kiln.sweep.space import Param, set_item
from kiln.sweep.study import FINISHED, TRIAL_CONFIG, claim_lock, live_trial, trial_dir, trial_lock
from kiln.train.run import StopRequest
from kiln.train.setup import CLAIM_FILE

TRIAL_LOG = "train.log"
POLL_S = 0.2
# A trial asked to stop saves a checkpoint first; one that has not stopped after this is killed.
STOP_GRACE_S = 300
# Runs of one trial, by one sweep process, before a trial whose process keeps dying is a failure.
MAX_ATTEMPTS = 3
# Trials of a config that evaluates only at the end evaluate this many times, so that they can be pruned.
EVALS_PER_TRIAL = 8
USAGE_ERROR = 2
# Out of memory (the next run starts a rung lower), or stopped by a signal the sweep did not send.
RETRIED_EXIT_CODES = (3, 130)
PR_SET_PDEATHSIG = 1


@dataclass
class Options:
    config: str | Path | None
    overrides: list[str]
    params: list[Param]
    study_dir: Path
    trials: int
    objective: str
    grid: bool
    seed: int
    parallel: int
    nproc_per_node: int


@dataclass
class Running:
    trial: Any  # optuna.Trial
    lock: Any  # FileLock, held (and inherited by the training process) while the trial runs
    run_dir: Path
    slot: int
    taken_over: bool  # from a sweep process that stopped
    proc: subprocess.Popen | None = None
    stop_sent: float | None = None
    attempts: int = 0

    @property
    def number(self) -> int:
        return self.trial.number


class Driver:
    def __init__(self, options: Options, study, optuna):
        self.o = options
        self.study = study
        self.optuna = optuna
        self.running: list[Running] = []
        self.threads = max(1, _cores() // (options.parallel * options.nproc_per_node))
        self.gpus = _gpus() if options.parallel > 1 else []
        self.preexec = _die_with_parent()

    def run(self) -> bool:
        """Run trials until the study has ``trials`` finished ones; True if stopped by a signal."""
        with StopRequest() as stop:
            try:
                while not stop.requested:
                    for polled in list(self.running):
                        self._poll(polled)
                    while len(self.running) < self.o.parallel and not stop.requested:
                        r = self.claim()
                        if r is None:
                            break
                        self._launch(r)
                    # With no trial of its own, this process waits for those other sweep
                    # processes run (or takes them over if those stop) until the study is done.
                    if not self.running and self._finished() >= self.o.trials:
                        break
                    time.sleep(POLL_S)
            finally:
                self._stop_all()
        return stop.requested

    # -- claiming trials ------------------------------------------------------------------------

    def _finished(self) -> int:
        return sum(t.state.name in FINISHED for t in self.study.get_trials(deepcopy=False))

    def claim(self) -> Running | None:
        """A trial left running by a sweep process that stopped, or else a new one while the
        study has fewer than ``trials`` finished or running."""
        optuna = self.optuna
        with claim_lock(self.o.study_dir):
            trials = self.study.get_trials(deepcopy=False)
            mine = {r.number for r in self.running}
            for t in trials:
                if t.state != optuna.trial.TrialState.RUNNING or t.number in mine:
                    continue
                lock = trial_lock(self.o.study_dir, t.number)
                if lock.acquire(blocking=False):
                    trial = live_trial(optuna, self.o.study_dir, self.study, t.number)
                    return self._running(trial, lock, taken_over=True)
            if sum(t.state.name in FINISHED or t.state.name == "RUNNING" for t in trials) >= self.o.trials:
                return None
            if not self.o.grid:
                # Seeded by the trial's number, so a sweep that was stopped and continued draws
                # what one that ran through would have drawn.
                seed = int(np.random.SeedSequence((self.o.seed, len(trials))).generate_state(1)[0])
                self.study.sampler = optuna.samplers.TPESampler(seed=seed)
            trial = self.study.ask()
            lock = trial_lock(self.o.study_dir, trial.number)
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"{lock.path}: held by another process, but trial {trial.number} is new")
            return self._running(trial, lock, taken_over=False)

    def _running(self, trial, lock, taken_over: bool) -> Running:
        slots = {r.slot for r in self.running}
        slot = next(i for i in range(self.o.parallel) if i not in slots)
        r = Running(trial, lock, trial_dir(self.o.study_dir, trial.number), slot, taken_over)
        self.running.append(r)
        return r

    # -- one trial ------------------------------------------------------------------------------

    def _launch(self, r: Running) -> None:
        config = r.run_dir / TRIAL_CONFIG
        if not config.is_file():  # a trial taken over keeps the config it started with
            params = {p.key: p.suggest(r.trial, self.o.grid) for p in self.o.params}
            try:
                cfg = self._trial_config(params, r.run_dir)
            except ConfigError as e:
                self._fail(r, "; ".join(e.errors))
                return
            r.run_dir.mkdir(parents=True, exist_ok=True)
            (r.run_dir / CLAIM_FILE).touch()  # a kiln run directory, before the trial's own files go in
            config.write_text(cfg.to_toml())
        values = ", ".join(f"{k}={v!r}" for k, v in r.trial.params.items())
        how = "was left running by a sweep that stopped; continuing it" if r.taken_over else "started"
        self._say(f"trial {r.number} {how}: {values} ({r.run_dir})")
        self._start(r)

    def _trial_config(self, params: dict[str, Any], run_dir: Path) -> Config:
        cfg = load_config(self.o.config, [*self.o.overrides, *(set_item(k, v) for k, v in params.items())])
        check_model_config(cfg)
        threads = cfg.run.threads or (self.threads if self.o.parallel > 1 else 0)
        return dataclasses.replace(
            cfg,
            run=dataclasses.replace(cfg.run, dir=str(run_dir), threads=threads),
            eval=dataclasses.replace(cfg.eval, every=eval_every(cfg)),
            checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"),
        )

    def _start(self, r: Running) -> None:
        launch = ["launch", "--nproc-per-node", str(self.o.nproc_per_node), "--"] if self.o.nproc_per_node > 1 else []
        command = [sys.executable, "-m", "kiln", *launch, "sweep-trial", str(self.o.study_dir), str(r.number)]
        with open(r.run_dir / TRIAL_LOG, "ab") as log:
            # A session of its own: a Ctrl-C at the terminal reaches the sweep alone, which then
            # stops each trial once (a second signal would stop kiln without a checkpoint).
            r.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(r.slot),
                start_new_session=True,
                pass_fds=(r.lock.fileno(),),
                preexec_fn=self.preexec,
            )
        r.stop_sent = None
        r.attempts += 1

    def _env(self, slot: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.o.parallel > 1:
            env["OMP_NUM_THREADS"] = str(self.threads)
            if self.gpus:
                per = len(self.gpus) // self.o.parallel
                mine = self.gpus[slot * per : (slot + 1) * per] if per else [self.gpus[slot % len(self.gpus)]]
                env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        return env

    def _poll(self, r: Running) -> None:
        assert r.proc is not None  # launched when claimed, or failed and dropped (_launch)
        code = r.proc.poll()
        if code is None:
            if r.stop_sent is not None and time.monotonic() - r.stop_sent > STOP_GRACE_S:
                r.proc.kill()
            return
        frozen = self.study.get_trials(deepcopy=False)[r.number]
        if frozen.state.name == "PRUNED":  # by its own process, at an evaluation
            step = frozen.last_step
            value = frozen.intermediate_values[step]
            self._say(f"trial {r.number} pruned at step {step} ({self.o.objective} {value:.5g}), checkpoint kept")
            self._done(r)
        elif frozen.state.name == "FAIL":  # its process found no objective in its evaluations
            self._done(r)
            raise ConfigError([frozen.user_attrs["error"]])
        elif code == 0:
            value = _final_value(r.run_dir, self.o.objective)
            if value is None:
                self._fail(r, f"it logged no {self.o.objective}")
                return
            frozen = self.study.tell(r.trial, value)
            if frozen.state.name == "COMPLETE":
                self._say(f"trial {r.number} finished: {self.o.objective} {value:.5g}{self._best_so_far()}")
            else:
                self._say(f"trial {r.number} failed: {self.o.objective} is {value}")
            self._done(r)
        elif (code < 0 or code in RETRIED_EXIT_CODES) and r.attempts < MAX_ATTEMPTS:
            self._say(f"trial {r.number} stopped ({_exit_reason(code)}); continuing it from its last checkpoint")
            self._start(r)
        else:
            error = _last_error(r.run_dir / TRIAL_LOG) or _exit_reason(code)
            self._fail(r, error)
            if code == USAGE_ERROR and not self._any_result():
                # The base config (or data) is wrong: every trial would fail the same way.
                raise ConfigError([f"trial {r.number} failed before any trial finished: {error}"])

    def _fail(self, r: Running, error: str) -> None:
        r.trial.set_user_attr("error", error)
        self.study.tell(r.trial, state=self.optuna.trial.TrialState.FAIL)
        self._say(f"trial {r.number} failed: {error} (see {r.run_dir / TRIAL_LOG})")
        self._done(r)

    def _done(self, r: Running) -> None:
        if r.proc is not None and r.proc.poll() is None:  # failed while it runs: it is of no more use
            self._stop(r)
            _wait(r.proc)
        r.lock.release()
        self.running.remove(r)
        write_csv(self.o.study_dir / CSV, trial_rows(self.study, self.o.params, self.o.study_dir), self.o.params)

    def _any_result(self) -> bool:
        return any(t.state.name in ("COMPLETE", "PRUNED") for t in self.study.get_trials(deepcopy=False))

    def _best_so_far(self) -> str:
        best = self.study.best_trial
        return f" (best: trial {best.number}, {best.value:.5g})"

    # -- stopping -------------------------------------------------------------------------------

    def _stop(self, r: Running) -> None:
        """SIGTERM, once: kiln saves a checkpoint at the end of the step and stops (under kiln
        launch, torchrun passes it on to every rank)."""
        if r.proc is not None and r.proc.poll() is None and r.stop_sent is None:
            r.proc.send_signal(signal.SIGTERM)
            r.stop_sent = time.monotonic()

    def _stop_all(self) -> None:
        """Stop the trials still running (they checkpoint) and wait for them; they stay RUNNING
        in the study, for the next sweep process to continue."""
        for r in self.running:
            self._stop(r)
        for r in self.running:
            if r.proc is not None:
                _wait(r.proc)
            r.lock.release()
        self.running.clear()

    def _say(self, message: str) -> None:
        print(f"kiln: {message}", flush=True)


def eval_every(cfg: Config) -> int:
    """A trial's evaluation interval: the config's, or when that evaluates only at the end
    (eval.every = 0, or not below max_steps), EVALS_PER_TRIAL evaluations over the run, so that
    the pruner has something to go by (with max_steps = auto, not known yet: the config's)."""
    steps = cfg.train.max_steps
    if not isinstance(steps, int) or 0 < cfg.eval.every < steps:
        return cfg.eval.every
    return max(1, math.ceil(steps / EVALS_PER_TRIAL))


def _wait(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _final_value(run_dir: Path, objective: str) -> float | None:
    try:
        records = read_metrics(run_dir)
    except CheckpointError:
        return None
    values = [r[objective] for r in records if objective in r and "loss" not in r and "event" not in r]
    return values[-1] if values else None


def _last_error(log: Path) -> str | None:
    """The last line of the trial's output that says what went wrong."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    errors = [line for line in lines if "error" in line.lower()]
    last = (errors or lines)[-1] if lines else None  # errors are some of the lines
    return last and re.sub(r"^kiln( \[rank \d+\])?: ", "", last)


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return {3: "out of memory", 130: "interrupted"}.get(code, f"exit code {code}")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _gpus() -> list[str]:
    """The GPUs trials share out, when there are several."""
    import torch

    count = torch.cuda.device_count()
    if count < 2:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[:count] if visible else [str(i) for i in range(count)]


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes Linux send the trial SIGTERM when the sweep process dies, even
    by SIGKILL: the trial saves a checkpoint and stops instead of running on as an orphan."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: trials outlive a killed sweep
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the sweep died before the call above
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
