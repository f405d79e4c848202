"""How long a checkpoint save blocks the training thread, synchronous against
``checkpoint.async_save``, and how much a background write slows the training steps it overlaps.

    python bench/async_save.py [--preset gpt2-124m] [--rounds 3] [--steps 4]

One process on the CPU. A Trainer trains one step (so the optimizer has its state), then each
round saves once synchronously and once in the background (the order alternating; a first
round, which allocates the host copy that later saves reuse, is not counted): "blocked" is
how long ``save`` took to return, "complete" how long until the background write was done. Then
``--steps`` forward/backward passes are timed alone and while a background write runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kiln import Trainer
from kiln.config import ModelConfig, load_config
from kiln.models import GPT, build_gpt_config
from kiln.models.lm import lm_loss

from common import random_tokens


def _mode(trainer: Trainer, background: bool) -> None:
    cfg = trainer.checkpointer.cfg
    trainer.checkpointer.cfg = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, async_save=background)
    )


def _steps(trainer: Trainer, batch: torch.Tensor, n: int) -> float:
    """Seconds per forward/backward pass of ``batch``."""
    started = time.perf_counter()
    for _ in range(n):
        lm_loss(trainer.model, (batch[:, :-1], batch[:, 1:])).backward()
    return (time.perf_counter() - started) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50304)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = random_tokens(tmp / "tokens.bin", args.vocab, 200_000, args.seq_len)
        cfg = load_config(
            None,
            [
                f"run.dir={tmp / 'run'}",
                "run.device=cpu",
                "train.max_steps=1",
                f"train.micro_batch_size={args.micro_batch}",
                f"train.global_batch_size={args.micro_batch}",
                "data.num_workers=0",
                "eval.every=0",
                "checkpoint.every=0",
                "checkpoint.keep=1",
            ],
        )
        torch.manual_seed(0)
        model = GPT(build_gpt_config(ModelConfig(preset=args.preset), args.vocab, args.seq_len))
        trainer = Trainer(model, data, lm_loss, cfg, tokens_per_sample=args.seq_len, console=False)
        trainer.fit()
        ckpt = trainer.checkpointer
        state_bytes = sum(f.stat().st_size for f in ckpt.latest().iterdir())
        blocked = {False: [], True: []}
        writes = []
        for r in range(args.rounds + 1):
            for background in (False, True) if r % 2 else (True, False):
                _mode(trainer, background)
                started = time.perf_counter()
                ckpt.save(trainer.step)
                took = time.perf_counter() - started
                ckpt.wait()
                if r:  # the first round allocates the host copy, kept for the run after that
                    blocked[background].append(took)
                    if background:
                        writes.append(time.perf_counter() - started)
        batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1))
        _steps(trainer, batch, 1)  # warm
        alone = _steps(trainer, batch, args.steps)
        _mode(trainer, True)
        ckpt.save(trainer.step)
        overlapped = _steps(trainer, batch, args.steps)
        ckpt.wait()
    print(
        json.dumps(
            {
                "bench": "async_save",
                "preset": args.preset,
                "parameters": model.num_params(),
                "checkpoint_mib": round(state_bytes / 2**20, 1),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "machine": platform.machine(),
                "sync_blocked_s": round(statistics.median(blocked[False]), 3),
                "async_blocked_s": round(statistics.median(blocked[True]), 3),
                "async_complete_s": round(statistics.median(writes), 3),
                "step_s_alone": round(alone, 3),
                "step_s_during_write": round(overlapped, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
