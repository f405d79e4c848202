"""The gradients of step 1 of the fine-tuning job, as the loop computes them (micro-batches,
accumulation, data-parallel reduction): in this process, or on 2 gloo ranks forked from the warm
server of ``kilnrun.launch`` (each joins the group from the environment torchrun would give it),
where rank 0 writes them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.data.batch import split_batch, to_device
from kiln.train.jobs import job_for
from kiln.train.trainer import Trainer

from kilnrun import free_port, join_as, spawn


def step_gradients(sets: list[str]) -> dict[str, torch.Tensor]:
    trainer = Trainer(job_for(load_config(None, sets)), console=False)
    batch = to_device(next(trainer.batches.loader(0)), trainer.device)
    trainer.train_step.forward_backward(split_batch(batch, trainer.micro_batch_size), 1)
    return {n: p.grad.detach().clone() for n, p in trainer.model.module.named_parameters() if p.grad is not None}


def _rank_gradients(rank: int, port: int, out: str, sets: list[str]) -> None:
    from kiln.distributed.world import close_world

    join_as(rank, 2, port)
    try:
        grads = step_gradients(sets)
        assert torch.distributed.get_world_size() == 2  # not two processes of one rank each
        if rank == 0:
            torch.save(grads, out)
    finally:
        close_world()  # a forked process ends without running atexit


def assert_same_gradients_three_ways(sets: Callable[..., list[str]], tmp_path: Path) -> None:
    """Step 1's gradients with micro-batch 4, with micro-batch 1 accumulated 4 times, and over 2
    gloo ranks with micro-batch 1 accumulated twice are equal (1e-6, fp32) and not zero.
    ``sets(micro, **overrides)`` gives the run's KEY=VALUE items at that micro-batch."""
    one = step_gradients(sets(4))
    accumulated = step_gradients(sets(1))
    out = tmp_path / "ranks.pt"
    spawn(_rank_gradients, (free_port(), str(out), sets(1, run__dir=tmp_path / "ddp")), 2)
    ranks = torch.load(out)
    assert one.keys() == accumulated.keys() == ranks.keys()
    for name in one:
        assert one[name].abs().max() > 0, name
        torch.testing.assert_close(accumulated[name], one[name], rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(ranks[name], one[name], rtol=0, atol=1e-6, msg=name)
