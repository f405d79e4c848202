"""Test-only, on PYTHONPATH in one test: each torchrun worker writes the config it trains with to
its run directory as rank-N.toml (a run's config.toml is written by rank 0 alone)."""

import os
from pathlib import Path

if "RANK" in os.environ:
    import kiln.train.trainer as trainer

    _train = trainer.train

    def _train_and_record(cfg, **kw):
        Path(cfg.run.dir, f"rank-{os.environ['RANK']}.toml").write_text(cfg.to_toml())
        return _train(cfg, **kw)

    trainer.train = _train_and_record
