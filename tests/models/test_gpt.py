import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kiln.models import GPT, GPTConfig
from kiln.models.decode import SlotCache


def small_config(**overrides):
    dims = dict(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=4, d_ff=64, max_seq_len=64)
    dims["tie_embeddings"] = True
    return GPTConfig(**{**dims, **overrides})


def small_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(small_config(**overrides)).eval()


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_forward_shape_and_loss(n_kv_head):
    model = small_model(n_kv_head=n_kv_head).train()
    idx, targets = torch.randint(0, 97, (2, 3, 20))
    logits = model(idx)
    assert logits.shape == (3, 20, 97) and logits.dtype == torch.float32
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    assert abs(loss.item() - math.log(97)) < 0.5  # near uniform at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_causal():
    model = small_model(n_kv_head=2)
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_cached_logits_equal_uncached(n_kv_head):
    model = small_model(n_kv_head=n_kv_head)
    idx = torch.randint(0, 97, (2, 24))
    full = model(idx)
    cache = SlotCache(2, 64, idx.device)
    # A prefill, a multi-token chunk at an offset (masked causally within it), then single tokens.
    pieces = []
    for start, end in [(0, 8), (8, 13), *((t, t + 1) for t in range(13, 24))]:
        cache.bind(slice(0, 2), torch.arange(start, end).expand(2, -1), [end - 1, end - 1])
        pieces.append(model(idx[:, start:end], kv_cache=cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def test_positions_beyond_max_seq_len_are_refused():
    model = small_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_tied_embeddings_share_storage():
    tied, untied = small_model(), small_model(tie_embeddings=False)
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert tied.num_params() == untied.num_params() - 97 * 32


def test_built_with_parameters_on_meta_it_computes_its_buffers():
    """What reads a model part by part (an export of a sharded run) builds it under
    params_on_meta and computes on its buffers as they are: the rotary tables, not uninitialised memory."""
    from kiln.models.init import params_on_meta

    with params_on_meta():
        skeleton = GPT(small_config())
    assert all(p.is_meta for p in skeleton.parameters())
    whole = small_model()
    for name, buffer in skeleton.named_buffers():
        assert torch.equal(buffer, whole.get_buffer(name)), name


def test_init_std_and_scaled_residual_init():
    cfg = GPTConfig(
        vocab_size=256, n_layer=4, d_model=128, n_head=4, n_kv_head=4, d_ff=384, max_seq_len=32, tie_embeddings=False
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    residual_std = 0.02 / math.sqrt(2 * 4)
    for block in model.blocks:
        assert block.attn.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
        assert block.mlp.w2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
        assert block.attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert torch.equal(block.attn_norm.weight, torch.ones(128))
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_rope_tables_are_not_in_state_dict():
    keys = small_model().state_dict().keys()
    assert not any("rope" in k for k in keys)
    assert not any("bias" in k for k in keys)


def test_meta_device_then_to_empty_and_init_weights():
    reference = small_model()
    with torch.device("meta"):
        model = GPT(small_config())
    model.to_empty(device="cpu")
    for m in (reference, model):
        torch.manual_seed(1)
        m.init_weights()
    assert model.lm_head.weight is model.tok_emb.weight
    model.eval()
    idx = torch.randint(0, 97, (2, 10))
    torch.testing.assert_close(model(idx), reference(idx))


def test_blocks_can_be_wrapped_with_activation_checkpointing():
    model, wrapped = small_model().train(), small_model().train()
    for block in wrapped.blocks:
        block.forward = lambda *args, _f=block.forward: checkpoint(_f, *args, use_reentrant=False)
    idx = torch.randint(0, 97, (2, 12))
    for m in (model, wrapped):
        F.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
    for p, q in zip(model.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
