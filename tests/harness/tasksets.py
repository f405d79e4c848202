"""Local lm-eval tasks for the tests: YAML files beside the jsonl they read, nothing downloaded."""

from __future__ import annotations

import random
from pathlib import Path

from conftest import write_jsonl


def write_tasks(out: Path) -> Path:
    """Three local tasks: multiple choice (kiln_mc), generation (kiln_gen) and perplexity
    (kiln_ppl), each a YAML beside the jsonl it reads."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    mc = []
    for _ in range(20):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        choices = [str(a + b), str(a + b + 1), str(a * 2), str(b)]
        rng.shuffle(choices)
        mc.append({"question": f"x = {a} + {b}  # x is", "choices": choices, "answer": choices.index(str(a + b))})
    write_jsonl(out / "mc.jsonl", mc)
    write_jsonl(out / "gen.jsonl", [{"prompt": f"def f{i}(x):\n    return", "target": " x"} for i in range(4)])
    texts = [{"text": f"import os\n\n\ndef main{i}():\n    print('{i}' * {i})\n" * (1 + i % 5)} for i in range(6)]
    write_jsonl(out / "ppl.jsonl", texts)
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (out / "mc.yaml").write_text(
        "task: kiln_mc\n" + data.format(out / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (out / "gen.yaml").write_text(
        "task: kiln_gen\n" + data.format(out / "gen.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (out / "ppl.yaml").write_text(
        "task: kiln_ppl\n" + data.format(out / "ppl.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return out
