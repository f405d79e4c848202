"""GRPO against TRL's ``GRPOTrainer`` (no vLLM): the same model, prompts, group size, completion
length and reward, one process on the CPU; seconds per step and kiln's speed-up.

    pip install -e ".[bench]" && python bench/grpo_vs_trl.py [--steps 12] [--warmup 2] [--group 8] [--max-new 32]

The model is bench/finetune_vs_hf.py's Llama (width 256, 4 layers, MiniLM's 30,522-token
vocabulary), untrained; the prompts are bench/grpo_split.py's --mixed ones (small sums after a
request of its own length, so a step's prompts differ in length), the reward examples/rewards.py's
``right_sum``. 8 prompts a step, 8 completions each, up to --max-new tokens, temperature 1, no KL
term, GRPO's loss (TRL's ``loss_type="grpo"``), one optimisation pass per generation. Each side's
step time is the mean over the steps after --warmup (TRL: its callback's step ends; kiln: its
log's elapsed time, logged every step).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    args = ap.parse_args()
    sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
    import torch
    from classify_stdlib import minilm
    from datasets import Dataset
    from rewards import right_sum
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from finetune_vs_hf import tiny_llama
    from grpo_split import train_grpo, write_prompts

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tiny_llama(tmp / "model", minilm(tmp))
        # TRL ends completions at the tokenizer's eos_token: MiniLM's [SEP], as the model's config says.
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.eos_token, tokenizer.bos_token = tokenizer.sep_token, tokenizer.cls_token
        tokenizer.save_pretrained(model)
        rows = write_prompts(tmp / "prompts.jsonl", mixed=True)
        logged = train_grpo(model, tmp / "prompts.jsonl", tmp / "kiln", args, seq_len=128, log_every=1)
        elapsed = {r["step"]: r["elapsed_s"] for r in logged if "elapsed_s" in r and "step" in r}
        kiln_step = (elapsed[args.steps] - elapsed[args.warmup]) / (args.steps - args.warmup)
        kiln_length = sum(r.get("completions/mean_length", 0) for r in logged) / max(
            1, sum("completions/mean_length" in r for r in logged)
        )

        stamps: list[float] = []
        lengths: list[float] = []

        class Clock(TrainerCallback):
            def on_step_end(self, *a, **kw):
                stamps.append(time.perf_counter())

            def on_log(self, _args, _state, _control, logs=None, **kw):
                if logs and "completions/mean_length" in logs:
                    lengths.append(logs["completions/mean_length"])

        torch.manual_seed(0)
        config = GRPOConfig(
            output_dir=str(tmp / "trl"),
            max_steps=args.steps,
            per_device_train_batch_size=8 * args.group,  # completions: 8 prompts a step
            num_generations=args.group,
            max_completion_length=args.max_new,
            temperature=1.0,
            beta=0.0,
            loss_type="grpo",
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa"),
            reward_funcs=[right_sum],
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        trainer.train()
        trl_step = (stamps[args.steps - 1] - stamps[args.warmup - 1]) / (args.steps - args.warmup)
    import transformers
    import trl

    print(
        json.dumps(
            {
                "bench": "grpo_vs_trl",
                "steps": args.steps,
                "warmup": args.warmup,
                "group": args.group,
                "max_new_tokens": args.max_new,
                "kiln_step_s": round(kiln_step, 3),
                "trl_step_s": round(trl_step, 3),
                "kiln_speedup": round(trl_step / kiln_step, 2),
                "kiln_completion_length": round(kiln_length, 1),
                "trl_completion_length": round(sum(lengths) / len(lengths), 1) if lengths else None,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "trl": trl.__version__,
                "threads": torch.get_num_threads(),
                "processor": platform.processor() or platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
