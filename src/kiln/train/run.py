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
        "parallel": {"strategy": cfg.parallel.strategy, "dp": world.dp, "tp": world.tp},
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


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None, device: str = "auto") -> LoadedRun:
    """A run directory's model at a checkpoint (the newest complete one by default), in eval mode,
    with its tokenizer: everything from the run directory, nothing from the data or its cache."""
    run_dir = Path(run_dir)
    hf_tokenizer = (run_dir / "tokenizer").is_dir()
    for name in ("config.toml", "model.json", "tokenizer" if hf_tokenizer else "tokenizer.json"):
        if not (run_dir / name).exists():
            raise CheckpointError(f"{run_dir}: not a kiln run directory (missing {name})")
    cfg = from_dict(tomllib.loads((run_dir / "config.toml").read_text()))
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise CheckpointError(f"{run_dir}: no complete checkpoint in {run_dir / 'checkpoints'}")
    model_state, _ = load_checkpoint(path)
    family = family_of(cfg.model)
    args = family.args_from_dict(json.loads((run_dir / "model.json").read_text()))
    model = build_model(family, args, "cpu", cfg.train.seed)
    if cfg.lora.rank:
        model = apply_lora(model, cfg.lora, family.lora_targets(args), cfg.model.task)
    if model_state is None:  # saved sharded: gather it into this one process
        model_state = model.state_dict()
        load_sharded(path, {"model": model_state})
    model.load_state_dict(model_state)
    model.to(resolve_device(device)).eval()
    if hf_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"), local_files_only=True)
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    return LoadedRun(cfg, family, args, model, tokenizer, path, int(path.name.split("-")[-1]))
