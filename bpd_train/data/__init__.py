"""Data: corpus loading via `datasets`, joint sentencepiece, tokenization/filtering, token-bucketed batches.

Shared by both model families (bpd_train/families): corpus.py (parallel corpora), tokenizer.py (the corpus's
sentencepiece model), hf_tokenizer.py (an imported model's tokenizer folder), sampler.py, batches.py (the
resumable, rank-sharded data module base) and distilled.py (distilled-corpus shards). Per family:
  mt/   processing.py (source/target encoding and filtering, collate), datamodule.py (BPDDataModule)
  lm/   processing.py (prompt/response and chat records, collate_lm), tokenizer.py (tokenizer.json folders),
        datamodule.py (LMDataModule)

Imports are lazy so that `import bpd_train.data` stays cheap (datasets and Lightning load on first use).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_corpus": "corpus", "SPLITS": "corpus",
    "Tokenizer": "tokenizer", "get_tokenizer": "tokenizer", "encode_source": "tokenizer",
    "PAD_ID": "tokenizer", "BOS_ID": "tokenizer", "EOS_ID": "tokenizer", "UNK_ID": "tokenizer",
    "tokenize_split": "mt.processing", "collate": "mt.processing",
    "TokenBucketBatchSampler": "sampler",
    "BPDDataModule": "mt.datamodule", "ResumableDataLoader": "batches", "TokenBatchesDataModule": "batches",
    "LMDataModule": "lm.datamodule", "SpmLMTokenizer": "lm.datamodule",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
