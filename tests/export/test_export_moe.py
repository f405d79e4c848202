"""kiln export --format hf of a mixture-of-experts GPT: each router becomes the transformers
architecture that computes it (sigmoid: GLM-4.5's MoE; softmax: Mixtral's, or ERNIE 4.5's with a
bias, shared experts or dense layers), which loads every tensor with kiln's logits; kiln generates
from the export as from the run; what no architecture computes is refused, naming the setting."""

import json

import pytest
import torch

from kiln.export.check import ExportError
from kiln.models import GPT, GPTConfig
from kiln.models.gpt import FAMILY
from kiln.train.run import load_run

from conftest import tiny_overrides
from kilnrun import in_process, sets

pytestmark = pytest.mark.e2e

transformers = pytest.importorskip("transformers")

# tiny-moe routes as DeepSeek-V3 does: sigmoid scores, a shared expert, the first layer dense.
ROUTERS = {
    "sigmoid": ("Glm4MoeForCausalLM", ["model.router_bias_rate=0.05"]),
    "softmax": (
        "MixtralForCausalLM",
        ["model.router=softmax", "model.n_shared_experts=0", "model.moe_layer_start=0", "model.router_bias_rate=0"],
    ),
    "softmax-bias": ("Ernie4_5_MoeForCausalLM", ["model.router=softmax", "model.router_bias_rate=0.05"]),
}


def train(tmp_path_factory, corpus_dir, name, extra, steps=3):
    run = tmp_path_factory.mktemp(name) / "run"
    items = tiny_overrides(run, corpus_dir, train__max_steps=steps, eval__sample_tokens=0, checkpoint__every=steps)
    in_process("train", *sets([*items, "model.preset=tiny-moe", *extra]))
    return run


@pytest.fixture(scope="module", params=list(ROUTERS))
def router_run(request, tmp_path_factory, corpus_dir):
    return request.param, train(tmp_path_factory, corpus_dir, request.param, ROUTERS[request.param][1])


def test_an_moe_gpt_exports_as_the_architecture_of_its_router(router_run, tmp_path):
    router, run_dir = router_run
    out = tmp_path / "hf"
    in_process("export", run_dir, "--format", "hf", "--out", out)
    info = json.loads((out / "export.json").read_text())
    assert info["hf"]["max_abs_diff"] <= 1e-4  # the export's own check, on the run's validation tokens
    model, loading = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(loading.values()), loading  # nothing missing, unexpected or mismatched
    assert type(model).__name__ == ROUTERS[router][0]
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert any(".experts.7." in n for n in names) and not any("gate_up_proj" in n for n in names)  # the Hub's layout

    run = load_run(run_dir, device="cpu")
    moe = run.model.blocks[-1].mlp
    assert bool(moe.expert_bias.any()) == (router != "softmax")  # trained: the architectures with a bias carry one
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("def parse(text):\n    return [word.strip() for word in text.split()]")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, run.model(ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("router_run", ["sigmoid"], indirect=True)  # the others decode alike
def test_kiln_generates_from_an_moe_run_and_its_export_alike(router_run, tmp_path):
    run_dir = router_run[1]
    out = tmp_path / "hf"
    in_process("export", run_dir, "--format", "hf", "--out", out)
    texts = [
        in_process("generate", source, "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "12").stdout
        for source in (run_dir, out)
    ]
    assert texts[0] == texts[1] and len(texts[0]) > len("def ")


def test_a_setting_no_architecture_computes_is_refused_in_one_line(tmp_path_factory, corpus_dir, tmp_path):
    run_dir = train(tmp_path_factory, corpus_dir, "k1", ["model.router=softmax", "model.experts_per_token=1"])
    out = tmp_path / "hf"
    proc = in_process("export", run_dir, "--format", "hf", "--out", out, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("kiln: error: model.experts_per_token=1 with model.router=softmax:")
    assert proc.stderr.count("\n") == 1
    assert not out.exists() and not list(tmp_path.iterdir())  # no staging directory left either


MOE = dict(
    vocab_size=97, n_layer=3, d_model=32, n_head=4, n_kv_head=2, d_ff=48, max_seq_len=32, tie_embeddings=False,
    n_experts=4, experts_per_token=2, n_shared_experts=1, d_expert=16, moe_layer_start=1, router="sigmoid",
    init_std=0.2, router_bias_rate=0.01,
)  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "refusal"),
    [
        (dict(expert_capacity=1.25), "model.expert_capacity=1.25: "),
        (dict(n_experts=1, experts_per_token=1), "model.n_experts=1 with model.router=sigmoid: "),
        (dict(router="softmax", experts_per_token=1), "model.experts_per_token=1 with model.router=softmax: "),
    ],
)
def test_each_refusal_names_its_setting(setting, refusal):
    with pytest.raises(ExportError, match=f"^{refusal}"):
        FAMILY.state_dict_adapter(GPTConfig(**{**MOE, **setting}))


def test_a_moved_bias_is_not_dropped_into_mixtral():
    cfg = GPTConfig(**{**MOE, "router": "softmax", "n_shared_experts": 0, "moe_layer_start": 0, "router_bias_rate": 0})
    model = GPT(cfg)
    model.blocks[2].mlp.expert_bias[1] = 0.5  # moved before the rate was set to 0
    with pytest.raises(ExportError, match=r"^blocks\.2\.mlp\.expert_bias is not zero"):
        FAMILY.state_dict_adapter(cfg).to_hf(model.state_dict())


# transformers builds GLM-4.5's zero-width shared experts, and PyTorch warns that it initialises nothing.
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")
@pytest.mark.parametrize(
    "setting",
    [
        dict(),  # GLM-4.5
        dict(n_shared_experts=0, experts_per_token=1, moe_layer_start=0),  # zero-width shared experts, k = 1
        dict(router="softmax", n_shared_experts=0, moe_layer_start=0, router_bias_rate=0),  # Mixtral
        dict(router="softmax"),  # ERNIE 4.5
    ],
)
def test_names_round_trip_and_rename_one_block_at_a_time(setting, tmp_path):
    """What the streamed export relies on: a block's tensors renamed alone are renamed as in the
    whole; and what kiln reads back from its export is what it wrote. The weights are large
    enough (init_std) and the bias random, so that a wrong routing or rotation shows."""
    from kiln.checkpoint.weights import write_weights

    cfg = GPTConfig(**{**MOE, **setting})
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    if cfg.router_bias_rate:
        for block in model.blocks[cfg.moe_layer_start :]:
            block.mlp.expert_bias.normal_(0, 0.3)
    state = model.state_dict()
    adapter = FAMILY.state_dict_adapter(cfg)
    whole = adapter.to_hf(state)
    parts: dict[str, torch.Tensor] = {}
    for prefix in [f"blocks.{i}." for i in range(cfg.n_layer)] + [""]:
        unit = {n: t for n, t in state.items() if n.startswith(prefix) and (prefix or not n.startswith("blocks."))}
        parts.update(adapter.to_hf(unit))
    assert parts.keys() == whole.keys() and all(torch.equal(parts[n], t) for n, t in whole.items())
    back = adapter.from_hf(whole)
    assert back.keys() == state.keys() and all(torch.equal(back[n], t) for n, t in state.items())

    write_weights(tmp_path, whole, 10**9)
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config()))
    hf, loading = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(loading.values()), loading
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids)
        assert expected.abs().max() > 1  # logits far enough from 0 for the comparison to mean something
        torch.testing.assert_close(hf.eval()(ids).logits, expected, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("router_run", ["sigmoid"], indirect=True)
@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_an_moe_gpt_exports_for_torch_export_and_onnx_runtime(router_run, tmp_path, fmt):
    """The grouped dispatch traces: torch.export (and AOTInductor) and ONNX Runtime compute the
    run's logits (the export's own check)."""
    out = tmp_path / fmt
    in_process("export", router_run[1], "--format", fmt, "--out", out)
    info = json.loads((out / "export.json").read_text())
    for key in ("pt2", "aoti") if fmt == "pt2" else ("onnx",):
        assert info[key]["max_abs_diff"] <= 1e-4, info[key]
