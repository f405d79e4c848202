"""``kiln export RUN --format hf``: a directory ``transformers`` loads with its own classes
(``from_pretrained``): config.json, model.safetensors and the tokenizer files; for a classifier its
label names (``id2label``) are in the config; for LoRA runs the merged model, plus the adapter in
PEFT's own format under ``adapter/``.

The directory is written under a temporary name beside ``out`` and renamed when complete, so an
interrupted export leaves nothing that looks whole.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kiln.checkpoint import CheckpointError
from kiln.io import write_atomic
from kiln.train.run import LoadedRun, load_run


def export_hf(
    run_dir: str | Path, out: str | Path, *, checkpoint: str | Path | None = None, force: bool = False
) -> dict[str, Any]:
    """Export a run's checkpoint (the newest by default) to ``out``; what was written, as a dict
    (also ``out/export.json``)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out}: exists and is not empty; choose another --out or pass --force")
    run = load_run(run_dir, checkpoint, device="cpu")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        files = _write(run, staging)
        info = {
            "format": "hf",
            "run": str(Path(run_dir).absolute()),
            "checkpoint": str(run.checkpoint),
            "step": run.step,
            "files": files,
        }
        write_atomic(staging / "export.json", json.dumps(info, indent=2))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return info


def _write(run: LoadedRun, out: Path) -> list[str]:
    hf = getattr(run.model, "hf", None)
    if hf is None:
        _write_converted(run, out)
    else:
        if hasattr(hf, "merge_and_unload"):  # LoRA: the adapter as PEFT saves it, and the merged model
            hf.save_pretrained(out / "adapter")
            hf = hf.merge_and_unload()
        hf.save_pretrained(out)
    _write_tokenizer(run, out)
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def _write_converted(run: LoadedRun, out: Path) -> None:
    """A model of kiln's own family, under the names of its Hugging Face equivalent."""
    from safetensors.torch import save_file

    adapter = run.family.state_dict_adapter(run.args)
    if adapter is None:
        raise CheckpointError(f"model family {run.cfg.model.family!r} has no Hugging Face equivalent to export to")
    state = adapter.to_hf(run.model.state_dict())
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(adapter.hf_config(), indent=2))


def _write_tokenizer(run: LoadedRun, out: Path) -> None:
    if hasattr(run.tokenizer, "save_pretrained"):
        run.tokenizer.save_pretrained(out)
        return
    from transformers import PreTrainedTokenizerFast

    from kiln.data.tokenizer import eot_id

    eot = run.tokenizer.id_to_token(eot_id(run.tokenizer))
    PreTrainedTokenizerFast(
        tokenizer_object=run.tokenizer, eos_token=eot, bos_token=eot, pad_token=eot, unk_token=None
    ).save_pretrained(out)
