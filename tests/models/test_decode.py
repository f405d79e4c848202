"""kiln's decoder (kiln.models.decode): cached decoding equals recomputing, rows of any lengths
batched, joining and leaving between steps, each row's output that of the row decoded alone."""

import pytest
import torch

from kiln.models import GPT, GPTConfig, get_family
from kiln.models.decode import (
    GREEDY,
    POSITIONS_MULTIPLE,
    CompiledDecoding,
    Decoder,
    Row,
    Sampling,
    SlotCache,
    generate,
    sample_rows,
)

GPT_FAMILY = get_family("gpt")


def small_model(dtype=torch.float32, **overrides):
    dims = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=32)
    dims["tie_embeddings"] = False
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dims, **overrides})).to(dtype)


def decoding(model):
    return GPT_FAMILY.decoding(model)


def greedy_without_cache(model, prompt, max_new_tokens):
    idx = prompt
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(idx[:, -model.config.max_seq_len :])[:, -1]
            idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return idx


@pytest.mark.parametrize("prompt_len, new", [(5, 20), (1, 8), (30, 2), (40, 4)])
def test_cached_greedy_equals_recomputed_greedy_within_the_context(prompt_len, new):
    # float64 so that no near-tie of the argmax can flip between the two computations; the
    # longest prompt is cut to the last max_seq_len (32) tokens.
    model = small_model(torch.float64).eval()
    prompt = torch.randint(0, 61, (3, prompt_len))
    out = GPT_FAMILY.generate(model, prompt, new, temperature=0)
    assert out.shape == (3, prompt_len + new)
    assert torch.equal(out[:, :prompt_len], prompt)
    assert torch.equal(out, greedy_without_cache(model, prompt, new))


def test_past_the_context_the_cache_is_a_ring_seeing_the_last_max_seq_len_tokens():
    # With one layer a token's key and value depend only on the token and its position, and RoPE's
    # scores only on distances, so attending to the ring equals recomputing the shifted window.
    model = small_model(torch.float64, n_layer=1).eval()
    prompt = torch.randint(0, 61, (2, 20))
    out = GPT_FAMILY.generate(model, prompt, 50, temperature=0)  # 70 tokens: the ring wraps twice
    assert torch.equal(out, greedy_without_cache(model, prompt, 50))


def test_decoding_feeds_one_token_per_row_and_step_after_the_prompts():
    model = small_model().eval()
    shapes = []
    model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    GPT_FAMILY.generate(model, torch.randint(0, 61, (2, 10)), 30, temperature=0)
    # The two rows share a prompt chunk each (their prompts differ), then decode together.
    assert shapes == [(1, 10), (1, 10)] + [(2, 1)] * 29


def test_restores_training_mode():
    model = small_model().train()
    GPT_FAMILY.generate(model, torch.zeros(1, 3, dtype=torch.long), 2)
    assert model.training
    model.eval()
    GPT_FAMILY.generate(model, torch.zeros(1, 3, dtype=torch.long), 2)
    assert not model.training


def test_rows_end_at_eos_and_the_others_go_on():
    model = small_model()
    prompts = torch.randint(0, 61, (2, 4))
    prompts[1] = prompts[0]
    eos = int(GPT_FAMILY.generate(model, prompts[:1], 1, temperature=0)[0, -1])
    assert GPT_FAMILY.generate(model, prompts, 10, temperature=0, eos_id=eos).shape == (2, 5)

    prompts[1] = torch.randint(0, 61, (4,))
    greedy = generate(decoding(model), prompts.tolist(), 10, temperature=0)
    out = GPT_FAMILY.generate(model, prompts, 10, temperature=0, eos_id=eos)
    assert (out[0, 4:] == eos).all()  # a finished row is padded with eos while others go on
    if eos not in greedy[1]:
        assert out[1, 4:].tolist() == greedy[1]


def _alone(model, row: Row) -> list[int]:
    twin = Row(row.prompt, row.max_tokens, row.sampling, row.eos_id)
    Decoder(decoding(model), max_batch=1).run([twin])
    return twin.tokens


def _rows(lengths, max_tokens, sampling=GREEDY, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        Row(torch.randint(0, 61, (n,), generator=generator).tolist(), m, sampling)
        for n, m in zip(lengths, max_tokens, strict=True)
    ]


def test_a_rows_greedy_tokens_are_those_it_gets_alone_whatever_its_neighbours():
    model = small_model()
    rows = _rows([3, 17, 1, 29, 8, 12], [20, 5, 25, 3, 12, 9])
    # Three slots for six rows: rows leave as they finish and waiting rows take their slots;
    # a small token budget feeds the long prompts in chunks while the others decode.
    decoder = Decoder(decoding(model), max_batch=3, max_batch_tokens=8)
    decoder.run(rows)
    for row in rows:
        assert row.tokens == _alone(model, row)
        assert row.finish == "length" and len(row.tokens) == row.max_tokens


def test_rows_join_while_others_decode_and_each_samples_from_its_own_seed():
    model = small_model()
    rows = _rows([5, 11, 2, 7], [15, 10, 12, 8])
    for i, row in enumerate(rows):
        row.sampling = Sampling(temperature=1.3, top_k=20, top_p=0.9, seed=100 + i)
    decoder = Decoder(decoding(model), max_batch=4)
    decoder.add(rows[:1])
    for row in rows[1:]:  # one more row every third step
        for _ in range(3):
            decoder.step()
        decoder.add([row])
    while decoder.busy:
        decoder.step()
    for row in rows:
        assert row.tokens == _alone(model, row)
    assert len({tuple(r.tokens) for r in rows}) == len(rows)


@pytest.mark.parametrize("multiple", [2, 3])
def test_forward_passes_padded_to_a_multiple_of_positions_decode_as_unpadded_ones(multiple):
    """Under sequence parallelism every forward pass feeds a multiple of the ranks' number of
    positions: the decoder pads each row in front, the padding's keys and values kept in a scratch
    column that only the padding sees. The rows' tokens are the unpadded decoder's, batched, fed
    in chunks, joining and leaving, and past the context, where the cache is a ring."""
    model = small_model(torch.float64)
    rows = _rows([3, 17, 1, 29, 8, 40], [20, 5, 45, 3, 12, 30])
    plain = [Row(r.prompt, r.max_tokens) for r in rows]
    Decoder(decoding(model), max_batch=3, max_batch_tokens=8).run(plain)
    fed = []
    model.register_forward_pre_hook(lambda module, args: fed.append(args[0].size(1)))
    setattr(model, POSITIONS_MULTIPLE, multiple)
    decoder = Decoder(decoding(model), max_batch=3, max_batch_tokens=8)
    decoder.run(rows)
    assert [r.tokens for r in rows] == [r.tokens for r in plain]
    assert set(fed) > {multiple} and all(t % multiple == 0 for t in fed)
    decoder._idle()  # a rank's idle pass (lockstep) too
    assert fed[-1] == multiple


def test_in_lockstep_a_rank_runs_as_many_forward_passes_as_the_busiest_and_its_rows_are_unchanged():
    """A sharded model's ranks each run every forward pass together: here the other rank runs
    two more passes a step and has rows for three steps after this one's end."""
    model = small_model()
    passes = []
    model.register_forward_pre_hook(lambda module, args: passes.append(tuple(args[0].shape)))
    rows = _rows([5, 11, 2], [6, 3, 8])
    answers = []

    def lockstep(ran: int, busy: bool) -> tuple[float, float]:
        answers.append(ran)
        return ran + 2, busy or len(answers) <= steps + 3

    steps = 0
    twins = [Row(r.prompt, r.max_tokens, r.sampling, r.eos_id) for r in rows]
    decoder = Decoder(decoding(model), max_batch=2)
    decoder.add(twins)
    while decoder.busy:
        decoder.step()
        steps += 1
    alone = len(passes)
    passes.clear()
    Decoder(decoding(model), max_batch=2).run(rows, lockstep=lockstep)
    assert [r.tokens for r in rows] == [t.tokens for t in twins]
    # Its own passes, two idle ones (one token) after each step, and three steps of idle ones.
    assert len(answers) == steps + 4 and answers[steps:] == [0, 0, 0, 0]
    assert len(passes) == alone + 2 * len(answers)
    assert passes.count((1, 1)) >= 2 * len(answers)


@pytest.mark.slow
def test_the_compiled_step_decodes_as_the_eager_one_and_compiles_only_while_warming_up():
    """kiln serve --compile: after ``warm_up`` rows of any count and length, joining and leaving
    while the cache grows, compile nothing more, and each row's tokens are the eager step's."""
    from torch._dynamo.utils import counters

    model = small_model(n_layer=1, max_seq_len=96).eval()
    compiled = CompiledDecoding(decoding(model))
    compiled.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    rows = _rows([3, 40, 9, 70, 1], [30, 20, 12, 6, 25], Sampling(temperature=1.0, top_k=20))
    for i, row in enumerate(rows):
        row.sampling = Sampling(temperature=1.0, top_k=20, seed=i)
    twins = [Row(r.prompt, r.max_tokens, r.sampling) for r in rows]
    Decoder(compiled, max_batch=3, max_batch_tokens=16).run(rows)
    Decoder(decoding(model), max_batch=3, max_batch_tokens=16).run(twins)
    assert [r.tokens for r in rows] == [t.tokens for t in twins]
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_long_prompt_is_fed_in_chunks_while_the_running_rows_go_on():
    model = small_model()
    short, long = _rows([2, 30], [40, 3])
    decoder = Decoder(decoding(model), max_batch=2, max_batch_tokens=6)
    decoder.add([short])
    decoder.step()
    decoder.add([long])
    made = []
    while not long.tokens:
        made.append([row for row, _ in decoder.step()])
    # 30 prompt tokens, at most 5 a step beside the running row: six steps, each with a token
    # of the short row.
    assert len(made) == 6 and all(short in step for step in made)
    decoder.run([])
    assert short.tokens == _alone(model, short) and long.tokens == _alone(model, long)


def test_rows_with_one_prompt_share_its_prefill():
    model = small_model()
    fed = []
    model.register_forward_pre_hook(lambda module, args: fed.append(args[0].numel()))
    prompt = torch.randint(0, 61, (9,)).tolist()
    rows = [Row(prompt, 6, Sampling(temperature=1.0, seed=i)) for i in range(4)]
    Decoder(decoding(model), max_batch=4).run(rows)
    assert fed[0] == 9 and fed[1:] == [4] * 5  # one prefill, then four rows a step
    fed.clear()
    for row in rows:
        assert row.tokens == _alone(model, row)


def test_a_cancelled_row_leaves_and_the_others_are_unchanged():
    model = small_model()
    rows = _rows([4, 6, 3], [20, 20, 20])
    decoder = Decoder(decoding(model), max_batch=3)
    decoder.add(rows)
    for _ in range(5):
        decoder.step()
    decoder.cancel(rows[1])
    decoder.run([])
    assert rows[1].finish == "cancelled" and len(rows[1].tokens) == 5
    assert rows[0].tokens == _alone(model, rows[0]) and rows[2].tokens == _alone(model, rows[2])


def test_stop_ends_a_row_at_the_token_it_names():
    model = small_model()
    (row,) = _rows([5], [30])
    expected = _alone(model, row)
    row.stop = lambda token: token == expected[6]
    Decoder(decoding(model)).run([row])
    cut = expected.index(expected[6]) + 1
    assert row.tokens == expected[:cut] and row.finish == "stop"


def _settings(n, **sampling):
    return [Sampling(**sampling)] * n, [torch.Generator().manual_seed(i) for i in range(n)]


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0]]).repeat(500, 1)
    tokens = sample_rows(logits, *_settings(500, temperature=5.0, top_k=2))
    assert set(tokens.tolist()) == {1, 3}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.1, 0.05])
    logits = probs.log()[None].repeat(2000, 1)
    # 0.5 + 0.3 = 0.8 < 0.85, so the 0.1 token is needed as well; the 0.05 ones are not.
    assert set(sample_rows(logits, *_settings(2000, top_p=0.85)).tolist()) == {1, 2, 3}
    assert set(sample_rows(logits, *_settings(2000, top_p=0.5)).tolist()) == {1}


def test_draws_follow_the_softmax_of_the_logits_over_the_temperature():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = (probs.log() * 2)[None].repeat(20000, 1)
    tokens = sample_rows(logits, *_settings(20000, temperature=2.0))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 61)
    settings = [Sampling(temperature=0.0), Sampling(), Sampling(temperature=0.0), Sampling()]
    gens = [None, torch.Generator(), None, torch.Generator()]
    tokens = sample_rows(logits, settings, gens)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_hugging_face_causal_lms_decode_as_transformers_generate_does(tmp_path):
    """Greedy, 16 prompts of different lengths batched in one decoder: each row's tokens are those
    of transformers' own generate for that prompt alone."""
    from transformers import AutoModelForCausalLM

    from kiln.models.hf import CausalLM

    from hf_models import tiny_llama

    directory = tiny_llama(tmp_path / "llama")
    hf = AutoModelForCausalLM.from_pretrained(directory).eval()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 90, (16,), generator=generator).tolist()
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    ours = generate(get_family("hf").decoding(CausalLM(hf).eval()), prompts, 24, temperature=0, max_batch=6)
    for prompt, tokens in zip(prompts, ours, strict=True):
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert tokens == theirs[0, len(prompt) :].tolist()


def test_a_hugging_face_decode_step_traces_as_one_graph(tmp_path):
    """kiln serve --compile on a transformers model: the one-token step is one graph, with no
    break (each break would leave the code around it to run eagerly, every step)."""
    from transformers import AutoModelForCausalLM

    from kiln.models.hf import CausalLM

    from hf_models import tiny_llama

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama(tmp_path / "llama")).eval()
    decodable = get_family("hf").decoding(CausalLM(hf).eval())
    cache = SlotCache(2, 32, torch.device("cpu"))
    cache.bind(slice(0, 2), torch.tensor([[3], [7]]), [3, 7])
    with torch.no_grad():
        explained = torch._dynamo.explain(decodable.forward)(torch.tensor([[5], [6]]), cache)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_hugging_face_models_padded_to_a_multiple_of_positions_decode_as_generate_does(tmp_path, model_type):
    """As above, through transformers' attention and its masks: a sliding window of 8 positions
    (Mistral's, every layer's; Gemma 3's local layers beside global ones)."""
    from transformers import AutoModelForCausalLM

    from kiln.models.hf import CausalLM

    from hf_models import save_tiny

    save_tiny(tmp_path, model_type, sliding_window=8)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    module = CausalLM(hf).eval()
    setattr(module, POSITIONS_MULTIPLE, 2)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=generator).tolist() for n in (3, 17, 10)]
    ours = generate(get_family("hf").decoding(module), prompts, 12, temperature=0, max_batch=2)
    for prompt, tokens in zip(prompts, ours, strict=True):
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert tokens == theirs[0, len(prompt) :].tolist()


def _decoders():
    from hf_models import DECODERS

    return sorted(DECODERS)


@pytest.mark.parametrize("model_type", _decoders())
def test_every_tiny_decoder_architecture_decodes_as_transformers_generate_does(tmp_path, model_type):
    """Rows of prompts of different lengths, three at a time, each as transformers' greedy
    generate answers that prompt alone; Mistral's and Gemma 3's sliding windows (8 and 16
    positions) shorter than the longer prompts, so the local layers' masks matter."""
    from transformers import AutoModelForCausalLM

    from kiln.models.hf import CausalLM

    from hf_models import save_tiny

    save_tiny(tmp_path, model_type, **({"sliding_window": 8} if model_type == "mistral" else {}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=generator).tolist() for n in (3, 17, 9, 30)]
    ours = generate(get_family("hf").decoding(CausalLM(hf).eval()), prompts, 12, temperature=0, max_batch=3)
    for prompt, tokens in zip(prompts, ours, strict=True):
        theirs = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert tokens == theirs[0, len(prompt) :].tolist()
