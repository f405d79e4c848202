"""Activation checkpointing's modes (train.activation_checkpointing = true | "selective", and
train.activation_checkpointing_every): the same gradients as keeping every activation, and the
recomputation each mode promises, counted in the matrix products the backward pass runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kiln.models.gpt.model import GPT, GPTConfig
from kiln.train.apply import apply_activation_checkpointing

LAYERS = 4


def model() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layer=LAYERS, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=32,
                    tie_embeddings=True)  # fmt: skip
    return GPT(cfg)


def backward(m: GPT) -> tuple[dict[str, torch.Tensor], int]:
    """The gradients of one batch's loss, and the FLOPs of its backward pass."""
    torch.manual_seed(1)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    loss = m(idx, targets)
    # The FLOPs of the products and attention the backward pass computes: a product that
    # selective checkpointing kept is read back, not computed again.
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return {n: p.grad for n, p in m.named_parameters()}, flops.get_total_flops()


def test_selective_and_every_kth_block_checkpointing_give_the_gradients_and_recompute_what_they_say():
    base = model()
    plain, plain_products = backward(copy.deepcopy(base))
    runs = {}
    for name, options in {
        "full": {},
        "selective": {"selective": True},
        "every 2nd": {"every": 2},
        "selective, every 2nd": {"selective": True, "every": 2},
    }.items():
        m = apply_activation_checkpointing(copy.deepcopy(base), **options)
        grads, products = backward(m)
        for key, grad in plain.items():
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
        runs[name] = products - plain_products  # the products recomputed
    # Full checkpointing recomputes every block's products; every 2nd block, half of them;
    # selective keeps them all, recomputing only cheap operations.
    assert runs["full"] > 0 and runs["every 2nd"] * 2 == runs["full"]
    assert runs["selective"] == 0 and runs["selective, every 2nd"] == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sometimes", "train.activation_checkpointing: expected true/false or selective, got 'sometimes'"),
    ],
)
def test_a_mode_that_is_not_one_is_named(value, message):
    from kiln.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, [f"train.activation_checkpointing={value}"])
    assert message in str(e.value)


def test_checkpointing_every_kth_block_needs_k_of_one_or_more():
    from kiln.config import from_dict

    errors = from_dict(
        {"train": {"activation_checkpointing": "selective", "activation_checkpointing_every": 0}}
    ).errors()
    assert "train.activation_checkpointing_every: must be >= 1, got 0" in errors
