"""kiln against nanoGPT's own ``train.py``: tokens/s on the CPU for the same model shape, batch,
context and token stream.

    python bench/vs_nanogpt.py --nanogpt PATH [--iters 60] [--rounds 2]

PATH is a checkout of https://github.com/karpathy/nanoGPT (not shipped with kiln). Its train.py
runs as its README's CPU recipe runs it (``--device=cpu --compile=False``, fp32, no dropout, no
biases), on a dataset this script writes to PATH/data/kiln_bench: 2M uniformly random token ids
of a 4096-token vocabulary (train.bin, val.bin, meta.pkl); the values do not change the work.
kiln trains the same ids through its ``Trainer`` with its defaults (fused loss, fused AdamW, its
data loader), fp32. The shape on both sides: 4 layers, width 128, 4 heads, context 128, batch 32,
tied embeddings, and a two-matrix MLP of width 512 (nanoGPT's GELU MLP; kiln's
``model.mlp=relu2``), so the matrix products are the same; what differs is LayerNorm and learned
positions (nanoGPT) against RMSNorm and RoPE (kiln), none of it matrix work. Both use AdamW
(lr 3e-3, betas 0.9/0.95, weight decay 0.1), clipping at 1.0, 5 warm-up steps.

nanoGPT's tokens/s is its tokens per iteration over the median of the iteration times it prints,
after the first 10; kiln's comes from its metrics after the same 10 steps. Each round runs both,
alternating which goes first; a first round warms the caches and is not counted.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kiln import Trainer
from kiln.config import load_config
from kiln.models import GPT, GPTConfig
from kiln.models.lm import lm_loss

from common import alternating_rounds, kiln_tokens_per_s, random_tokens

VOCAB, LAYERS, WIDTH, HEADS, CONTEXT, BATCH = 4096, 4, 128, 4, 128, 32
WARMUP = 10


def nanogpt_tokens_per_s(root: Path, out: Path, iters: int) -> float:
    args = dict(
        dataset="kiln_bench",
        out_dir=str(out),
        device="cpu",
        compile=False,
        dtype="float32",
        eval_interval=10**6,
        eval_iters=1,
        log_interval=1,
        always_save_checkpoint=False,
        block_size=CONTEXT,
        batch_size=BATCH,
        gradient_accumulation_steps=1,
        n_layer=LAYERS,
        n_head=HEADS,
        n_embd=WIDTH,
        dropout=0.0,
        bias=False,
        learning_rate=3e-3,
        min_lr=3e-4,
        beta2=0.95,
        weight_decay=0.1,
        grad_clip=1.0,
        warmup_iters=5,
        max_iters=iters,
        lr_decay_iters=iters,
    )
    command = [sys.executable, "train.py", *(f"--{k}={v}" for k, v in args.items())]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=True)
    logged = re.findall(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", done.stdout, re.M)
    times = [float(t) for n, t in logged if int(n) >= WARMUP]
    return BATCH * CONTEXT / (statistics.median(times) / 1000)


def kiln_run(windows, run_dir: Path, iters: int) -> float:
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, n_layer=LAYERS, d_model=WIDTH, n_head=HEADS, n_kv_head=HEADS, d_ff=4 * WIDTH)
    model = GPT(GPTConfig(**shape, max_seq_len=CONTEXT, mlp="relu2", tie_embeddings=True))
    sets = [
        f"run.dir={run_dir}",
        "run.device=cpu",
        f"train.max_steps={iters}",
        f"train.micro_batch_size={BATCH}",
        f"train.global_batch_size={BATCH}",
        f"train.log_every={WARMUP}",
        "train.warmup_steps=5",
        "train.lr=3e-3",
        "eval.every=0",
        "checkpoint.every=0",
        "checkpoint.resume=never",
    ]
    Trainer(model, windows, lm_loss, load_config(None, sets), tokens_per_sample=CONTEXT, console=False).fit()
    return kiln_tokens_per_s(run_dir, WARMUP)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    data = args.nanogpt / "data" / "kiln_bench"
    data.mkdir(parents=True, exist_ok=True)
    windows = random_tokens(data / "train.bin", VOCAB, 2_000_000, CONTEXT)
    shutil.copy(data / "train.bin", data / "val.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": VOCAB}))
    with tempfile.TemporaryDirectory() as tmp:

        def measure(name: str, r: int) -> float:
            out = Path(tmp) / f"{name}{r}"
            if name == "kiln":
                return kiln_run(windows, out, args.iters)
            return nanogpt_tokens_per_s(args.nanogpt, out, args.iters)

        kiln_rates, nano_rates, ratios = alternating_rounds(args.rounds, measure, "nanogpt", "nanoGPT")
    summary = {
        "bench": "vs_nanogpt",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
        "kiln_tokens_per_s": statistics.median(kiln_rates),
        "nanogpt_tokens_per_s": statistics.median(nano_rates),
        "ratio_median": statistics.median(ratios),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
