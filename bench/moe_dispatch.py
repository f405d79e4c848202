"""Tokens/s of a mixture-of-experts GPT training on the CPU: the experts' grouped matrix
multiply (``torch._grouped_mm``) against a loop over the experts.

    python bench/moe_dispatch.py [--preset tiny-moe] [--batch 16] [--seq 128] [--steps 20] [--dtype fp32]

One process. Each variant trains ``--steps`` AdamW steps (after 3 to warm up) on random tokens
(vocabulary 4096) from the same initial weights; the variants alternate, three rounds, and the
median round is reported with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from kiln.config import ModelConfig
from kiln.models import GPT, build_gpt_config
from kiln.models.gpt.moe import Experts


def tokens_per_s(model: GPT, batch: torch.Tensor, steps: int, dtype: torch.dtype) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(batch, targets=batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch.numel() / (time.perf_counter() - began)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cfg = build_gpt_config(ModelConfig(preset=args.preset), vocab_size=4096, max_seq_len=args.seq)
    torch.manual_seed(0)
    batch = torch.randint(0, 4096, (args.batch, args.seq))
    state = GPT(cfg).state_dict()
    rounds: dict[str, list[float]] = {"grouped": [], "loop": []}
    for _ in range(3):
        for variant in rounds:
            model = GPT(cfg)
            model.load_state_dict(state)
            for experts in model.modules():
                if isinstance(experts, Experts):
                    experts.native = variant == "grouped"
            rounds[variant].append(tokens_per_s(model, batch, args.steps, dtype))
    result = {variant: round(statistics.median(values)) for variant, values in rounds.items()}
    print(
        json.dumps(
            {
                "tokens_per_s": result,
                "grouped_over_loop": round(result["grouped"] / result["loop"], 3),
                "preset": args.preset,
                "batch": [args.batch, args.seq],
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "command": " ".join(["python", *sys.argv]),
            }
        )
    )


if __name__ == "__main__":
    main()
