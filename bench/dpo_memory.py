"""Peak memory of LoRA-DPO: the reference as the model with its adapters off (kiln, and TRL without
a ``ref_model``) against DPO with a second, full copy of the model as the reference (TRL with a
``ref_model``), and against LoRA SFT of the same model (one copy, no reference at all). Each run is
its own process; its peak resident set is read from outside (``/usr/bin/time``'s maximum RSS).

    pip install -e ".[bench]" trl && python bench/dpo_memory.py [--steps 4]

The model is a Llama of GPT-2-small's size built here (12 layers, width 768, SwiGLU 2048, MiniLM's
30,522-token vocabulary: 108M parameters, 0.43 GB in fp32), LoRA rank 16 on the attention and MLP
projections, fp32 on the CPU; the data are bench/dpo_vs_trl.py's pairs, 4 pairs a step, rows of
up to 256 tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SRC = HERE.parent / "src"

TRL = """
import sys, json, torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
model_dir, pairs, out, steps, copy = sys.argv[1:6]
tok = AutoTokenizer.from_pretrained(model_dir)
rows = [json.loads(line) for line in open(pairs)]
model = AutoModelForCausalLM.from_pretrained(model_dir)
ref = AutoModelForCausalLM.from_pretrained(model_dir) if copy == "copy" else None
args = DPOConfig(output_dir=out, max_steps=int(steps), per_device_train_batch_size=4, max_length=256, report_to=[],
                 use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, learning_rate=5e-6)
lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
DPOTrainer(model=model, ref_model=ref, args=args, processing_class=tok, train_dataset=Dataset.from_list(rows),
           peft_config=lora).train()
"""


def peak_gib(command: list[str]) -> float:
    """The command's maximum resident set, GiB (``/usr/bin/time -f %M`` prints it in KiB)."""
    done = subprocess.run(["/usr/bin/time", "-f", "PEAK %M", *command], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{command[:4]} failed:\n{done.stderr[-3000:]}")
    line = next(x for x in reversed(done.stderr.splitlines()) if x.startswith("PEAK "))
    return int(line.split()[1]) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
    from classify_stdlib import minilm
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dpo_vs_trl import pairs
    from finetune_vs_hf import causal_records

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, _ = causal_records(tmp / "records")
        source = pairs(train, tmp / "pairs.jsonl", 64)
        sft = tmp / "sft.jsonl"
        sft.write_text(
            "".join(
                json.dumps({"prompt": r["prompt"], "completion": r["chosen"]}) + "\n"
                for r in map(json.loads, source.read_text().splitlines())
            )
        )
        tok = AutoTokenizer.from_pretrained(minilm(tmp))
        tok.eos_token, tok.bos_token = tok.sep_token, tok.cls_token
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=12,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            bos_token_id=tok.cls_token_id,
            eos_token_id=tok.sep_token_id,
            pad_token_id=tok.pad_token_id,
        )
        model = tmp / "model"
        LlamaForCausalLM(cfg).save_pretrained(model)
        tok.save_pretrained(model)

        def kiln(objective: str, data: Path, name: str) -> list[str]:
            items = {
                "run.dir": tmp / name,
                "run.device": "cpu",
                "model.source": f"hf:{model}",
                "data.source": data,
                "data.num_workers": 0,
                "data.seq_len": 256,
                "run.job": objective,
                "train.max_steps": args.steps,
                "train.micro_batch_size": 4,
                "train.global_batch_size": 4,
                "train.lr": 5e-6,
                "eval.every": 0,
                "checkpoint.every": 0,
                "lora.rank": 16,
                "lora.dropout": 0.0,
            }
            sets = [a for k, v in items.items() for a in ("--set", f"{k}={v}")]
            return [sys.executable, "-m", "kiln", "train", *sets]

        env_python = [sys.executable, "-c", TRL, str(model), str(source), str(tmp / "trl")]
        import os

        os.environ["PYTHONPATH"] = str(SRC)
        results = {
            "kiln LoRA SFT (one copy, no reference)": peak_gib(kiln("sft", sft, "sft")),
            "kiln LoRA-DPO (reference: adapters off)": peak_gib(kiln("dpo", source, "dpo")),
            "TRL LoRA-DPO (reference: adapters off)": peak_gib([*env_python, str(args.steps), "none"]),
            "TRL LoRA-DPO with ref_model (a second, full copy)": peak_gib([*env_python, str(args.steps), "copy"]),
        }
    for name, gib in results.items():
        print(f"{name}: {gib:.2f} GiB")
    print(json.dumps({"bench": "dpo_memory", "steps": args.steps, "machine": platform.machine(), "peak_gib": results}))


if __name__ == "__main__":
    main()
