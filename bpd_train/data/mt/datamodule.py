"""`BPDDataModule`: the encoder-decoder family's batches. Gold, distilled or mixed (distilled plus a share of gold
pairs) translation corpora -> tokenized, filtered (data/mt/processing.py) source/target batches (src, tgt_in,
tgt_out), token-bucketed, sharded and resumable as data/batches.py makes every family's.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np
from datasets import Dataset, concatenate_datasets
import torch
from torch.utils.data import DataLoader

from bpd_train.data import distilled
from bpd_train.data.batches import ResumableDataLoader, TokenBatchesDataModule  # noqa: F401 - importable here
from bpd_train.data.corpus import cfg_get, load_corpus
from bpd_train.data.mt.processing import collate, tokenize_split
from bpd_train.data.sampler import TokenBucketBatchSampler
from bpd_train.data.tokenizer import Tokenizer, get_tokenizer

log = logging.getLogger(__name__)


SOURCES = ("gold", "distilled", "mixed")


def mix_gold(distilled: Dataset, gold: Dataset, gold_share: float, seed: int) -> Dataset:
    """All tokenized distilled pairs plus gold pairs drawn at random (without replacement, from the whole gold
    training split) so that gold makes up `gold_share` of the result; capped at the whole gold split.
    The student still learns mostly the teacher's (simpler) targets, while the gold pairs keep it writing at
    the gold length, which beam search at a low length penalty shortens."""
    if not 0.0 <= gold_share < 1.0:
        raise ValueError(f"gold_share must be in [0, 1), got {gold_share}")
    n = min(len(gold), round(len(distilled) * gold_share / (1.0 - gold_share)))
    if n == 0:
        return distilled
    pick = np.sort(np.random.default_rng(seed).choice(len(gold), size=n, replace=False))
    # the columns both share with the same type (ids may be strings in one and ints in the other)
    cols = [c for c in distilled.column_names if c in gold.column_names and distilled.features[c] == gold.features[c]]
    return concatenate_datasets([distilled.select_columns(cols), gold.select(pick).select_columns(cols)])


class BPDDataModule(TokenBatchesDataModule):
    def __init__(self, data_cfg: Any, artifacts_dir: str | os.PathLike, seed: int = 0, source: str = "gold",
                 distilled_dir: str | os.PathLike | None = None, max_tokens: int | None = None,
                 num_workers: int | None = None, tokenizer_path: str | os.PathLike | None = None,
                 eval_max_tokens: int | None = None, cache_dir: str | os.PathLike | None = None,
                 tokenizer: Any = None, gold_share: float = 0.5):
        """tokenizer: an object with `Tokenizer`'s API to use instead of the corpus's sentencepiece model (an
        imported model's own, bpd_train/data/hf_tokenizer.ModelTokenizer); tokenizer_path: a sentencepiece file;
        gold_share: source=mixed only (see SOURCES)."""
        if source not in SOURCES:
            raise ValueError(f"source={source!r}; expected one of {SOURCES}")
        super().__init__(data_cfg, artifacts_dir, seed=seed, source=source, distilled_dir=distilled_dir,
                         max_tokens=max_tokens, num_workers=num_workers, tokenizer_path=tokenizer_path,
                         eval_max_tokens=eval_max_tokens, cache_dir=cache_dir, tokenizer=tokenizer)
        self.gold_share = float(gold_share)  # source=mixed only

    # ------------------------------------------------------------------------------------------- setup
    def prepare_data(self) -> None:
        # One process per node, before setup() on every rank: read the gold corpus, train (or find) the tokenizer
        # and tokenize, so the ranks' setup() finds everything in the caches instead of racing to build it.
        corpus = load_corpus(self.data_cfg, cache_dir=self.cache_dir)
        tok = self._given_tokenizer or (Tokenizer(self.tokenizer_path) if self.tokenizer_path is not None
                                        else get_tokenizer(self.data_cfg, self.artifacts_dir, corpus["train"]))
        for split, ds in corpus.items():
            tokenize_split(ds, tok, self.data_cfg, split)

    def _load_train_source(self) -> Dataset | None:
        if self.source == "gold":
            return None
        folder = self.distilled_dir or distilled.find_distilled_corpus(self.corpus_artifacts_dir)
        want = distilled.read_manifest(folder).get("tokenizer_hash")
        if want and want != self.tokenizer.hash:
            raise ValueError(f"the distilled corpus {folder} was made with tokenizer sha256 {want[:12]}, but this run "
                             f"uses {self.tokenizer.path} ({self.tokenizer.hash[:12]}); its teacher_ids don't apply")
        ds = distilled.load_distilled_corpus(folder, vocab_size=self.tokenizer.vocab_size)   # teacher ids in range
        src, tgt = str(cfg_get(self.data_cfg, "src_lang")), str(cfg_get(self.data_cfg, "tgt_lang"))
        # teacher_ids (when present) are the teacher's own pieces: used as targets as they are, no re-encoding
        ds = ds.select_columns([c for c in ds.column_names if c in ("id", "translation", "teacher_ids")])
        ds = ds.map(lambda b: {"translation": [{src: t[src], tgt: t[tgt]} for t in b["translation"]]},
                    batched=True, desc="distilled schema")
        log.info("train source: distilled corpus %s (%d pairs)", folder, len(ds))
        return ds

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        self.corpus = load_corpus(self.data_cfg, cache_dir=self.cache_dir)
        gold_train = self.corpus["train"]
        if self._given_tokenizer is not None:
            self.tokenizer = self._given_tokenizer
        elif self.tokenizer_path is not None:
            self.tokenizer = Tokenizer(self.tokenizer_path)
        else:  # the tokenizer always comes from the gold training split, also when training on distilled data
            self.tokenizer = get_tokenizer(self.data_cfg, self.artifacts_dir, gold_train)
        distilled = self._load_train_source()
        if distilled is not None:
            self.corpus["train"] = distilled
        for split, ds in self.corpus.items():
            self.datasets[split], self.stats[split] = tokenize_split(ds, self.tokenizer, self.data_cfg, split)
            if len(self.datasets[split]) == 0:
                raise ValueError(f"split {split!r} is empty after filtering; relax data.filter")
        if self.source == "mixed":
            gold, _ = tokenize_split(gold_train, self.tokenizer, self.data_cfg, "train")
            self.datasets["train"] = mix_gold(self.datasets["train"], gold, self.gold_share, self.seed)
            self.stats["train"]["mixed_gold"] = len(self.datasets["train"]) - self.stats["train"]["kept"]
            log.info("train source: mixed, %d distilled + %d gold pairs (gold_share=%s)", self.stats["train"]["kept"],
                     self.stats["train"]["mixed_gold"], self.gold_share)

    def _loader(self, split: str, sampler: TokenBucketBatchSampler, cls=DataLoader) -> DataLoader:
        tok = self.tokenizer
        ds = self.datasets[split].select_columns(["row", "src", "tgt"])
        # pinned host batches copy to a GPU asynchronously (Lightning moves them with non_blocking)
        return cls(ds, batch_sampler=sampler, num_workers=self.num_workers,
                   collate_fn=functools.partial(collate, pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id),
                   persistent_workers=False, pin_memory=torch.cuda.is_available())

