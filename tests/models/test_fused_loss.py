"""The fused output projection + cross-entropy (and the per-row log-probabilities) equal the plain
two-step computation."""

import pytest
import torch
import torch.nn.functional as F

from kiln.models import GPT, GPTConfig
from kiln.models.fused_loss import default_chunk_size, linear_cross_entropy, linear_log_probs

from conftest import tiny_gpt_config


def _inputs(n=300, d=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [64, 100, 1000])
def test_loss_and_gradients_equal_plain_cross_entropy(chunk_size):
    hidden, weight, targets = _inputs()
    expected = F.cross_entropy(hidden @ weight.t(), targets)
    want = torch.autograd.grad(expected * 3.0, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size)
    got = torch.autograd.grad(loss * 3.0, (hidden, weight))
    torch.testing.assert_close(loss, expected)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_without_grad_it_only_computes_the_loss():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, 64)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.t(), targets))


def test_all_targets_ignored_gives_zero_not_nan():
    hidden, weight, targets = _inputs()
    loss = linear_cross_entropy(hidden, weight, torch.full_like(targets, -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() == 0


def test_bf16_weights_get_bf16_gradients_close_to_fp32():
    hidden, weight, targets = _inputs()
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    linear_cross_entropy(h16, w16, targets, 64).backward()
    assert h16.grad.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    F.cross_entropy(hidden @ weight.t(), targets).backward()
    torch.testing.assert_close(w16.grad.double(), weight.grad, rtol=0.05, atol=1e-3)


def test_under_autocast_the_fp32_weight_is_cast_once_not_in_every_chunk():
    """Each chunk's products would each cast the fp32 weight again (traced under compile, no
    autocast cache): 3 ms of a 68-ms GPT-2 step on an H200 (BENCHMARKS.md, "Sixth lease")."""
    hidden, weight, targets = (t.detach().float() if t.is_floating_point() else t for t in _inputs())
    hidden.requires_grad_(), weight.requires_grad_()
    with torch.profiler.profile(record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_cross_entropy(hidden, weight, targets, 64)  # 5 chunks
        loss.backward()
    shapes = ([50, 16], [16, 50])
    casts = [
        e
        for e in prof.events()
        if e.name == "aten::_to_copy" and e.input_dtypes[:1] == ["float"] and list(e.input_shapes[0]) in shapes
    ]
    assert len(casts) == 1
    expected = F.cross_entropy(hidden.double() @ weight.double().t(), targets)
    torch.testing.assert_close(loss.double(), expected, rtol=2e-2, atol=2e-2)


def test_gpt_with_targets_returns_the_loss_of_its_logits_with_tied_gradients():
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=16, tie_embeddings=True
    )
    model = GPT(cfg).double()
    x, y = torch.randint(0, 97, (3, 16)), torch.randint(0, 97, (3, 16))
    plain = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    want = torch.autograd.grad(plain, list(model.parameters()))
    fused = model(x, y)
    got = torch.autograd.grad(fused, list(model.parameters()))
    torch.testing.assert_close(fused, plain)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk_size", [64, 1000])
def test_soft_capped_loss_and_gradients_equal_plain_cross_entropy_of_capped_logits(chunk_size):
    hidden, weight, targets = _inputs()
    cap = 2.5  # below the logits' spread here, so the cap bends them
    logits = hidden @ weight.t()
    assert logits.abs().max() > 2 * cap
    expected = F.cross_entropy(cap * torch.tanh(logits / cap), targets)
    want = torch.autograd.grad(expected * 3.0, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size, softcap=cap)
    got = torch.autograd.grad(loss * 3.0, (hidden, weight))
    torch.testing.assert_close(loss, expected)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, chunk_size, softcap=cap), expected)


def test_a_soft_capped_gpt_caps_its_logits_and_refuses_hugging_face_export():
    from kiln.models.family import ExportError
    from kiln.models.gpt.hf import hf_adapter

    cfg = tiny_gpt_config(n_layer=1, tie_embeddings=False, logit_softcap=0.5)
    model = GPT(cfg)
    model.init_weights()
    with torch.no_grad():
        model.lm_head.weight.mul_(100)  # logits far past the cap
        x = torch.randint(0, 97, (2, 16))
        logits = model(x)
        assert logits.abs().max() <= 0.5 and logits.abs().max() > 0.45
        torch.testing.assert_close(model(x, x), F.cross_entropy(logits.flatten(0, 1), x.flatten()))
    with pytest.raises(ExportError, match="model.logit_softcap=0.5"):
        hf_adapter(cfg)


@pytest.mark.parametrize("chunk_size", [64, 1000])
def test_log_probs_and_their_weighted_gradients_equal_log_softmax(chunk_size):
    hidden, weight, targets = _inputs()
    keep = targets != -100
    plain = F.log_softmax(hidden @ weight.t(), -1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1) * keep
    row_weights = torch.randn(len(targets), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad((plain * row_weights).sum(), (hidden, weight))
    fused = linear_log_probs(hidden, weight, targets, chunk_size)
    got = torch.autograd.grad((fused * row_weights).sum(), (hidden, weight))
    torch.testing.assert_close(fused, plain)
    assert (fused[~keep] == 0).all()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_log_probs_of_a_frozen_head_give_no_weight_gradient():
    hidden, weight, targets = _inputs()
    frozen = weight.detach()
    (grad,) = torch.autograd.grad(linear_log_probs(hidden, frozen, targets, 64).sum(), (hidden,))
    assert grad.abs().sum() > 0 and frozen.grad is None


def test_chunks_are_cache_sized_on_a_cpu_and_gigabyte_sized_on_a_gpu():
    # GPT-2's padded vocabulary: 8 MiB of fp32 logits is 41 rows (raised to the floor of 256) on a
    # CPU; on a GPU 1 GiB is 5336 rows, between the 4096 and 16384 measured fastest on an H100.
    assert default_chunk_size(50304) == default_chunk_size(50304, "cpu") == 256
    assert default_chunk_size(50304, "cuda") == 5336
    assert default_chunk_size(1000, "cpu") == 2097


def test_the_plans_loss_memory_follows_the_devices_chunk():
    from kiln.models.family import MemoryContext
    from kiln.models.gpt.memory import GPTMemory

    cfg = GPTConfig(
        vocab_size=50304, n_layer=1, d_model=64, n_head=2, n_kv_head=2, d_ff=128, max_seq_len=64, tie_embeddings=True
    )
    memory = GPTMemory(cfg)
    heads = {
        device: memory.head(
            MemoryContext(tokens=8192, autocast=True, residual_bytes=4, tp=1, casts_weights=True, device=device)
        )
        for device in ("cpu", "cuda")
    }
    assert heads["cpu"].saved == heads["cuda"].saved
    # The transient is a few chunks of [chunk, vocab] logits: 5336 rows on the GPU, 256 on the CPU.
    assert heads["cuda"].transient - heads["cpu"].transient > 10 * (5336 - 256) * 50304
