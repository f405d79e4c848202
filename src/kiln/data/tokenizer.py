"""Tokenizers: train a byte-level BPE on a corpus's train split (cached), or load a tokenizer.json; and
Codec, text to ids and back with kiln's own tokenizer or a model's transformers one."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.data.corpus import DataError
from kiln.io import write_atomic

EOT = "<|endoftext|>"
# Bump when training settings change, so cached tokenizers from older code are not reused.
TOKENIZER_VERSION = 1
# End-of-sequence tokens of common tokenizers, preferred in this order when EOT is absent.
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>", "<|eot_id|>")


class TrainingText(Protocol):
    """What a BPE is trained on: a corpus, or several (a mixture's)."""

    @property
    def fingerprint(self) -> str: ...

    def documents(self, split: str) -> Iterator[tuple[str, str]]: ...

    def count(self, split: str) -> int: ...


def load_or_train_tokenizer(corpus: TrainingText, data_cfg, cache_dir: Path) -> Tokenizer:
    """The tokenizer ``data_cfg.tokenizer`` names: 'bpe' trains (or reuses) one, else a tokenizer.json path.

    The BPE is trained on the train split, or on a sample of it of up to
    ``data_cfg.tokenizer_sample_bytes`` (see :func:`sample_documents`). A trained BPE is cached at
    ``cache_dir/tokenizers/<key>/tokenizer.json``, where the key covers the corpus fingerprint (so
    its train split), the vocab size, the sample size and TOKENIZER_VERSION.
    """
    if data_cfg.tokenizer != "bpe":
        return load_tokenizer(Path(data_cfg.tokenizer).expanduser())
    path = bpe_cache_path(corpus, data_cfg, cache_dir)
    if path.is_file():
        return load_tokenizer(path)
    texts, count = sample_documents(corpus, data_cfg.tokenizer_sample_bytes)
    tok = _train_bpe(texts, data_cfg.vocab_size, count)
    write_atomic(path, tok.to_str())
    return tok


def bpe_cache_path(corpus: TrainingText, data_cfg, cache_dir: Path) -> Path:
    """Where the BPE trained for this corpus, vocab size and sample size is (or will be) cached."""
    key = f"{corpus.fingerprint}\0{data_cfg.vocab_size}\0{TOKENIZER_VERSION}"
    if data_cfg.tokenizer_sample_bytes:  # 0 (the whole split) keeps the key it always had
        key += f"\0sample={data_cfg.tokenizer_sample_bytes}"
    return Path(cache_dir) / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32] / "tokenizer.json"


def sample_documents(corpus: TrainingText, max_bytes: int) -> tuple[Iterator[str], int]:
    """The train documents a BPE is trained on, and how many: all of them when ``max_bytes`` is 0
    or the split holds no more than that many UTF-8 bytes, else a sample of up to ``max_bytes``.

    The sample is chosen by name, so it is deterministic, spread evenly over the corpus (every
    file and every part of each file, not its first N bytes) and stable as the corpus grows: a
    salted hash of each document's name puts it in one of SAMPLE_BUCKETS buckets, a first pass
    adds up the UTF-8 bytes of each bucket, and the sample is the documents of the buckets
    0, 1, ..., k, the longest run of buckets whose bytes add up to ``max_bytes`` or less (at least
    the first bucket that holds any). A second pass yields them, in corpus order. Memory is the two
    tables of bucket sizes, whatever the corpus size.
    """
    if not max_bytes:
        return (text for _, text in corpus.documents("train")), corpus.count("train")
    sizes, counts = [0] * SAMPLE_BUCKETS, [0] * SAMPLE_BUCKETS
    for name, text in corpus.documents("train"):
        bucket = _sample_bucket(name)
        sizes[bucket] += len(text.encode("utf-8", "surrogatepass"))
        counts[bucket] += 1
    if sum(sizes) <= max_bytes:
        return (text for _, text in corpus.documents("train")), sum(counts)
    cumulative = np.cumsum(sizes)
    # The buckets whose running total stays within max_bytes; at least the first non-empty one.
    taken = max(int(np.searchsorted(cumulative, max_bytes, side="right")), int(np.argmax(cumulative > 0)) + 1)
    texts = (text for name, text in corpus.documents("train") if _sample_bucket(name) < taken)
    return texts, sum(counts[:taken])


# Buckets a document's name hashes to, for sample_documents: the sample's size is exact to 1/65536
# of the train split.
SAMPLE_BUCKETS = 1 << 16


def _sample_bucket(name: str) -> int:
    # Salted, so the sample does not line up with the train/val split (a hash of the same names).
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8, person=b"kiln-bpe-sample")
    return int.from_bytes(digest.digest(), "big") % SAMPLE_BUCKETS


def load_tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found; data.tokenizer takes 'bpe' or a path to a tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise DataError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from None


def _train_bpe(texts: Iterable[str], vocab_size: int, length: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def eot_id(tok: Tokenizer) -> int:
    """Id of the end-of-text token appended after every document.

    EOT itself if the tokenizer has it; otherwise, for user tokenizers, the first known
    end-of-sequence special token (</s>, <|end_of_text|>, <eos>, ...) it has; else DataError.
    """
    found = tok.token_to_id(EOT)
    if found is not None:
        return found
    for name in _EOS_NAMES:
        found = tok.token_to_id(name)
        if found is not None:
            return found
    raise DataError(
        f"the tokenizer has no end-of-text token ({EOT} or one of {', '.join(_EOS_NAMES)}); "
        f"add {EOT} as a special token to its tokenizer.json, or use data.tokenizer = 'bpe'"
    )


def tokenizer_hash(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens), for bits-per-byte.

    In byte-level tokenizers every character of a vocabulary token stands for one byte, so the
    count is exact. Other tokenizers decode each token alone, which is approximate where a decoder
    joins tokens (e.g. SentencePiece's leading-space marker). Added tokens are stored as plain text.
    """
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    added = tok.get_added_tokens_decoder()
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        for token, i in tok.get_vocab(with_added_tokens=False).items():
            lengths[i] = len(token)
    else:
        ids = [i for i in range(len(lengths)) if i not in added]
        texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
        lengths[ids] = [len(t.encode("utf-8")) for t in texts]
    for i, added_token in added.items():
        lengths[i] = 0 if added_token.special else len(added_token.content.encode("utf-8"))
    return lengths


class Codec:
    """Text to token ids and back with kiln's own tokenizer (a ``tokenizers.Tokenizer``) or a
    model's ``transformers`` one, as ``kiln generate`` and ``kiln serve`` use them. One lock
    guards the tokenizer: a server's handlers encode while its worker decodes, and a
    ``transformers`` tokenizer is not safe to share between threads."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.hf = hasattr(tokenizer, "eos_token_id")
        self.eos_id = tokenizer.eos_token_id if self.hf else eot_id(tokenizer)
        self.vocab_size = len(tokenizer) if self.hf else tokenizer.get_vocab_size()
        self.has_chat_template = self.hf and getattr(tokenizer, "chat_template", None) is not None
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt; an empty one starts from end-of-text."""
        with self._lock:
            ids = self.tokenizer(text)["input_ids"] if self.hf else self.tokenizer.encode(text).ids
        return ids or ([] if self.eos_id is None else [self.eos_id])

    def chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's chat template, ready for the
        assistant's turn; tokenized as kiln's fine-tuning tokenizes it (the template writes the
        special tokens)."""
        with self._lock:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True) if self.hf else self.tokenizer.decode(ids)
