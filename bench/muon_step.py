"""Muon's optimizer step under FSDP: each hidden matrix orthogonalised once, by the rank that
owns it (kiln's ``orthogonalize_all``), against every rank gathering and orthogonalising every
matrix (what kiln did before: N ranks doing N times the work).

    python -m torch.distributed.run --nproc-per-node 2 bench/muon_step.py [--preset gpt2-124m] [--steps 5]

Each rank builds the preset, shards every block and the root with FSDP2 (``fully_shard``), makes
gradients with one forward and backward, then times whole ``Muon.step()`` calls both ways (the
"every rank" way by swapping in the per-matrix path of ``orthogonalize``). Rank 0 prints the
median seconds per step and the speed-up; both ways give the same updates (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from kiln.config import TrainConfig
from kiln.models.gpt.model import GPT, GPTConfig
from kiln.models.gpt.presets import PRESETS
from kiln.train import optim


def every_rank(updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """Before: each update gathered whole and orthogonalised on every rank."""
    return [optim.orthogonalize(u) for u in updates]


def timed_steps(opt: torch.optim.Optimizer, steps: int, spread: bool) -> list[float]:
    chosen = optim.orthogonalize_all
    if not spread:
        optim.orthogonalize_all = every_rank
    try:
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            dist.barrier()
            times.append(time.perf_counter() - start)
    finally:
        optim.orthogonalize_all = chosen
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = GPTConfig(**{**PRESETS[args.preset], "vocab_size": 4096, "max_seq_len": 128})
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x = torch.randint(0, 4096, (2, 128))
    model(x, x).backward()
    hidden = [p.grad for n, p in model.named_parameters() if p.ndim == 2 and "emb" not in n and "lm_head" not in n]
    for a, b in zip(every_rank(hidden), optim.orthogonalize_all(hidden), strict=True):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=1e-6)
    opt = optim.build_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu"))
    opt.step()  # the optimizer's state exists: the timed steps are alike
    before = timed_steps(opt, args.steps, spread=False)
    after = timed_steps(opt, args.steps, spread=True)
    if dist.get_rank() == 0:
        weights = sum(g.numel() for g in hidden)
        b, a = statistics.median(before), statistics.median(after)
        print(
            f"{args.preset} ({weights:,} hidden-matrix weights), FSDP x {dist.get_world_size()} gloo ranks: "
            f"Muon step {b:.3f} s every rank -> {a:.3f} s owner rank ({b / a:.2f}x), median of {args.steps}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
