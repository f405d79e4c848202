"""Is kiln's training on a GPU repeatable bit for bit, eager and compiled, with and without
deterministic algorithms, and what do they cost? Each arm trains the same model on the same
batches twice in one process; the arm is repeatable when every logged loss and every final
weight are equal bitwise.

    python bench/gpu_determinism.py --out DIR [--deterministic off|warn|strict] [--attention flash]
        [--preset gpt2-124m] [--micro 16]

cuBLAS reads CUBLAS_WORKSPACE_CONFIG when the process first uses it, so the deterministic arms
run in a process of their own, started with ``CUBLAS_WORKSPACE_CONFIG=:4096:8 ... --deterministic warn``
(the script refuses it otherwise), and the others without. `--device cpu --preset tiny --steps 8`
checks the script on a CPU. One JSON line per arm goes to DIR/determinism.jsonl. "warn" asks for
deterministic algorithms where an op has one and warns where not; "strict" makes such an op an
error, and is also what switches the attention kernels' backward passes to their deterministic
forms (an arm that fails records its error)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu import VOCAB, config, model_for
from kiln import Trainer
from kiln.models.lm import lm_loss
from kiln.plan import make_plan

from common import kiln_tokens_per_s, random_tokens

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def train_once(cfg, data) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The run's logged losses, its final weights (on the CPU) and its peak allocated GiB."""
    model = model_for(cfg)
    if cfg.run.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    flops = make_plan(cfg).job.flops_per_token
    Trainer(model, data, lm_loss, cfg, tokens_per_sample=data.seq_len, flops_per_token=flops, console=False).fit()
    records = [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["memory/peak_allocated_gib"] for r in records if "memory/peak_allocated_gib" in r]
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return [r["loss"] for r in records if "loss" in r], weights, max(peaks, default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deterministic", default="off", choices=["off", "warn", "strict"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--arms", default="eager,compiled")
    ap.add_argument(
        "--attention",
        default="default",
        choices=["default", *BACKENDS],
        help="the only attention kernel scaled_dot_product_attention may pick (default: its own choice)",
    )
    args = ap.parse_args()
    if args.deterministic != "off" and args.device == "cuda" and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        sys.exit("--deterministic on a GPU needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if args.deterministic != "off":
        # warn: an op without a deterministic kernel is named (collected below), not fatal.
        torch.use_deterministic_algorithms(True, warn_only=args.deterministic == "warn")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = random_tokens(tmp / "random.bin", VOCAB, 4_000_000, args.seq_len)
        for arm in args.arms.split(","):
            began = time.monotonic()
            runs = []
            backend = BACKENDS.get(args.attention)
            chosen = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
            with warnings.catch_warnings(record=True) as caught, chosen:
                warnings.simplefilter("always")
                for repeat in range(2):
                    cfg = config(
                        tmp / f"{arm}-{repeat}",
                        device,
                        args.preset,
                        "bf16",
                        args.steps,
                        args.micro,
                        args.seq_len,
                        **{"train.compile": str(arm == "compiled").lower(), "train.log_every": 2},
                    )
                    try:
                        runs.append((*train_once(cfg, data), kiln_tokens_per_s(cfg.run.dir, args.steps // 2)))
                    except Exception as e:  # strict: an op without a deterministic kernel
                        runs.append(e)
            if errors := [r for r in runs if isinstance(r, Exception)]:
                row = {"arm": arm, "deterministic": args.deterministic, "error": repr(errors[0])[:2000]}
                with (args.out / "determinism.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
                continue
            (loss_a, w_a, peak, rate_a), (loss_b, w_b, _, rate_b) = runs
            differ = [k for k in w_a if not torch.equal(w_a[k], w_b[k])]
            first = next((i for i, (a, b) in enumerate(zip(loss_a, loss_b, strict=True)) if a != b), None)
            nondeterministic = sorted(
                {str(w.message)[:200] for w in caught if "deterministic" in str(w.message).lower()}
            )
            row = {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "arm": arm,
                "attention": args.attention,
                "deterministic": args.deterministic,
                "preset": args.preset,
                "micro": args.micro,
                "losses_equal": loss_a == loss_b,
                "first_differing_log": first,
                "max_loss_diff": max(abs(a - b) for a, b in zip(loss_a, loss_b, strict=True)),
                "weights_differing": len(differ),
                "weights": len(w_a),
                "tokens_per_s": [round(rate_a), round(rate_b)],
                "peak_allocated_gib": peak,
                "nondeterministic_ops": nondeterministic,
                "seconds": round(time.monotonic() - began, 1),
            }
            with (args.out / "determinism.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
