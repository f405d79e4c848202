"""kiln serve on a port someone else can reach, over real HTTP on loopback: an API key on every
route but /health, a request for another model is a 404, a body must be JSON and at most 8 MiB
(413 before it is read, while other requests go on), prompts and stop strings a request are
bounded, a token id past the embedding is refused, and --max-model-len caps the context."""

import concurrent.futures
import dataclasses
import json
import socket
import statistics
import threading
import time

import pytest
import torch

from kiln.train.run import load_run

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from serving import running, tiny_run  # noqa: E402

from kiln.serve import create_app  # noqa: E402

pytestmark = pytest.mark.e2e
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, corpus_dir):
    return tiny_run(tmp_path_factory, corpus_dir)


@pytest.fixture(scope="module")
def url(gpt_run):
    with running(create_app(load_run(gpt_run, device="cpu"), "tiny-gpt", api_key=KEY, max_model_len=64)) as url:
        yield url


def _post(url, body, key=KEY, **kw):
    return httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, **kw)


def test_every_route_but_health_needs_the_api_key(url):
    assert httpx.get(f"{url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        reply = httpx.get(f"{url}/v1/models", headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert _post(url, {"prompt": "def ", "max_tokens": 2}, key="wrong").status_code == 401
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny-gpt", prompt="def ", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_another_model_is_a_404_and_a_body_must_be_json(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist here") as e:
        client.completions.create(model="gpt-4", prompt="def ", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    form = httpx.post(
        f"{url}/v1/completions",
        content=b"prompt=hi",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert form.status_code == 415 and "Content-Type: application/json" in form.json()["error"]["message"]


def _raw(url, head: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head)
    return sock


def _status(sock: socket.socket) -> int:
    return int(sock.recv(65536).split(b" ", 2)[1])


def test_a_20_mb_body_is_a_413_at_once_while_other_requests_go_on(url, alone):
    """A body announced as 20 MB is answered 413 from its headers alone, within 100 ms; one sent
    in chunks, without its length, is cut off at 8 MiB; meanwhile a small request takes no more
    than twice what it takes on an idle server."""
    announced = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {20 * 10**6}\r\n\r\n"
    ).encode()

    def small() -> float:
        started = time.perf_counter()
        assert _post(url, {"prompt": "def ", "max_tokens": 1}).status_code == 200
        return time.perf_counter() - started

    with alone():  # timed: no other test beside it (once: each turn waits for the other worker's test)
        started = time.perf_counter()
        sock = _raw(url, announced + b'{"prompt": "')
        assert _status(sock) == 413 and time.perf_counter() - started < 0.1
        sock.close()
        idle = statistics.median(small() for _ in range(5))
        busy = _beside_an_upload(url, small)
    assert busy <= 2 * idle + 0.01, f"a small request took {busy * 1e3:.0f} ms beside the upload, {idle * 1e3:.0f} idle"


def _beside_an_upload(url, small) -> float:
    """The median time of ``small`` requests while another client sends 20 MiB in chunks, which
    the server cuts off with a 413 at 8 MiB."""
    chunked = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    sock = _raw(url, chunked)
    piece = b'{"prompt": "' + b"x" * (1 << 20)
    answered = []

    def send() -> None:
        try:
            for _ in range(20):  # 20 MiB, a MiB at a time
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                time.sleep(0.01)
        except OSError:  # the server answered and closed: the rest is not read
            pass
        answered.append(_status(sock))

    sender = threading.Thread(target=send)
    sender.start()
    busy = statistics.median(small() for _ in range(5))
    sender.join(timeout=60)
    sock.close()
    assert answered == [413]
    return busy


def test_prompts_stop_strings_and_the_context_a_request_may_fill_are_bounded(url):
    for body, param, said in [
        ({"prompt": ["x"] * 257, "max_tokens": 1}, "prompt", "at most 256 prompts"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop strings"),
        ({"prompt": "x", "stop": ["y" * 1001]}, "stop", "at most 4 stop strings of at most 1000 characters"),
        ({"prompt": list(range(60)), "max_tokens": 10}, "max_tokens", "exceed the model's context of 64 tokens"),
    ]:
        reply = _post(url, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and said in error["message"], error
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["max_model_len"] == 64


def test_token_ids_are_checked_against_the_embedding_and_an_unknown_context_bounds_max_tokens(gpt_run):
    run = load_run(gpt_run, device="cpu")
    model = run.model
    rows = 100  # fewer rows than the tokenizer's 512 ids: the embedding is what an id must index
    model.tok_emb = torch.nn.Embedding(rows, model.tok_emb.embedding_dim)

    class NoContext(type(run.family)):
        def context_length(self, args):
            return None

    with running(create_app(dataclasses.replace(run, family=NoContext()), "small-embedding")) as url:
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": [rows - 1], "max_tokens": 1})
        assert ok.status_code == 200
        past = httpx.post(f"{url}/v1/completions", json={"prompt": [rows], "max_tokens": 1})
        assert past.status_code == 400 and f"token ids must be in [0, {rows})" in past.json()["error"]["message"]
        many = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 5000})
        assert many.status_code == 400 and "context length is unknown" in many.json()["error"]["message"]


def _slow(run, made: list[int], seconds: float = 0.02):
    """``run`` with a family whose every step takes ``seconds`` more and is counted in ``made``."""

    class Slow(type(run.family)):
        def decoding(self, model):
            return _Slowly(super().decoding(model), made, seconds)

    return dataclasses.replace(run, family=Slow())


@dataclasses.dataclass(frozen=True)
class _Slowly:
    inner: object
    made: list
    seconds: float

    @property
    def module(self):
        return self.inner.module

    @property
    def context(self):
        return self.inner.context

    def forward(self, tokens, cache):
        time.sleep(self.seconds)
        self.made.append(1)
        return self.inner.forward(tokens, cache)


def test_a_full_queue_is_a_429_and_a_request_past_its_time_a_504(gpt_run):
    made: list[int] = []
    app = create_app(_slow(load_run(gpt_run, device="cpu"), made), "slow", max_batch=1, max_queue=1, timeout=1.0)
    with running(app) as url, concurrent.futures.ThreadPoolExecutor(4) as pool:
        body = {"prompt": "def ", "max_tokens": 150, "temperature": 0}
        first = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
        time.sleep(0.3)  # decoding: the one slot taken
        second = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
        time.sleep(0.3)  # waiting: the queue full
        third = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert third.status_code == 429 and third.headers["Retry-After"] == "1"
        assert third.json()["error"]["code"] == "queue_full"
        # 150 tokens at 20 ms do not fit in the second's limit: the first is ended by it, and
        # the second, which waited, too.
        assert first.result().status_code == 504 and "limit" in first.result().json()["error"]["message"]
        assert second.result().status_code == 504


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_goes_away_stops_its_decoding(gpt_run, stream):
    made: list[int] = []
    with running(create_app(_slow(load_run(gpt_run, device="cpu"), made), "slow", max_batch=2)) as url:
        body = json.dumps({"prompt": "def ", "max_tokens": 200, "temperature": 0, "stream": stream}).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock = _raw(url, head + body)
        deadline = time.monotonic() + 30
        while len(made) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        sock.close()
        time.sleep(1.0)  # the server notices within a quarter of a second (or at its next write)
        stopped = len(made)
        time.sleep(0.5)
        assert len(made) == stopped < 200, f"{len(made)} tokens decoded for a client that left"
        # The server serves on.
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
