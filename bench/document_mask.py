"""Does document masking (``data.document_mask``) help the default run, and what does it cost?
Trains the default recipe on the embedded corpus with and without it, for several seeds, and
reports each run's steady tokens/s and its whole-validation-split bits per byte (each run scored
as it trained: the masked runs with their documents kept apart).

    python bench/document_mask.py [--seeds 0 1 2] [--steps 1050] [--out rows.jsonl]

The fixed recipe (``train.max_steps=1050``, batch 32 x 128) makes the runs see the same tokens,
so the difference in bits per byte is the mask's and the difference in time its cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kiln.config import load_config
from kiln.train.run import load_run
from kiln.train.trainer import train


def run(seed: int, mask: bool, steps: int, work: Path) -> dict:
    run_dir = work / f"seed{seed}-{'mask' if mask else 'plain'}"
    cfg = load_config(
        None,
        [
            f"run.dir={run_dir}",
            f"train.seed={seed}",
            f"train.max_steps={steps}",
            f"data.document_mask={str(mask).lower()}",
            "eval.sample_tokens=0",
            "checkpoint.every=0",
        ],
    )
    t0 = time.perf_counter()
    train(cfg, console=False)
    wall = time.perf_counter() - t0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in lines if "tokens_per_s" in r and r["step"] > 20]
    loaded = load_run(run_dir, device="cpu")
    scores = loaded.job.evaluate_saved(loaded, source=None, max_batches=10**6, batch_size=None)
    return {
        "seed": seed,
        "document_mask": mask,
        "steps": steps,
        "wall_s": round(wall, 1),
        "tokens_per_s_median": round(statistics.median(rates)),
        "val_bpb": round(scores["val_bpb"], 4),
        "val_tokens": scores["tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=1050)
    ap.add_argument("--out", type=Path, help="append one JSON line per run here too")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mask in (False, True):
                row = run(seed, mask, args.steps, Path(tmp))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(
        "\n| data.document_mask | seeds | val bpb (each seed) | mean | tokens/s (median of medians) |"
        "\n|---|---|---|---|---|"
    )
    for mask in (False, True):
        mine = [r for r in rows if r["document_mask"] is mask]
        bpb = [r["val_bpb"] for r in mine]
        print(
            f"| {str(mask).lower()} | {len(mine)} | {' / '.join(f'{b:.4f}' for b in bpb)} | "
            f"{statistics.mean(bpb):.4f} | {statistics.median(r['tokens_per_s_median'] for r in mine):,.0f} |"
        )


if __name__ == "__main__":
    main()
