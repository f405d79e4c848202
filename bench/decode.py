"""kiln's batched decoder against transformers' ``generate`` on the same Hugging Face Llama: 16
prompts of 8 to 200 tokens, 64 new tokens each, greedy. Prints one JSON line.

    pip install -e ".[bench]" && python bench/decode.py [--prompts 16] [--new 64] [--repeats 3]
        [--width 256] [--layers 4] [--vocab 30522] [--compile]

The model is a Llama shaped as bench/finetune_vs_hf.py's by default (width 256, 4 layers, 8 heads
of which 4 key/value, MiniLM's 30,522-token vocabulary), untrained, in fp32 on the CPU.
transformers decodes the 16 prompts in one batch, left-padded with an attention mask (its way to
batch prompts of different lengths), and one at a time; kiln decodes them as rows of one batch,
each at its own positions. The outputs are compared token for token with transformers'
one-at-a-time answers (left padding can move a near-tie of the argmax in fp32, so the padded
batch's answers are compared too but only counted). Each timing is the best of --repeats.
With --compile, kiln's decoder also runs with its decode step compiled (``kiln serve --compile``'s
``CompiledDecoding``), timed after its warm-up, whose seconds are printed apart.
"""

from __future__ import annotations

import argparse
import json
import platform
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--compile", action="store_true", help="time the decoder with its decode step compiled too")
    args = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.models import get_family
    from kiln.models.decode import CompiledDecoding, generate
    from kiln.models.hf import CausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=3 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(8, 200, args.prompts).round().int().tolist()
    prompts = [torch.randint(1, args.vocab, (n,), generator=generator).tolist() for n in lengths]
    pad = 0

    def theirs_alone() -> list[list[int]]:
        out = []
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=args.new, do_sample=False, eos_token_id=None)
            out.append(ids[0, len(p) :].tolist())
        return out

    def theirs_batched() -> list[list[int]]:
        width = max(lengths)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=pad
        )
        return out[:, width:].tolist()

    decodable = get_family("hf").decoding(CausalLM(hf).eval())

    def ours() -> list[list[int]]:
        return generate(decodable, prompts, args.new, temperature=0, max_batch=len(prompts))

    runs = [("kiln", ours), ("transformers_batched", theirs_batched)]
    warm_up_s = None
    if args.compile:
        compiled = CompiledDecoding(decodable)
        start = time.perf_counter()
        with torch.no_grad():
            compiled.warm_up()
        warm_up_s = round(time.perf_counter() - start, 1)
        runs.append(
            ("kiln_compiled", lambda: generate(compiled, prompts, args.new, temperature=0, max_batch=len(prompts)))
        )
    timings: dict[str, list[float]] = {name: [] for name, _ in runs}
    timings["transformers_one_at_a_time"] = []
    answers = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, fn in runs:
                start = time.perf_counter()
                answers[name] = fn()
                timings[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        answers["transformers_one_at_a_time"] = theirs_alone()
        timings["transformers_one_at_a_time"].append(time.perf_counter() - start)
    tokens = args.prompts * args.new
    speed = {name: tokens / min(t) for name, t in timings.items()}
    alone = answers["transformers_one_at_a_time"]
    print(
        json.dumps(
            {
                "bench": "decode",
                "prompts": args.prompts,
                "prompt_lengths": [min(lengths), max(lengths)],
                "model": {"width": args.width, "layers": args.layers, "vocab": args.vocab},
                "new_tokens": args.new,
                "tokens_per_s": {k: round(v, 1) for k, v in speed.items()},
                "kiln_over_transformers_batched": round(speed["kiln"] / speed["transformers_batched"], 2),
                "kiln_over_transformers_one_at_a_time": round(speed["kiln"] / speed["transformers_one_at_a_time"], 2),
                "identical_to_one_at_a_time": sum(a == b for a, b in zip(answers["kiln"], alone, strict=True)),
                "compiled_identical_to_eager": answers["kiln_compiled"] == answers["kiln"] if args.compile else None,
                "compile_warm_up_s": warm_up_s,
                "padded_batch_identical_to_one_at_a_time": sum(
                    a == b for a, b in zip(answers["transformers_batched"], alone, strict=True)
                ),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "processor": platform.processor() or platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
