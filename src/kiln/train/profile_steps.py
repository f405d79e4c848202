"""``kiln profile``: a run's steps traced by torch.profiler in a throw-away run, of which only the
trace and its breakdown are kept."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from kiln.config import Config, ConfigError, parse_step_range, validate
from kiln.train.trainer import train


def profile_steps(cfg: Config, steps: str, out: str | Path | None = None) -> Path:
    """Train ``cfg`` up to the last of ``steps`` (START:END, 1-based) from scratch, profiling
    those steps into ``out`` (default RUN_DIR/profile), without evaluation or checkpoints; the
    run itself goes to a directory made inside ``out`` and removed after, so nothing of the
    config's run directory is read or written beside the profile. Returns ``out``."""
    try:
        _, end = parse_step_range(steps)
    except ValueError as e:
        raise ConfigError([f"--steps: {e}"]) from None
    validate(replace(cfg, profile=replace(cfg.profile, steps=steps)))  # before anything is written
    out = Path(out or Path(cfg.run.dir) / "profile")
    made = [p for p in (out, *out.parents) if not p.exists()]  # removed again if the run fails
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".run-", dir=out))
    cfg = replace(
        cfg,
        profile=replace(cfg.profile, steps=steps, dir=str(out)),
        run=replace(cfg.run, dir=str(scratch)),
        train=replace(cfg.train, max_steps=end),
        checkpoint=replace(cfg.checkpoint, every=0, resume="never"),
        eval=replace(cfg.eval, every=0, sample_tokens=0),
    )
    try:
        train(cfg)
    except BaseException:
        # A profile that did not run leaves no directory made for it (a bad data path is found
        # only once the run prepares its data); a directory that was there keeps what it held.
        shutil.rmtree(made[-1] if made else scratch, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out
