"""Fine-tuning a ~1B Llama on one GPU, as issue 14 asks: bf16 with FSDP and activation
checkpointing, then QLoRA (an nf4 base under bf16 LoRA adapters). Tokens/s, the largest log
interval's peak memory against `kiln plan`, and the loss at the start and the end.

    python bench/gpu_finetune.py --out DIR [--steps 40] [--runs fsdp,qlora]

The model is a `LlamaForCausalLM` of kiln's `1b` shape (16 layers, width 2048, 32 query and 8
key/value heads, MLP 8192, tied) with random weights, saved here from its config together with
a byte-level BPE trained here (the test suite's `tests/hf_models.py`): nothing is downloaded.
The records are bench/finetune_vs_hf.py's prompt/completion pairs from the standard library
(a function's signature and docstring, then its body), packed into 1024-token rows.
(`--device cpu --layers 2 --width 256 --steps 6` runs the same code on a CPU in a minute.)

Each run appends a JSON line to DIR/gpu_finetune.jsonl as it ends; a failing run records its
error and the next one runs."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from finetune_vs_hf import causal_records
from kiln.config import load_config
from kiln.plan import make_plan
from kiln.train.trainer import train

from common import kiln_tokens_per_s

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import tiny_llama  # noqa: E402


def llama(directory: Path, layers: int, width: int) -> Path:
    """kiln's `1b` shape at width 2048 and 16 layers: 64-wide heads, a quarter of them for keys
    and values, an MLP 4x the width, tied, with a BPE of up to 8192 tokens."""
    return tiny_llama(
        directory,
        tie=True,
        n_kv_head=max(1, width // 256),
        vocab=8192,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        max_position_embeddings=2048,
        rope_theta=500000.0,
    )


RUNS = {
    "fsdp": {"parallel.strategy": "fsdp", "train.activation_checkpointing": "true", "train.lr": 1e-4},
    "qlora": {"lora.rank": 16, "lora.alpha": 32, "lora.quantize_base": "nf4", "train.lr": 2e-4},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", default="fsdp,qlora")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    header = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(header), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        model = llama(tmp / "llama", args.layers, args.width)
        train_file, val_file = causal_records(tmp / "records")
        print(json.dumps({"built_s": round(time.perf_counter() - t0, 1)}), flush=True)
        for name in args.runs.split(","):
            run_dir = tmp / name
            sets = {
                "run.dir": run_dir,
                "run.device": args.device,
                "model.source": f"hf:{model}",
                "model.task": "causal_lm",
                "data.source": train_file,
                "data.val_source": val_file,
                "data.seq_len": args.seq_len,
                "data.packing": "true",
                "data.num_workers": 2,
                "train.precision": "bf16" if args.device == "cuda" else "fp32",
                "train.max_steps": args.steps,
                "train.micro_batch_size": args.micro_batch,
                "train.global_batch_size": args.micro_batch,
                "train.warmup_steps": 5,
                "train.log_every": 5,
                "eval.every": 0,
                "eval.sample_tokens": 0,
                "checkpoint.every": 0,
                "checkpoint.resume": "never",
                **RUNS[name],
            }
            try:
                cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
                planned = make_plan(cfg).memory.allocated / 2**30
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                train(cfg, console=False)
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                losses = [r["loss"] for r in records if "loss" in r]
                peaks = [r["memory/peak_allocated_gib"] for r in records if "memory/peak_allocated_gib" in r]
                row = {
                    "run": name,
                    "tokens_per_s": kiln_tokens_per_s(run_dir, args.steps // 2),
                    "peak_allocated_gib": max(peaks, default=None),
                    "plan_allocated_gib": planned,
                    "first_loss": losses[0] if losses else None,
                    "last_loss": losses[-1] if losses else None,
                }
            except Exception as e:  # a failing run is a result; the next one runs
                traceback.print_exc()
                row = {"run": name, "error": f"{type(e).__name__}: {e}"[:4000]}
            with (args.out / "gpu_finetune.jsonl").open("a") as f:
                f.write(json.dumps({**header, **row}) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
