"""``kiln serve``: a run's model behind an OpenAI-compatible HTTP API (docs/serve.md).

FastAPI and uvicorn are an optional extra (``pip install 'kiln[serve]'``): they are imported when
a server is made, not with this package.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from kiln.serve.engine import ServeError
from kiln.train.run import load_run

__all__ = ["create_app", "listen", "serve"]


def serve(
    path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "auto",
    model_name: str | None = None,
    checkpoint: str | Path | None = None,
    max_batch: int = 8,
    max_batch_tokens: int = 512,
    trust: bool = False,
    api_key: str | None = None,
    max_model_len: int | None = None,
    max_queue: int = 256,
    timeout: float = 600.0,
    compiled: bool = False,
) -> int:
    """Serve the model of a run directory, one of its checkpoints or an export (what ``load_run``
    loads) at http://HOST:PORT/v1 until Ctrl-C, which stops taking requests and lets those in
    flight finish (a second one quits at once). The model is named ``model_name``, by default
    the run's (or export's) directory name; ``max_batch`` requests are decoded at once, in one batch;
    ``compiled``: the decode step compiled before the server listens. Returns
    the exit status: 2 when it cannot serve (a missing extra, a model that does not generate, a
    busy port)."""
    try:
        from kiln.serve.app import create_app, run_server
    except ImportError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    run = load_run(path, checkpoint, device, trust)
    name = model_name or run.directory.resolve().name  # the run's, also when a checkpoint of it is named
    if compiled:
        print("kiln: compiling the decode step (a minute or two on a CPU) ...", flush=True)
    try:
        app = create_app(
            run,
            name,
            max_batch=max_batch,
            max_batch_tokens=max_batch_tokens,
            api_key=api_key,
            max_model_len=max_model_len,
            max_queue=max_queue,
            timeout=timeout,
            compiled=compiled,
        )
    except ServeError as e:
        print(f"kiln: error: cannot serve {path}: {e}", file=sys.stderr)
        return 2
    try:
        sock = listen(host, port)
    except OSError as e:
        print(f"kiln: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 2
    # The socket listens already: a request made from now on is answered once the loop starts.
    where = f"[{host}]" if ":" in host else host
    print(f"kiln: serving {name} (step {run.step}) at http://{where}:{sock.getsockname()[1]}/v1", flush=True)
    run_server(app, sock)
    print("kiln: server stopped", flush=True)
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, for uvicorn's ``Server.run(sockets=[...])``.

    It names its protocol because asyncio turns Nagle's algorithm off only on connections whose
    socket says IPPROTO_TCP (``socket.create_server``'s do not); with it on, each write of a
    response after the first waits for the client's delayed acknowledgement, 40 ms."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def __getattr__(name: str):
    if name == "create_app":  # imports fastapi: only when asked for
        from kiln.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'kiln.serve' has no attribute {name!r}")
