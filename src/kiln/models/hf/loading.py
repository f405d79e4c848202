"""A local Hugging Face model directory, read safely: its config, weights and tokenizer.

Nothing is downloaded (``local_files_only``, and the hub is told it is offline) and no code from
the directory runs (``trust_remote_code`` stays off: a model whose config maps to its own Python
classes is refused). Weights are read from safetensors only, one file or a sharded index.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kiln.config import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _offline() -> None:
    # Belt and braces beside local_files_only: nothing the hub library does may reach the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def transformers_module():
    """``transformers``, or a config error saying how to get it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            ["model.source: Hugging Face models need the transformers package: pip install 'kiln[hf]'"]
        ) from None
    _offline()
    # kiln reports what it loads itself; transformers' progress bars and load reports would
    # interleave with every rank's output.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def model_dir(source: str) -> Path:
    """The directory of ``model.source = "hf:PATH"``, checked: config.json and safetensors weights."""
    path = Path(source.removeprefix("hf:")).expanduser()
    if not path.is_dir():
        raise ConfigError([f"model.source: {path} is not a directory (a local Hugging Face model directory)"])
    if not (path / "config.json").is_file():
        raise ConfigError([f"model.source: {path} has no config.json; it is not a Hugging Face model directory"])
    return path.absolute()


def has_weights(path: Path) -> bool:
    return any((path / name).is_file() for name in WEIGHT_FILES)


def weights_error(path: Path) -> ConfigError:
    other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = (
        (
            f"; it has {', '.join(other)}, which kiln does not load (pickle files can run code): convert them to "
            "safetensors"
        )
        if other
        else ""
    )
    return ConfigError(
        [
            f"model.source: {path} has no {' or '.join(WEIGHT_FILES)}{hint}; or set "
            "model.weights=random to train the architecture from scratch"
        ]
    )


def read_config(path: Path) -> dict[str, Any]:
    """config.json as a dict, refused if it needs code from the directory or an unknown architecture."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError([f"model.source: {path / 'config.json'} is not readable JSON: {e}"]) from None
    if config.get("auto_map"):
        raise ConfigError(
            [
                f"model.source: {path} needs its own Python code (config.json has auto_map, i.e. "
                "trust_remote_code); kiln never runs code from a model directory"
            ]
        )
    model_type = config.get("model_type")
    transformers = transformers_module()
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(
            [
                f"model.source: {path / 'config.json'}: model_type {model_type!r} is not an "
                f"architecture of transformers {transformers.__version__}"
            ]
        )
    return config


def load_tokenizer(path: Path):
    """The directory's own tokenizer (a fast tokenizer; no code from the directory)."""
    transformers = transformers_module()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            [f"model.source: {path}: cannot load its tokenizer: {str(e).splitlines()[0][:300]}"]
        ) from None
