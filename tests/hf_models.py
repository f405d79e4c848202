"""Tiny Hugging Face models made locally from configs (``save_pretrained`` into a directory), with
real tokenizers trained here: nothing is downloaded."""

from __future__ import annotations

import random
import sysconfig
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AlbertConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    DebertaV2Config,
    DistilBertConfig,
    ElectraConfig,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MixtralConfig,
    MixtralForCausalLM,
    ModernBertConfig,
    MPNetConfig,
    Olmo2Config,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    RobertaConfig,
    XLMRobertaConfig,
)

# A chat template that marks what the assistant says with {% generation %}, and one that does not.
CHAT_MARKED = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT_PLAIN = CHAT_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def _texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(errors="replace")[:4000] for p in sorted(stdlib.glob("*.py"))[:30]]


def bpe_tokenizer(directory: Path, vocab_size: int = 300, chat_template: str | None = CHAT_MARKED):
    """A byte-level BPE with <s>, </s>, <pad> and the chat roles as special tokens."""
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _texts(),
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return fast


def wordpiece_tokenizer(directory: Path, vocab_size: int = 400):
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    # The vocabulary is counted here rather than by tokenizers' WordPieceTrainer, whose choice
    # among equally frequent words changes from run to run (and a classifier's accuracy with it).
    pre = pre_tokenizers.BertPreTokenizer()
    # The texts of the classification tests are in it too, as a pretrained tokenizer's words would be.
    texts = [*_texts(), *(r["text"] for r in learnable_classes())]
    words = Counter(w for text in texts for w, _ in pre.pre_tokenize_str(text))
    chars = sorted({c for w in words for c in w})
    vocab = [*specials, *chars, *(f"##{c}" for c in chars)]
    frequent = sorted((w for w in words if len(w) > 1), key=lambda w: (-words[w], w))
    vocab += frequent[: max(0, vocab_size - len(vocab))]
    tok = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.WordPiece()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
    fast = BertTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(directory)
    return fast


def _tiny_decoder(
    directory: Path,
    config_class: type,
    model_class: type,
    *,
    seed: int,
    shards: bool,
    chat_template: str | None,
    dims: dict,
    config: dict,
    vocab: int = 300,
) -> Path:
    """A 2-layer decoder of ``model_class`` with its tokenizer (a BPE of up to ``vocab`` tokens),
    saved like a model from the hub (optionally sharded): ``dims`` the architecture's own,
    ``config`` the caller's on top."""
    tokenizer = bpe_tokenizer(directory, vocab_size=vocab, chat_template=chat_template)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = model_class(config_class(**{**common, **dims, **config}))
    model.save_pretrained(directory, max_shard_size="100KB" if shards else "5GB")
    return directory


def tiny_llama(
    directory: Path,
    *,
    seed: int = 0,
    shards: bool = False,
    tie: bool = False,
    n_kv_head: int = 2,
    chat_template: str | None = CHAT_MARKED,
    vocab: int = 300,
    **config,
) -> Path:
    """A 2-layer Llama (or as ``config`` sizes it) with its tokenizer, saved like a model from the
    hub (optionally sharded)."""
    dims = dict(intermediate_size=128, num_key_value_heads=n_kv_head, tie_word_embeddings=tie)
    return _tiny_decoder(
        directory,
        LlamaConfig,
        LlamaForCausalLM,
        seed=seed,
        shards=shards,
        chat_template=chat_template,
        dims=dims,
        config=config,
        vocab=vocab,
    )


def tiny_qwen3_moe(directory: Path, *, seed: int = 0, shards: bool = False, experts: int = 4, **config) -> Path:
    """A 2-layer Qwen3-MoE (``experts`` experts a layer, 2 of them a token) with its tokenizer."""
    dims = dict(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128)
    return _tiny_decoder(
        directory,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        seed=seed,
        shards=shards,
        chat_template=CHAT_MARKED,
        dims=dims,
        config=config,
    )


def tiny_mixtral(directory: Path, *, seed: int = 0, experts: int = 4, **config) -> Path:
    """A 2-layer Mixtral (``experts`` experts a layer, 2 of them a token) with its tokenizer."""
    dims = dict(num_local_experts=experts, num_experts_per_tok=2, intermediate_size=32)
    return _tiny_decoder(
        directory,
        MixtralConfig,
        MixtralForCausalLM,
        seed=seed,
        shards=False,
        chat_template=CHAT_MARKED,
        dims=dims,
        config=config,
    )


def tiny_bert(directory: Path, *, seed: int = 0, num_labels: int = 2, **config) -> Path:
    tokenizer = wordpiece_tokenizer(directory)
    dims = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(BertConfig(**{**dims, **config}))
    model.save_pretrained(directory)
    return directory


def learnable_classes(n: int = 320, seed: int = 0) -> list[dict]:
    """Sentences of words from three vocabularies; the label is the vocabulary most words come from."""
    rng = random.Random(seed)
    words = {
        "sport": "ball goal team match score coach league",
        "food": "bread soup apple cheese salt dinner",
        "code": "loop function class import return value",
    }
    out = []
    for _ in range(n):
        label = rng.choice(sorted(words))
        own = words[label].split()
        noise = " ".join(words[k] for k in words if k != label).split()
        text = [rng.choice(own) for _ in range(5)] + [rng.choice(noise) for _ in range(2)]
        rng.shuffle(text)
        out.append({"text": " ".join(text), "label": label})
    return out


def verse_and_prose(n: int = 240, seed: int = 0) -> list[dict]:
    """Two-line passages of Shakespeare (bench/data's plays) labelled "verse", and sentences of
    English prose from the standard library's module docstrings labelled "prose", ``n`` of each,
    shuffled: a task a pretrained encoder learns in a few dozen steps and random weights do not."""
    import ast
    import lzma
    import re

    plays = lzma.decompress((Path(__file__).parents[1] / "bench" / "data" / "shakespeare.txt.xz").read_bytes())
    lines = [line.strip() for line in plays.decode().splitlines()]
    pairs = zip(lines[::2], lines[1::2], strict=False)
    verse = [f"{a} {b}" for a, b in pairs if len(a.split()) >= 5 and len(b.split()) >= 5]
    prose = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(errors="replace"))) or ""
        except SyntaxError:
            continue
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
            if 8 <= len(sentence.split()) <= 40 and not re.search(r"[(){}\[\]=_<>>:*`]", sentence):
                prose.append(sentence)
    rng = random.Random(seed)
    records = [{"text": t, "label": "verse"} for t in rng.sample(verse, n)]
    records += [{"text": t, "label": "prose"} for t in rng.sample(prose, n)]
    rng.shuffle(records)
    return records


# -- the architectures kiln loads, tiny ------------------------------------------------------------

WIDTH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
DECODER = dict(WIDTH, num_key_value_heads=2, max_position_embeddings=128)
# Encoders people fine-tune as classifiers (sequence_classification) and decoders they fine-tune
# as causal LMs: each model_type's config at tiny sizes (2 layers, width 32, 4 heads).
ENCODERS: dict[str, Callable[[], PretrainedConfig]] = {
    "bert": lambda: BertConfig(**WIDTH, max_position_embeddings=128),
    "roberta": lambda: RobertaConfig(**WIDTH, max_position_embeddings=130),
    "distilbert": lambda: DistilBertConfig(dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=128),
    "deberta-v2": lambda: DebertaV2Config(**WIDTH, max_position_embeddings=128, pooler_hidden_size=32),
    "modernbert": lambda: ModernBertConfig(
        **WIDTH, max_position_embeddings=128, local_attention=16, global_attn_every_n_layers=2
    ),
    "electra": lambda: ElectraConfig(**WIDTH, embedding_size=16, max_position_embeddings=128),
    "xlm-roberta": lambda: XLMRobertaConfig(**WIDTH, max_position_embeddings=130),
    "albert": lambda: AlbertConfig(**WIDTH, embedding_size=16, max_position_embeddings=128),
    "mpnet": lambda: MPNetConfig(**WIDTH, max_position_embeddings=130),
}
DECODERS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**DECODER),
    "qwen2": lambda: Qwen2Config(**DECODER),
    "qwen3": lambda: Qwen3Config(**DECODER, head_dim=8),
    "mistral": lambda: MistralConfig(**DECODER),
    "gemma2": lambda: Gemma2Config(**DECODER, head_dim=8),
    "gemma3_text": lambda: Gemma3TextConfig(**DECODER, head_dim=8, sliding_window=16),
    "phi3": lambda: Phi3Config(**DECODER),
    "gpt2": lambda: GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128),
    "gpt_neox": lambda: GPTNeoXConfig(**WIDTH, max_position_embeddings=128),
    "opt": lambda: OPTConfig(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=128,
    ),
    "falcon": lambda: FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    "olmo2": lambda: Olmo2Config(**DECODER),
}


def tiny_config(model_type: str, vocab_size: int = 96, pad: int | None = 0, bos: int = 1, eos: int = 2):
    """The tiny config of ``model_type`` (an encoder's or a decoder's above) with its vocabulary
    and special token ids."""
    config = {**ENCODERS, **DECODERS}[model_type]()
    config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id = vocab_size, pad, bos, eos
    return config


def task_of(model_type: str) -> str:
    return "sequence_classification" if model_type in ENCODERS else "causal_lm"


def auto_class(task: str):
    """transformers' Auto class of a kiln ``model.task``."""
    return AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification


def save_tiny(
    directory: Path,
    model_type: str,
    *,
    headless: bool = False,
    shards: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer: bool = False,
    **config,
) -> Path:
    """``model_type`` at tiny sizes with random weights, saved as the hub holds such models: with
    its head (a classifier of two labels for an encoder, a causal LM for a decoder) or headless (the
    base model alone, as sentence-transformers saves encoders and as a ``LlamaModel`` is saved), in
    one file or several with an index, in fp32 or bf16. With ``tokenizer``, a tokenizer of its kind
    (WordPiece for an encoder, byte-level BPE for a decoder) sized to its vocabulary; without, the
    config names its padding, start and end ids alone. ``config`` is set on the config."""
    if tokenizer:
        tok = wordpiece_tokenizer(directory) if model_type in ENCODERS else bpe_tokenizer(directory)
        ids = (tok.pad_token_id, tok.cls_token_id, tok.sep_token_id) if model_type in ENCODERS else None
        ids = ids or (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        cfg = tiny_config(model_type, len(tok), *ids)
    else:
        cfg = tiny_config(model_type)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = AutoModel.from_config(cfg) if headless else auto_class(task_of(model_type)).from_config(cfg)
    model.to(dtype).save_pretrained(directory, max_shard_size="20KB" if shards else "5GB")
    return directory
