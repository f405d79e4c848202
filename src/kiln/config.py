"""The configuration tree: dataclasses, TOML loading, ``--set`` overrides and validation.

One ``Config`` describes a whole run. It is built once from defaults, an optional TOML file and
``--set section.key=value`` overrides, validated once, and then only read. Each field's docstring
(the string literal after it) is the user-facing description used by ``kiln config`` and the docs.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad configuration: each line of the message names one key and what is allowed."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("\n".join(errors))


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """Run directory: config, metrics, TensorBoard events and checkpoints are written here."""
    device: str = "auto"
    """Device to train on: auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    threads: int = 0
    """CPU threads for intra-op parallelism; 0 keeps PyTorch's default."""


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Model preset: tiny, small, gpt2-124m, 350m, 1b or 7b (see `kiln presets`)."""
    n_layer: int = 0
    """Number of Transformer blocks; 0 keeps the preset's."""
    d_model: int = 0
    """Residual stream width; 0 keeps the preset's."""
    n_head: int = 0
    """Attention heads; 0 keeps the preset's."""
    n_kv_head: int = 0
    """Key/value heads for grouped-query attention (divides n_head); 0 keeps the preset's."""
    d_ff: int = 0
    """Hidden width of the SwiGLU MLP; 0 keeps the preset's."""
    tie_embeddings: str = "preset"
    """Share input embedding and output projection: true, false or preset."""
    rope_theta: float = 0.0
    """RoPE base frequency; 0 keeps the preset's."""


@dataclass
class DataConfig:
    source: str = "stdlib"
    """Training text: 'stdlib' (the Python standard library on this machine, no download) or a
    file, directory or glob of .txt or .py files (one document each), .jsonl (one document per
    line) and .parquet files (one per row)."""
    text_field: str = "text"
    """Field holding the text in .jsonl and .parquet records."""
    tokenizer: str = "bpe"
    """'bpe' trains a byte-level BPE on the training split (cached), or a path to a tokenizer.json."""
    vocab_size: int = 4096
    """Vocabulary size of the trained BPE tokenizer."""
    seq_len: int = 128
    """Tokens per training sequence (context length)."""
    val_fraction: float = 0.05
    """Share of documents held out for validation, chosen by a stable hash of each document's name."""
    num_workers: int = 2
    """DataLoader worker processes (0 loads in the training process)."""
    prepare_workers: int = 0
    """Processes that tokenize during preparation; 0 uses every CPU core."""
    cache_dir: str = ""
    """Where tokenizers and token shards are cached; empty means $KILN_CACHE or ~/.cache/kiln."""


@dataclass
class TrainConfig:
    max_steps: int = 1050
    """Optimizer steps to train for (the default run takes about five minutes on 2 CPU cores)."""
    micro_batch_size: Union[int, Literal["auto"]] = 32
    """Sequences per forward/backward pass on each rank, or "auto": before training, find the
    largest that fits in device memory by probing real steps (accumulation then makes up the
    global batch). A run that meets an out-of-memory error lowers it by itself (see docs/memory.md)."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all ranks; a multiple of micro_batch_size times the
    data-parallel degree (the ratio is the number of gradient accumulation steps)."""
    batch_ramp_start: int = 0
    """Global batch size at the first step of a batch-size ramp, which grows it in equal
    increments to global_batch_size; 0 turns the ramp off."""
    batch_ramp_increment: int = 0
    """How much the global batch grows at each stage of the ramp; 0 means by batch_ramp_start."""
    batch_ramp_steps: int = 0
    """Length of the ramp in optimizer steps (stages of equal length); set this or batch_ramp_tokens."""
    batch_ramp_tokens: int = 0
    """Length of the ramp in training tokens (stages of equal token counts); set this or batch_ramp_steps."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine, linear and wsd schedules)."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "wsd"
    """Learning-rate schedule after warmup: cosine, linear, constant or wsd (warmup-stable-decay)."""
    warmup_steps: int = 50
    """Steps of linear warmup from 0 to lr."""
    decay_fraction: float = 0.2
    """For wsd: the final share of steps in which the rate decays."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to norms, biases or embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm; 0 turns clipping off."""
    seed: int = 1337
    """Seed for initialisation, data order and sampling."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Numeric precision: fp32, bf16 (autocast) or fp16 (autocast with a gradient scaler)."""
    compile: bool = False
    """Compile the model with torch.compile."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass to save memory."""
    log_every: int = 10
    """Log metrics every N steps (the only points where the loop waits for the device)."""
    time_budget: str = ""
    """Wall-clock limit of the training loop, e.g. "300s", "5m", "1h30m" (empty: none). The run
    stops at the step boundary that would cross it, then evaluates and checkpoints; running the
    same command again resumes and trains for another budget. The schedule still follows
    max_steps."""


@dataclass
class EvalConfig:
    every: int = 350
    """Evaluate every N steps (and at the end); 0 only at the end."""
    batches: int = 8
    """Validation micro-batches per evaluation (a fixed sample, the same each time)."""
    sample_tokens: int = 64
    """Tokens to generate as a sample at each evaluation; 0 turns samples off."""
    prompt: str = "def "
    """Prompt for the generated sample."""


@dataclass
class CheckpointConfig:
    every: int = 350
    """Save a checkpoint every N steps (and at the end); 0 only at the end."""
    keep: int = 2
    """Complete checkpoints to keep; older ones are deleted."""
    resume: str = "auto"
    """'auto' resumes from the newest complete checkpoint in run.dir if there is one, 'never'
    starts fresh (refusing a run.dir that already has checkpoints), or a checkpoint path."""


@dataclass
class ParallelConfig:
    strategy: Literal["ddp", "fsdp", "fsdp_grad_op"] = "ddp"
    """How data-parallel ranks share the model when the world size is above 1: ddp (replicas,
    gradients all-reduced), fsdp (FSDP2, parameters, gradients and optimizer state sharded, like
    ZeRO-3) or fsdp_grad_op (as fsdp, but parameters stay gathered from forward to backward, like
    ZeRO-2: less communication, more memory). Ignored in a single process unless
    parallel.cpu_offload is on."""
    tp: int = 1
    """Tensor-parallel degree: each block's attention and MLP are split over this many ranks
    (a divisor of the world size; the rest of the world is data-parallel). Needs fsdp or
    fsdp_grad_op when the data-parallel degree is above 1."""
    bucket_mb: int = 25
    """DDP gradient bucket size in MiB: larger buckets mean fewer, bigger all-reduces."""
    cpu_offload: bool = False
    """With fsdp/fsdp_grad_op on CUDA: keep sharded parameters, gradients and optimizer state in
    CPU memory, and run the optimizer there (slower; fits much larger models). Works in a single
    process too (FSDP over a group of one), e.g. to train a 7B model on one GPU."""


@dataclass
class GuardConfig:
    max_bad_steps: int = 3
    """Non-finite steps (loss or gradient norm NaN/Inf) in a row, each skipped, before the run rolls
    back to its last checkpoint with a lower learning rate; 0 turns the rollback off (bad steps
    are still skipped)."""
    lr_factor: float = 0.5
    """The learning rate is multiplied by this at each rollback."""
    max_rollbacks: int = 2
    """Rollbacks allowed before the run stops with a report."""
    spike_threshold: float = 6.0
    """Warn when a step's loss exceeds its running mean by this many running standard deviations; 0 is off."""


@dataclass
class ObserveConfig:
    histograms_every: int = 0
    """Write weight and gradient histograms to TensorBoard every N steps; 0 is off."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package; WANDB_MODE=offline logs without a network)."""
    wandb_project: str = "kiln"
    """Weights & Biases project name."""


@dataclass
class ProfileConfig:
    steps: str = ""
    """Optimizer steps to profile with torch.profiler, as START:END (1-based, inclusive), e.g. 5:8;
    empty is off. The trace goes to profile.dir (TensorBoard, Perfetto or chrome://tracing)."""
    dir: str = ""
    """Where the trace and breakdown.json are written; empty means RUN_DIR/profile."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def grad_accum_steps(self, data_parallel: int = 1) -> int:
        """Micro-batches per rank per optimizer step (at the full global batch, with a fixed micro-batch)."""
        if self.train.micro_batch_size == "auto":
            raise ValueError("train.micro_batch_size is 'auto': the accumulation is known only once it is probed")
        return self.train.global_batch_size // (self.train.micro_batch_size * data_parallel)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
            lines.append("")
        return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a JSON string is a valid TOML basic string


# ---------------------------------------------------------------------------------------------
# Building a Config from TOML and overrides


def sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def field_docs(section_cls: type) -> dict[str, str]:
    """Field docstrings, read from the class source (the string literal after each field)."""
    import inspect

    try:
        tree = ast.parse(inspect.getsource(section_cls))
    except (OSError, TypeError):  # pragma: no cover - source not available (frozen app)
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def config_reference() -> str:
    """Every key with its default and meaning, as Markdown (docs/config.md is this text)."""
    defaults = Config().to_dict()
    out = ["# Configuration reference", "",
           "Set keys in a TOML file (`[section]` tables) or on the command line with "
           "`--set section.key=value`. Generated by `kiln config --reference`.", ""]
    for section, cls in sections().items():
        out += [f"## [{section}]", "", "| key | default | meaning |", "|---|---|---|"]
        for key, doc in field_docs(cls).items():
            out.append(f"| `{section}.{key}` | `{_toml_value(defaults[section][key])}` | {doc} |")
        out.append("")
    return "\n".join(out)


_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds in "90", "90s", "5m", "1.5h" or "1h30m"; ValueError otherwise."""
    import re

    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def parse_step_range(text: str) -> tuple[int, int]:
    """(start, end) of "START:END" (1-based, inclusive) or of a single step "N"."""
    parts = text.split(":")
    try:
        start, end = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        start, end = 0, 0
    if not 1 <= start <= end:
        raise ValueError(f"{text!r} is not a step range START:END with 1 <= START <= END, e.g. 5:8")
    return start, end


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Union:
        return " or ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return " | ".join(str(a) for a in get_args(tp))
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(key: str, tp: Any, value: Any, from_text: bool) -> Any:
    """Turn ``value`` into type ``tp`` or raise ConfigError naming ``key``."""
    if get_origin(tp) is Union:
        for option in get_args(tp):
            try:
                return _coerce(key, option, value, from_text)
            except ConfigError:
                pass
        raise ConfigError([f"{key}: expected {_type_name(tp)}, got {value!r}"])
    if get_origin(tp) is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError([f"{key}: {value!r} is not allowed; choose one of {', '.join(map(str, allowed))}"])
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return str(value).lower() in ("true", "1", "yes", "on")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(str(value).replace("_", ""))
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text:
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if from_text:
            return str(value)
    raise ConfigError([f"{key}: expected {_type_name(tp)}, got {value!r}"])


def _unknown_key(key: str, known: list[str]) -> str:
    hint = difflib.get_close_matches(key, known, n=1)
    msg = f"{key}: unknown config key"
    if hint:
        msg += f"; did you mean {hint[0]}?"
    section = key.split(".")[0]
    same = [k for k in known if k.startswith(section + ".")]
    if same and not hint:
        msg += f"; keys in [{section}]: {', '.join(same)}"
    elif not same:
        msg += f"; sections are {', '.join(sections())}"
    return msg


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in sections().items() for f in dataclasses.fields(cls)]


def _apply(values: dict[str, dict[str, Any]], pairs: list[tuple[str, Any, bool]], origin: str) -> list[str]:
    """Set ``(dotted key, value, from_text)`` pairs into the nested ``values`` dict."""
    errors = []
    known = all_keys()
    secs = sections()
    for key, value, from_text in pairs:
        if key not in known:
            errors.append(origin + _unknown_key(key, known))
            continue
        section, name = key.split(".", 1)
        tp = typing.get_type_hints(secs[section])[name]
        try:
            values[section][name] = _coerce(key, tp, value, from_text)
        except ConfigError as e:
            errors.extend(origin + line for line in e.errors)
    return errors


def _flatten(table: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in table.items():
        if isinstance(v, dict):
            out.extend(_flatten(v, f"{prefix}{k}."))
        else:
            out.append((f"{prefix}{k}", v))
    return out


def parse_set(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=3e-4"])
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- ``--set`` overrides, then validation. Raises ConfigError."""
    values = Config().to_dict()
    errors: list[str] = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([f"{p}: config file not found"])
        try:
            table = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError([f"{p}: not valid TOML: {e}"]) from None
        errors += _apply(values, [(k, v, False) for k, v in _flatten(table)], f"{p}: ")
    pairs = []
    for item in overrides or []:
        try:
            pairs.append((*parse_set(item), True))
        except ConfigError as e:
            errors += e.errors
    errors += _apply(values, pairs, "--set ")
    if errors:
        raise ConfigError(errors)
    secs = sections()
    cfg = Config(**{s: secs[s](**v) for s, v in values.items()})
    validate(cfg)
    return cfg


def from_dict(values: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config saved with ``to_dict`` (e.g. from a checkpoint), ignoring unknown keys."""
    secs = sections()
    known = {s: {f.name for f in dataclasses.fields(cls)} for s, cls in secs.items()}
    return Config(**{s: secs[s](**{k: v for k, v in values.get(s, {}).items() if k in known[s]}) for s in secs})


def _ramp_errors(t: TrainConfig) -> list[str]:
    if t.batch_ramp_start == 0:
        unused = [k for k in ("batch_ramp_increment", "batch_ramp_steps", "batch_ramp_tokens") if getattr(t, k)]
        return [f"train.{k}: set, but the ramp is off; set train.batch_ramp_start too" for k in unused]
    start, inc, end = t.batch_ramp_start, t.batch_ramp_increment or t.batch_ramp_start, t.global_batch_size
    if start < 0 or inc < 0:
        return [f"train.batch_ramp_start / batch_ramp_increment: must be >= 0, got {start} / {t.batch_ramp_increment}"]
    errors = []
    if not 0 < start < end:
        errors.append(f"train.batch_ramp_start: {start} must be below train.global_batch_size {end}")
    elif (end - start) % inc:
        errors.append(f"train.batch_ramp_increment: {inc} does not divide train.global_batch_size - "
                      f"train.batch_ramp_start = {end - start}; the ramp must end on global_batch_size")
    micro = t.micro_batch_size
    if micro != "auto" and micro >= 1:
        errors += [f"train.{k}: {v} is not a multiple of train.micro_batch_size {micro}"
                   for k, v in (("batch_ramp_start", start), ("batch_ramp_increment", inc)) if v % micro]
    if (t.batch_ramp_steps > 0) == (t.batch_ramp_tokens > 0) or min(t.batch_ramp_steps, t.batch_ramp_tokens) < 0:
        errors.append("train.batch_ramp_steps / train.batch_ramp_tokens: set exactly one of them to a positive "
                      f"length, got {t.batch_ramp_steps} / {t.batch_ramp_tokens}")
    return errors


def validate(cfg: Config) -> None:
    """Check values that a type alone cannot; collect every problem, then raise once."""
    from kiln.models.presets import build_gpt_config

    t, d = cfg.train, cfg.data
    errors = []
    try:
        build_gpt_config(cfg.model, vocab_size=d.vocab_size, max_seq_len=d.seq_len)
    except ConfigError as e:
        errors += e.errors

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    need(t.max_steps >= 1, f"train.max_steps: must be >= 1, got {t.max_steps}")
    micro = t.micro_batch_size
    need(micro == "auto" or micro >= 1, f"train.micro_batch_size: must be >= 1 or auto, got {micro}")
    need(t.global_batch_size >= 1, f"train.global_batch_size: must be >= 1, got {t.global_batch_size}")
    if micro != "auto" and micro >= 1 and t.global_batch_size >= 1:
        need(t.global_batch_size % micro == 0,
             f"train.global_batch_size: {t.global_batch_size} is not a multiple of train.micro_batch_size "
             f"{micro}; accumulation steps must be a whole number")
    errors += _ramp_errors(t)
    need(t.lr > 0, f"train.lr: must be > 0, got {t.lr}")
    need(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
    need(t.warmup_steps >= 0, f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    need(0 < t.decay_fraction <= 1, f"train.decay_fraction: must be in (0, 1], got {t.decay_fraction}")
    need(t.weight_decay >= 0, f"train.weight_decay: must be >= 0, got {t.weight_decay}")
    need(0 <= t.beta1 < 1, f"train.beta1: must be in [0, 1), got {t.beta1}")
    need(0 <= t.beta2 < 1, f"train.beta2: must be in [0, 1), got {t.beta2}")
    need(t.eps > 0, f"train.eps: must be > 0, got {t.eps}")
    need(t.grad_clip >= 0, f"train.grad_clip: must be >= 0 (0 is off), got {t.grad_clip}")
    need(t.seed >= 0, f"train.seed: must be >= 0, got {t.seed}")
    need(t.log_every >= 1, f"train.log_every: must be >= 1, got {t.log_every}")
    if t.time_budget:
        try:
            need(parse_duration(t.time_budget) > 0, f"train.time_budget: must be more than 0, got {t.time_budget!r}")
        except ValueError:
            errors.append(f"train.time_budget: {t.time_budget!r} is not a duration; use e.g. 300s, 5m, 1h30m")
    need(d.vocab_size >= 260, f"data.vocab_size: must be >= 260 (256 bytes and special tokens), got {d.vocab_size}")
    need(d.seq_len >= 2, f"data.seq_len: must be >= 2, got {d.seq_len}")
    need(0 < d.val_fraction < 1, f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    need(d.num_workers >= 0, f"data.num_workers: must be >= 0, got {d.num_workers}")
    need(d.prepare_workers >= 0, f"data.prepare_workers: must be >= 0, got {d.prepare_workers}")
    need(bool(d.text_field), "data.text_field: must not be empty")
    need(bool(d.source), "data.source: must not be empty; use 'stdlib' or a path")
    need(cfg.eval.every >= 0, f"eval.every: must be >= 0 (0 evaluates only at the end), got {cfg.eval.every}")
    need(cfg.eval.batches >= 1, f"eval.batches: must be >= 1, got {cfg.eval.batches}")
    need(cfg.eval.sample_tokens >= 0, f"eval.sample_tokens: must be >= 0, got {cfg.eval.sample_tokens}")
    need(cfg.checkpoint.every >= 0, f"checkpoint.every: must be >= 0 (0 saves only at the end), got {cfg.checkpoint.every}")
    need(cfg.checkpoint.keep >= 1, f"checkpoint.keep: must be >= 1, got {cfg.checkpoint.keep}")
    need(cfg.parallel.tp >= 1, f"parallel.tp: must be >= 1, got {cfg.parallel.tp}")
    need(cfg.parallel.bucket_mb >= 1, f"parallel.bucket_mb: must be >= 1, got {cfg.parallel.bucket_mb}")
    g = cfg.guard
    need(g.max_bad_steps >= 0, f"guard.max_bad_steps: must be >= 0 (0 turns rollback off), got {g.max_bad_steps}")
    need(0 < g.lr_factor <= 1, f"guard.lr_factor: must be in (0, 1], got {g.lr_factor}")
    need(g.max_rollbacks >= 0, f"guard.max_rollbacks: must be >= 0, got {g.max_rollbacks}")
    need(g.spike_threshold >= 0, f"guard.spike_threshold: must be >= 0 (0 is off), got {g.spike_threshold}")
    need(cfg.observe.histograms_every >= 0, f"observe.histograms_every: must be >= 0, got {cfg.observe.histograms_every}")
    if cfg.profile.steps:
        try:
            parse_step_range(cfg.profile.steps)
        except ValueError as e:
            errors.append(f"profile.steps: {e}")
    need(bool(cfg.run.dir), "run.dir: must not be empty")
    need(cfg.run.threads >= 0, f"run.threads: must be >= 0, got {cfg.run.threads}")
    dev = cfg.run.device
    need(dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
         f"run.device: {dev!r} is not allowed; choose auto, cpu, cuda or cuda:N")
    if errors:
        raise ConfigError(errors)
