"""The configuration tree: ConfigError, one dataclass per section, and Config, which holds them.

Each field's docstring (the string literal after it) is the user-facing description used by ``kiln config`` and the
docs. Each section checks its own values in ``errors()``, which lists every problem rather than stopping at the first.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.config.units import parse_duration, parse_step_range


class ConfigError(ValueError):
    """A bad configuration: each line of the message names one key and what is allowed."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("\n".join(errors))


def _failed(*checks: tuple[bool, str]) -> list[str]:
    """The messages of the checks that do not hold, in order; each check is ``(ok, message)``."""
    return [message for ok, message in checks if not ok]


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"
    """Run directory: config, metrics, TensorBoard events and checkpoints are written here."""
    device: str = "auto"
    """Device to train on: auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    threads: int = 0
    """CPU threads for intra-op parallelism; 0 keeps PyTorch's default."""
    job: Literal["auto", "lm", "sft", "classify", "dpo", "ipo", "simpo", "orpo", "kto", "grpo", "module"] = "auto"
    """What the run is, and what it trains for. lm: a language model trained on text (kiln's GPT,
    a plug-in family, or a Hugging Face causal LM continuing pretraining). On records, with a
    Hugging Face model (model.source): sft (the completions' likelihood, prompt/completion or chat
    records), classify (a sequence classifier on labelled text; model.task follows), or a
    preference objective on {prompt, chosen, rejected} records ([preference] holds its settings):
    dpo (Rafailov et al. 2023, with preference.loss_type), ipo (Azar et al. 2023), simpo (Meng et
    al. 2024: length-normalised, no reference model), orpo (Hong et al. 2024: the chosen
    completion's likelihood plus beta times an odds-ratio term, no reference model), kto
    (Ethayarajh et al. 2024, on {prompt, completion, label} records: an answer labelled desirable
    or not, with a reference model); or grpo (Shao et al. 2024: reinforcement learning with
    verifiable rewards on {prompt, ...} records, [grpo] holds its settings). dpo and ipo compare
    with a reference model: the base with its adapters off under LoRA, else log-probabilities of
    the initial model computed once before the first step (preference.precompute_reference); kto
    likewise. auto: classify where model.task is sequence_classification, else sft when
    data.format resolves to records, else lm. module is recorded for your own nn.Module trained through
    kiln.Trainer, which only Python can rebuild. A run's config.toml records what auto became,
    and every kiln command on the run directory takes its job from there. (Earlier versions said
    run.job = "finetune" with train.objective; such a config is told what to write instead, and
    such a run directory still loads.)"""

    def errors(self) -> list[str]:
        dev = self.device
        return _failed(
            (bool(self.dir), "run.dir: must not be empty"),
            (self.threads >= 0, f"run.threads: must be >= 0, got {self.threads}"),
            (
                dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
                f"run.device: {dev!r} is not allowed; choose auto, cpu, cuda or cuda:N",
            ),
        )


@dataclass(frozen=True)
class ModelConfig:
    family: str = "gpt"
    """Model family: gpt (kiln's own Llama-style Transformer), or a plug-in given as
    package.module:object, an object implementing kiln.models.ModelFamily. A model.source of
    hf:PATH selects the hf family by itself."""
    source: str = ""
    """Start from an existing model: hf:PATH, a local Hugging Face transformers directory
    (config.json, model.safetensors or a sharded index, the tokenizer). Never downloads, never
    runs code from the directory. Empty: build the family's model from the fields below."""
    task: Literal["causal_lm", "sequence_classification"] = "causal_lm"
    """With model.source: causal_lm (AutoModelForCausalLM) or sequence_classification
    (AutoModelForSequenceClassification; labels from the data)."""
    weights: Literal["pretrained", "random"] = "pretrained"
    """With model.source: start from its pretrained weights, or from random ones (its
    architecture only, e.g. to compare with training from scratch)."""
    allow_missing: bool = False
    """With model.source and pretrained weights: start the tensors its files lack from random
    values, listing them, instead of stopping. Off, only a classifier's head may be new (when the
    files have none, as a base model's save, or another label count); any other missing tensor
    stops the run before it starts (a fine-tune from noise is not a fine-tune)."""
    preset: str = "tiny"
    """Model preset of the gpt family: tiny, small, gpt2-124m, 350m, 1b, 7b, or llama3-8b, llama3-70b,
    llama3-405b (shaped like Llama 3: set data.vocab_size=128256); mixtures of experts: tiny-moe,
    qwen3-30b-a3b, deepseek-v3 (shaped like those, for kiln plan); see `kiln presets`."""
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
    zero_init: str = "preset"
    """Start the output layer and the projections back into the residual stream (attention's wo,
    the MLP's w2) at zero, as the GPT-2 speedruns do: true, false or preset (off). Needs an
    untied output layer (model.tie_embeddings=false)."""
    logit_softcap: float = 0.0
    """Soft-cap the output logits to logit_softcap * tanh(logits / logit_softcap) (Gemma 2, the
    GPT-2 speedruns use 15-30); 0 is off. Not exportable to Hugging Face (Llama and Qwen3 do not cap)."""
    qk_norm: str = "preset"
    """RMSNorm over each head's queries and keys before the rotary embedding (QK-norm, as Qwen3
    and the GPT-2 speedruns use): true, false or preset. A dense model with it exports as Qwen3."""
    mlp: str = "preset"
    """The dense blocks' MLP: swiglu (w2(silu(w1 x) * w3 x), Llama's), relu2 (w2(relu(w1 x)^2),
    as the GPT-2 speedruns use: two matrices, so at one model.d_ff a third fewer MLP weights and
    FLOPs), or preset (swiglu). A dense relu2 model exports to Hugging Face as Arcee
    (ArceeForCausalLM, Llama with this MLP; not with model.qk_norm); a mixture of experts'
    experts stay SwiGLU."""
    n_experts: int = 0
    """Mixture of experts: routed experts per MoE layer; 0 keeps the preset's (none for the dense
    presets: every layer has one MLP). tiny-moe is the small MoE preset."""
    experts_per_token: int = 0
    """Experts the router picks for each token (top-k); 0 keeps the preset's (2 if it has none)."""
    n_shared_experts: int = -1
    """Experts every token goes through besides those picked (DeepSeek's shared experts); -1 keeps the preset's."""
    d_expert: int = 0
    """Hidden width of each expert's SwiGLU MLP; 0 keeps the preset's (d_ff if it has none)."""
    moe_layer_start: int = -1
    """First layer with a mixture of experts, the earlier ones dense (as DeepSeek-V3's first 3);
    -1 keeps the preset's."""
    router: str = "preset"
    """Router scores: softmax (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3), or preset."""
    router_bias_rate: float = 0.01
    """Auxiliary-loss-free load balancing (DeepSeek-V3): after each step, each expert's routing
    bias moves by this much towards an even load; 0 turns it off. DeepSeek-V3 used 0.001 over a
    run of hundreds of thousands of steps; 0.01 evens tiny-moe's load within 200 steps."""
    router_aux_loss: float = 0.0
    """Coefficient of the auxiliary balance loss (Switch Transformer's) added to the training
    loss; 0: none."""
    expert_capacity: float = 0.0
    """Capacity factor: each expert takes at most this times its even share of a batch's tokens,
    the rest of its tokens dropped (skip the expert); 0: no capacity, nothing dropped."""

    def errors(self) -> list[str]:
        # Only the family knows its presets and which dimensions fit together: it checks the rest when it builds.
        return _failed(
            (bool(self.family), "model.family: must not be empty; use gpt or package.module:object"),
            (
                not self.source or (self.source.startswith("hf:") and len(self.source) > 3),
                f"model.source: {self.source!r} is not hf:PATH (a local Hugging Face model directory)",
            ),
        )


@dataclass(frozen=True)
class MixSource:
    """One corpus of a weighted mixture (``data.mix``)."""

    source: str
    weight: float
    text_field: str = ""  # empty: data.text_field
    name: str = ""  # empty: from the source (a file's or folder's name)

    @property
    def label(self) -> str:
        """The source's name in metrics and reports."""
        if self.name:
            return self.name
        stem = self.source.rstrip("/").rsplit("/", 1)[-1]
        for suffix in (".gz", ".zst", ".jsonl", ".parquet", ".txt"):
            stem = stem.removesuffix(suffix)
        return stem or self.source


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"
    """Training text: 'stdlib' (the Python standard library on this machine, no download) or a
    file, directory or glob of .txt or .py files (one document each), .jsonl, .jsonl.gz and
    .jsonl.zst (one document per line), .parquet files (one per row; Hub-style shard sets read as
    one) and directories written by datasets' save_to_disk. Fine-tuning records (see data.format)
    come from .jsonl, .csv or .parquet files."""
    mix: tuple[MixSource, ...] = ()
    """A weighted mixture of corpora instead of data.source, each entry {source = ..., weight = ...}
    (optionally text_field, and name, its label in metrics): [[data.mix]] tables in TOML, or
    --set 'data.mix=[{source="web/", weight=0.7}, {source="code.jsonl", weight=0.3}]'. Weights are
    shares of the training sequences; each source has its own train/val split, one tokenizer is
    trained on them all, and validation reports each source and their weighted mean."""
    max_epochs: float = 4.0
    """A planned run (train.max_steps = "auto") ends once it has read its training data this many
    times, before its time budget if need be: more passes over a small corpus fit it ever closer
    and held-out text worse. Runs given a number of steps are not cut. With data.mix, an event
    also warns when one source has been read more than this many times over."""
    format: Literal["auto", "text", "records"] = "auto"
    """text: a corpus (one document per file, line or row); records: fine-tuning examples
    (prompt/completion or messages for causal_lm, text/label for sequence_classification);
    auto: records when model.source is set and the files are .jsonl, .csv or .parquet."""
    val_source: str = ""
    """Validation data (a file, directory or glob in the same formats as data.source); when set,
    data.source is not split, and its documents (records) whose text is also in val are left out
    of training. Empty: hold out data.val_fraction of data.source."""
    text_field: str = "text"
    """Field holding the text in .jsonl and .parquet corpora, and of classification records."""
    text_pair_field: str = "text_pair"
    """Field holding the second text of a classification record, if it has one."""
    label_field: str = "label"
    """Field holding the label of a classification record (a name or an integer)."""
    prompt_field: str = "prompt"
    """Field holding the prompt of a causal_lm record."""
    completion_field: str = "completion"
    """Field holding the completion of a causal_lm record (what the model learns to write)."""
    messages_field: str = "messages"
    """Field holding a chat (a list of {role, content}) of a causal_lm record, rendered with the
    tokenizer's chat template; assistant turns are what the model learns."""
    train_on_prompt: bool = False
    """Also learn the prompt (and non-assistant turns) of causal_lm records; by default the loss
    covers only completions and assistant turns."""
    packing: bool = False
    """causal_lm records: pack whole records into rows of data.seq_len tokens (best-fit
    decreasing), each record attending only to itself (per-record positions, block-diagonal
    causal mask), instead of padding each row."""
    document_mask: bool = False
    """Text: attention stays within each document of a training window (the documents of the
    token stream, each ended by the end-of-text token), positions restart at each document, and
    the end-of-text token's target, the next document's first token, is left out of the loss.
    Off by default: on the default run it changed val bpb by less than its seed-to-seed spread
    and cost about 1% of tokens/s (BENCHMARKS.md, "Document masking")."""
    tokenizer: str = "bpe"
    """'bpe' trains a byte-level BPE on the training split (cached), or a path to a tokenizer.json."""
    tokenizer_sample_bytes: int = 0
    """Train the BPE on a sample of the training split of up to this many bytes of UTF-8 text
    (e.g. 100000000, 100 MB, for a corpus of many GB) instead of all of it; 0 trains on all of it. The
    sample is chosen by a hash of the document names: deterministic and spread over the whole
    corpus, not its first bytes."""
    vocab_size: int = 4096
    """Vocabulary size of the trained BPE tokenizer."""
    seq_len: int = 128
    """Tokens per training sequence (context length)."""
    val_fraction: float = 0.05
    """Share of documents held out for validation, chosen by a stable hash of each document's name
    (of each record's content, for fine-tuning records). Exact duplicate documents are kept once.
    A corpus's only document, and any of data.position_split_chars or more, is split by position
    instead: its last val_fraction (from a line start) is val."""
    position_split_chars: int = 1_000_000
    """Documents of at least this many characters (a book, a dump) are split by position rather
    than going to train or val whole; 0 splits only a corpus's only document."""
    max_record_bytes: int = 64 << 20
    """Longest line of a .jsonl file (plain or compressed) or of fine-tuning records, in bytes:
    a longer one, a decompression bomb's included, is an error naming the file and line, before
    it is held in memory whole. Raise it for records meant to be that long."""
    num_workers: int = 2
    """DataLoader worker processes (0 loads in the training process)."""
    prepare_workers: int = 0
    """Processes that tokenize during preparation; 0 uses every CPU core."""
    shard_bytes: int = 1 << 30
    """Largest file of prepared tokens: each split's token stream is written in shards of at most
    this many bytes (train-00000.bin, train-00001.bin, ...); at least 1 MiB (1048576)."""
    cache_dir: str = ""
    """Where tokenizers and token shards are cached; empty means $KILN_CACHE or ~/.cache/kiln."""

    def errors(self) -> list[str]:
        return (
            _failed(
                (
                    self.vocab_size >= 260,
                    f"data.vocab_size: must be >= 260 (256 bytes and special tokens), got {self.vocab_size}",
                ),
                (self.seq_len >= 2, f"data.seq_len: must be >= 2, got {self.seq_len}"),
                (0 < self.val_fraction < 1, f"data.val_fraction: must be in (0, 1), got {self.val_fraction}"),
                (self.num_workers >= 0, f"data.num_workers: must be >= 0, got {self.num_workers}"),
                (self.prepare_workers >= 0, f"data.prepare_workers: must be >= 0, got {self.prepare_workers}"),
                (
                    self.position_split_chars >= 0,
                    f"data.position_split_chars: must be >= 0, got {self.position_split_chars}",
                ),
                (self.max_record_bytes >= 1, f"data.max_record_bytes: must be >= 1, got {self.max_record_bytes}"),
                (
                    self.tokenizer_sample_bytes >= 0,
                    f"data.tokenizer_sample_bytes: must be >= 0 (0: all of the train split), "
                    f"got {self.tokenizer_sample_bytes}",
                ),
                (
                    self.shard_bytes >= 1 << 20,
                    f"data.shard_bytes: must be at least 1 MiB (1048576), got {self.shard_bytes}",
                ),
                *(
                    (bool(getattr(self, key)), f"data.{key}: must not be empty")
                    for key in (
                        "text_field",
                        "text_pair_field",
                        "label_field",
                        "prompt_field",
                        "completion_field",
                        "messages_field",
                    )
                ),
                (bool(self.source), "data.source: must not be empty; use 'stdlib' or a path"),
                (not self.mix or self.source == "stdlib", "data.mix: give either data.source or data.mix, not both"),
                (self.max_epochs > 0, f"data.max_epochs: must be above 0, got {self.max_epochs}"),
            )
            + self._mix_errors()
        )

    def __post_init__(self):
        # A config read back from a checkpoint or a run's config.toml holds the mixture as tables.
        if any(isinstance(m, dict) for m in self.mix):
            object.__setattr__(self, "mix", tuple(m if isinstance(m, MixSource) else MixSource(**m) for m in self.mix))

    def _mix_errors(self) -> list[str]:
        errors = []
        for i, m in enumerate(self.mix):
            if not m.source:
                errors.append(f"data.mix[{i}].source: must not be empty")
            if not (m.weight > 0 and math.isfinite(m.weight)):
                errors.append(f"data.mix[{i}].weight: must be a number above 0, got {m.weight}")
        total = sum(m.weight for m in self.mix if m.weight > 0 and math.isfinite(m.weight))
        for i, m in enumerate(self.mix):
            if 0 < m.weight < total / 1000:
                errors.append(
                    f"data.mix[{i}].weight: {m.weight} is {m.weight / total:.2%} of the mixture, below the 0.1% "
                    "that it draws at the least (one sequence in a thousand)"
                )
        labels = [m.label for m in self.mix]
        for label in sorted({x for x in labels if labels.count(x) > 1}):
            errors.append(f"data.mix: two sources are named {label!r}; give each a distinct name (name = ...)")
        return errors


# What max_steps = "auto" fills when train.time_budget is not set: the default run's length.
DEFAULT_BUDGET = "5m"
# global_batch_size = "auto" with a number of steps: the default recipe's batch.
FIXED_STEPS_BATCH = 32
# compile = "auto": the shortest time plan that compiles (about 25 s to compile on 2 CPU cores with
# a cold cache, repaid by 1.28x the tokens/s after ~115 s), and the eager steps before it, whose
# losses show while the compiler works (BENCHMARKS.md, "Faster steps on the CPU").
AUTO_COMPILE_MIN_S = 120.0
AUTO_COMPILE_AFTER = 20


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int | Literal["auto"] = "auto"
    """Optimizer steps to train for, or "auto" (the default): as many as fit train.time_budget
    (five minutes when that is not set), measured at the start of the run (a few timed steps, an
    evaluation and a checkpoint). With the wsd and constant schedules, whose rate up to the decay
    does not depend on it, that probe is short and the run's own first steps fix the plan (a few
    seconds in), which is corrected again at 1/2 and 3/4 of the run with the pace kept; cosine and
    linear are timed in full before the run. So the schedule ends, and the run evaluates and saves,
    when the budget does. The planned steps are printed, recorded in the run's config.toml and kept
    on resume. A number makes runs comparable across machines: the default recipe took 1050 steps
    in five minutes on a 2-core Xeon."""
    micro_batch_size: int | Literal["auto"] = 32
    """Sequences per forward/backward pass on each rank, or "auto": before training, find the
    largest that fits in device memory by probing real steps (accumulation then makes up the
    global batch). A run that meets an out-of-memory error lowers it by itself (see docs/memory.md)."""
    global_batch_size: int | Literal["auto"] = "auto"
    """Sequences per optimizer step over all ranks; a multiple of micro_batch_size times the
    data-parallel degree (the ratio is the number of gradient accumulation steps). Or "auto" (the
    default): with max_steps = "auto", chosen at the start of the run from the tokens the time
    budget buys (docs/time_plan.md: the batch grows as the square root of those tokens, so a
    short run takes many small steps), printed, recorded in config.toml and kept on resume; with
    a number of steps, 32."""
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
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon: Muon (momentum orthogonalised by Newton-Schulz iterations) for the hidden
    weight matrices, AdamW (train.lr, betas, eps) for embeddings, the output layer, norms and
    biases; both with train.weight_decay, both following the schedule."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (the schedule scales it as it scales train.lr), before the
    per-matrix factor sqrt(max(1, rows / columns))."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm; 0 turns clipping off."""
    seed: int = 1337
    """Seed for initialisation, data order and sampling."""
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    """Numeric precision: fp32, bf16 (autocast), fp16 (autocast with a gradient scaler), fp8
    (float8 training: the model's linear layers multiply in float8 with dynamic scales, as
    train.fp8_recipe says, everything else in bf16; needs torchao and, to be faster than bf16, a
    GPU of compute capability 8.9+ such as the H100), or auto: bf16 on a CUDA GPU that computes it
    natively (compute capability 8.0+), fp32 elsewhere. A run's config.toml records what auto
    became."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """How train.precision=fp8 scales tensors into float8: one scale per tensor (the fastest) or
    one per row (more accurate, a little slower)."""
    compile: bool | Literal["auto"] = "auto"
    """Compile the model with torch.compile (true), or not (false). On the CPU the compiled code
    runs with deterministic algorithms, so a compiled run, repeated or resumed, trains bitwise the
    same weights (on a GPU neither eager nor compiled training repeats bitwise: its attention
    kernels' backward passes are not deterministic). "auto" (the default) compiles a run of
    kiln's own model whose time plan has at least two minutes (max_steps = "auto" with the wsd
    or constant schedule, no pipeline), after its first 20 steps (train.compile_after): the
    first losses show at once, the compile (about 25 s on a 2-core CPU with a cold cache) comes
    after them, and the compiled steps (1.28x the tokens/s on the CPU, 1.8x on an H200) repay
    it; shorter runs stay eager. A run's config.toml records what auto became."""
    compile_after: int = 0
    """With train.compile: steps to run eagerly before the compiled ones (0: compiled from the
    first). With max_steps = "auto" the time plan times the compiled steps, not these."""
    activation_checkpointing: bool | Literal["selective"] = False
    """Recompute each block's activations in the backward pass to save memory (true), or only
    the cheap ones ("selective": the outputs of matrix products and attention are kept, norms,
    activation functions and elementwise operations recomputed, as torchtitan's op-level mode:
    most of the memory for a few percent of the time)."""
    activation_checkpointing_every: int = 1
    """With train.activation_checkpointing: checkpoint every N-th block only (1: every block);
    the others keep their activations, trading memory back for time."""
    log_every: int = 10
    """Log metrics every N steps (the only points where the loop waits for the device)."""
    time_budget: str = ""
    """Wall-clock limit of the training loop, e.g. "300s", "5m", "1h30m" (empty: five minutes
    with max_steps = "auto", none with a number of steps). The run stops at the step boundary
    that would cross it, then evaluates and checkpoints; running the same command again resumes
    and trains for another budget. The schedule follows max_steps: "auto" fits it to the budget."""

    def errors(self) -> list[str]:
        if self.chooses_batch:
            return self._auto_batch_errors() + self._common_errors()
        micro, batch = self.micro_batch_size, self.global_batch(1)
        # Divisibility means something only once both sizes are valid; the other checks report them if not.
        whole = micro == "auto" or micro < 1 or batch < 1 or batch % micro == 0
        errors = _failed(
            (batch >= 1, f"train.global_batch_size: must be >= 1, got {batch}"),
            (
                whole,
                (
                    f"train.global_batch_size: {batch} is not a multiple of train.micro_batch_size {micro}; "
                    "accumulation steps must be a whole number"
                ),
            ),
        )
        return errors + self._ramp_errors() + self._common_errors()

    def _auto_batch_errors(self) -> list[str]:
        micro = self.micro_batch_size
        why = "the batch is chosen from the budget's tokens"
        return _failed(
            (micro != "auto", f"train.global_batch_size: auto needs a number for train.micro_batch_size ({why})"),
            (
                not self.batch_ramp_start,
                "train.global_batch_size: auto chooses one batch size; set train.batch_ramp_start = 0",
            ),
        )

    def _common_errors(self) -> list[str]:
        micro = self.micro_batch_size
        errors = _failed(
            (micro == "auto" or micro >= 1, f"train.micro_batch_size: must be >= 1 or auto, got {micro}"),
            (
                self.max_steps == "auto" or self.max_steps >= 1,
                f"train.max_steps: must be >= 1 or auto, got {self.max_steps}",
            ),
            (self.muon_lr > 0, f"train.muon_lr: must be > 0, got {self.muon_lr}"),
            (0 <= self.muon_momentum < 1, f"train.muon_momentum: must be in [0, 1), got {self.muon_momentum}"),
            (self.lr > 0, f"train.lr: must be > 0, got {self.lr}"),
            (0 <= self.min_lr_ratio <= 1, f"train.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}"),
            (self.warmup_steps >= 0, f"train.warmup_steps: must be >= 0, got {self.warmup_steps}"),
            (0 < self.decay_fraction <= 1, f"train.decay_fraction: must be in (0, 1], got {self.decay_fraction}"),
            (self.weight_decay >= 0, f"train.weight_decay: must be >= 0, got {self.weight_decay}"),
            (0 <= self.beta1 < 1, f"train.beta1: must be in [0, 1), got {self.beta1}"),
            (0 <= self.beta2 < 1, f"train.beta2: must be in [0, 1), got {self.beta2}"),
            (self.eps > 0, f"train.eps: must be > 0, got {self.eps}"),
            (self.grad_clip >= 0, f"train.grad_clip: must be >= 0 (0 is off), got {self.grad_clip}"),
            (self.seed >= 0, f"train.seed: must be >= 0, got {self.seed}"),
            (self.log_every >= 1, f"train.log_every: must be >= 1, got {self.log_every}"),
            (self.compile_after >= 0, f"train.compile_after: must be >= 0, got {self.compile_after}"),
            (
                self.activation_checkpointing_every >= 1,
                f"train.activation_checkpointing_every: must be >= 1, got {self.activation_checkpointing_every}",
            ),
            (
                not self.compile_after or self.compile is not False,
                f"train.compile_after: {self.compile_after} steps before compiling, but train.compile is false",
            ),
            (
                not self.compile_after or self.max_steps != "auto" or self.schedule in ("wsd", "constant"),
                f"train.compile_after: with max_steps = auto the time plan must time the compiled steps, which "
                f"only the wsd and constant schedules let it do; train.schedule is {self.schedule}: set "
                "train.compile_after=0 (compile before the plan times the steps)",
            ),
        )
        if self.time_budget:
            try:
                if parse_duration(self.time_budget) <= 0:
                    errors.append(f"train.time_budget: must be more than 0, got {self.time_budget!r}")
            except ValueError:
                errors.append(f"train.time_budget: {self.time_budget!r} is not a duration; use e.g. 300s, 5m, 1h30m")
        return errors

    @property
    def budget(self) -> str:
        """The time budget in force: train.time_budget, or the default plan's five minutes."""
        return self.time_budget or (DEFAULT_BUDGET if self.max_steps == "auto" else "")

    def compile_resolved(self, job: str, pp: int) -> TrainConfig:
        """This config with ``compile = "auto"`` made concrete for a run of ``job`` (see compile)."""
        if self.compile != "auto":
            return self
        planned = self.max_steps == "auto" and self.schedule in ("wsd", "constant")
        long = planned and parse_duration(self.budget) >= AUTO_COMPILE_MIN_S
        if not (long and job == "lm" and pp == 1):
            return dataclasses.replace(self, compile=False, compile_after=0)
        return dataclasses.replace(self, compile=True, compile_after=self.compile_after or AUTO_COMPILE_AFTER)

    @property
    def chooses_batch(self) -> bool:
        """Whether the run chooses its global batch from its time budget (see global_batch_size)."""
        return self.global_batch_size == "auto" and self.max_steps == "auto"

    def global_batch(self, data_ranks: int) -> int:
        """Sequences per step: global_batch_size; for "auto" with a number of steps, 32; for one
        the run chooses, until it has, one micro-batch on each of the ``data_ranks`` ranks that
        read different batches."""
        if self.global_batch_size != "auto":
            return self.global_batch_size
        return self.nominal_micro_batch * data_ranks if self.chooses_batch else FIXED_STEPS_BATCH

    @property
    def nominal_micro_batch(self) -> int:
        """The micro-batch size, or 8 for "auto" where the size the run found is not at hand
        (its fixed validation sample, evaluating a saved run, the doctor's checks)."""
        return 8 if self.micro_batch_size == "auto" else self.micro_batch_size

    def _ramp_errors(self) -> list[str]:
        if self.batch_ramp_start == 0:
            unused = [k for k in ("batch_ramp_increment", "batch_ramp_steps", "batch_ramp_tokens") if getattr(self, k)]
            return [f"train.{k}: set, but the ramp is off; set train.batch_ramp_start too" for k in unused]
        start, end = self.batch_ramp_start, self.global_batch(1)
        inc = self.batch_ramp_increment or start
        if start < 0 or inc < 0:
            got = f"{start} / {self.batch_ramp_increment}"
            return [f"train.batch_ramp_start / batch_ramp_increment: must be >= 0, got {got}"]
        errors = []
        if not 0 < start < end:
            errors.append(f"train.batch_ramp_start: {start} must be below train.global_batch_size {end}")
        elif (end - start) % inc:
            errors.append(
                f"train.batch_ramp_increment: {inc} does not divide train.global_batch_size - "
                f"train.batch_ramp_start = {end - start}; the ramp must end on global_batch_size"
            )
        micro = self.micro_batch_size
        if micro != "auto" and micro >= 1:
            errors += [
                f"train.{k}: {v} is not a multiple of train.micro_batch_size {micro}"
                for k, v in (("batch_ramp_start", start), ("batch_ramp_increment", inc))
                if v % micro
            ]
        steps, tokens = self.batch_ramp_steps, self.batch_ramp_tokens
        if (steps > 0) == (tokens > 0) or min(steps, tokens) < 0:
            errors.append(
                "train.batch_ramp_steps / train.batch_ramp_tokens: set exactly one of them to a positive "
                f"length, got {steps} / {tokens}"
            )
        return errors


@dataclass(frozen=True)
class EvalConfig:
    every: int = 350
    """Evaluate every N steps (and at the end); 0 only at the end."""
    batches: int = 8
    """Validation micro-batches per evaluation (a fixed sample, the same each time)."""
    sample_tokens: int = 64
    """Tokens to generate as a sample at each evaluation; 0 turns samples off."""
    prompt: str = "def "
    """Prompt for the generated sample."""
    tasks: tuple[str, ...] = ()
    """lm-evaluation-harness tasks scored during training (needs kiln[eval]), logged as
    tasks/<task>/<metric>; e.g. ["hellaswag", "my_task"]. Their data must be on this machine."""
    tasks_every: int = 0
    """Score eval.tasks every N steps (and at the end); 0 only at the end."""
    tasks_limit: int = 0
    """At most this many documents of each task at each scoring; 0 all of them."""
    tasks_include: str = ""
    """A directory of lm-eval task YAML files, beside lm-eval's own tasks (whose thousands of
    files are indexed only when a task asked for is not in this directory)."""

    def errors(self) -> list[str]:
        return _failed(
            (self.every >= 0, f"eval.every: must be >= 0 (0 evaluates only at the end), got {self.every}"),
            (self.batches >= 1, f"eval.batches: must be >= 1, got {self.batches}"),
            (self.sample_tokens >= 0, f"eval.sample_tokens: must be >= 0, got {self.sample_tokens}"),
            (
                self.tasks_every >= 0,
                f"eval.tasks_every: must be >= 0 (0 scores only at the end), got {self.tasks_every}",
            ),
            (self.tasks_limit >= 0, f"eval.tasks_limit: must be >= 0 (0 is every document), got {self.tasks_limit}"),
            (all(t.strip() for t in self.tasks), f"eval.tasks: a task name is empty in {list(self.tasks)}"),
        )


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 350
    """Save a checkpoint every N steps (and at the end); 0 only at the end."""
    keep: int = 2
    """Complete checkpoints to keep; older ones are deleted."""
    resume: str = "auto"
    """'auto' resumes from the newest complete checkpoint in run.dir if there is one, 'never'
    starts fresh (refusing a run.dir that already has checkpoints), or a checkpoint path."""
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint's async_save): training
    goes on once the state is copied to host memory. A checkpoint counts only once fully written,
    so a kill during the write leaves the previous one as the newest."""

    def errors(self) -> list[str]:
        return _failed(
            (self.every >= 0, f"checkpoint.every: must be >= 0 (0 saves only at the end), got {self.every}"),
            (self.keep >= 1, f"checkpoint.keep: must be >= 1, got {self.keep}"),
        )


@dataclass(frozen=True)
class ParallelConfig:
    strategy: Literal["ddp", "fsdp", "fsdp_grad_op"] = "ddp"
    """How data-parallel ranks share the model when the world size is above 1: ddp (replicas,
    gradients all-reduced), fsdp (FSDP2, parameters, gradients and optimizer state sharded, like
    ZeRO-3) or fsdp_grad_op (as fsdp, but parameters stay gathered from forward to backward, like
    ZeRO-2: less communication, more memory). Ignored in a single process unless
    parallel.cpu_offload is on."""
    dp_replicate: int = 1
    """HSDP: with fsdp or fsdp_grad_op, the data-parallel ranks form this many replicas, each
    sharding the model over its own ranks (FSDP within a node, replicas across nodes: gathers
    stay on the fast links, and only gradients cross between replicas). It must divide the
    data-parallel ranks (over parallel.cp); 1 is plain FSDP over every data-parallel rank."""
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
    pp: int = 1
    """Pipeline-parallel degree: the model's layers are split into this many consecutive stages,
    one group of ranks each (the embedding goes with the first, the final norm, output layer and
    loss with the last). The world is pp x dp x tp ranks."""
    ep: int = 1
    """Expert-parallel degree, for a mixture of experts: each MoE layer's experts are split over
    this many data-parallel ranks, which exchange their tokens with an all-to-all (it must divide
    the data-parallel ranks and model.n_experts; needs fsdp or fsdp_grad_op). The other
    data-parallel ranks, dp / ep, shard each rank's experts with FSDP."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many data-parallel ranks, which
    hold its tokens in 2 x cp chunks (rank r the r-th and the r-th from the end, so that causal
    attention costs each the same) and gather each layer's keys and values from one another. The
    activations of a rank are those of seq_len / cp tokens; the loss is the whole sequence's. It
    must divide the data-parallel ranks, and 2 x cp must divide data.seq_len; kiln's GPT and
    Llama-class Hugging Face models, in pipeline stages too. With parallel.ep, the experts are split over the
    context-parallel ranks and more (ep a multiple of cp)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    """How the pipeline orders its micro-batches: gpipe (all forwards, then all backwards: the
    most activation memory), 1f1b (one forward, one backward: at most pp micro-batches in flight)
    or interleaved_1f1b (1f1b over parallel.pp_virtual_stages stages per rank: a smaller bubble,
    more communication)."""
    pp_microbatches: int = 0
    """Pipeline micro-batches each micro-batch of train.micro_batch_size sequences is cut into
    (it must divide the micro-batch); at least as many as the pipeline's stages. 0 means as many
    as the stages (parallel.pp x parallel.pp_virtual_stages). More of them shrink the bubble."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank: 2 or more with interleaved_1f1b (rank r holds stages r, r + pp,
    ...), 1 with the other schedules."""
    pp_layers: tuple[int, ...] = ()
    """The model's repeated layers in each pipeline stage, first to last, e.g. [3, 4, 4, 3]: the
    first and last stages lighter, as they also hold the embedding and the output layer (Llama 3
    405B's 126 layers in 8 stages, as torchtitan splits them); one number per stage (parallel.pp x
    parallel.pp_virtual_stages), each at least 1, summing to the model's layers. Empty: equal stages."""
    init_timeout: str = "10m"
    """How long a collective may wait while the process group starts and the model is set up
    (loading, first compile), and during evaluations and checkpoint saves, before the watchdog
    declares the job hung (a duration: 600, 10m)."""
    train_timeout: str = "5m"
    """How long a collective may wait once the first step is done; shorter than init_timeout, so
    a rank stuck in training is found quickly. The watchdog then dumps every rank's stacks into
    RUN_DIR/hang/, names the rank that did not arrive and exits non-zero (kiln launch
    --max-restarts restarts from the last checkpoint)."""

    def errors(self) -> list[str]:
        errors = _failed(
            (self.tp >= 1, f"parallel.tp: must be >= 1, got {self.tp}"),
            (self.dp_replicate >= 1, f"parallel.dp_replicate: must be >= 1, got {self.dp_replicate}"),
            (
                self.dp_replicate == 1 or self.strategy != "ddp",
                "parallel.dp_replicate: replicas of FSDP's shards (HSDP) need parallel.strategy fsdp or "
                "fsdp_grad_op; under ddp every data-parallel rank is a replica already",
            ),
            (self.bucket_mb >= 1, f"parallel.bucket_mb: must be >= 1, got {self.bucket_mb}"),
            (self.pp >= 1, f"parallel.pp: must be >= 1, got {self.pp}"),
            (self.ep >= 1, f"parallel.ep: must be >= 1, got {self.ep}"),
            (self.cp >= 1, f"parallel.cp: must be >= 1, got {self.cp}"),
            (
                self.cp == 1 or self.ep == 1 or self.ep % self.cp == 0,
                f"parallel.ep: with parallel.cp = {self.cp} the experts are split over the context-parallel ranks "
                f"and, beyond them, over more data-parallel ranks: parallel.ep must be a multiple of {self.cp}",
            ),
            (
                self.pp_microbatches >= 0,
                f"parallel.pp_microbatches: must be >= 0 (0: one per stage), got {self.pp_microbatches}",
            ),
            (self.pp_virtual_stages >= 1, f"parallel.pp_virtual_stages: must be >= 1, got {self.pp_virtual_stages}"),
            (
                self.pp_virtual_stages == 1 or self.pp_schedule == "interleaved_1f1b",
                f"parallel.pp_virtual_stages: {self.pp_virtual_stages} stages per rank need "
                "parallel.pp_schedule=interleaved_1f1b",
            ),
            (
                self.pp_schedule != "interleaved_1f1b" or self.pp == 1 or self.pp_virtual_stages >= 2,
                "parallel.pp_schedule: interleaved_1f1b needs parallel.pp_virtual_stages >= 2",
            ),
            (
                not self.pp_layers or (len(self.pp_layers) == self.pp_stages and min(self.pp_layers) >= 1),
                f"parallel.pp_layers: {list(self.pp_layers)} must give each of the pipeline's {self.pp_stages} "
                "stages (parallel.pp x parallel.pp_virtual_stages) one or more layers",
            ),
            (
                self.pp_microbatches == 0 or self.pp_microbatches >= self.pp_stages,
                f"parallel.pp_microbatches: {self.pp_microbatches} is fewer than the pipeline's "
                f"{self.pp_stages} stages (parallel.pp x parallel.pp_virtual_stages); every stage needs one",
            ),
        )
        for key in ("init_timeout", "train_timeout"):
            try:
                if parse_duration(getattr(self, key)) <= 0:
                    errors.append(f"parallel.{key}: must be above 0, got {getattr(self, key)!r}")
            except ValueError as e:
                errors.append(f"parallel.{key}: {e} (write e.g. 300, 90s or 10m)")
        return errors

    @property
    def pp_stages(self) -> int:
        """Stages of the whole pipeline."""
        return self.pp * self.pp_virtual_stages

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per micro-batch (``pp_microbatches``, or one per stage)."""
        return self.pp_microbatches or self.pp_stages


@dataclass(frozen=True)
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

    def errors(self) -> list[str]:
        return _failed(
            (
                self.max_bad_steps >= 0,
                f"guard.max_bad_steps: must be >= 0 (0 turns rollback off), got {self.max_bad_steps}",
            ),
            (0 < self.lr_factor <= 1, f"guard.lr_factor: must be in (0, 1], got {self.lr_factor}"),
            (self.max_rollbacks >= 0, f"guard.max_rollbacks: must be >= 0, got {self.max_rollbacks}"),
            (self.spike_threshold >= 0, f"guard.spike_threshold: must be >= 0 (0 is off), got {self.spike_threshold}"),
        )


@dataclass(frozen=True)
class ObserveConfig:
    histograms_every: int = 0
    """Write weight and gradient histograms to TensorBoard every N steps; 0 is off."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package; WANDB_MODE=offline logs without a network)."""
    wandb_project: str = "kiln"
    """Weights & Biases project name."""
    straggler_factor: float = 1.5
    """A data-parallel run logs a straggler event when one rank's step time exceeds the median
    rank's by this factor for observe.straggler_intervals log intervals in a row; 0 is off."""
    straggler_intervals: int = 3
    """Log intervals in a row a rank must be slow before it is named a straggler."""

    def errors(self) -> list[str]:
        return _failed(
            (self.histograms_every >= 0, f"observe.histograms_every: must be >= 0, got {self.histograms_every}"),
            (
                self.straggler_factor == 0 or self.straggler_factor > 1,
                f"observe.straggler_factor: must be above 1 (or 0: off), got {self.straggler_factor}",
            ),
            (
                self.straggler_intervals >= 1,
                f"observe.straggler_intervals: must be >= 1, got {self.straggler_intervals}",
            ),
        )


@dataclass(frozen=True)
class ProfileConfig:
    steps: str = ""
    """Optimizer steps to profile with torch.profiler, as START:END (1-based, inclusive), e.g. 5:8;
    empty is off. The trace goes to profile.dir (TensorBoard, Perfetto or chrome://tracing)."""
    dir: str = ""
    """Where the trace and breakdown.json are written; empty means RUN_DIR/profile."""

    def errors(self) -> list[str]:
        if self.steps:
            try:
                parse_step_range(self.steps)
            except ValueError as e:
                return [f"profile.steps: {e}"]
        return []


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r (needs the peft package: pip install 'kiln[hf]'): only low-rank adapters of the
    target modules train, the base model stays frozen; 0 is off (every weight trains). With
    train.precision bf16 or fp16 the frozen base is stored in that dtype (half the bytes of fp32,
    and in checkpoints; sharded under FSDP), and the adapters keep fp32 master weights. Under
    tensor parallelism each adapter splits with its layer: a column-split layer's B by columns, a
    row-split layer's A by rows, the other factor whole on every rank."""
    alpha: float = 16.0
    """LoRA scaling alpha (the adapter's update is scaled by alpha / rank)."""
    dropout: float = 0.05
    """Dropout on the adapters' input."""
    target_modules: str = ""
    """Comma-separated module names to adapt (e.g. q_proj,v_proj); empty uses the model family's
    default (the attention and MLP projections of Llama-class models, query/key/value of BERT)."""
    quantize_base: Literal["none", "nf4"] = "none"
    """QLoRA: nf4 stores the frozen weight of every adapted linear layer in 4 bits (NormalFloat4
    with double-quantized block scales, torchao's NF4Tensor: about 0.52 bytes a weight instead of
    4 in fp32; needs torchao), dequantized on the fly in each forward; the adapters train in the
    run's precision. Needs lora.rank. Works in one process, with DDP, with pipeline stages and
    sharded by FSDP (parallel.cpu_offload too): each FSDP rank keeps its own rows of every 4-bit
    weight, so a weight's groups of NF4 scales (256 blocks of 64 weights each, fewer in a small
    layer) must divide evenly among the ranks; an error names any layer whose groups do not."""

    def errors(self) -> list[str]:
        return _failed(
            (self.rank >= 0, f"lora.rank: must be >= 0 (0 is off), got {self.rank}"),
            (self.alpha > 0, f"lora.alpha: must be > 0, got {self.alpha}"),
            (0 <= self.dropout < 1, f"lora.dropout: must be in [0, 1), got {self.dropout}"),
            (
                self.quantize_base == "none" or self.rank > 0,
                f"lora.quantize_base: {self.quantize_base} quantizes the frozen base of a LoRA run; set lora.rank too",
            ),
        )


@dataclass(frozen=True)
class PreferenceConfig:
    beta: float = 0.1
    """dpo: the strength of the pull towards the reference model (the rewards are beta times the
    log-ratio to it); ipo: its regularisation tau (the margin aimed for is 1 / (2 beta)); simpo:
    the reward scale (the paper uses 2-2.5); orpo: the weight lambda of the odds-ratio term
    (the paper's 0.1 is TRL's default)."""
    loss_type: Literal["sigmoid", "hinge", "robust"] = "sigmoid"
    """dpo's loss of the reward margin m: sigmoid (-log sigmoid(m), the paper's; with
    label_smoothing, conservative DPO), hinge (relu(1 - m), SLiC) or robust (Chowdhury et al.
    2024: unbiased for preferences flipped with probability label_smoothing)."""
    label_smoothing: float = 0.0
    """dpo and simpo: the probability that a pair's preference is flipped, in [0, 0.5)."""
    gamma: float = 0.5
    """simpo: the target reward margin over beta (TRL's simpo_gamma)."""
    desirable_weight: float = 1.0
    """kto: the weight of a desirable answer's loss (raise it when they are fewer: the paper
    keeps desirable_weight x desirables / (undesirable_weight x undesirables) in [1, 4/3])."""
    undesirable_weight: float = 1.0
    """kto: the weight of an undesirable answer's loss."""
    precompute_reference: bool = True
    """dpo and ipo without LoRA: the reference model's log-probabilities of every train and val
    pair, computed with the initial model once before the first step (on every rank, in the
    run's layout) and kept in the run directory (reference_logps.pt) for resuming, so no second
    copy of the model is held. With LoRA the reference is the same model with its adapters off."""

    def errors(self) -> list[str]:
        return _failed(
            (self.beta > 0, f"preference.beta: must be > 0, got {self.beta}"),
            (
                0 <= self.label_smoothing < 0.5,
                f"preference.label_smoothing: must be in [0, 0.5), got {self.label_smoothing}",
            ),
            (self.gamma >= 0, f"preference.gamma: must be >= 0, got {self.gamma}"),
            (self.desirable_weight > 0, f"preference.desirable_weight: must be > 0, got {self.desirable_weight}"),
            (self.undesirable_weight > 0, f"preference.undesirable_weight: must be > 0, got {self.undesirable_weight}"),
        )


@dataclass(frozen=True)
class GRPOConfig:
    reward: str = ""
    """The reward function, "package.module:function" (importable where kiln runs): called as
    TRL calls one, function(prompts=[...], completions=[...], **fields), each field a list of the
    records' other values (e.g. answer=[...]), one entry per completion; returns a float per
    completion (None counts as 0). Several: grpo.rewards."""
    rewards: tuple[str, ...] = ()
    """Several reward functions (each as grpo.reward says, instead of it), their weighted sum the
    reward, each logged as rewards/<function>/mean and std, as TRL logs them."""
    reward_weights: tuple[float, ...] = ()
    """A weight for each of grpo.rewards (then grpo.reward_model, if set), in order; empty: 1 each."""
    reward_model: str = ""
    """A sequence classifier in transformers' format (a kiln classification run exported with
    kiln export RUN --format hf, or any such directory) that scores each prompt + completion: its
    probability of grpo.reward_label is a reward (alone, or beside grpo.reward's or
    grpo.rewards', weighed by grpo.reward_weights)."""
    reward_label: str = ""
    """The class of grpo.reward_model whose probability is the reward; empty: its last class."""
    group_size: int = 8
    """Completions sampled for each prompt; each one's advantage is its reward against its
    group's (minus the group's mean, over its standard deviation with grpo.scale_rewards)."""
    max_new_tokens: int = 64
    """The longest completion sampled; one that reaches it without ending is cut there."""
    temperature: float = 1.0
    """Sampling temperature of the completions."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probabilities reach top_p."""
    kl_coef: float = 0.0
    """Weight of the per-token KL estimate (Schulman's k3) to the reference model, which is the
    model with its LoRA adapters off (so a kl_coef > 0 needs lora.rank); 0 (TRL's default) leaves
    the reference out."""
    scale_rewards: bool = True
    """Divide each advantage by its group's reward standard deviation (GRPO's); false leaves the
    rewards unscaled, as Dr. GRPO does."""
    loss: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = "grpo"
    """How token losses become the loss. grpo: each completion's mean, then their mean (Shao et al.
    2024); dr_grpo: each completion's sum over grpo.max_new_tokens, then their mean, with no bias
    towards long wrong answers (Liu et al. 2025, who also leave grpo.scale_rewards off); dapo: the
    mean over every completion token of the global batch, whatever the accumulation and ranks,
    so long completions weigh by their length (Yu et al. 2025); bnpo: each micro-batch's mean over
    its tokens, then the micro-batches' mean, weighed by their completions (TRL's bnpo)."""
    iterations: int = 1
    """Optimizer steps trained on each batch's sampled completions (TRL's num_iterations): the
    batch's prompts are sampled at the first and serve the next iterations - 1 steps too (none is
    skipped), where the loss's ratio to the sampling policy moves off 1 and grpo.epsilon clips
    it. 1 (the default) samples at every step: on-policy, the ratio always 1."""
    epsilon: float = 0.2
    """The clip of the ratio of a token's probability to the sampling policy's: below 1 - epsilon
    and above 1 + epsilon (grpo.epsilon_high, if set) it gives no gradient where the advantage
    would push it further (PPO's clipped surrogate; TRL's epsilon). It matters only with
    grpo.iterations > 1."""
    epsilon_high: float = 0.0
    """The upper clip of the ratio, above grpo.epsilon's (DAPO's clip-higher, Yu et al. 2025, who
    use 0.28 with epsilon 0.2: more room to raise unlikely tokens; TRL's epsilon_high); 0 means
    grpo.epsilon."""
    rollout: Literal["kiln", "vllm"] = "kiln"
    """Who samples the completions: kiln's own batched decoder (kiln.models.decode), under every
    layout GRPO runs in. vllm (a colocated vLLM engine given the policy's weights after each step,
    as TRL's colocate mode) is an interface documented in docs/preference.md, not built: vLLM pins
    its own CUDA build of torch, which cannot be installed beside the torch kiln is tested with."""

    def errors(self) -> list[str]:
        rewards = len(self.rewards) + bool(self.reward) + bool(self.reward_model)
        return _failed(
            (
                self.group_size >= 2,
                f"grpo.group_size: must be >= 2 (a group's rewards are compared), got {self.group_size}",
            ),
            (self.max_new_tokens >= 1, f"grpo.max_new_tokens: must be >= 1, got {self.max_new_tokens}"),
            (self.temperature > 0, f"grpo.temperature: must be > 0 (completions are sampled), got {self.temperature}"),
            (0 < self.top_p <= 1, f"grpo.top_p: must be in (0, 1], got {self.top_p}"),
            (self.kl_coef >= 0, f"grpo.kl_coef: must be >= 0, got {self.kl_coef}"),
            (self.iterations >= 1, f"grpo.iterations: must be >= 1, got {self.iterations}"),
            (
                self.rollout != "vllm",
                "grpo.rollout: 'vllm' is documented, not built: vLLM pins its own CUDA build of torch (vLLM "
                "0.34: torch 2.14), which cannot be installed beside the torch kiln is tested with; 'kiln' (the "
                "default) samples with kiln's batched decoder (docs/preference.md, 'Sampling with vLLM')",
            ),
            (0 < self.epsilon < 1, f"grpo.epsilon: must be in (0, 1), got {self.epsilon}"),
            (
                self.epsilon_high == 0 or self.epsilon_high >= self.epsilon,
                f"grpo.epsilon_high: must be 0 (grpo.epsilon's) or >= grpo.epsilon = {self.epsilon}, got "
                f"{self.epsilon_high}",
            ),
            (
                not (self.reward and self.rewards),
                "grpo.rewards: set grpo.reward (one function) or grpo.rewards (several), not both",
            ),
            (
                not self.reward_weights or len(self.reward_weights) == rewards,
                f"grpo.reward_weights: {len(self.reward_weights)} weights for {rewards} rewards (grpo.reward or "
                "grpo.rewards, then grpo.reward_model)",
            ),
        )


@dataclass(frozen=True)
class DebugConfig:
    """Test-only fault injection (``kiln.train.faults``): every fault is off by default, and a
    real run never sets one."""

    oom_above: int = -1
    """Fake a CUDA out-of-memory error in any micro-batch of more than N sequences (0: every one);
    -1 is off."""
    oom_from_step: int = 0
    """Fake out-of-memory errors only once this many optimizer steps are done."""
    oom_unless_checkpointing: bool = False
    """Activation checkpointing makes any micro-batch fit (no fake out-of-memory error with it)."""
    nan_steps: str = ""
    """Steps (1-based, as logged, comma-separated: "7,8,9") whose forward pass goes NaN, until a
    rollback passes over them (as if the lower learning rate had cured them); empty is off."""
    nan_persist: bool = False
    """The steps of debug.nan_steps go NaN every time, rollbacks or not."""
    nan_module: str = ""
    """The module whose output debug.nan_steps poisons; empty: blocks.1.mlp, or the whole model if
    it has no such module."""
    slow_save_seconds: float = 0.0
    """Every checkpoint write pauses this long before the main rank writes its files (in the
    background with checkpoint.async_save, while training goes on)."""
    disk_full_save: int = 0
    """The N-th checkpoint write of the process (1-based) fails as on a full disk (ENOSPC) as the
    main rank starts writing its files; 0 is off."""
    hang_rank: int = 0
    """The rank that hangs at debug.hang_step."""
    hang_step: int = 0
    """Rank debug.hang_rank stops for good before this step's forward pass, as a rank stuck outside a
    collective would, in the first attempt only (a group kiln launch --max-restarts restarted runs
    on); 0 is off."""
    slow_prepare_seconds: float = 0.0
    """Rank 0's share of the tokenization takes this much longer (a large corpus), while the other ranks wait."""
    slow_rank: int = 0
    """The rank that debug.slow_seconds slows down."""
    slow_seconds: float = 0.0
    """Each forward pass of rank debug.slow_rank takes this much longer (a straggler); 0 is off."""

    def errors(self) -> list[str]:
        return _failed(
            (self.oom_above >= -1, f"debug.oom_above: must be >= 0, or -1 (off), got {self.oom_above}"),
            (self.oom_from_step >= 0, f"debug.oom_from_step: must be >= 0, got {self.oom_from_step}"),
            (
                all(s.strip().isdigit() and int(s) >= 1 for s in self.nan_steps.split(",")) or not self.nan_steps,
                f"debug.nan_steps: {self.nan_steps!r} is not a comma-separated list of steps >= 1, e.g. 7,8,9",
            ),
            (self.slow_save_seconds >= 0, f"debug.slow_save_seconds: must be >= 0, got {self.slow_save_seconds}"),
            (self.disk_full_save >= 0, f"debug.disk_full_save: must be >= 0, got {self.disk_full_save}"),
            (self.hang_rank >= 0, f"debug.hang_rank: must be >= 0, got {self.hang_rank}"),
            (self.hang_step >= 0, f"debug.hang_step: must be >= 0 (0 is off), got {self.hang_step}"),
            (self.slow_rank >= 0, f"debug.slow_rank: must be >= 0, got {self.slow_rank}"),
            (self.slow_seconds >= 0, f"debug.slow_seconds: must be >= 0, got {self.slow_seconds}"),
        )

    @property
    def nan_step_set(self) -> frozenset[int]:
        return frozenset(int(s) for s in self.nan_steps.split(",") if s.strip())


@dataclass(frozen=True)
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
    lora: LoraConfig = field(default_factory=LoraConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def grad_accum_steps(self, data_parallel: int = 1) -> int:
        """Micro-batches per rank per optimizer step (at the full global batch, with a fixed micro-batch)."""
        if self.train.micro_batch_size == "auto":
            raise ValueError("train.micro_batch_size is 'auto': the accumulation is known only once it is probed")
        return self.train.global_batch(data_parallel) // (self.train.micro_batch_size * data_parallel)

    def errors(self) -> list[str]:
        """Every problem in every section, then the combinations of sections that cannot work."""
        # The order validate() has always reported them in, so that what users see does not reshuffle.
        order = (
            self.model,
            self.train,
            self.data,
            self.eval,
            self.checkpoint,
            self.parallel,
            self.guard,
            self.observe,
            self.profile,
            self.run,
            self.lora,
            self.preference,
            self.grpo,
            self.debug,
        )
        pp, cp, micro = self.parallel.pp, self.parallel.cp, self.train.micro_batch_size
        # What a pipeline cuts into pieces: a micro-batch's rows (GRPO's: each prompt's completions).
        group = self.grpo.group_size if self.run.job == "grpo" else 1
        rows = micro * group if isinstance(micro, int) else 0
        pieces = (
            f"train.micro_batch_size={micro} prompts' grpo.group_size={group} completions ({rows} rows)"
            if group > 1
            else f"train.micro_batch_size={micro} sequences"
        )
        combinations = [
            (
                not self.data.mix or self.data.format != "records",
                "data.mix: a mixture is of text corpora; fine-tuning records (data.format=records) come from "
                "data.source",
            ),
            (
                not self.data.mix or not self.data.val_source,
                "data.val_source: with data.mix each source is split into train and val itself; leave it empty",
            ),
            (
                cp == 1 or self.data.seq_len % (2 * cp) == 0,
                f"parallel.cp: each sequence is cut into 2 x parallel.cp = {2 * cp} equal chunks, so it must divide "
                f"data.seq_len={self.data.seq_len}",
            ),
            (
                not self.data.document_mask or self.data.format != "records",
                "data.document_mask: masks the documents of a text corpus; fine-tuning records are kept apart "
                "by data.packing",
            ),
            (
                cp == 1 or micro != "auto",
                "train.micro_batch_size: auto is not probed under context parallelism (parallel.cp > 1), whose "
                "forward passes wait for one another; give a number",
            ),
            (
                # Rows of records are padded to whole shares in each forward, but to data.seq_len
                # in a pipeline (its stages exchange one shape).
                self.parallel.tp == 1
                or (bool(self.model.source) and self.parallel.pp == 1)
                or self.data.seq_len % (self.parallel.tp * (2 * cp if cp > 1 else 1)) == 0,
                f"parallel.tp: sequence parallelism splits the positions of each sequence (of each of its 2 x "
                f"parallel.cp chunks) over the parallel.tp = {self.parallel.tp} ranks, so {self.parallel.tp} x "
                f"{2 * cp if cp > 1 else 1} must divide data.seq_len={self.data.seq_len}",
            ),
            (
                self.lora.quantize_base == "none" or self.parallel.tp == 1,
                f"lora.quantize_base: {self.lora.quantize_base} packs the frozen base in blocks that tensor-parallel "
                "ranks cannot split by rows or columns; shard it with parallel.strategy=fsdp, or set parallel.tp=1",
            ),
            (
                pp == 1 or micro != "auto",
                "train.micro_batch_size: auto is not probed under pipeline parallelism (parallel.pp > 1); give a "
                "number that parallel.pp_microbatches divides",
            ),
            (
                pp == 1 or micro == "auto" or rows % self.parallel.microbatches == 0,
                f"parallel.pp_microbatches: each micro-batch of {pieces} is cut into "
                f"{self.parallel.microbatches} pipeline micro-batches, which must divide it",
            ),
            (
                self.train.precision != "fp8" or not self.lora.rank,
                "train.precision: fp8 trains full linear layers; LoRA adapters (lora.rank) train in bf16",
            ),
            (
                self.run.job != "grpo" or bool(self.grpo.reward or self.grpo.rewards or self.grpo.reward_model),
                "grpo.reward: grpo needs a reward: a function (grpo.reward = package.module:function, or several in "
                "grpo.rewards) or a sequence classifier (grpo.reward_model = DIR), or both",
            ),
            (
                self.run.job != "grpo" or not self.grpo.kl_coef or self.lora.rank,
                "grpo.kl_coef: the KL term's reference is the model with its LoRA adapters off; set lora.rank, or "
                "grpo.kl_coef=0",
            ),
            (
                self.run.job != "grpo" or self.grpo.iterations == 1 or not self.train.batch_ramp_start,
                "grpo.iterations: a batch of prompts serves grpo.iterations steps, which a batch ramp "
                "(train.batch_ramp_start) would resize in between; set one or the other",
            ),
            (
                self.run.job != "grpo" or self.train.compile is not True,
                "run.job: grpo is not compiled yet (its rollout decodes completions of every length); set "
                "train.compile=false",
            ),
        ]
        return [message for section in order for message in section.errors()] + [
            message for ok, message in combinations if not ok
        ]

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
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_toml_value, value)) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # a JSON string is a valid TOML basic string
