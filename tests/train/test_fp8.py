"""train.precision=fp8: torchao's float8 linear layers inside bf16 autocast (emulated on the CPU
by PyTorch's scaled matrix product; the speed is the GPU's, see tests/test_gpu.py)."""

import numpy as np
import pytest
import torch
from torch import nn

from kiln import Trainer
from kiln.config import ConfigError, load_config
from kiln.data import TokenSequences
from kiln.models import GPT, GPTConfig, get_family
from kiln.models.lm import lm_loss
from kiln.train.precision import Precision

from kilnrun import in_process, losses
from layouts import STEPS, layout_sets, train_on

pytest.importorskip("torchao")


def _gpt(**over) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=256, n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=128, max_seq_len=32)
    cfg["tie_embeddings"] = True
    return GPT(GPTConfig(**{**cfg, **over}))


def test_fp8_makes_every_linear_layer_float8_but_the_output_layer():
    model = _gpt(tie_embeddings=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    precision = Precision("fp8", torch.device("cpu"), "rowwise")
    precision.convert(model)
    names = precision.float8
    linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(names) == linear - {"lm_head"} and len(names) == 2 * 7
    assert {type(model.get_submodule(n)).__name__ for n in names} == {"Float8Linear"}
    assert type(model.lm_head) is nn.Linear
    # The same weights under the same names: checkpoints and exports are the plain model's.
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert precision.describe() == ["fp8: 14 linear layers multiply in float8 (rowwise scales)"]
    plain = Precision("bf16", torch.device("cpu"))
    plain.convert(_gpt())
    assert plain.float8 == [] and plain.describe() == []


def _fit(tmp_path, precision):
    path = tmp_path / "tokens.bin"
    np.tile(np.arange(256, dtype=np.uint16), 200).tofile(path)
    data = TokenSequences(np.memmap(path, dtype=np.uint16, mode="r"), 32)
    sets = [
        f"run.dir={tmp_path / precision}",
        "run.device=cpu",
        "train.max_steps=30",
        # Small batches: float8 matmuls on a CPU run a slow reference path (about 18 ms each here).
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "train.lr=1e-2",
        "train.warmup_steps=3",
        "train.log_every=5",
        f"train.precision={precision}",
        "eval.every=0",
        "checkpoint.every=0",
    ]
    # Narrow layers (a 32-wide model learns this stream as well): see the batch size above.
    trainer = Trainer(
        _gpt(d_model=32, d_ff=64), data, lm_loss, load_config(None, sets), tokens_per_sample=32, console=False
    )
    return trainer.fit().metrics["loss"]


def test_fp8_training_follows_bf16(tmp_path):
    bf16, fp8 = _fit(tmp_path, "bf16"), _fit(tmp_path, "fp8")
    assert fp8 < 3.0  # from ln(256) = 5.5 on a perfectly predictable stream
    assert abs(fp8 - bf16) / bf16 < 0.05, (fp8, bf16)


def test_a_float8_model_samples_as_a_run_does_at_its_evaluations():
    model = _gpt()
    Precision("fp8", torch.device("cpu")).convert(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = get_family("gpt").generate(model, torch.tensor([[1, 2, 3]]), 5, temperature=0)
    assert out.shape == (1, 8)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["lora.rank=8"], "LoRA adapters"),
        (["train.fp8_recipe=blockwise"], "train.fp8_recipe"),
    ],
)
def test_fp8_refuses_what_it_cannot_do(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train.precision=fp8", *sets])


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_two_tensor_parallel_ranks_trains_as_one_process(tmp_path, corpus_dir, recipe):
    """A float8 layer splits as its plain linear layer does: each rank casts its columns or rows
    with the scales of the whole tensor (the amax reduced over the ranks), so the split run
    follows the one-process run. Both compute in bf16 autocast, and the row-split products are
    summed over the ranks in another order, so they agree to bf16's rounding, not fp32's (the
    same pair in bf16 differs by up to 1.4e-3 over these steps)."""
    # Half the width and the sequence of the other layouts' runs: a float8 product on the CPU
    # takes the reference path, whose time grows with the multiply-adds (about 18 ms for 1M).
    fp8 = dict(train__precision="fp8", train__fp8_recipe=recipe, model__d_model=32, model__d_ff=64, data__seq_len=16)
    one, tp = tmp_path / "one", tmp_path / "tp"
    in_process("train", *layout_sets(one, corpus_dir, micro=4, **fp8))
    proc = train_on(2, layout_sets(tp, corpus_dir, micro=4, parallel__strategy="ddp", parallel__tp=2, **fp8))
    assert f"linear layers multiply in float8 ({recipe} scales)" in proc.stdout + proc.stderr
    got, want = losses(tp), losses(one)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-2 if step > 3 else 2e-3), f"loss at step {step}"
