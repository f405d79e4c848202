"""model.zero_init: the output layer and the projections back into the residual stream start at
zero (the rest as before), the run still learns, and a tied output layer is refused."""

from __future__ import annotations

import torch

from kiln.config import load_config
from kiln.models.family import build_model, family_of

from conftest import tiny_overrides
from kilnrun import in_process, losses, sets


def test_the_output_layer_and_residual_projections_start_at_zero():
    def model(*items: str):
        cfg = load_config(None, ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.d_ff=64", *items])
        family = family_of(cfg.model)
        args = family.resolve(cfg.model, vocab_size=97, seq_len=16)
        return build_model(family, args, "cpu", cfg.train.seed).state_dict()

    zero, plain = model("model.zero_init=true", "model.tie_embeddings=false"), model("model.tie_embeddings=false")
    starts_at_zero = [k for k in zero if k == "lm_head.weight" or k.endswith(("attn.wo.weight", "mlp.w2.weight"))]
    assert len(starts_at_zero) == 5
    for name, value in zero.items():
        if name in starts_at_zero:
            assert not value.any() and plain[name].any(), name
        else:
            assert torch.equal(value, plain[name]), name  # every other tensor as before


def test_a_zero_initialised_run_learns(tmp_path, corpus_dir):
    run = tmp_path / "run"
    items = tiny_overrides(run, corpus_dir, model__zero_init="true", model__tie_embeddings="false")
    in_process("train", *sets(items))
    got = losses(run)
    assert got[max(got)] < got[1] - 0.5


def test_a_tied_output_layer_is_refused(tmp_path, corpus_dir):
    items = tiny_overrides(tmp_path / "run", corpus_dir, model__zero_init="true", model__tie_embeddings="true")
    proc = in_process("train", *sets(items), check=False)
    assert proc.returncode == 2 and "model.zero_init: a tied output layer" in proc.stderr
