"""Data: corpus loading via `datasets`, joint sentencepiece, tokenization/filtering, token-bucketed batches.

Imports are lazy so that `import bpd_train.data` stays cheap (datasets and Lightning load on first use).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_corpus": "corpus", "SPLITS": "corpus",
    "Tokenizer": "tokenizer", "get_tokenizer": "tokenizer", "encode_source": "tokenizer",
    "PAD_ID": "tokenizer", "BOS_ID": "tokenizer", "EOS_ID": "tokenizer", "UNK_ID": "tokenizer",
    "tokenize_split": "processing", "collate": "processing",
    "TokenBucketBatchSampler": "sampler",
    "BPDDataModule": "datamodule", "ResumableDataLoader": "datamodule",
    "LMDataModule": "lm_datamodule", "SpmLMTokenizer": "lm_datamodule",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
