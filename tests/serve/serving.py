"""What the serve tests share: an app served over real HTTP on a free loopback port."""

import contextlib
import threading
import time

import httpx
import uvicorn

from kiln.cli import main
from kiln.serve import listen

from conftest import tiny_overrides

_runs: dict[str, object] = {}


def tiny_run(tmp_path_factory, corpus_dir):
    """The tiny GPT run (4 steps) that the serve tests share, trained once per session."""
    if "gpt" not in _runs:
        run = tmp_path_factory.mktemp("gpt") / "run"
        sets = tiny_overrides(run, corpus_dir, train__max_steps=4, eval__sample_tokens=0)
        assert main(["train", *[a for item in sets for a in ("--set", item)]]) == 0
        _runs["gpt"] = run
    return _runs["gpt"]


@contextlib.contextmanager
def running(app):
    """The app served by uvicorn in a thread on a free loopback port: its base URL."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
