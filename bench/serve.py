"""kiln serve under load: tokens/s and time to first token of streamed completions, with 1 and
with 8 clients at once (or as --clients says). Prints a table and one JSON line.

    python bench/serve.py RUN_DIR [--clients 1 8] [--requests 4] [--max-tokens 64] [--device cpu]
    python bench/serve.py --url http://HOST:PORT/v1 [...]     # a server that is already running
    python bench/serve.py RUN_DIR --hostile 3 [...]           # beside 3 hostile clients

Without --url the server runs in its own process (so the clients' threads do not share its
interpreter), started as ``kiln serve`` starts it. Each client sends --requests completions one
after another, sampled at temperature 1 with a seed of its own, and counts the tokens from the
usage the server reports (an answer may end early, at end-of-text). One request before each round
warms the server up and is not counted. Time to first token: from sending the request to the
first chunk with text; decode tokens/s of a request: its tokens after the first over the time
after it; aggregate tokens/s: all tokens of a round over the round's wall-clock time. With
--hostile N, N more clients keep sending what a server on a network meets: a 20 MB body, a long
generation whose client goes away after 0.2 s, a body trickled a byte every 50 ms.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

PROMPTS = [
    "def parse(text):\n",
    "import os\nimport sys\n\n",
    "class Queue:\n    ",
    "    for i in range(",
    "# Copyright",
    "if __name__ == ",
    "    return self.",
    "from collections import ",
]


def start_server(run_dir: str, device: str, max_batch: int, compiled: bool) -> tuple[subprocess.Popen, str]:
    """``kiln serve`` on a free port in a child process; (process, base URL) once it is ready
    (compiled first, with ``compiled``)."""
    code = (
        "import sys; from kiln.serve import serve; sys.exit(serve(sys.argv[1], port=0, device=sys.argv[2], "
        "max_batch=int(sys.argv[3]), compiled=sys.argv[4] == 'compiled'))"
    )
    argv = [sys.executable, "-c", code, run_dir, device, str(max_batch), "compiled" if compiled else "eager"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.startswith("kiln: compiling"):
        line = proc.stdout.readline()
    if not line.startswith("kiln: serving"):
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split()[-1]


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int, seed: int) -> dict:
    """One streamed completion: its time to first token, duration and token count."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = tokens = None
    with client.stream("POST", f"{url}/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "duration": end - start, "tokens": tokens, "decode_time": end - first}


def hostile(url: str, which: int, stop: threading.Event) -> None:
    """One hostile client until ``stop``: in turn, a 20 MB body (its length announced, then sent),
    a long generation whose client goes away after 0.2 s, and a body trickled a byte at a time."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n"
    kind = which
    while not stop.is_set():
        kind = (kind + 1) % 3
        try:
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                if kind == 0:
                    body = json.dumps({"prompt": "x " * (10 << 20), "max_tokens": 1}).encode()
                    sock.sendall(head.format(len(body)).encode() + body)
                    sock.recv(4096)
                elif kind == 1:
                    body = json.dumps({"prompt": "def ", "max_tokens": 400, "temperature": 1.0}).encode()
                    sock.sendall(head.format(len(body)).encode() + body)
                    time.sleep(0.2)  # then gone
                else:
                    body = json.dumps({"prompt": "def ", "max_tokens": 1}).encode()
                    sock.sendall(head.format(len(body)).encode())
                    for byte in body[:40]:
                        if stop.wait(0.05):
                            break
                        sock.sendall(bytes([byte]))
        except OSError:
            time.sleep(0.05)


def round_of(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``clients`` clients at once, each sending ``requests`` requests in turn."""

    def client_loop(c: int) -> list[dict]:
        with httpx.Client(timeout=600) as client:
            return [
                one_request(client, url, PROMPTS[(c + r) % len(PROMPTS)], max_tokens, seed=1000 * c + r)
                for r in range(requests)
            ]

    with httpx.Client(timeout=600) as client:
        one_request(client, url, PROMPTS[0], max_tokens, seed=0)  # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client_loop, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    decode = [(r["tokens"] - 1) / r["decode_time"] for r in results if r["tokens"] > 1 and r["decode_time"] > 0]
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "ttft_max_ms": 1000 * ttft[-1],
        "decode_tokens_per_s_per_request": statistics.median(decode) if decode else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", nargs="?", help="run directory to serve (or --url)")
    ap.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--max-batch", type=int, default=8, help="requests the server decodes at once, in one batch (its default: 8)"
    )
    ap.add_argument("--compile", action="store_true", help="the server compiles its decode step (kiln serve --compile)")
    ap.add_argument(
        "--hostile",
        type=int,
        default=0,
        help="hostile clients beside the measured ones (huge bodies, disconnects, trickles)",
    )
    args = ap.parse_args()
    if not args.run_dir and not args.url:
        ap.error("give a RUN_DIR to serve or the --url of a running server")

    proc, url = (
        (None, args.url.rstrip("/"))
        if args.url
        else start_server(args.run_dir, args.device, args.max_batch, args.compile)
    )
    stop = threading.Event()
    attackers = [threading.Thread(target=hostile, args=(url, i, stop), daemon=True) for i in range(args.hostile)]
    for attacker in attackers:
        attacker.start()
    try:
        rounds = [round_of(url, c, args.requests, args.max_tokens) for c in args.clients]
    finally:
        stop.set()
        for attacker in attackers:
            attacker.join(timeout=60)
        if proc is not None:
            proc.terminate()
            proc.wait()

    print(f"{'clients':>7}{'requests':>9}{'tokens':>8}{'tokens/s':>10}{'TTFT p50':>10}{'TTFT max':>10}{'decode/s':>10}")
    for r in rounds:
        per_request = r["decode_tokens_per_s_per_request"]
        print(
            f"{r['clients']:>7}{r['requests']:>9}{r['tokens']:>8}{r['tokens_per_s']:>10.1f}"
            f"{r['ttft_p50_ms']:>8.0f}ms{r['ttft_max_ms']:>8.0f}ms{per_request or float('nan'):>10.1f}"
        )
    print(
        json.dumps(
            {
                "bench": "serve",
                "run": args.run_dir or args.url,
                "device": args.device if proc is not None else None,
                "max_batch": args.max_batch if proc is not None else None,
                "compiled": args.compile if proc is not None else None,
                "max_tokens": args.max_tokens,
                "hostile": args.hostile,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "machine": platform.machine(),
                "processor": platform.processor() or platform.machine(),
                "rounds": rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
