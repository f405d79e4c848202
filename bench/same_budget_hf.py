"""Same wall-clock budget, same documents: kiln's default recipe against a Hugging Face
``Trainer`` run, both scored in bits per byte on the same val text the same way.

    pip install -e ".[bench]" && python bench/same_budget_hf.py [--budget 5m] [--hf-lr 3e-3 ...]
        [--set model.mlp=relu2 ...] [--skip-kiln | --skip-hf]

Both sides train on the embedded corpus's train split, tokenized with the same byte-level BPE
(the one ``kiln train`` trains), and neither sees the val split. kiln runs exactly as
``kiln train`` does with ``train.time_budget`` set (its steps and batch planned for the budget).
The HF side is a ``LlamaForCausalLM`` of the
same shape, batch 16 x 128 tokens (its reference setting), AdamW and cosine decay; its max_steps
is calibrated by a short probe so that its schedule ends with the budget, and a callback stops it
at the budget. Each model is then scored on every non-overlapping window of its own training
context over the whole val stream: summed loss in bits over the UTF-8 bytes those targets
stand for.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from kiln.config import ModelConfig, load_config, parse_duration
from kiln.data import TokenSequences, prepare
from kiln.models import build_gpt_config
from kiln.models.lm import evaluate_lm
from kiln.train.run import load_run
from kiln.train.trainer import train

from vs_hf_trainer import hf_model


class Windows(Dataset):
    def __init__(self, tokens, seq_len: int):
        self.windows = TokenSequences(tokens, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.windows[i]
        ids = torch.cat([x, y[-1:]])
        return {"input_ids": ids, "labels": ids}


def train_hf(prepared, args, budget_s: float, out: Path, max_steps: int):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Budget(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            self.t0 = time.perf_counter()
            self.steps = 0

        def on_step_end(self, targs, state, control, **kw):
            self.steps = state.global_step
            control.should_training_stop = time.perf_counter() - self.t0 > budget_s

    gpt_cfg = build_gpt_config(ModelConfig(preset="tiny"), prepared.vocab_size, args.hf_seq_len)
    torch.manual_seed(args.seed)
    model = hf_model(gpt_cfg)
    targs = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=args.hf_batch,
        learning_rate=args.hf_lr,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, min(max_steps, 10**4) // 20),
        logging_steps=50,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    clock = Budget()
    # HF shifts labels inside the model, so each item holds seq_len + 1 tokens.
    data = Windows(prepared.tokens("train"), args.hf_seq_len)
    Trainer(model=model, args=targs, train_dataset=data, callbacks=[clock]).train()
    return model, clock.steps


def score(model_fn, prepared, seq_len: int) -> dict[str, float]:
    val = TokenSequences(prepared.tokens("val"), seq_len)
    batches = []
    for start in range(0, len(val), 16):
        xs, ys = zip(*(val[i] for i in range(start, min(start + 16, len(val)))), strict=True)
        batches.append((torch.stack(xs), torch.stack(ys)))

    def mean_loss(x, targets):  # what evaluate_lm asks of a model: the batch's mean loss
        logits = model_fn(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    with torch.no_grad():
        return evaluate_lm(mean_loss, batches, torch.from_numpy(prepared.token_bytes()), torch.device("cpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", default="5m")
    ap.add_argument("--hf-lr", type=float, default=3e-3)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-seq-len", type=int, default=128)
    ap.add_argument("--skip-kiln", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="a kiln override (KEY=VALUE), repeatable")
    ap.add_argument("--seed", type=int, default=0, help="HF init and data order; kiln's train.seed is 1337 + this")
    args = ap.parse_args()
    budget_s = parse_duration(args.budget)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = load_config(
            None,
            [
                f"run.dir={tmp / 'kiln'}",
                f"train.time_budget={args.budget}",
                f"train.seed={1337 + args.seed}",
                "eval.sample_tokens=0",
                "checkpoint.resume=never",
                *args.set,
            ],
        )
        prepared = prepare(cfg.data, progress=False)
        if not args.skip_kiln:
            t0 = time.perf_counter()
            result = train(cfg, console=False)
            wall = time.perf_counter() - t0
            kiln_scores, batch = _evaluate(tmp / "kiln")
            results["kiln"] = {
                "steps": result.step,
                "global_batch": batch,
                "tokens_per_s": round(result.step * batch * cfg.data.seq_len / wall),
                "wall_s": round(wall, 1),
                "seq_len": cfg.data.seq_len,
                "val_bpb": kiln_scores["val_bpb"],
                "val_loss": kiln_scores["val_loss"],
                "set": args.set,
            }
            print(json.dumps({"kiln": results["kiln"]}), flush=True)
        if not args.skip_hf:
            results["hf_trainer"] = _run_hf(prepared, args, budget_s, tmp)
            print(json.dumps({"hf_trainer": results["hf_trainer"]}), flush=True)
    print(json.dumps({"bench": "same_budget_hf", "budget": args.budget, "seed": args.seed, **results}))


def _run_hf(prepared, args, budget_s: float, tmp: Path) -> dict:
    """The Trainer's run for the budget, its schedule's length calibrated by a short probe of
    its steps per second, and its score."""
    _, probe_steps = train_hf(prepared, args, 10.0, tmp / "hf-probe", 10**6)
    max_steps = max(20, int(probe_steps * budget_s / 10.0))
    t0 = time.perf_counter()
    model, steps = train_hf(prepared, args, budget_s, tmp / "hf", max_steps)
    wall = time.perf_counter() - t0
    model.eval()
    hf_scores = score(lambda x: model(input_ids=x).logits, prepared, args.hf_seq_len)
    return {
        "steps": steps,
        "planned_steps": max_steps,
        "wall_s": round(wall, 1),
        "seq_len": args.hf_seq_len,
        "lr": args.hf_lr,
        "batch": args.hf_batch,
        "val_bpb": hf_scores["val_bpb"],
        "val_loss": hf_scores["val_loss"],
    }


def _evaluate(run_dir) -> tuple[dict, int]:
    """kiln eval of the run (its whole validation split), and the global batch it trained with
    (the plan's choice, written to the run's config)."""
    run = load_run(run_dir, device="cpu")
    scores = run.job.evaluate_saved(run, source=None, max_batches=10**6, batch_size=None)
    return scores, run.cfg.train.global_batch_size


if __name__ == "__main__":
    main()
