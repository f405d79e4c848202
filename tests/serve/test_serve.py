"""kiln serve over real HTTP on loopback, driven by the official openai client: greedy answers are
``kiln generate``'s, seeds draw its samples, streaming says what the whole answer says, stop
strings and max_tokens end it as OpenAI's API does, concurrent clients each get their own answer,
bad requests and failures get OpenAI's error JSON and leave the server serving, chat goes through
the model's chat template, and ``serve`` says where it listens and stops cleanly on Ctrl-C."""

import concurrent.futures
import dataclasses
import json
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from kiln.cli import main
from kiln.serve.engine import TextStream
from kiln.train.run import load_run

from conftest import sft_records, write_jsonl

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from serving import running, tiny_run  # noqa: E402

from kiln.serve import create_app  # noqa: E402  (needs fastapi, skipped above without the extra)

pytestmark = pytest.mark.e2e

PROMPTS = ["def ", "import os\n", "class A", "return x", "# the", "for i in", "if not", "print("]


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, corpus_dir):
    return tiny_run(tmp_path_factory, corpus_dir)


@pytest.fixture(scope="module")
def gpt_url(gpt_run):
    # Fewer slots than the 8 concurrent clients below: some of them wait in the queue.
    with running(create_app(load_run(gpt_run, device="cpu"), "tiny-gpt", max_batch=3)) as url:
        yield url


@pytest.fixture(scope="module")
def client(gpt_url):
    return openai.OpenAI(base_url=f"{gpt_url}/v1", api_key="x", max_retries=0)


def complete(client, prompt, **kw):
    return client.completions.create(model="tiny-gpt", prompt=prompt, **kw)


def streamed(client, prompt, **kw) -> tuple[str, str]:
    """The text and finish_reason of a streamed completion."""
    text, finish = [], None
    for chunk in complete(client, prompt, stream=True, **kw):
        text.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def test_models_names_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny-gpt"]


def test_greedy_completion_is_what_kiln_generate_writes(gpt_run, client, capsys):
    prompt = "def parse(text):"
    reply = complete(client, prompt, max_tokens=12, temperature=0)
    args = ["generate", str(gpt_run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]
    assert main([*args, "--device", "cpu"]) == 0
    assert capsys.readouterr().out == prompt + reply.choices[0].text + "\n"
    run = load_run(gpt_run, device="cpu")
    ids = run.tokenizer.encode(prompt).ids
    new = run.family.generate(run.model, torch.tensor([ids]), 12, temperature=0)[0, len(ids) :].tolist()
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(new) == 12
    assert reply.choices[0].text == run.tokenizer.decode(new) and reply.choices[0].finish_reason == "length"
    assert reply.model == "tiny-gpt" and reply.object == "text_completion"


def test_a_seed_reproduces_kiln_generates_sample(gpt_run, client, capsys):
    prompt = "import "
    first, again, other = (complete(client, prompt, max_tokens=10, seed=s).choices[0].text for s in (7, 7, 8))
    assert first == again != other
    args = ["generate", str(gpt_run), "--prompt", prompt, "--temperature", "1", "--top-k", "0", "--seed", "7"]
    assert main([*args, "--max-new-tokens", "10", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == prompt + first + "\n"


def test_streaming_says_what_the_whole_answer_says(client, gpt_url):
    for kw in (dict(temperature=0), dict(temperature=1, seed=3, top_p=0.9)):
        whole = complete(client, "def ", max_tokens=20, **kw).choices[0]
        assert streamed(client, "def ", max_tokens=20, **kw) == (whole.text, whole.finish_reason)
    body = {"prompt": "def ", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    raw = httpx.post(f"{gpt_url}/v1/completions", json=body).text
    events = raw.split("\n\n")
    assert raw.endswith("data: [DONE]\n\n") and all(e.startswith("data: ") for e in events[:-1])
    last = json.loads(events[-3].removeprefix("data: "))
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5


def test_a_stop_string_ends_the_text_before_it(client):
    full = complete(client, "class A", max_tokens=24, temperature=0).choices[0].text
    stop = full[8:11]
    assert len(stop) == 3, full
    reply = complete(client, "class A", max_tokens=24, temperature=0, stop=[stop, "never said"]).choices[0]
    assert (reply.text, reply.finish_reason) == (full[: full.index(stop)], "stop")
    assert streamed(client, "class A", max_tokens=24, temperature=0, stop=stop) == (reply.text, "stop")


def test_max_tokens_ends_with_length_after_exactly_that_many(client):
    reply = complete(client, "for i in", max_tokens=5, temperature=0.5, seed=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 5


def test_concurrent_clients_each_get_their_own_answer(client):
    def ask(i):
        kw = dict(temperature=0.7 if i % 2 else 1.0, seed=i)  # sampled: every answer differs, so none can be swapped
        if i % 4 < 2:
            return complete(client, PROMPTS[i], max_tokens=16, **kw).choices[0].text
        return streamed(client, PROMPTS[i], max_tokens=16, **kw)[0]

    alone = [ask(i) for i in range(8)]
    assert len(set(alone)) == 8
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == alone


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "the of and to in a " * 1000}, "prompt"),  # longer than the context (1024)
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
    ],
)
def test_a_bad_request_gets_a_400_and_the_server_serves_on(gpt_url, client, body, param):
    reply = httpx.post(f"{gpt_url}/v1/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], error
    assert complete(client, "def ", max_tokens=2, temperature=0).choices[0].finish_reason == "length"


def test_malformed_json_and_unknown_routes_get_openai_errors(gpt_url, client):
    for content in (b"{not json", b"[1, 2]", b"\xff"):
        reply = httpx.post(f"{gpt_url}/v1/completions", content=content, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{gpt_url}/v1/nothing", json={}).json()["error"]["message"].startswith("Not Found")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        complete(client, "x", temperature=-1)


def test_a_model_without_a_chat_template_refuses_chat(client):
    with pytest.raises(openai.BadRequestError, match="no chat template") as e:
        client.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400


def test_text_waits_for_whole_characters_and_for_stop_strings_to_resolve():
    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    text = TextStream(decode, list(b"say "), ["END"])
    assert [text.add(b) for b in "é!EN".encode()] == [("", False), ("é", False), ("!", False), ("", False), ("", False)]
    assert text.add(ord("D")) == ("", True) and text.text == "é!"
    text = TextStream(decode, [], ["END"])
    assert [text.add(b)[0] for b in b"aEN"] + [text.rest()] == ["a", "", "", "EN"]


# -- chat, with a fine-tuned Hugging Face causal LM ------------------------------------------


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import tiny_llama

    tmp = tmp_path_factory.mktemp("chat")
    model, run = tiny_llama(tmp / "llama"), tmp / "run"
    items = {
        "run.dir": run,
        "run.device": "cpu",
        "model.source": f"hf:{model}",
        "data.source": write_jsonl(tmp / "sft.jsonl", sft_records(16)),
        "data.num_workers": 0,
        "data.seq_len": 64,
        "train.max_steps": 2,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 2,
        "eval.every": 0,
        "checkpoint.every": 2,
    }
    assert main(["train", *[a for k, v in items.items() for a in ("--set", f"{k}={v}")]]) == 0
    return run


def test_chat_renders_the_chat_template_and_streams_the_same(chat_run):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "Add 2 and 3."}]
    with running(create_app(load_run(chat_run, device="cpu"), "tiny-llama")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        ask = dict(model="tiny-llama", messages=messages, max_tokens=12, temperature=0)
        reply = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(**ask, stream=True))
        tok = AutoTokenizer.from_pretrained(chat_run / "tokenizer")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        plain = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=12, temperature=0)

    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "tiny-llama" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    # The answer continues the rendered conversation, as a plain completion of its tokens does.
    assert reply.usage.prompt_tokens == len(ids)
    assert plain.choices[0].text == choice.message.content and plain.usage == reply.usage

    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_a_hugging_face_model_scores_with_its_own_log_softmax(chat_run):
    run = load_run(chat_run, device="cpu")
    prompts = [[5, 17, 3, 42, 8, 99], [7, 1, 2]]
    with running(create_app(run, "tiny-llama")) as url:
        body = {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 0}
        choices = httpx.post(f"{url}/v1/completions", json=body).json()["choices"]
    for ids, choice in zip(prompts, choices, strict=True):
        with torch.no_grad():
            own = run.model(torch.tensor([ids[:-1]]))[0].float().log_softmax(-1)
        got = torch.tensor(choice["logprobs"]["token_logprobs"][1:])
        torch.testing.assert_close(got, own[torch.arange(len(ids) - 1), ids[1:]], rtol=0, atol=1e-5)


# -- serve(): what `kiln serve` runs ---------------------------------------------------------


def test_serve_prints_its_url_when_ready_and_stops_cleanly_on_ctrl_c(gpt_run):
    code = "import sys; from kiln.serve import serve; sys.exit(serve(sys.argv[1], port=0, device='cpu'))"
    proc = subprocess.Popen([sys.executable, "-c", code, str(gpt_run)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("kiln: serving run (step 4) at http://127.0.0.1:"), line
        reply = httpx.post(f"{line.split()[-1]}/completions", json={"prompt": "def ", "max_tokens": 3})
        assert reply.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0 and proc.stdout.read() == "kiln: server stopped\n"
    finally:
        proc.kill()


def test_serve_says_when_the_port_is_taken(gpt_run, capsys):
    from kiln.serve import serve

    with socket.create_server(("127.0.0.1", 0)) as taken:
        assert serve(gpt_run, port=taken.getsockname()[1], device="cpu") == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_answers_on_a_kept_alive_connection_do_not_wait_for_delayed_acks(gpt_url):
    with httpx.Client() as http:
        http.get(f"{gpt_url}/health")
        start = time.perf_counter()
        for _ in range(10):
            http.get(f"{gpt_url}/health")
        assert time.perf_counter() - start < 0.3  # with Nagle's algorithm on: 10 x 40 ms


def test_a_model_that_cannot_generate_is_refused(gpt_run):
    from kiln.models import ModelFamily
    from kiln.serve.engine import ServeError

    run = dataclasses.replace(load_run(gpt_run, device="cpu"), family=ModelFamily())  # its decoding is None
    with pytest.raises(ServeError, match="cannot generate text"):
        create_app(run, "classifier")


def test_a_failure_while_generating_is_that_requests_500_and_the_server_goes_on(gpt_run, caplog):
    run = load_run(gpt_run, device="cpu")

    class Failing(type(run.family)):
        """Fails at the step after the first token of any 3-token prompt."""

        def decoding(self, model):
            inner = super().decoding(model)

            class Forward:
                module, context = inner.module, inner.context
                armed = False  # a 3-token prompt was fed: the next step fails

                def forward(self, tokens, cache):
                    if self.armed:
                        self.armed = False
                        raise RuntimeError("the device fell over")
                    self.armed = tokens.size(1) == 3
                    return inner.forward(tokens, cache)

            return Forward()

    with running(create_app(dataclasses.replace(run, family=Failing()), "failing")) as url:
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        # What failed is in the server's log, not in the answer.
        assert reply.status_code == 500 and reply.json()["error"]["message"] == "internal error (see the server's log)"
        assert "the device fell over" not in reply.text and "the device fell over" in caplog.text
        events = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "stream": True}).text.split("\n\n")
        assert json.loads(events[-3].removeprefix("data: "))["error"]["type"] == "server_error"
        assert events[-2] == "data: [DONE]"
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
        assert reply.json()["usage"]["completion_tokens"] == 4


def test_an_event_is_one_line_whatever_characters_its_text_holds():
    from kiln.serve.app import _sse

    text = "a\u2028b\x85c\u2029d\ne\u00e9"  # line ends for str.splitlines (httpx's iter_lines)
    event = _sse({"text": text})
    line, blank = event.splitlines()
    assert blank == "" and json.loads(line.removeprefix("data: "))["text"] == text
