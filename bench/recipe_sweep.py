"""Which recipe learns the most in a fixed wall-clock budget? Trains each candidate on the
embedded corpus for the same budget and scores its final checkpoint on the whole val split in
bits per byte (tokenizer-independent, so vocabularies compare).

    python bench/recipe_sweep.py [--budget 5m] [--only NAME ...] [--out sweep.jsonl]

Each candidate's schedule must end when its budget does, so a short probe first measures its
steps per second; max_steps is set from that, and train.time_budget guards the run. Data
preparation (tokenizer training) is done before the clock starts, once per vocabulary size.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from kiln.config import load_config, parse_duration
from kiln.train.run import load_run
from kiln.train.trainer import train

# Overrides on top of the defaults; "default" is kiln's current default recipe.
CANDIDATES: dict[str, list[str]] = {
    "default": [],
    "cosine": ["train.schedule=cosine"],
    "lr-1e-3": ["train.lr=1e-3"],
    "lr-6e-3": ["train.lr=6e-3"],
    "seq-256": ["data.seq_len=256", "train.micro_batch_size=16", "train.global_batch_size=16"],
    "vocab-2048": ["data.vocab_size=2048"],
    "vocab-8192": ["data.vocab_size=8192"],
    "wide-192": ["model.d_model=192", "model.n_head=6", "model.n_kv_head=6", "model.d_ff=512"],
    "deep-6": ["model.n_layer=6"],
    "batch-64": ["train.micro_batch_size=64", "train.global_batch_size=64"],
    "wd-0": ["train.weight_decay=0"],
    "compile": ["train.compile=true"],
}
PROBE_STEPS = 12


def run_candidate(name: str, overrides: list[str], budget_s: float, work: Path) -> dict:
    base = [
        "eval.every=0",
        "eval.sample_tokens=0",
        "checkpoint.every=0",
        "checkpoint.resume=never",
        "train.log_every=4",
        *overrides,
    ]
    probe_cfg = load_config(
        None, [*base, f"run.dir={work / name / 'probe'}", f"train.max_steps={PROBE_STEPS}", "train.warmup_steps=1"]
    )
    train(probe_cfg, console=False)  # also prepares data and warms compile caches
    lines = [json.loads(line) for line in (work / name / "probe" / "metrics.jsonl").read_text().splitlines()]
    rates = [record["tokens_per_s"] for record in lines if "tokens_per_s" in record and record["step"] > 4]
    tokens_per_step = probe_cfg.train.global_batch_size * probe_cfg.data.seq_len
    # Leave a little of the budget for the final evaluation and checkpoint.
    steps = max(20, int(0.97 * budget_s * min(rates) / tokens_per_step))
    cfg = load_config(
        None,
        [
            *base,
            f"run.dir={work / name / 'run'}",
            f"train.max_steps={steps}",
            f"train.time_budget={budget_s}s",
            f"train.warmup_steps={max(1, steps // 20)}",
        ],
    )
    t0 = time.perf_counter()
    result = train(cfg, console=False)
    wall = time.perf_counter() - t0
    scores = _evaluate(work / name / "run")
    return {
        "name": name,
        "overrides": overrides,
        "steps": result.step,
        "planned_steps": steps,
        "tokens": result.step * tokens_per_step,
        "wall_s": round(wall, 1),
        "val_loss": scores["val_loss"],
        "val_bpb": scores["val_bpb"],
        "val_tokens": scores["tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", default="5m", help="wall-clock budget per candidate (default 5m)")
    ap.add_argument("--only", nargs="*", help="candidate names to run (default: all)")
    ap.add_argument("--out", type=Path, help="append one JSON line per candidate here too")
    args = ap.parse_args()
    budget_s = parse_duration(args.budget)
    names = args.only or list(CANDIDATES)
    unknown = sorted(set(names) - set(CANDIDATES))
    if unknown:
        sys.exit(f"unknown candidates {unknown}; choose from {', '.join(CANDIDATES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = run_candidate(name, CANDIDATES[name], budget_s, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print("\n| candidate | overrides | steps | tokens | val bpb |\n|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["val_bpb"]):
        print(
            f"| {r['name']} | {' '.join(r['overrides']) or '(defaults)'} | {r['steps']} | "
            f"{r['tokens']:,} | {r['val_bpb']:.4f} |"
        )


def _evaluate(run_dir):
    """kiln eval of the run: its whole validation split."""
    run = load_run(run_dir, device="cpu")
    return run.job.evaluate_saved(run, source=None, max_batches=10**6, batch_size=None)


if __name__ == "__main__":
    main()
