"""kiln's training loop against a minimal hand-written PyTorch loop: same model, same batches,
same optimizer, one process. Prints tokens/s of each and kiln's ratio (target >= 0.97).

    python bench/loop_overhead.py [--preset tiny] [--steps 60] [--rounds 3]

Both loops see identical work: a GPT built from the same seed, AdamW with the same parameter
groups, micro-batches drawn from the same in-memory token array, gradient clipping, fp32. The
rounds alternate which loop goes first so that drift in the machine's speed hits both alike, a
first round warms the process up and is not counted, and the median of the per-round ratios is
reported. Within a run, timing starts after warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kiln import Trainer
from kiln.config import ModelConfig, load_config
from kiln.data.loader import make_train_loader
from kiln.models import GPT, build_gpt_config
from kiln.models.lm import lm_loss
from kiln.train.optim import build_optimizer, lr_at

from common import kiln_tokens_per_s, random_tokens


def hand_written(model, data, cfg, warmup: int) -> float:
    """The loop a person would write, with the same data order and optimizer; tokens/s."""
    t = cfg.train
    opt = build_optimizer(model, t, torch.device("cpu"))
    batches = iter(
        make_train_loader(
            data, schedule=t.global_batch_size, seed=t.seed, start_step=0, num_workers=0, pin_memory=False
        )
    )
    accum = cfg.grad_accum_steps()
    start = None
    for step in range(t.max_steps):
        if step == warmup:
            start = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        xs, ys = next(batches)
        for x, y in zip(xs.split(t.micro_batch_size), ys.split(t.micro_batch_size), strict=True):
            loss = model(x, y)  # the same fused output layer + loss the Trainer's lm_loss calls
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    return (t.max_steps - warmup) * t.global_batch_size * data.seq_len / elapsed


def kiln_loop(model, data, cfg, warmup: int) -> float:
    """kiln's Trainer; tokens/s from its own metrics, skipping the intervals inside warm-up."""
    Trainer(model, data, lm_loss, cfg, tokens_per_sample=data.seq_len, console=False).fit()
    return kiln_tokens_per_s(cfg.run.dir, warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = random_tokens(tmp / "tokens.bin", args.vocab, 2_000_000, args.seq_len)
        gpt_cfg = build_gpt_config(ModelConfig(preset=args.preset), args.vocab, args.seq_len)
        ratios, kiln_rates, hand_rates = [], [], []
        for r in range(args.rounds + 1):
            cfg = load_config(
                None,
                [
                    f"run.dir={tmp / f'run{r}'}",
                    "run.device=cpu",
                    f"train.max_steps={args.steps}",
                    f"train.micro_batch_size={args.micro_batch}",
                    f"train.global_batch_size={args.micro_batch * args.accum}",
                    f"train.log_every={args.warmup}",
                    "train.warmup_steps=5",
                    "data.num_workers=0",
                    "eval.every=0",
                    "checkpoint.every=0",
                    "checkpoint.resume=never",
                ],
            )
            # Alternate which loop goes first, so neither always gets the warmer (or cooler) machine.
            runs = {"kiln": kiln_loop, "hand": hand_written}
            rates = {}
            for name in ("kiln", "hand") if r % 2 else ("hand", "kiln"):
                torch.manual_seed(0)
                rates[name] = runs[name](GPT(gpt_cfg), data, cfg, args.warmup)
            k, h = rates["kiln"], rates["hand"]
            if r == 0:
                print(f"warm-up round (not counted): kiln {k:,.0f} tok/s, hand-written {h:,.0f} tok/s", flush=True)
                continue
            kiln_rates.append(k)
            hand_rates.append(h)
            ratios.append(k / h)
            print(f"round {r}: kiln {k:,.0f} tok/s, hand-written {h:,.0f} tok/s, ratio {k / h:.3f}", flush=True)
    print(
        json.dumps(
            {
                "bench": "loop_overhead",
                "preset": args.preset,
                "seq_len": args.seq_len,
                "micro_batch": args.micro_batch,
                "accum": args.accum,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "machine": platform.machine(),
                "processor": platform.processor() or platform.machine(),
                "kiln_tokens_per_s": statistics.median(kiln_rates),
                "hand_tokens_per_s": statistics.median(hand_rates),
                "ratio_median": statistics.median(ratios),
            }
        )
    )


if __name__ == "__main__":
    main()
