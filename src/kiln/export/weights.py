"""``--format safetensors``: the weights under kiln's own names in one ``model.safetensors`` (a
tied matrix stored once), beside the run's ``config.toml``, ``model.json`` and tokenizer: a
directory ``kiln generate``, ``kiln eval`` and ``kiln serve`` load like a run directory, without
its checkpoints' optimizer state (a fraction of their size)."""

from __future__ import annotations

import shutil
from pathlib import Path

from kiln.export.check import Logits
from kiln.train.run import LoadedRun, load_export

WEIGHTS = "model.safetensors"


def write_safetensors(run: LoadedRun, out: Path) -> dict[str, Logits]:
    from safetensors.torch import save_model

    save_model(run.model, str(out / WEIGHTS), metadata={"format": "pt"})
    for name in ("config.toml", "model.json", "tokenizer.json", "tokenizer"):
        src = run.directory / name
        if src.is_dir():
            shutil.copytree(src, out / name)
        elif src.is_file():
            shutil.copy2(src, out / name)
    return {"safetensors": load_export(out, "safetensors", "cpu").model}
