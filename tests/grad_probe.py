"""The gradients of step 1 of the fine-tuning job, as the loop computes them (micro-batches,
accumulation, data-parallel reduction). Run directly, or under torchrun, where rank 0 writes them:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/grad_probe.py OUT.pt KEY=VALUE ...
"""

from __future__ import annotations

import sys

import torch

from kiln.config import load_config
from kiln.data.batch import split_batch, to_device
from kiln.train.jobs import job_for
from kiln.train.trainer import Trainer


def step_gradients(sets: list[str]) -> dict[str, torch.Tensor]:
    trainer = Trainer(job_for(load_config(None, sets)), console=False)
    batch = to_device(next(trainer.batches.loader(0)), trainer.device)
    trainer.train_step.forward_backward(split_batch(batch, trainer.micro_batch_size), 1)
    return {n: p.grad.detach().clone() for n, p in trainer.model.module.named_parameters() if p.grad is not None}


if __name__ == "__main__":
    import os

    grads = step_gradients(sys.argv[2:])
    if os.environ.get("RANK", "0") == "0":
        torch.save(grads, sys.argv[1])
