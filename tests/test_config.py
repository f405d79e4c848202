import pytest

from kiln.config import Config, ConfigError, all_keys, field_docs, from_dict, load_config, sections

REQUIRED_KEYS = [
    "run.dir",
    "model.preset",
    "data.source",
    "train.max_steps",
    "train.micro_batch_size",
    "train.global_batch_size",
    "train.lr",
    "train.seed",
    "train.precision",
    "train.compile",
    "train.activation_checkpointing",
    "checkpoint.every",
    "eval.every",
]


def test_required_keys_exist():
    assert set(REQUIRED_KEYS) <= set(all_keys())


def test_every_key_is_documented():
    for name, cls in sections().items():
        docs = field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if f not in docs]
        assert not missing, f"[{name}] fields without a docstring: {missing}"


def test_toml_then_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[train]\nlr = 0.001\nmax_steps = 5\n[model]\npreset = "small"\n')
    cfg = load_config(p, ["train.lr=3e-4", "train.compile=true", "train.precision=bf16", "data.source=x/*.txt"])
    assert cfg.train.lr == 3e-4 and cfg.train.max_steps == 5 and cfg.model.preset == "small"
    assert cfg.train.compile is True and cfg.train.precision == "bf16" and cfg.data.source == "x/*.txt"


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["train.lr=0.5", 'eval.prompt=say "hi"\\n', "train.global_batch_size=64"])
    p = tmp_path / "resolved.toml"
    p.write_text(cfg.to_toml())
    again = load_config(p)
    assert again == cfg
    assert from_dict(cfg.to_dict()) == cfg


def test_accumulation_is_derived():
    cfg = load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=32"])
    assert cfg.grad_accum_steps() == 8


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrr=1", "train.lrr: unknown config key; did you mean train.lr?"),
        ("bogus.key=1", "bogus.key: unknown config key"),
        ("train.max_steps=ten", "train.max_steps: expected an integer or auto, got 'ten'"),
        ("train.precision=fp4", "train.precision: 'fp4' is not allowed; choose one of auto, fp32, bf16, fp16, fp8"),
        ("train.compile=maybe", "train.compile: expected true/false"),
        ("train.global_batch_size=30", "train.global_batch_size: 30 is not a multiple of train.micro_batch_size 32"),
        ("train.lr=-1", "train.lr: must be > 0"),
        ("train.max_steps", "expected KEY=VALUE"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expected in str(e.value)


def test_sequence_parallel_rows_of_a_pipeline_must_split_into_whole_shares():
    """A Hugging Face model's rows are padded to whole shares of positions in each forward, but
    to data.seq_len in a pipeline."""
    hf = ["model.source=hf:somewhere", "data.seq_len=63", "parallel.tp=2"]
    load_config(None, hf)
    with pytest.raises(ConfigError, match="parallel.tp: sequence parallelism splits the positions"):
        load_config(None, [*hf, "parallel.pp=2"])


def test_all_errors_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.lr=0", "train.max_steps=0"])
    assert len(e.value.errors) == 2


def test_toml_type_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('[train]\nmax_steps = "many"\n')
    with pytest.raises(ConfigError, match=r"bad.toml: train.max_steps: expected an integer"):
        load_config(p)
    p.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")


def test_configs_folder_files_load():
    from pathlib import Path

    files = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))
    assert files
    for f in files:
        load_config(f)


def test_default_config_is_valid():
    from kiln.config import validate

    validate(Config())


def test_docs_config_reference_is_current():
    from pathlib import Path

    from kiln.config import config_reference

    doc = Path(__file__).parents[1] / "docs" / "config.md"
    assert doc.read_text() == config_reference(), "regenerate with: kiln config --reference > docs/config.md"


def test_a_config_of_an_earlier_version_is_told_what_to_write_now():
    """train.objective and run.job = "finetune" were one selector split in two: a config that
    still says them is refused with what to say instead; a run directory saved with them loads
    as the same run."""
    from kiln.config import ConfigError, from_dict, load_config

    with pytest.raises(ConfigError, match=r"train.objective: .* set run.job = 'dpo' instead"):
        load_config(None, ["train.objective=dpo"])
    with pytest.raises(ConfigError, match="run.job: finetune is sft now"):
        load_config(None, ["run.job=finetune"])
    saved = {"run": {"job": "finetune"}, "train": {"objective": "kto"}}
    assert from_dict(saved).run.job == "kto"
    assert from_dict({"run": {"job": "finetune"}, "train": {"objective": "sft"}}).run.job == "sft"
    classifier = {"run": {"job": "finetune"}, "model": {"task": "sequence_classification"}}
    assert from_dict(classifier).run.job == "classify"
    assert from_dict({"run": {"job": "lm"}, "train": {"objective": "sft"}}).run.job == "lm"
    # grpo.length_norm became grpo.loss.
    with pytest.raises(ConfigError, match="grpo.length_norm: .* set grpo.loss = 'dr_grpo'"):
        load_config(None, ["grpo.length_norm=dr_grpo"])
    assert from_dict({"grpo": {"length_norm": "sequence"}}).grpo.loss == "grpo"
    assert from_dict({"grpo": {"length_norm": "dr_grpo"}}).grpo.loss == "dr_grpo"
    weights = load_config(None, ["grpo.rewards=a:f,b:g", "grpo.reward_weights=1,0.5"]).grpo
    assert weights.rewards == ("a:f", "b:g") and weights.reward_weights == (1.0, 0.5)


def test_classify_is_the_job_of_a_sequence_classifier(tmp_path):
    from kiln.config import ConfigError, load_config
    from kiln.train.jobs import resolve_config

    assert resolve_config(load_config(None, ["run.job=classify"])).model.task == "sequence_classification"
    with pytest.raises(ConfigError, match="model.task: sequence_classification is trained by run.job = classify"):
        resolve_config(load_config(None, ["run.job=dpo", "model.task=sequence_classification"]))
