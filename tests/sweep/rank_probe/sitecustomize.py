"""Test-only, on PYTHONPATH in one test: each torchrun worker writes the config it trains with to
its run directory as rank-N.toml (a run's config.toml is written by rank 0 alone)."""

import os
from pathlib import Path

if "RANK" in os.environ:
    import kiln.train.jobs as jobs

    _build = jobs.build_trainer

    def _build_and_record(cfg, **kw):
        Path(cfg.run.dir, f"rank-{os.environ['RANK']}.toml").write_text(cfg.to_toml())
        return _build(cfg, **kw)

    jobs.build_trainer = _build_and_record
