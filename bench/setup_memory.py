"""Per-rank peak memory and setup time of starting a large model, measured from outside.

    python bench/setup_memory.py --nproc 2 [--preset 1b --n-layer 24] [--lora 8] [--precision bf16]
        [--llama DIR] [--src DIR] [--resume]

Runs ``kiln launch --nproc-per-node N -- train`` (``kiln train`` for N = 1) for one step of a
kiln GPT on a small generated corpus, polls the peak resident set (VmHWM) of every process the
launch starts, and prints each worker's peak beside the whole model's fp32 bytes, with the
run's own ``setup:`` line. ``--llama DIR`` fine-tunes a Hugging Face Llama from DIR instead
(``model.source=hf:DIR``); an empty or missing DIR first gets a random ~1B-parameter one (the
TinyLlama shape with a 4096-token BPE vocabulary), saved in bf16 in files of 500 MB with an
index. ``--src`` runs another kiln source tree (its ``src/``), to measure a version before a
change. ``--resume`` measures a run that resumes from a whole-model checkpoint (one process
trains one step and saves it first, unmeasured) and trains one more step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procs import descendants


def peak_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def is_worker(pid: int) -> bool:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"train" in args and b"launch" not in args


def make_llama(directory: Path) -> None:
    """A random Llama of about 1B parameters (TinyLlama's shape: 22 layers, d 2048, MLP 5632,
    32 heads, 4 key/value heads) with a 4096-token BPE tokenizer, saved in bf16 in files of
    500 MB with an index, as a model from the hub is."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = [f"line {i}: the quick brown fox jumps over the lazy dog {i % 97}" for i in range(2000)]
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"]))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="500MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--lora", type=int, default=8, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--precision", default="fp32", help="train.precision")
    ap.add_argument("--llama", type=Path, help="a Hugging Face Llama directory to fine-tune (made if missing)")
    ap.add_argument("--src", type=Path, help="a kiln source tree's src/ to run instead of the installed kiln")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="measure resuming from a whole-model checkpoint (one process trains a step and saves it first)",
    )
    args = ap.parse_args()
    if args.llama and not (args.llama / "config.json").is_file():
        make_llama(args.llama)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.txt"
        corpus.write_text(
            "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 97}" for i in range(20000))
        )
        sets = {
            "run.dir": tmp / "run",
            "data.source": corpus,
            "data.seq_len": 64,
            "data.num_workers": 0,
            **(
                {"model.source": f"hf:{args.llama.resolve()}"}
                if args.llama
                else {"model.preset": args.preset, "model.n_layer": args.n_layer}
            ),
            "train.precision": args.precision,
            "parallel.strategy": "fsdp",
            "train.max_steps": 1,
            "train.micro_batch_size": 1,
            "train.global_batch_size": args.nproc,
            "train.log_every": 1,
            "eval.every": 0,
            "eval.batches": 1,
            "eval.sample_tokens": 0,
            "checkpoint.every": 0,
        }
        if args.lora:
            sets["lora.rank"] = args.lora
        items = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        kiln = [sys.executable, "-m", "kiln"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.src:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.src.resolve()), env.get("PYTHONPATH")]))
        if args.resume:
            # One process writes a whole-model checkpoint at step 1; the measured run resumes it.
            first = [a for k, v in {**sets, "checkpoint.every": 1}.items() for a in ("--set", f"{k}={v}")]
            subprocess.run([*kiln, "train", *first], check=True, env=env, stdout=subprocess.DEVNULL)
            sets["train.max_steps"] = 2
            items = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        cmd = (
            [*kiln, "train", *items]
            if args.nproc == 1
            else [*kiln, "launch", "--nproc-per-node", str(args.nproc), "--", "train", *items]
        )
        began = time.perf_counter()
        log = (tmp / "output.txt").open("w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        peaks: dict[int, int] = {}
        workers: set[int] = set()
        first_step: dict[int, int] = {}  # each worker's peak when the run said its setup line
        while proc.poll() is None:
            if not first_step and "setup:" in (tmp / "output.txt").read_text():
                first_step = {pid: peaks.get(pid, 0) for pid in workers}
            for pid in descendants(proc.pid):
                if pid not in workers and is_worker(pid) and pid != proc.pid or (args.nproc == 1 and pid == proc.pid):
                    workers.add(pid)
                if (kib := peak_kib(pid)) is not None:
                    peaks[pid] = max(peaks.get(pid, 0), kib)
            time.sleep(0.1)
        wall = time.perf_counter() - began
        log.close()
        text = (tmp / "output.txt").read_text()
        if proc.returncode:
            sys.exit(f"kiln exited {proc.returncode}:\n{text[-3000:]}")

    sys.path.insert(0, str(args.src or Path(__file__).parents[1] / "src"))
    import torch

    from kiln.config import ModelConfig
    from kiln.models.gpt import GPT, build_gpt_config

    if args.llama:
        from safetensors import safe_open

        index = json.loads((args.llama / "model.safetensors.index.json").read_text())
        params = 0
        for file in set(index["weight_map"].values()):
            with safe_open(str(args.llama / file), framework="pt") as f:
                params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    else:
        with torch.device("meta"):
            params = GPT(build_gpt_config(ModelConfig(preset=args.preset, n_layer=args.n_layer), 4096, 64)).num_params()
    whole = 4 * params
    worker_peaks = sorted((peaks[p] * 1024 for p in workers if p in peaks), reverse=True)
    setup_peaks = sorted((first_step.get(p, 0) * 1024 for p in workers), reverse=True)
    setup = next((line.split("kiln: ", 1)[1] for line in text.splitlines() if "setup:" in line), None)
    print(
        json.dumps(
            {
                "nproc": args.nproc,
                "model": str(args.llama) if args.llama else f"{args.preset}, {args.n_layer} layers",
                "precision": args.precision,
                "lora": args.lora,
                "params": params,
                "whole_fp32_gb": whole / 1e9,
                "worker_peak_rss_gb": [round(b / 1e9, 3) for b in worker_peaks],
                "peak_over_whole": round(worker_peaks[0] / whole, 3) if worker_peaks else None,
                "peak_through_first_step_gb": [round(b / 1e9, 3) for b in setup_peaks],
                "wall_s": round(wall, 1),
                "setup": setup,
            }
        )
    )


if __name__ == "__main__":
    main()
