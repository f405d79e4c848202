"""The run around the loop: the files that describe it, the signals that stop it at a step
boundary, and its wall-clock budget."""

from __future__ import annotations

import json
import platform
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.config import Config
from kiln.distributed.world import World


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
