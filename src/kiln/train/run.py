"""The run around the loop: the files that describe it, the signals that stop it at a step
boundary, its wall-clock budget, and loading a run directory back (to evaluate, sample or export)."""

from __future__ import annotations

import dataclasses
import json
import platform
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, load_sharded
from kiln.config import Config, from_dict, tomllib
from kiln.device import resolve_device
from kiln.distributed.world import World
from kiln.models.family import ModelFamily, build_model, family_of
from kiln.train.apply import apply_lora


def write_run_files(run_dir: Path, cfg: Config, world: World, model: nn.Module) -> None:
    """``config.toml`` (the resolved config) and ``env.json`` (software, device, parallel layout)."""
    if not world.is_main:
        return
    device = world.device
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "world_size": world.size,
        "parallel": {"strategy": cfg.parallel.strategy, "pp": world.pp, "dp": world.dp, "tp": world.tp},
    }
    (run_dir / "env.json").write_text(json.dumps(env, indent=2))


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop saves and stops at the next step boundary, so a
    checkpoint is never taken from a half-applied optimizer step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # second signal: stop now
            raise KeyboardInterrupt
        self.requested = True
        print(
            f"\nkiln: received signal {signum}; saving a checkpoint at the end of this step "
            "(send it again to stop at once)",
            flush=True,
        )

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Budget:
    """Wall-clock limit of one ``fit`` call, checked on the host at step boundaries (no sync)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._t0 = time.perf_counter()
        self._step_t0 = self._t0

    def step_started(self) -> None:
        self._step_t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def next_step_overruns(self) -> bool:
        """Would one more step, as long as the last one, end past the budget?"""
        now = time.perf_counter()
        return (now - self._t0) + (now - self._step_t0) > self.seconds


@dataclasses.dataclass
class LoadedRun:
    cfg: Config
    family: ModelFamily
    args: Any
    model: nn.Module
    tokenizer: Any  # a tokenizers.Tokenizer (kiln's own), or the model's transformers tokenizer
    checkpoint: Path
    step: int
    directory: Path  # the run directory, or the export directory it was loaded from


def load_run(path: str | Path, checkpoint: str | Path | None = None, device: str = "auto") -> LoadedRun:
    """A model with its tokenizer, in eval mode, from ``path``: a run directory (at its newest
    complete checkpoint, or ``checkpoint``), one of its checkpoint directories, or a directory
    ``kiln export`` wrote in the ``safetensors`` or ``hf`` format. Nothing is read from the data or
    its cache."""
    path = Path(path)
    if (path / "export.json").is_file():
        info = json.loads((path / "export.json").read_text())
        return load_export(path, info.get("format"), device, int(info.get("step", 0)), info.get("task", "causal_lm"))
    if checkpoint is None and path.parent.name == "checkpoints" and (path.parent.parent / "config.toml").is_file():
        path, checkpoint = path.parent.parent, path
    run_dir = path
    hf_tokenizer = (run_dir / "tokenizer").is_dir()
    for name in ("config.toml", "model.json", "tokenizer" if hf_tokenizer else "tokenizer.json"):
        if not (run_dir / name).exists():
            raise CheckpointError(f"{run_dir}: not a kiln run directory (missing {name})")
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise CheckpointError(f"{run_dir}: no complete checkpoint in {run_dir / 'checkpoints'}")
    model_state, _ = load_checkpoint(path)
    cfg, family, args, model = _build_saved(run_dir)
    if model_state is None:  # saved sharded: gather it into this one process
        model_state = model.state_dict()
        load_sharded(path, {"model": model_state})
    model.load_state_dict(model_state)
    model.to(resolve_device(device)).eval()
    step = int(path.name.split("-")[-1])
    return LoadedRun(cfg, family, args, model, _tokenizer(run_dir), path, step, run_dir)


def _build_saved(directory: Path) -> tuple[Config, ModelFamily, Any, nn.Module]:
    """The config, family, arguments and (freshly initialised) model described by the
    ``config.toml`` and ``model.json`` of a run or a safetensors export."""
    cfg = from_dict(tomllib.loads((directory / "config.toml").read_text()))
    family = family_of(cfg.model)
    args = family.args_from_dict(json.loads((directory / "model.json").read_text()))
    model = build_model(family, args, "cpu", cfg.train.seed)
    # A QLoRA base is loaded as the checkpoint holds it, dequantized: what the run computed, exactly.
    model = apply_lora(model, cfg, family.lora_targets(args), quantize=False)
    return cfg, family, args, model


def _tokenizer(directory: Path):
    if (directory / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory / "tokenizer"), local_files_only=True)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def load_export(path: Path, fmt: str, device: str = "auto", step: int = 0, task: str = "causal_lm") -> LoadedRun:
    """A directory ``kiln export`` wrote: safetensors (kiln's names, beside the run's config) or hf
    (loaded through ``transformers`` as the hf family loads any model directory)."""
    if fmt == "safetensors":
        from safetensors.torch import load_model

        cfg, family, args, model = _build_saved(path)
        load_model(model, str(path / "model.safetensors"))
        tokenizer = _tokenizer(path)
    elif fmt == "hf":
        cfg = from_dict({"model": {"source": f"hf:{path}", "task": task}})
        family = family_of(cfg.model)
        args = family.resolve(cfg.model, vocab_size=0, seq_len=0)
        model = family.create(args, "cpu", cfg.train.seed)
        tokenizer = family.tokenizer(args)
    else:
        raise CheckpointError(
            f"{path}: a {fmt} export runs without kiln (see its export.json); kiln loads run directories "
            "and the safetensors and hf exports"
        )
    model.to(resolve_device(device)).eval()
    return LoadedRun(cfg, family, args, model, tokenizer, path, step, path)
