"""Where a GRPO step's time goes: sampling the completions against training on them, from the
log's ``time/generation_s`` and the intervals' wall-clock time, one process on the CPU.

    pip install -e ".[bench]" && python bench/grpo_split.py [--steps 20] [--group 8] [--max-new 32] [--mixed]

The model is bench/finetune_vs_hf.py's Llama (width 256, 4 layers, MiniLM's 30,522-token
vocabulary), untrained; the prompts are small sums ("3 + 4 ="), the reward 1 for a completion
whose first number is the sum (examples/rewards.py's ``right_sum``). 8 prompts a step,
``--group`` completions each, up to ``--max-new`` tokens (an untrained model rarely ends early, so
nearly every completion is that long). With --mixed each prompt starts with a request of its own
length ("Please add. " zero to eight times), so the prompts of a step have different lengths.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def write_prompts(path: Path, mixed: bool, n: int = 400) -> list[dict]:
    """``n`` small sums as {prompt, answer} records in ``path`` (jsonl); with ``mixed`` each after a
    request of its own length."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        preamble = "Please add. " * rng.randint(0, 8) if mixed else ""
        rows.append({"prompt": f"{preamble}{a} + {b} =", "answer": a + b})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def train_grpo(model: Path, source: Path, run: Path, args, seq_len: int, log_every: int) -> list[dict]:
    """kiln's GRPO on ``model`` and the prompts of ``source``, 8 prompts a step, ``args.group``
    completions of up to ``args.max_new`` tokens each, rewarded by examples/rewards.py's
    ``right_sum``: its log's records."""
    from kiln.config import load_config
    from kiln.train.trainer import train

    items = {
        "run.dir": run,
        "run.device": "cpu",
        "model.source": f"hf:{model}",
        "data.source": source,
        "data.num_workers": 0,
        "data.seq_len": seq_len,
        "run.job": "grpo",
        "grpo.reward": "rewards:right_sum",  # examples/rewards.py
        "grpo.group_size": args.group,
        "grpo.max_new_tokens": args.max_new,
        "train.max_steps": args.steps,
        "train.micro_batch_size": 8,
        "train.global_batch_size": 8,
        "train.lr": 1e-5,
        "train.log_every": log_every,
        "eval.every": 0,
        "checkpoint.every": 0,
    }
    train(load_config(None, [f"{k}={v}" for k, v in items.items()]), console=False)
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--mixed", action="store_true", help="prompts of different lengths")
    args = ap.parse_args()
    sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
    import torch
    from classify_stdlib import minilm

    from finetune_vs_hf import tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tiny_llama(tmp / "model", minilm(tmp))
        write_prompts(tmp / "prompts.jsonl", args.mixed)
        logged = train_grpo(model, tmp / "prompts.jsonl", tmp / "run", args, seq_len=64, log_every=5)
    logged = [r for r in logged if "time/generation_s" in r]
    # The first interval holds the start-up; the rest are steady.
    steady = logged[1:] or logged
    seconds = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(logged, logged[1:], strict=False)] or [
        logged[0]["elapsed_s"]
    ]
    generation = sum(r["time/generation_s"] for r in steady)
    total = sum(seconds)
    print(
        json.dumps(
            {
                "bench": "grpo_split",
                "steps": args.steps,
                "group": args.group,
                "max_new_tokens": args.max_new,
                "mixed_lengths": args.mixed,
                "completion_tokens_mean": sum(r["completions/mean_length"] for r in steady) / len(steady),
                "generation_s": round(generation, 2),
                "interval_s": round(total, 2),
                "generation_share": round(generation / total, 3),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "processor": platform.processor() or platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
