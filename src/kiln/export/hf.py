"""``--format hf``: a directory ``transformers`` loads with its own classes (``from_pretrained``):
config.json, model.safetensors and the tokenizer files. kiln's GPT becomes a ``LlamaForCausalLM``
(its state-dict adapter gives the names and the config); a fine-tuned ``transformers`` model is
saved by ``transformers`` itself, a classifier with its label names (``id2label``); a LoRA run
as the merged model (a QLoRA run's adapters merged into its dequantized 4-bit base), plus the
adapter in PEFT's own format under ``adapter/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, cast

from torch import nn

from kiln.checkpoint import CheckpointError
from kiln.checkpoint.weights import write_weights
from kiln.export.check import Logits
from kiln.models.hf.loading import transformers_module
from kiln.train.apply import merge_lora
from kiln.train.run import LoadedRun


class _Saves(Protocol):
    """A ``transformers`` model, or PEFT's wrapper of one."""

    def save_pretrained(self, save_directory: Path, **kwargs: object) -> None: ...


class _Merges(_Saves, Protocol):
    """PEFT's wrapper of a ``transformers`` model, which folds its adapters into the model."""

    def merge_and_unload(self) -> nn.Module: ...


def write_hf(run: LoadedRun, out: Path, max_shard_size: int) -> dict[str, Logits]:
    """Write the directory; the model loaded back from it through ``transformers``' public API."""
    hf = run.family.transformers_model(run.model)
    if hf is None:
        _write_converted(run, out, max_shard_size)
    else:
        if hasattr(hf, "merge_and_unload"):  # LoRA: the adapter as PEFT saves it, and the merged model
            adapted = cast(_Merges, hf)
            adapted.save_pretrained(out / "adapter")
            hf = adapted.merge_and_unload()
        cast(_Saves, hf).save_pretrained(out, max_shard_size=max_shard_size)
    write_tokenizer(run.tokenizer, out)
    return {"hf": _reload(out, run.cfg.model.task)}


def _reload(out: Path, task: str) -> Logits:
    transformers = transformers_module()
    auto = transformers.AutoModelForSequenceClassification if task == "sequence_classification" else None
    model = (auto or transformers.AutoModelForCausalLM).from_pretrained(out, local_files_only=True).eval()
    return lambda ids: model(ids).logits


def _write_converted(run: LoadedRun, out: Path, max_shard_size: int) -> None:
    """A model of kiln's own family, under the names of its Hugging Face equivalent."""
    adapter = run.family.state_dict_adapter(run.args)
    if adapter is None:
        raise CheckpointError(f"model family {run.cfg.model.family!r} has no Hugging Face equivalent to export to")
    write_weights(out, adapter.to_hf(merge_lora(run.model, run.family).state_dict()), max_shard_size)
    (out / "config.json").write_text(json.dumps(adapter.hf_config(), indent=2))


def write_tokenizer(tokenizer: Any, out: Path) -> None:
    """The run's tokenizer as ``transformers`` loads it (kiln's own becomes a fast tokenizer
    whose end-of-text token ends, begins and pads)."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)
        return
    from transformers import PreTrainedTokenizerFast

    from kiln.data.tokenizer import eot_id

    eot = tokenizer.id_to_token(eot_id(tokenizer))
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=eot, bos_token=eot, pad_token=eot, unk_token=None
    ).save_pretrained(out)
