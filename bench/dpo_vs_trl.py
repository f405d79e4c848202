"""DPO against TRL's ``DPOTrainer``: the same model, pairs, batches, order and loss, one process on
the CPU; real (non-padding) tokens of both completions' rows per second, and kiln's ratio.

    pip install -e ".[bench]" trl && python bench/dpo_vs_trl.py [--steps 30] [--rounds 1] [--lora]

The model and records are bench/finetune_vs_hf.py's causal ones (a Llama of width 256, 4 layers,
MiniLM's 30,522-token vocabulary; prompt: a standard-library function's signature and docstring):
the chosen completion is the function's own body, the rejected one the body of the function
after it. Rows of up to 256 tokens, 8 pairs a step, lr 5e-6, beta 0.1, sigmoid loss. The
reference: both precompute the initial model's log-probabilities before training (kiln's default,
TRL's ``precompute_ref_log_probs=True``), or with ``--lora`` (rank 16) both take the model with its
adapters off. TRL sees the pairs in kiln's order; both are timed after warm-up steps, and rounds
alternate which goes first. The first 400 records are used (``--pairs``): both sides compute the
reference over all of them before the first step, which is not timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

from classify_stdlib import minilm  # noqa: E402

from finetune_vs_hf import causal_records, tiny_llama  # noqa: E402
from kiln.config import load_config  # noqa: E402
from kiln.data.finetune import split_records  # noqa: E402
from kiln.data.loader import StepSampler  # noqa: E402
from kiln.train.jobs import job_for  # noqa: E402
from kiln.train.trainer import Trainer  # noqa: E402

from common import alternating_rounds, kiln_tokens_per_s  # noqa: E402


def pairs(records: Path, out: Path, n: int) -> Path:
    """The first ``n`` records as pairs (both sides compute the reference on all of them first)."""
    rows = [json.loads(line) for line in records.read_text().splitlines()][:n]
    pairs = [
        {"prompt": r["prompt"], "chosen": r["completion"], "rejected": rows[(i + 1) % len(rows)]["completion"]}
        for i, r in enumerate(rows)
    ]
    out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return out


def kiln_sets(model: Path, source: Path, run: Path, args) -> list[str]:
    items = {
        "run.dir": run,
        "run.device": "cpu",
        "model.source": f"hf:{model}",
        "data.source": source,
        "data.num_workers": 0,
        "data.seq_len": 256,
        "run.job": "dpo",
        "train.max_steps": args.steps,
        "train.micro_batch_size": 8,
        "train.global_batch_size": 8,
        "train.lr": 5e-6,
        "train.warmup_steps": 0,
        "train.log_every": args.warmup,
        "eval.every": 0,
        "checkpoint.every": 0,
        "checkpoint.resume": "never",
        "lora.rank": 16 if args.lora else 0,
        "lora.dropout": 0.0,
    }
    return [f"{k}={v}" for k, v in items.items()]


def run_trl(job, args, out: Path) -> float:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cfg = job.cfg
    # The records behind kiln's train rows (rows keep the train records' file order), in the order
    # kiln's sampler takes them, and the real tokens of each step's rows.
    records, is_val, _ = split_records(cfg.data)
    train_records = [r.fields for r, val in zip(records, is_val, strict=True) if not val]
    rows = job.pairs.train.rows
    sampler = iter(StepSampler(len(rows), cfg.train.global_batch_size, cfg.train.seed))
    steps = [next(sampler) for _ in range(args.steps)]
    texts = [train_records[i] for step in steps for i in step]
    tokens = [
        sum(2 * len(rows[i]["prompt_ids"]) + len(rows[i]["chosen_ids"]) + len(rows[i]["rejected_ids"]) for i in step)
        for step in steps
    ]
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **kw):
            stamps.append(time.perf_counter())

    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_pretrained(job.args.path, attn_implementation="sdpa")
    targs = DPOConfig(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        adam_beta1=cfg.train.beta1,
        adam_beta2=cfg.train.beta2,
        max_grad_norm=cfg.train.grad_clip,
        lr_scheduler_type="constant",
        logging_steps=args.warmup,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=cfg.data.seq_len,
        beta=cfg.preference.beta,
        precompute_ref_log_probs=not args.lora,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=cfg.train.seed,
    )
    lora = (
        LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=job.family.lora_targets(job.args))
        if args.lora
        else None
    )
    trainer = DPOTrainer(
        model=model,
        args=targs,
        processing_class=job.tokenizer,
        train_dataset=Dataset.from_list(texts),
        peft_config=lora,
        callbacks=[Clock()],
    )
    trainer._get_train_sampler = lambda *a, **kw: torch.utils.data.SequentialSampler(trainer.train_dataset)
    trainer.train()
    timed = tokens[args.warmup : len(stamps)]
    return sum(timed) / (stamps[-1] - stamps[args.warmup - 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--pairs", type=int, default=400, help="records used (kiln holds out its val split of them)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, _ = causal_records(tmp / "records")
        source = pairs(train, tmp / "pairs.jsonl", args.pairs)
        model = tiny_llama(tmp / "model", minilm(tmp))
        from transformers import AutoTokenizer

        # TRL appends the tokenizer's eos_token to text completions: MiniLM's [SEP], as the model's config says.
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.eos_token, tokenizer.bos_token = tokenizer.sep_token, tokenizer.cls_token
        tokenizer.save_pretrained(model)

        def measure(name: str, r: int) -> float:
            cfg = load_config(None, kiln_sets(model, source, tmp / f"kiln{r}", args))
            job = job_for(cfg)
            if name == "trl":
                from kiln.distributed.world import World

                job.prepare(World(), console=False)
                return run_trl(job, args, tmp / f"trl{r}")
            Trainer(job, console=False).fit()
            return kiln_tokens_per_s(cfg.run.dir, args.warmup)

        kiln_rates, trl_rates, ratios = alternating_rounds(args.rounds, measure, "trl", "TRL DPOTrainer")
    import transformers
    import trl

    print(
        json.dumps(
            {
                "bench": "dpo_vs_trl",
                "lora": args.lora,
                "steps": args.steps,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "trl": trl.__version__,
                "threads": torch.get_num_threads(),
                "processor": platform.processor() or platform.machine(),
                "kiln_tokens_per_s": statistics.median(kiln_rates),
                "trl_tokens_per_s": statistics.median(trl_rates),
                "ratio_median": statistics.median(ratios),
            }
        )
    )


if __name__ == "__main__":
    main()
