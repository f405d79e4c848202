"""Preparing a large corpus: `kiln prepare`'s throughput and memory against the tokenizer's own encode_batch.

    python bench/prepare_scale.py --gb 0.2 --gb 2 [--dir DIR] [--vocab 32768] [--sample-mb 100] [--keep]

For each size it generates a .jsonl corpus of English-like text (a seeded Zipfian vocabulary of
30,000 pseudo-words in sentences and paragraphs, documents of about 1-5 KB; nothing is
downloaded), then measures, one thing at a time:

1. BPE training as ``kiln prepare`` does it with ``data.tokenizer_sample_bytes`` (``--sample-mb``),
   in a subprocess: fingerprinting the corpus, the split plan (a pass over every document), the
   pass that sizes the sample, and the training on it (which reads the corpus once more). The
   tokenizer trained on the first corpus is the one every later step uses.
2. The tokenizers library's own multi-threaded ``Tokenizer.encode_batch`` (all cores, batches of
   1000 documents) over every document of the corpus, with that tokenizer (special tokens
   encoded as text, as kiln does); only the encode_batch calls are timed, not reading the file.
3. ``kiln prepare`` as a subprocess with ``data.tokenizer=<that tokenizer.json>`` and a fresh
   ``data.cache_dir``: its whole wall time, and the tokenization alone (the train and val passes,
   from kiln's own ``tokenized ...`` lines). The resident memory of its process tree (the main
   process and its tokenizing workers) is sampled from /proc every 0.1 s: the peak of the sum of
   VmRSS (which counts pages the forked workers share with the parent once per process, so it
   is an upper bound), the peak of the sum of Pss (shared pages divided among the processes) and
   the largest single VmHWM.

The CPU time other processes took during each step (from /proc/stat, less this benchmark's own)
is printed, as the comparison is only fair when nothing else runs. Prints a JSON line per
measurement and a Markdown table at the end; the corpora are deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

# -- the corpus -----------------------------------------------------------------------------------
from procs import descendants


def vocabulary(rng: np.random.Generator, n: int = 30000) -> list[str]:
    """``n`` distinct pseudo-words of one to five syllables, the shortest first (they get the
    highest Zipf frequencies, as in English)."""
    onsets = [*"bcdfghlmnprstw", "th", "st", "pr", "ch", "sh", "gr", "br", "tr", "", "", ""]
    vowels = [*"aeiou", "ea", "ou", "ai", "ee", "io"]
    codas = [*"nrstl", "nd", "st", "ng", "rt", "ck", "m", "", "", "", ""]
    words: set[str] = set()
    while len(words) < n:
        syllables = 1 + min(int(rng.poisson(1.2)), 4)
        words.add(
            "".join(
                onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))] + codas[rng.integers(len(codas))]
                for _ in range(syllables)
            )
        )
    return sorted(words, key=lambda w: (len(w), w))


def write_corpus(path: Path, size_bytes: int, seed: int = 0) -> tuple[int, int]:
    """A .jsonl of documents ({"text": ...}) of 150-850 words, about ``size_bytes`` long; returns
    (bytes, documents)."""
    rng = np.random.default_rng(seed)
    words = vocabulary(rng)
    v = len(words)
    # Every word in 8 forms: lower or capitalised (a sentence's first word), followed by nothing,
    # a comma, a full stop or a full stop and a paragraph break.
    ends = ("", ",", ".", ".\n\n")
    table = np.array([(w.capitalize() if cap else w) + end for cap in (False, True) for end in ends for w in words])
    table = table.astype(object)
    zipf = 1 / (np.arange(v) + 2.7)
    cdf = np.cumsum(zipf / zipf.sum())
    written = documents = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_bytes:
            lengths = rng.integers(150, 850, 2000)
            n = int(lengths.sum())
            index = np.minimum(np.searchsorted(cdf, rng.random(n)), v - 1)
            u = rng.random(n)
            end = np.where(u < 0.06, 2, np.where(u < 0.075, 3, np.where(u < 0.13, 1, 0)))
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            end[starts + lengths - 1] = 2
            cap = np.zeros(n, bool)
            cap[1:] = end[:-1] >= 2
            cap[starts] = True
            tokens = table[index + v * (end + 4 * cap)].tolist()
            lines = [
                json.dumps({"text": " ".join(tokens[s : s + k]).replace("\n\n ", "\n\n")}) + "\n"
                for s, k in zip(starts.tolist(), lengths.tolist(), strict=True)
            ]
            block = "".join(lines)
            f.write(block)
            written += len(block.encode("utf-8"))
            documents += len(lines)
    return written, documents


# -- measuring ------------------------------------------------------------------------------------


def cpu_busy() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / tick, sum(fields) / tick


def _kib(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeMemory:
    """Samples the memory of a process and its descendants in a thread: the sum of VmRSS every
    ``period`` seconds; the process tree and the sum of Pss (a costlier read) every ``slow``
    seconds. Each process's own peak (VmHWM) is the kernel's, so it misses nothing."""

    def __init__(self, pid: int, period: float = 0.1, slow: float = 5.0):
        self.pid, self.period, self.every = pid, period, max(1, round(slow / period))
        self.rss = self.pss = self.hwm = 0  # KiB: peaks of the sums, and the largest single peak
        self.processes = 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pids = [self.pid]
        for i in itertools.count():
            if i % self.every == 0:
                pids = descendants(self.pid)
                self.processes = max(self.processes, len(pids))
                self.pss = max(self.pss, sum(_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids))
            status = [_status(p) for p in pids]
            self.rss = max(self.rss, sum(rss for rss, _ in status))
            self.hwm = max([self.hwm, *(hwm for _, hwm in status)])
            if self._stop.wait(self.period):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _status(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB; zeros once it is gone."""
    rss = hwm = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


def run_measured(cmd: list[str], env: dict, log: Path) -> dict:
    """Runs ``cmd``, its stderr and stdout lines timestamped into ``log``; wall time, memory of its
    process tree, its CPU time and the other processes' CPU time."""
    children, mine = resource.getrusage(resource.RUSAGE_CHILDREN), os.times()
    busy0, all0 = cpu_busy()
    began = time.monotonic()
    lines: list[tuple[float, str]] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        memory = TreeMemory(proc.pid)
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - began, line.rstrip("\n")))
        proc.wait()
        memory.stop()
    wall = time.monotonic() - began
    busy1, all1 = cpu_busy()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    bench = (os.times().user - mine.user) + (os.times().system - mine.system)  # sampling, reading its output
    log.write_text("".join(f"{t:9.2f}  {text}\n" for t, text in lines))
    if proc.returncode:
        tail = "\n".join(text for _, text in lines[-30:])
        sys.exit(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{tail}")
    return {
        "wall_s": wall,
        "lines": lines,
        "peak_rss_sum_mb": memory.rss * 1024 / 1e6,
        "peak_pss_sum_mb": memory.pss * 1024 / 1e6,
        "largest_process_mb": memory.hwm * 1024 / 1e6,
        "processes": memory.processes,
        "cpu_s": own,
        "bench_cpu_share": bench / max(all1 - all0, 1e-9),
        "others_cpu_share": max(0.0, (busy1 - busy0) - own - bench) / max(all1 - all0, 1e-9),
    }


BPE_SNIPPET = """
import json, sys, time
from pathlib import Path
from kiln.config import DataConfig
from kiln.data.corpus import open_corpus
from kiln.data.tokenizer import _train_bpe, bpe_cache_path, sample_documents
source, cache, vocab, sample, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cfg = DataConfig(source=source, cache_dir=str(cache), vocab_size=vocab, tokenizer_sample_bytes=sample)
corpus = open_corpus(source, cfg.text_field, cfg.val_fraction, position_split_chars=cfg.position_split_chars)
t = [time.monotonic()]
corpus.fingerprint; t.append(time.monotonic())
corpus.count("train"); t.append(time.monotonic())
texts, count = sample_documents(corpus, sample); t.append(time.monotonic())
sampled = [0]
def counted(texts):
    for text in texts:
        sampled[0] += len(text.encode())
        yield text
tok = _train_bpe(counted(texts), vocab, count); t.append(time.monotonic())
tok.save(out)
print(json.dumps({"fingerprint_s": t[1] - t[0], "plan_s": t[2] - t[1], "sample_pass_s": t[3] - t[2],
                  "train_s": t[4] - t[3], "sample_documents": count, "sample_bytes": sampled[0]}))
"""


def train_tokenizer(corpus: Path, out: Path, vocab: int, sample: int, work: Path, env: dict) -> dict:
    cache = Path(tempfile.mkdtemp(dir=work, prefix="bpe-cache-"))
    cmd = [sys.executable, "-c", BPE_SNIPPET, str(corpus), str(cache), str(vocab), str(sample), str(out)]
    result = run_measured(cmd, env, work / f"bpe-{corpus.stem}.log")
    result.update(json.loads(result.pop("lines")[-1][1]))
    shutil.rmtree(cache)
    return result


def encode_batch_baseline(corpus: Path, tokenizer: Path, batch: int = 1000) -> dict:
    """The tokenizers library's own multi-threaded encode_batch over every document of ``corpus``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    tok.encode_special_tokens = True  # as kiln encodes: a "<|endoftext|>" in a text is text
    seconds = 0.0
    nbytes = tokens = documents = 0
    cpu0, (busy0, all0) = os.times(), cpu_busy()
    began = time.monotonic()

    def encode(texts: list[str]) -> None:
        nonlocal seconds, tokens
        start = time.perf_counter()
        encodings = tok.encode_batch(texts, add_special_tokens=False)
        seconds += time.perf_counter() - start
        tokens += sum(len(e.ids) for e in encodings)

    texts: list[str] = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            texts.append(text)
            nbytes += len(text.encode("utf-8"))
            documents += 1
            if len(texts) == batch:
                encode(texts)
                texts = []
    if texts:
        encode(texts)
    cpu1, (busy1, all1) = os.times(), cpu_busy()
    own = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "seconds": seconds,
        "wall_s": time.monotonic() - began,
        "bytes": nbytes,
        "documents": documents,
        "tokens": tokens,
        "mb_per_s": nbytes / seconds / 1e6,
        "tokens_per_s": tokens / seconds,
        "others_cpu_share": max(0.0, (busy1 - busy0) - own) / max(all1 - all0, 1e-9),
    }


_TOKENIZED = re.compile(
    r"kiln: tokenized (?P<split>\w+): (?P<documents>[\d,]+) documents, (?P<bytes>[\d,]+) bytes, "
    r"(?P<tokens>[\d,]+) tokens in (?P<seconds>[\d.]+)s"
)


def kiln_prepare(corpus: Path, tokenizer: Path, work: Path, env: dict, extra: list[str]) -> dict:
    cache = Path(tempfile.mkdtemp(dir=work, prefix="kiln-cache-"))
    sets = {"data.source": corpus, "data.cache_dir": cache, "data.tokenizer": tokenizer}
    cmd = [sys.executable, "-m", "kiln", "prepare", *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
    result = run_measured([*cmd, *extra], env, work / f"prepare-{corpus.stem}.log")
    lines = result.pop("lines")
    splits = {}
    for _, text in lines:
        if m := _TOKENIZED.search(text):
            splits[m["split"]] = {k: float(v.replace(",", "")) for k, v in m.groupdict().items() if k != "split"}
    when = {key: next(t for t, text in lines if key in text) for key in ("fingerprinting", "tokenizing")}
    [manifest_path] = cache.glob("prepared/*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    shards = {s: len(info["shards"]) for s, info in manifest["splits"].items()}
    largest = max(shard["tokens"] for info in manifest["splits"].values() for shard in info["shards"])
    shutil.rmtree(cache)
    nbytes = sum(s["bytes"] for s in splits.values())
    tokens = sum(s["tokens"] for s in splits.values())
    seconds = sum(s["seconds"] for s in splits.values())
    return {
        **result,
        "bytes": int(nbytes),
        "documents": int(sum(s["documents"] for s in splits.values())),
        "tokens": int(tokens),
        "tokenize_s": seconds,
        "tokenize_mb_per_s": nbytes / seconds / 1e6,
        "tokenize_tokens_per_s": tokens / seconds,
        "whole_mb_per_s": nbytes / result["wall_s"] / 1e6,
        "whole_tokens_per_s": tokens / result["wall_s"],
        "startup_s": when["fingerprinting"],
        "fingerprint_and_plan_s": when["tokenizing"] - when["fingerprinting"],
        "splits": splits,
        "shards": shards,
        "largest_shard_bytes": largest * np.dtype(manifest["dtype"]).itemsize,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, action="append", help="corpus size in GB (1e9 bytes); repeatable")
    ap.add_argument("--dir", type=Path, help="where to write the corpora (default: a temporary directory)")
    ap.add_argument("--vocab", type=int, default=32768, help="data.vocab_size of the BPE")
    ap.add_argument("--sample-mb", type=float, default=100, help="data.tokenizer_sample_bytes, in MB")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpora")
    ap.add_argument("--set", action="append", default=[], help="more --set KEY=VALUE for kiln prepare")
    args = ap.parse_args()
    sizes = args.gb or [0.2, 2.0]
    root = Path(tempfile.mkdtemp(prefix="kiln-prepare-scale-", dir=args.dir))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    extra = [a for s in args.set for a in ("--set", s)]
    tokenizer = root / "tokenizer.json"
    rows = []
    try:
        for gb in sizes:
            corpus = root / f"corpus-{gb:g}gb.jsonl"
            began = time.monotonic()
            nbytes, documents = write_corpus(corpus, int(gb * 1e9))
            made = {"gb": gb, "bytes": nbytes, "documents": documents, "generate_s": time.monotonic() - began}
            print(json.dumps({"corpus": made}), flush=True)
            trained = tokenizer if not tokenizer.exists() else root / f"tokenizer-{gb:g}gb.json"
            bpe = train_tokenizer(corpus, trained, args.vocab, int(args.sample_mb * 1e6), root, env)
            print(json.dumps({"gb": gb, "bpe": bpe}), flush=True)
            base = encode_batch_baseline(corpus, tokenizer)
            print(json.dumps({"gb": gb, "encode_batch": base}), flush=True)
            kiln = kiln_prepare(corpus, tokenizer, root, env, extra)
            print(json.dumps({"gb": gb, "kiln_prepare": kiln}), flush=True)
            if kiln["bytes"] != base["bytes"] or kiln["tokens"] - kiln["documents"] != base["tokens"]:
                print(f"warning: kiln and encode_batch saw different text ({kiln['bytes']} vs {base['bytes']} bytes)")
            rows.append((made, bpe, base, kiln))
            corpus.unlink()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(
        "| corpus | encode_batch MB/s (tokens/s) | kiln tokenization MB/s (tokens/s) | ratio | "
        "kiln prepare whole MB/s (wall) | ratio | peak memory (RSS sum / PSS sum / largest process) | "
        "shards | BPE on the sample | others' CPU |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for made, bpe, base, kiln in rows:
        print(
            f"| {made['bytes'] / 1e9:.2f} GB, {made['documents']:,} docs "
            f"| {base['mb_per_s']:.2f} ({base['tokens_per_s'] / 1e6:.3f}M) "
            f"| {kiln['tokenize_mb_per_s']:.2f} ({kiln['tokenize_tokens_per_s'] / 1e6:.3f}M) "
            f"| {kiln['tokenize_mb_per_s'] / base['mb_per_s']:.2f}x "
            f"| {kiln['whole_mb_per_s']:.2f} ({kiln['wall_s']:.0f} s) "
            f"| {kiln['whole_mb_per_s'] / base['mb_per_s']:.2f}x "
            f"| {kiln['peak_rss_sum_mb']:.0f} / {kiln['peak_pss_sum_mb']:.0f} / {kiln['largest_process_mb']:.0f} MB "
            f"| {kiln['shards']['train']} + {kiln['shards']['val']} "
            f"| {bpe['train_s']:.0f} s on {bpe['sample_bytes'] / 1e6:.0f} MB (+ {bpe['sample_pass_s']:.0f} s sizing), "
            f"{bpe['peak_rss_sum_mb']:.0f} MB "
            f"| {base['others_cpu_share']:.0%} / {kiln['others_cpu_share']:.0%} |"
        )


if __name__ == "__main__":
    main()
