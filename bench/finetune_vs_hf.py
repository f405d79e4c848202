"""Fine-tuning against the Hugging Face ``Trainer``: the same model, records, batches, order and
precision, one process on the CPU; real (non-padding) tokens per second of each, kiln's ratio, and
the validation metric each reaches.

    pip install -e ".[bench]" && python bench/finetune_vs_hf.py [--task classify|causal|all] [--steps 40]

classify: the pretrained all-MiniLM-L6-v2 encoder (22M parameters) as a sequence classifier on the
stdlib-functions set of examples/classify_stdlib.py (8 labels, 128 tokens, batch 32, lr 5e-5).
causal: a Llama-class model built here from a config (4 layers, width 256, 8 heads, 4 key/value
heads, SwiGLU 768, MiniLM's 30,522-token vocabulary, 2.2M non-embedding parameters) on
prompt/completion records from the same functions (the signature and docstring, then the body; 256
tokens, batch 16, lr 3e-4), unpacked (both pad each batch to its longest row) and packed (kiln only:
the Trainer pads). Both sides see the rows in kiln's order (its step-pure sampler drives the HF
dataset); both are timed after warm-up steps; rounds alternate which goes first. The metrics are
computed for both models by kiln's evaluators on the same validation records.
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
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

from classify_stdlib import build_records, functions, minilm  # noqa: E402

from kiln.config import load_config  # noqa: E402
from kiln.data.loader import StepSampler  # noqa: E402
from kiln.distributed.world import World  # noqa: E402
from kiln.models.hf import FAMILY as HF  # noqa: E402
from kiln.models.hf import CausalLM, SequenceClassifier  # noqa: E402
from kiln.train.jobs import job_for  # noqa: E402
from kiln.train.jobs.finetune import evaluate  # noqa: E402
from kiln.train.trainer import Trainer  # noqa: E402

from common import kiln_tokens_per_s  # noqa: E402


class InKilnOrder(Dataset):
    """Rows in the order kiln's sampler visits them, as the HF collators want them."""

    def __init__(self, rows: list[dict], batch: int, seed: int, steps: int, task: str):
        sampler = iter(StepSampler(len(rows), batch, seed))
        self.rows = [rows[i] for _ in range(steps) for i in next(sampler)]
        self.task = task

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        out = {"input_ids": row["input_ids"], "attention_mask": [1] * len(row["input_ids"]), "labels": row["labels"]}
        if "token_type_ids" in row:
            out["token_type_ids"] = row["token_type_ids"]
        return out


def causal_records(out: Path) -> tuple[Path, Path]:
    """Prompt: a function's signature and docstring; completion: its body. One file in ten is val."""
    import ast
    import hashlib
    import textwrap

    records = {"train": [], "val": []}
    for package in ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "unittest", "xml"):
        for file, source in functions(package):
            text = textwrap.dedent(source)
            try:
                node = ast.parse(text).body[0]
            except (SyntaxError, IndexError):  # cut off at MAX_CHARS, or not a lone function
                continue
            first = node.body[1] if ast.get_docstring(node) and len(node.body) > 1 else node.body[0]
            lines = text.splitlines()
            prompt, completion = "\n".join(lines[: first.lineno - 1]) + "\n", "\n".join(lines[first.lineno - 1 :])
            val = int(hashlib.blake2b(file.encode(), digest_size=4).hexdigest(), 16) % 10 == 0
            # A prompt longer than about half the context would leave the completion little room.
            if completion.strip() and len(prompt) <= 500:
                records["val" if val else "train"].append({"prompt": prompt, "completion": completion})
    paths = []
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in records.items():
        path = out / f"causal-{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def tiny_llama(directory: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def sets(task: str, model: Path, train: Path, val: Path, run: Path, args, packing: bool = False) -> list[str]:
    common = {
        "run.dir": run,
        "run.device": "cpu",
        "model.source": f"hf:{model}",
        "model.task": "sequence_classification" if task == "classify" else "causal_lm",
        "data.source": train,
        "data.val_source": val,
        "data.num_workers": 0,
        "data.packing": str(packing).lower(),
        "train.max_steps": args.steps,
        "train.warmup_steps": 5,
        "train.schedule": "linear",
        "train.weight_decay": 0.01,
        "train.log_every": args.warmup,
        "eval.every": 0,
        "eval.sample_tokens": 0,
        "checkpoint.every": 0,
        "checkpoint.resume": "never",
    }
    if task == "classify":
        common.update(
            {"data.seq_len": 128, "train.micro_batch_size": 32, "train.global_batch_size": 32, "train.lr": 5e-5}
        )
    else:
        common.update(
            {"data.seq_len": 256, "train.micro_batch_size": 16, "train.global_batch_size": 16, "train.lr": 3e-4}
        )
    return [f"{k}={v}" for k, v in common.items()]


def run_kiln(cfg_sets: list[str], warmup: int) -> tuple[float, torch.nn.Module]:
    cfg = load_config(None, cfg_sets)
    trainer = Trainer(job_for(cfg), console=False)
    trainer.fit()
    return kiln_tokens_per_s(cfg.run.dir, warmup), trainer.model.module


def run_hf(task: str, job, args, out: Path) -> tuple[float, torch.nn.Module]:
    """The Hugging Face Trainer on the rows kiln tokenized (``job.data``), in kiln's order."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        DataCollatorForSeq2Seq,
        DataCollatorWithPadding,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers import Trainer as HFTrainer

    cfg, model_dir = job.cfg, job.args.path
    torch.manual_seed(cfg.train.seed)
    if task == "classify":
        labels = job.data.labels
        model = AutoModelForSequenceClassification.from_pretrained(
            model_dir,
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={n: i for i, n in enumerate(labels)},
            attn_implementation="sdpa",
        )
        collator = DataCollatorWithPadding(job.tokenizer)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
        collator = DataCollatorForSeq2Seq(job.tokenizer, padding=True, label_pad_token_id=-100)
    data = InKilnOrder(job.data.train.rows, cfg.train.global_batch_size, cfg.train.seed, args.steps, task)
    stamps, real = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **kw):
            stamps.append(time.perf_counter())

    def counting(rows):
        real.append(sum(len(r["input_ids"]) for r in rows))
        return collator(rows)

    t = cfg.train
    targs = TrainingArguments(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=t.micro_batch_size,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.beta1,
        adam_beta2=t.beta2,
        adam_epsilon=t.eps,
        max_grad_norm=t.grad_clip,
        lr_scheduler_type="linear",
        warmup_steps=t.warmup_steps,
        logging_steps=args.warmup,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=t.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = HFTrainer(model=model, args=targs, train_dataset=data, data_collator=counting, callbacks=[Clock()])
    trainer._get_train_sampler = lambda *a, **kw: torch.utils.data.SequentialSampler(data)
    trainer.train()
    timed = real[args.warmup : len(stamps)]
    return sum(timed) / (stamps[-1] - stamps[args.warmup - 1]), model


def compare(task: str, job, kiln_model, hf_model) -> dict:
    """The validation metrics of both trained models, by kiln's evaluators on the same records."""
    wrapped = (SequenceClassifier if task == "classify" else CausalLM)(hf_model)
    keys = ("val_accuracy", "val_macro_f1", "val_loss") if task == "classify" else ("val_loss", "val_bpb")
    out = {}
    for side, model in (("kiln", kiln_model), ("hf", wrapped)):
        model.eval()
        with torch.no_grad():
            metrics = evaluate(HF, model, job.data, 16, torch.device("cpu"))
        out[side] = {k: metrics[k] for k in keys}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=["classify", "causal", "all"], default="all")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import transformers

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        encoder = minilm(tmp)
        tasks = ["classify", "causal"] if args.task == "all" else [args.task]
        for task in tasks:
            if task == "classify":
                model_dir, (train, val, _) = encoder, build_records(tmp / "cls")
                variants = ["padded"]
            else:
                model_dir, (train, val) = tiny_llama(tmp / "llama", encoder), causal_records(tmp / "causal")
                variants = ["padded", "packed"]
            for variant in variants:
                ratios, kiln_rates, hf_rates = [], [], []
                for r in range(args.rounds + 1):  # round 0 warms the process up and is not counted
                    order = ("kiln", "hf") if r % 2 == 0 else ("hf", "kiln")
                    rates = {}
                    for side in order:
                        run = tmp / f"{task}-{variant}-{side}-{r}"
                        cfg_sets = sets(task, model_dir, train, val, run, args, packing=variant == "packed")
                        if side == "kiln":
                            rates["kiln"], kiln_model = run_kiln(cfg_sets, args.warmup)
                        else:  # the Trainer pads: it gets the unpacked rows
                            job = job_for(load_config(None, sets(task, model_dir, train, val, run, args)))
                            job.prepare(World(), console=False)
                            rates["hf"], hf_model = run_hf(task, job, args, run)
                    if r:
                        ratios.append(rates["kiln"] / rates["hf"])
                        kiln_rates.append(rates["kiln"])
                        hf_rates.append(rates["hf"])
                    print(
                        f"{task} {variant} round {r}: kiln {rates['kiln']:,.0f} real tok/s, "
                        f"HF Trainer {rates['hf']:,.0f}, ratio {rates['kiln'] / rates['hf']:.3f}",
                        flush=True,
                    )
                results[f"{task}-{variant}"] = {
                    "kiln_real_tokens_per_s": statistics.median(kiln_rates),
                    "hf_real_tokens_per_s": statistics.median(hf_rates),
                    "ratio_median": statistics.median(ratios),
                    "ratios": ratios,
                    "val": compare(task, job, kiln_model, hf_model),
                }
                print(json.dumps({f"{task}-{variant}": results[f"{task}-{variant}"]}), flush=True)
    print(
        json.dumps(
            {
                "bench": "finetune_vs_hf",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "machine": platform.machine(),
                "steps": args.steps,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
