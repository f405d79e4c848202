"""``--format safetensors``: the weights under kiln's own names (a tied matrix stored once), in
``model.safetensors`` or, past ``--max-shard-size``, in several files with an index, beside the
run's ``config.toml``, ``model.json`` and tokenizer: a directory ``kiln generate``, ``kiln eval``
and ``kiln serve`` load like a run directory, without its checkpoints' optimizer state (a
fraction of their size)."""

from __future__ import annotations

import shutil
from pathlib import Path

from kiln.checkpoint.weights import write_weights
from kiln.export.check import Logits
from kiln.train.run import LoadedRun, load_export

RUN_FILES = ("config.toml", "model.json", "tokenizer.json", "tokenizer")


def write_safetensors(run: LoadedRun, out: Path, max_shard_size: int) -> dict[str, Logits]:
    write_weights(out, run.model.state_dict(), max_shard_size)
    copy_run_files(run.directory, out)
    return {"safetensors": load_export(out, "safetensors", "cpu").model}


def copy_run_files(run_dir: Path, out: Path) -> None:
    """What loads a safetensors export as a run: the run's config, model arguments and tokenizer."""
    for name in RUN_FILES:
        src = run_dir / name
        if src.is_dir():
            shutil.copytree(src, out / name)
        elif src.is_file():
            shutil.copy2(src, out / name)
