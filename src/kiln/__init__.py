"""kiln: train Transformer models with PyTorch efficiently, from a laptop CPU to a GPU cluster.

The public entry points are re-exported here lazily, so ``import kiln`` (and the CLI's start-up)
does not pay for importing torch until it is needed.
"""

from __future__ import annotations

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "kiln.config",
    "ConfigError": "kiln.config",
    "load_config": "kiln.config",
    "Trainer": "kiln.train.trainer",
    "FitResult": "kiln.train.trainer",
    "GPT": "kiln.models",
    "GPTConfig": "kiln.models",
    "ModelFamily": "kiln.models",
    "ParallelPlan": "kiln.models",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
