"""Tiny Hugging Face models made locally from configs (``save_pretrained`` into a directory), with
real tokenizers trained here: nothing is downloaded."""

from __future__ import annotations

import random
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
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
