"""`BPDDataModule`: gold, distilled or mixed (distilled plus a share of gold pairs) corpora -> tokenized, filtered, token-bucketed, sharded batches.

Lightning integration (2.6):
- Ranks: the samplers shard by `trainer.world_size` / `trainer.global_rank` themselves, so the Trainer must be
  built with `use_distributed_sampler=False` (Lightning cannot inject a DistributedSampler into a batch
  sampler; `train_dataloader()` raises a clear error if it would try).
- Mid-epoch resume: the train DataLoader is a `ResumableDataLoader` with `state_dict()`/`load_state_dict()`,
  which Lightning's fit loop saves under `checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]`
  and restores before it creates the epoch's iterator. The data module's own `state_dict()` (saved by
  Lightning under the class name) holds the same sampler position, so either path restores it. The
  position counts batches *delivered by the DataLoader* (after worker prefetch), which is what Lightning's
  `batch_progress` counts for sized loaders (they are not prefetched by the fetcher), so a checkpoint
  saved at `on_train_batch_end`, at validation end or at epoch end resumes at exactly the next batch.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import numpy as np
from datasets import Dataset, concatenate_datasets
import torch
from torch.utils.data import DataLoader

from .corpus import _get, load_corpus
from .processing import collate, tokenize_split
from .sampler import TokenBucketBatchSampler
from .tokenizer import Tokenizer, get_tokenizer

log = logging.getLogger(__name__)


class ResumableDataLoader(DataLoader):
    """DataLoader over a TokenBucketBatchSampler whose state is the number of batches it delivered this epoch."""

    def __iter__(self) -> Iterator:
        # A generator: the underlying iterator (and its workers) starts at the first next(), i.e. after
        # Lightning's set_epoch() -- Lightning calls iter() before set_epoch() when it sets up the data.
        bs: TokenBucketBatchSampler = self.batch_sampler
        self._epoch, self._delivered = bs.epoch, bs._resume_from
        for batch in super().__iter__():
            self._delivered += 1
            yield batch

    def state_dict(self) -> dict:
        bs: TokenBucketBatchSampler = self.batch_sampler
        state = bs.state_dict()
        state["consumed"] = self._delivered if getattr(self, "_epoch", None) == bs.epoch else bs._resume_from
        return state

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)


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


class BPDDataModule(pl.LightningDataModule):
    def __init__(self, data_cfg: Any, artifacts_dir: str | os.PathLike, seed: int = 0, source: str = "gold",
                 distilled_dir: str | os.PathLike | None = None, max_tokens: int | None = None,
                 num_workers: int | None = None, tokenizer_path: str | os.PathLike | None = None,
                 eval_max_tokens: int | None = None, cache_dir: str | os.PathLike | None = None,
                 tokenizer: Any = None, gold_share: float = 0.5):
        """tokenizer: an object with `Tokenizer`'s API to use instead of the corpus's sentencepiece model (an
        imported model's own, bpd_train/data/hf_tokenizer.ModelTokenizer); tokenizer_path: a sentencepiece file;
        gold_share: source=mixed only (see SOURCES)."""
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"source={source!r}; expected one of {SOURCES}")
        self.gold_share = float(gold_share)  # source=mixed only
        self.data_cfg = data_cfg
        self.artifacts_dir = Path(artifacts_dir)
        self.seed = int(seed)
        self.source = source
        self.distilled_dir = Path(distilled_dir) if distilled_dir is not None else None
        self.max_tokens = int(max_tokens or _get(data_cfg, "max_tokens", 4096))
        self.eval_max_tokens = int(eval_max_tokens or self.max_tokens)
        nw = num_workers if num_workers is not None else _get(data_cfg, "num_workers", 0)
        self.num_workers = int(nw or 0)
        self.tokenizer_path = Path(tokenizer_path) if tokenizer_path is not None else None
        self.cache_dir = cache_dir
        self.tokenizer: Tokenizer | None = None
        self._given_tokenizer = tokenizer
        self.datasets: dict[str, Dataset] = {}  # tokenized splits
        self.corpus = None  # the DatasetDict as loaded (gold; train replaced by distilled when source=distilled)
        self.stats: dict[str, dict] = {}
        self._train_loader: ResumableDataLoader | None = None
        self._pending_state: dict | None = None

    @property
    def corpus_artifacts_dir(self) -> Path:
        return self.artifacts_dir / str(_get(self.data_cfg, "name"))

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
        from . import distilled  # owned by the distillation part; imported lazily

        folder = self.distilled_dir or distilled.find_distilled_corpus(self.corpus_artifacts_dir)
        want = distilled.read_manifest(folder).get("tokenizer_hash")
        if want and want != self.tokenizer.hash:
            raise ValueError(f"the distilled corpus {folder} was made with tokenizer sha256 {want[:12]}, but this run "
                             f"uses {self.tokenizer.path} ({self.tokenizer.hash[:12]}); its teacher_ids don't apply")
        ds = distilled.load_distilled_corpus(folder, vocab_size=self.tokenizer.vocab_size)   # teacher ids in range
        src, tgt = str(_get(self.data_cfg, "src_lang")), str(_get(self.data_cfg, "tgt_lang"))
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

    # ---------------------------------------------------------------------------------------- loaders
    def _ranks(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 1, 0
        world, rank = int(trainer.world_size), int(trainer.global_rank)
        conn = getattr(trainer, "_accelerator_connector", None)
        if world > 1 and getattr(conn, "use_distributed_sampler", False):
            raise ValueError("BPDDataModule shards batches across ranks itself: build the Trainer with "
                             "use_distributed_sampler=False")
        return world, rank

    def _sampler(self, split: str, shuffle: bool, max_tokens: int) -> TokenBucketBatchSampler:
        world, rank = self._ranks()
        # Column access through the Dataset (not .data): .data is the raw Arrow table and ignores the
        # indices mapping that filtering leaves behind, which would misalign lengths and rows.
        lengths = np.asarray(self.datasets[split]["length"])
        return TokenBucketBatchSampler(lengths, max_tokens, num_replicas=world, rank=rank, seed=self.seed,
                                       shuffle=shuffle)

    def _loader(self, split: str, sampler: TokenBucketBatchSampler, cls=DataLoader) -> DataLoader:
        tok = self.tokenizer
        ds = self.datasets[split].select_columns(["row", "src", "tgt"])
        # pinned host batches copy to a GPU asynchronously (Lightning moves them with non_blocking)
        return cls(ds, batch_sampler=sampler, num_workers=self.num_workers,
                   collate_fn=functools.partial(collate, pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id),
                   persistent_workers=False, pin_memory=torch.cuda.is_available())

    def train_dataloader(self) -> ResumableDataLoader:
        sampler = self._sampler("train", shuffle=True, max_tokens=self.max_tokens)
        if self._pending_state is not None:
            sampler.load_state_dict(self._pending_state)
            self._pending_state = None
        self._train_loader = self._loader("train", sampler, ResumableDataLoader)
        return self._train_loader

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", self._sampler("validation", False, self.eval_max_tokens))

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self._sampler("test", False, self.eval_max_tokens))

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        if self._train_loader is not None:
            return {"train_sampler": self._train_loader.state_dict()}
        if self._pending_state is not None:
            return {"train_sampler": dict(self._pending_state)}
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        state = state_dict.get("train_sampler")
        if not state:
            return
        if self._train_loader is not None:
            self._train_loader.load_state_dict(state)
        else:
            self._pending_state = dict(state)
