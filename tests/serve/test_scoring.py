"""kiln serve for evaluators, over real HTTP on loopback: ``echo``, ``logprobs`` and
``max_tokens=0`` on /v1/completions give the model's own log-softmax for the prompt's tokens and
the generated ones, in OpenAI's legacy shape, for several prompts in one request; the openai
client reads the fields; lm-eval's ``local-completions`` model scores a multiple-choice task
against the server exactly as lm-eval's own ``hf`` model scores the run's Hugging Face export."""

import json
import math

import pytest
import torch

from kiln.cli import main
from kiln.train.run import load_run

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from serving import running, tiny_run  # noqa: E402

from kiln.serve import create_app  # noqa: E402  (needs fastapi, skipped above without the extra)

pytestmark = pytest.mark.e2e

PROMPTS = ["def parse(text):\n    return text.split()", "import os", "x", "class Tree:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, corpus_dir):
    return tiny_run(tmp_path_factory, corpus_dir)


@pytest.fixture(scope="module")
def loaded(gpt_run):
    return load_run(gpt_run, device="cpu")


@pytest.fixture(scope="module")
def url(loaded):
    with running(create_app(loaded, "tiny-gpt", max_batch=2)) as url:
        yield url


def own_logprobs(run, ids: list[int]) -> torch.Tensor:
    """The model's log-softmax after each of ``ids`` but the last, computed here: [len - 1, V]."""
    with torch.no_grad():
        return run.model(torch.tensor([ids[:-1]]))[0].float().log_softmax(-1)


def post(url, **body):
    reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny-gpt", **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_echo_with_max_tokens_0_scores_every_prompt_with_the_models_log_softmax(loaded, url):
    ids = [loaded.tokenizer.encode(p).ids for p in PROMPTS]
    answer = post(url, prompt=PROMPTS, echo=True, logprobs=3, max_tokens=0, return_tokens_as_token_ids=True)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    total = sum(map(len, ids))
    assert answer["usage"] == {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total}
    for prompt, tokens, choice in zip(PROMPTS, ids, answer["choices"], strict=True):
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        got = choice["logprobs"]
        assert got["tokens"] == [f"token_id:{t}" for t in tokens]
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        assert len(got["token_logprobs"]) == len(got["top_logprobs"]) == len(tokens)
        if len(tokens) == 1:
            continue
        own = own_logprobs(loaded, tokens)
        expected = own[torch.arange(len(tokens) - 1), tokens[1:]]
        torch.testing.assert_close(torch.tensor(got["token_logprobs"][1:]), expected, rtol=0, atol=1e-5)
        values, best = own.topk(3, dim=-1)
        for j, top in enumerate(got["top_logprobs"][1:]):
            # The three most likely tokens, most likely first, and the prompt's own token.
            names = [f"token_id:{t}" for t in best[j].tolist()]
            assert list(top)[:3] == names
            torch.testing.assert_close(torch.tensor([top[n] for n in names]), values[j], rtol=0, atol=1e-5)
            assert top[got["tokens"][j + 1]] == got["token_logprobs"][j + 1]
            assert len(top) == 3 + (got["tokens"][j + 1] not in names)
    # A prompt scored with others (padded beside longer ones) is scored as it is alone.
    alone = post(url, prompt=ids[2], echo=True, logprobs=3, max_tokens=0)["choices"][0]["logprobs"]
    assert alone["token_logprobs"] == answer["choices"][2]["logprobs"]["token_logprobs"]


def test_token_texts_spell_the_echoed_prompt_and_offsets_point_into_it(loaded, url):
    choice = post(url, prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=0)["choices"][0]
    got = choice["logprobs"]
    assert "".join(got["tokens"]) == choice["text"] == PROMPTS[0]
    assert got["text_offset"] == [sum(map(len, got["tokens"][:i])) for i in range(len(got["tokens"]))]
    # Sent as token ids, the echo is their text.
    ids = loaded.tokenizer.encode(PROMPTS[3]).ids
    assert post(url, prompt=[ids], echo=True, max_tokens=0)["choices"][0]["text"] == PROMPTS[3]


def test_echo_and_logprobs_of_generated_tokens(loaded, url):
    prompt = PROMPTS[1]
    plain = post(url, prompt=prompt, max_tokens=6, temperature=0)["choices"][0]
    choice = post(url, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=2)["choices"][0]
    assert choice["text"] == prompt + plain["text"] and choice["finish_reason"] == plain["finish_reason"]
    got = choice["logprobs"]
    ids = loaded.tokenizer.encode(prompt).ids
    generated = loaded.family.generate(loaded.model, torch.tensor([ids]), 6, temperature=0)[0].tolist()
    own = own_logprobs(loaded, generated)
    expected = own[torch.arange(len(generated) - 1), generated[1:]]
    assert len(got["tokens"]) == len(generated)
    torch.testing.assert_close(torch.tensor(got["token_logprobs"][1:]), expected, rtol=0, atol=1e-5)
    # Greedy: each generated token is the most likely one.
    for lp, top in zip(got["token_logprobs"][len(ids) :], got["top_logprobs"][len(ids) :], strict=True):
        assert lp == max(top.values())
    assert got["text_offset"][len(ids)] == len(prompt)

    # Without echo: the generated tokens only, offsets from the start of the completion.
    alone = post(url, prompt=prompt, max_tokens=6, temperature=0, logprobs=0)["choices"][0]
    assert alone["text"] == plain["text"]
    assert alone["logprobs"]["token_logprobs"] == got["token_logprobs"][len(ids) :]
    assert alone["logprobs"]["tokens"] == got["tokens"][len(ids) :] and alone["logprobs"]["text_offset"][0] == 0
    assert all(len(top) == 1 for top in alone["logprobs"]["top_logprobs"])  # logprobs=0: the token's own


def test_several_prompts_are_each_generated_as_alone(url):
    together = post(url, prompt=PROMPTS[:3], max_tokens=5, temperature=0.8, seed=11)
    for i, prompt in enumerate(PROMPTS[:3]):
        alone = post(url, prompt=prompt, max_tokens=5, temperature=0.8, seed=11)["choices"][0]
        assert together["choices"][i]["text"] == alone["text"] and together["choices"][i]["logprobs"] is None
    assert together["usage"]["completion_tokens"] == 15


def test_the_openai_client_reads_the_scores(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    reply = client.completions.create(model="tiny-gpt", prompt=PROMPTS[:2], echo=True, logprobs=2, max_tokens=0)
    assert [c.text for c in reply.choices] == PROMPTS[:2]
    lp = reply.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.top_logprobs) and lp.top_logprobs[0] is None
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert sum(math.exp(v) for v in lp.top_logprobs[1].values()) <= 1 + 1e-6 and lp.text_offset[0] == 0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # nothing asked for: only with echo
        ({"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "echo": True, "stream": True}, "stream"),
        ({"prompt": ["x", "y"], "stream": True}, "stream"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["x", 3]}, "prompt"),
        ({"prompt": [[1, 2], [10**6]]}, "prompt"),
        ({"prompt": ["x", "the of and to in a " * 1000], "echo": True, "max_tokens": 0}, "prompt"),
        ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ],
)
def test_a_bad_scoring_request_gets_a_400(url, body, param):
    path = "chat/completions" if "messages" in body else "completions"
    reply = httpx.post(f"{url}/v1/{path}", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], error


# -- lm-eval's local-completions against the server, and lm-eval's hf model on the export ------------

QUESTIONS = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
    ("import", [" os", " the", " 42"], 0),
    ("for i in", [" range(10):", " x", " True"], 0),
    ("class Tree", [":", "(object):", " = 3"], 0),
    ("if not", [" x:", " in", " )"], 0),
    ("print(", ["'hello')", "1 +", ")"], 0),
    ("# the", [" value", " of", " a"], 1),
    ("return", [" self", " None", " 0"], 2),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A multiple-choice task on a local jsonl file, as an lm-eval include path."""
    out = tmp_path_factory.mktemp("tasks")
    data = out / "kiln_code_mc.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (out / "kiln_code_mc.yaml").write_text(
        "task: kiln_code_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: multiple_choice\n"
        "test_split: test\n"
        'doc_to_text: "{{q}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )
    (out / "kiln_code_ppl.yaml").write_text(  # perplexity: lm-eval's rolling windows, from end-of-text
        "task: kiln_code_ppl\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: loglikelihood_rolling\n"
        "test_split: test\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{q}}{{choices[answer]}}"\n'
        "metric_list:\n  - metric: word_perplexity\n"
    )
    return out


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def loglikelihoods(results) -> list[float]:
    return [ll for sample in results["samples"]["kiln_code_mc"] for ll, _ in sample["filtered_resps"]]


def test_lm_eval_local_completions_scores_as_lm_evals_hf_model_on_the_export(gpt_run, url, task_dir, offline, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's API models need it (lm-eval[api])
    export = tmp_path / "hf"
    assert main(["export", str(gpt_run), "--format", "hf", "--out", str(export)]) == 0
    context = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    # Only the task written here: indexing lm-eval's own thousands of tasks takes a minute.
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)

    def evaluate(model, model_args):
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=["kiln_code_mc", "kiln_code_ppl"],
            task_manager=tasks,
            device="cpu",
            log_samples=True,
        )

    hf = evaluate("hf", f"pretrained={export},dtype=float32")
    served = evaluate(
        "local-completions",
        f"base_url={url}/v1/completions,model=tiny-gpt,tokenizer={export},tokenizer_backend=huggingface,"
        f"max_length={context},batch_size=4,num_concurrent=1,max_retries=1",
    )
    acc = served["results"]["kiln_code_mc"]["acc,none"]
    assert acc == hf["results"]["kiln_code_mc"]["acc,none"]
    theirs, ours = loglikelihoods(hf), loglikelihoods(served)
    assert len(ours) == sum(len(c) for _, c, _ in QUESTIONS)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-4)
    greedy = [[g for _, g in s["filtered_resps"]] for s in served["samples"]["kiln_code_mc"]]
    assert greedy == [[g for _, g in s["filtered_resps"]] for s in hf["samples"]["kiln_code_mc"]]
    ppl = served["results"]["kiln_code_ppl"]["word_perplexity,none"]
    assert ppl == pytest.approx(hf["results"]["kiln_code_ppl"]["word_perplexity,none"], rel=1e-4)
