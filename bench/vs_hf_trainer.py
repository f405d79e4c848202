"""kiln against the Hugging Face ``Trainer`` on the same model and batches: tokens/s of each and
kiln's ratio (target >= 1.15 on 2 CPU cores).

    pip install -e ".[bench]" && python bench/vs_hf_trainer.py [--steps 80] [--rounds 2]

On a GPU: ``--device cuda --precision bf16 --preset gpt2-124m --seq-len 1024 --vocab 50304``
(both sides bf16 autocast over fp32 weights and fused AdamW; ``--compile`` compiles kiln,
``--hf-compile`` sets the Trainer's ``torch_compile``).

The model is the same architecture on both sides: kiln's ``tiny`` preset (4 layers, width 128,
4 heads, SwiGLU 384, tied embeddings, RoPE, RMSNorm) and a ``LlamaForCausalLM`` with the same
config, both initialised normal(0, 0.02). Both see the same windows of the same token stream in
the same order (kiln's step-pure sampler drives the HF dataset), fp32 on the CPU, AdamW with
lr 3e-3, betas (0.9, 0.95), weight decay 0.1, clipping at 1.0, warmup then cosine. Both are
timed in one process after warm-up steps, rounds alternating which goes first.
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
from torch.utils.data import Dataset

from kiln import Trainer
from kiln.config import ModelConfig, load_config
from kiln.data.loader import StepSampler
from kiln.models import GPT, build_gpt_config
from kiln.models.lm import lm_loss

from common import alternating_rounds, kiln_tokens_per_s, random_tokens


class InKilnOrder(Dataset):
    """The token windows in exactly the order kiln's sampler visits them, as HF wants them:
    ``input_ids`` and ``labels`` (HF shifts labels inside the model)."""

    def __init__(self, windows, global_batch: int, seed: int, steps: int):
        sampler = iter(StepSampler(len(windows), global_batch, seed))
        self.order = [i for _ in range(steps) for i in next(sampler)]
        self.windows = windows

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.windows[self.order[i]]
        return {"input_ids": x, "labels": x}


def hf_model(gpt_cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=gpt_cfg.vocab_size,
        hidden_size=gpt_cfg.d_model,
        intermediate_size=gpt_cfg.d_ff,
        num_hidden_layers=gpt_cfg.n_layer,
        num_attention_heads=gpt_cfg.n_head,
        num_key_value_heads=gpt_cfg.n_kv_head,
        max_position_embeddings=gpt_cfg.max_seq_len,
        rms_norm_eps=gpt_cfg.norm_eps,
        rope_theta=gpt_cfg.rope_theta,
        tie_word_embeddings=gpt_cfg.tie_embeddings,
        initializer_range=gpt_cfg.init_std,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def hf_tokens_per_s(model, data, args, out_dir: Path) -> float:
    from transformers import Trainer as HFTrainer
    from transformers import TrainerCallback, TrainingArguments

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **kw):
            stamps.append(time.perf_counter())

    targs = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        learning_rate=3e-3,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        logging_steps=args.warmup,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=args.precision == "bf16",
        optim="adamw_torch_fused" if args.device == "cuda" else "adamw_torch",
        torch_compile=args.hf_compile,
        seed=1337,
        dataloader_num_workers=0,
        disable_tqdm=True,
        dataloader_drop_last=True,
    )
    # The dataset is already in kiln's order; a sequential sampler keeps it so.
    trainer = HFTrainer(model=model, args=targs, train_dataset=data, callbacks=[Clock()])
    trainer._get_train_sampler = lambda *a, **kw: torch.utils.data.SequentialSampler(data)
    trainer.train()
    timed = len(stamps) - args.warmup
    return timed * args.micro_batch * args.seq_len / (stamps[-1] - stamps[args.warmup - 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--compile", action="store_true", help="kiln with train.compile=true")
    ap.add_argument("--hf-compile", action="store_true", help="the Trainer with torch_compile=True")
    ap.add_argument("--preset", default="tiny", help="kiln model preset; the HF side is a Llama of its shape")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()

    gpt_cfg = build_gpt_config(ModelConfig(preset=args.preset), args.vocab, args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        windows = random_tokens(tmp / "tokens.bin", args.vocab, 2_000_000, args.seq_len)
        hf_data = InKilnOrder(windows, args.micro_batch, 1337, args.steps)

        def measure(name: str, r: int) -> float:
            torch.manual_seed(0)
            if name == "hf":
                return hf_tokens_per_s(hf_model(gpt_cfg), hf_data, args, tmp / f"hf{r}")
            cfg = load_config(
                None,
                [
                    f"run.dir={tmp / f'kiln{r}'}",
                    f"run.device={args.device}",
                    f"train.precision={args.precision}",
                    f"train.max_steps={args.steps}",
                    f"train.micro_batch_size={args.micro_batch}",
                    f"train.global_batch_size={args.micro_batch}",
                    f"train.log_every={args.warmup}",
                    "train.warmup_steps=5",
                    "train.lr=3e-3",
                    f"data.seq_len={args.seq_len}",
                    "data.num_workers=0",
                    "eval.every=0",
                    "checkpoint.every=0",
                    "checkpoint.resume=never",
                    f"train.compile={str(args.compile).lower()}",
                ],
            )
            Trainer(GPT(gpt_cfg), windows, lm_loss, cfg, tokens_per_sample=args.seq_len, console=False).fit()
            return kiln_tokens_per_s(cfg.run.dir, args.warmup)

        kiln_rates, hf_rates, ratios = alternating_rounds(args.rounds, measure, "hf", "HF Trainer")
    import transformers

    print(
        json.dumps(
            {
                "bench": "vs_hf_trainer",
                "seq_len": args.seq_len,
                "micro_batch": args.micro_batch,
                "vocab": args.vocab,
                "threads": torch.get_num_threads(),
                "kiln_compile": args.compile,
                "hf_compile": args.hf_compile,
                "preset": args.preset,
                "precision": args.precision,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "processor": platform.processor() or platform.machine(),
                "kiln_tokens_per_s": statistics.median(kiln_rates),
                "hf_tokens_per_s": statistics.median(hf_rates),
                "ratio_median": statistics.median(ratios),
            }
        )
    )


if __name__ == "__main__":
    main()
