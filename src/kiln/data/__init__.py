"""Data: corpora, tokenizers, prepared token files and the training loader."""

from kiln.data.corpus import Corpus, DataError, open_corpus, split_of
from kiln.data.loader import StepSampler, TokenSequences, make_train_loader, val_batches
from kiln.data.shards import PreparedData, cache_root, open_prepared, prepare, prepare_mix, verify
from kiln.data.tokenizer import EOT, eot_id, load_or_train_tokenizer, token_byte_lengths, tokenizer_hash

__all__ = [
    "EOT",
    "Corpus",
    "DataError",
    "PreparedData",
    "StepSampler",
    "TokenSequences",
    "cache_root",
    "eot_id",
    "load_or_train_tokenizer",
    "make_train_loader",
    "open_corpus",
    "open_prepared",
    "prepare",
    "prepare_mix",
    "split_of",
    "token_byte_lengths",
    "tokenizer_hash",
    "val_batches",
    "verify",
]
