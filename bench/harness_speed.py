"""Scoring lm-evaluation-harness tasks: kiln's language model against lm-eval's own ``hf`` model
on the run's Hugging Face export, on the CPU, at the same batch size.

    python bench/harness_speed.py [--dir DIR] [--docs 200] [--batch-size 8] [--steps 30]

Trains a small kiln GPT (4 layers, d_model 256, seq_len 256) for a few steps on the embedded
corpus, exports it with ``kiln export --format hf``, writes three local tasks (nothing is
downloaded): a multiple-choice task of ``--docs`` questions with four choices, a perplexity task
(loglikelihood_rolling over ``--docs // 4`` Python sources) and a generation task (``--docs // 10``
prompts, 16 greedy tokens). Each model is built first (kiln: ``load_run`` and ``KilnLM``; lm-eval:
``HFLM(pretrained=EXPORT, dtype=float32, device=cpu)``), then only ``simple_evaluate`` on each
task is timed, twice in alternation, the faster kept. The scores are compared too (they must be
the same). Prints a JSON line per measurement and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def write_tasks(out: Path, docs: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with open(out / "mc.jsonl", "w") as f:
        for _ in range(docs):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            choices = [str(a + b), str(a + b + 1), str(a * 2), str(abs(a - b))]
            rng.shuffle(choices)
            record = {"question": f"def total():\n    # {a} plus {b}\n    return", "choices": choices}
            f.write(json.dumps({**record, "answer": choices.index(str(a + b))}) + "\n")
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: max(1, docs // 4)]
    with open(out / "ppl.jsonl", "w") as f:
        for path in sources:
            f.write(json.dumps({"text": path.read_text(errors="replace")[:4000]}) + "\n")
    with open(out / "gen.jsonl", "w") as f:
        for i in range(max(1, docs // 10)):
            f.write(json.dumps({"prompt": f"import os\n\n\ndef helper_{i}(path):\n", "target": "    return"}) + "\n")
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (out / "mc.yaml").write_text(
        "task: bench_mc\n" + data.format(out / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (out / "ppl.yaml").write_text(
        "task: bench_ppl\n" + data.format(out / "ppl.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: bits_per_byte\n'
    )
    (out / "gen.yaml").write_text(
        "task: bench_gen\n" + data.format(out / "gen.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kiln-harness-", dir=args.dir))
    run, export, tasks = root / "run", root / "export", root / "tasks"
    model = ["model.n_layer=4", "model.d_model=256", "model.n_head=8", "model.n_kv_head=4", "model.d_ff=768"]
    sets = [*model, f"run.dir={run}", "data.seq_len=256", f"train.max_steps={args.steps}", "eval.sample_tokens=0"]
    kiln = [sys.executable, "-m", "kiln"]
    subprocess.run([*kiln, "train", *(a for s in sets for a in ("--set", s))], check=True, capture_output=True)
    subprocess.run([*kiln, "export", str(run), "--format", "hf", "--out", str(export)], check=True, capture_output=True)
    write_tasks(tasks, args.docs)

    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM

    from kiln.harness import run_tasks, scores, task_manager
    from kiln.harness.model import KilnLM
    from kiln.train.run import load_run

    torch.set_num_threads(torch.get_num_threads())
    manager = task_manager(tasks)
    saved = load_run(run, device="cpu")
    ours = KilnLM(saved.model, saved.family, saved.tokenizer, 256, batch_size=args.batch_size)
    # The same context as kiln's (the export says 1024 positions; the model trained on 256).
    theirs = HFLM(pretrained=str(export), dtype="float32", device="cpu", batch_size=args.batch_size, max_length=256)
    rows = []
    for task in ("bench_mc", "bench_ppl", "bench_gen"):
        best: dict[str, float] = {}
        results: dict[str, dict] = {}
        for _ in range(2):
            for name, lm in (("kiln", ours), ("hf", theirs)):
                started = time.perf_counter()
                if name == "kiln":
                    out = run_tasks(lm, [task], manager, bootstrap_iters=0)
                else:
                    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, bootstrap_iters=0)
                seconds = time.perf_counter() - started
                best[name] = min(best.get(name, seconds), seconds)
                results[name] = scores(out)
        row = {"task": task, "kiln_s": round(best["kiln"], 2), "hf_s": round(best["hf"], 2)}
        row.update(speedup=round(best["hf"] / best["kiln"], 2), kiln=results["kiln"], hf=results["hf"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| task | kiln (s) | lm-eval hf (s) | kiln speed-up | same scores |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        same = all(abs(r["kiln"][k] - r["hf"][k]) < 1e-6 for k in r["kiln"])
        print(f"| {r['task']} | {r['kiln_s']} | {r['hf_s']} | {r['speedup']}x | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
