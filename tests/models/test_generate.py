import pytest
import torch

from kiln.models import GPT, GPTConfig, generate
from kiln.models.generate import sample_next


def small_model(dtype=torch.float32, **overrides):
    dims = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=32)
    dims["tie_embeddings"] = False
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dims, **overrides})).to(dtype)


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
    out = generate(model, prompt, new, temperature=0)
    assert out.shape == (3, prompt_len + new)
    assert torch.equal(out[:, :prompt_len], prompt)
    assert torch.equal(out, greedy_without_cache(model, prompt, new))


def test_past_the_context_the_cache_is_a_ring_seeing_the_last_max_seq_len_tokens():
    # With one layer a token's key and value depend only on the token and its position, and RoPE's
    # scores only on distances, so attending to the ring equals recomputing the shifted window.
    model = small_model(torch.float64, n_layer=1).eval()
    prompt = torch.randint(0, 61, (2, 20))
    out = generate(model, prompt, 50, temperature=0)  # 70 tokens: the ring wraps twice
    assert torch.equal(out, greedy_without_cache(model, prompt, 50))


def test_decoding_feeds_one_token_per_step_and_never_rebuilds_the_cache():
    model = small_model().eval()
    lengths = []
    model.register_forward_pre_hook(lambda module, args: lengths.append(args[0].size(1)))
    generate(model, torch.randint(0, 61, (1, 10)), 100, temperature=0)
    assert lengths == [10] + [1] * 99


def test_restores_training_mode():
    model = small_model().train()
    generate(model, torch.zeros(1, 3, dtype=torch.long), 2)
    assert model.training
    model.eval()
    generate(model, torch.zeros(1, 3, dtype=torch.long), 2)
    assert not model.training


def test_sampling_is_reproducible_with_a_generator():
    model = small_model()
    prompt = torch.randint(0, 61, (2, 4))
    a = generate(model, prompt, 10, top_k=10, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 10, top_k=10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def test_stops_when_every_row_has_produced_eos():
    model = small_model()
    prompt = torch.randint(0, 61, (1, 4)).repeat(2, 1)
    eos = int(generate(model, prompt, 1, temperature=0)[0, -1])
    assert generate(model, prompt, 10, temperature=0, eos_id=eos).shape == (2, 5)

    prompt[1] = torch.randint(0, 61, (4,))
    greedy = generate(model, prompt, 10, temperature=0)
    out = generate(model, prompt, 10, temperature=0, eos_id=eos)
    assert (out[0, 4:] == eos).all()  # a finished row keeps emitting eos while others go on
    if eos not in greedy[1, 4:]:
        assert torch.equal(out[1], greedy[1])


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0]]).repeat(500, 1)
    tokens = sample_next(logits, temperature=5.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1, 3}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.1, 0.05])
    logits = probs.log()[None].repeat(2000, 1)
    # 0.5 + 0.3 = 0.8 < 0.85, so the 0.1 token is needed as well; the 0.05 ones are not.
    tokens = sample_next(logits, temperature=1.0, top_p=0.85, generator=torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1, 2, 3}
    tokens = sample_next(logits, temperature=1.0, top_p=0.5, generator=torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1}


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 61)
    assert torch.equal(sample_next(logits, temperature=0), logits.argmax(-1))
