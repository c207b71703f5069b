"""The batches both families train on: token-bucketed, sharded across ranks by the module itself, resumable mid-epoch.

`TokenBatchesDataModule` is what the encoder-decoder's `BPDDataModule` (data/mt/datamodule.py) and the decoder-only
`LMDataModule` (data/lm/datamodule.py) share; each adds how its corpus is read, tokenized and collated
(`prepare_data`, `setup`, `_loader`).

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

import os
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import numpy as np
from datasets import Dataset
from torch.utils.data import DataLoader

from bpd_train.data.corpus import cfg_get
from bpd_train.data.sampler import TokenBucketBatchSampler


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


class TokenBatchesDataModule(pl.LightningDataModule):
    """What both families' data modules share: settings, per-rank token-bucket samplers, the loaders and the
    resumable sampler state. Subclasses fill `self.tokenizer` and `self.datasets` (split -> a Dataset with a
    `length` column) in setup() and say how a split's rows become a batch in `_loader`."""

    def __init__(self, data_cfg: Any, artifacts_dir: str | os.PathLike, seed: int = 0, source: str = "gold",
                 distilled_dir: str | os.PathLike | None = None, max_tokens: int | None = None,
                 num_workers: int | None = None, tokenizer_path: str | os.PathLike | None = None,
                 eval_max_tokens: int | None = None, cache_dir: str | os.PathLike | None = None,
                 tokenizer: Any = None):
        super().__init__()
        self.data_cfg = data_cfg
        self.artifacts_dir = Path(artifacts_dir)
        self.seed = int(seed)
        self.source = source
        self.distilled_dir = Path(distilled_dir) if distilled_dir is not None else None
        self.max_tokens = int(max_tokens or cfg_get(data_cfg, "max_tokens", 4096))
        self.eval_max_tokens = int(eval_max_tokens or self.max_tokens)
        nw = num_workers if num_workers is not None else cfg_get(data_cfg, "num_workers", 0)
        self.num_workers = int(nw or 0)
        self.tokenizer_path = Path(tokenizer_path) if tokenizer_path is not None else None
        self.cache_dir = cache_dir
        self.tokenizer: Any = None
        self._given_tokenizer = tokenizer
        self.datasets: dict[str, Dataset] = {}  # tokenized splits
        self.corpus = None  # the DatasetDict as loaded (gold; train replaced by distilled when source=distilled)
        self.stats: dict[str, dict] = {}
        self._train_loader: ResumableDataLoader | None = None
        self._pending_state: dict | None = None

    @property
    def corpus_artifacts_dir(self) -> Path:
        return self.artifacts_dir / str(cfg_get(self.data_cfg, "name"))

    def _loader(self, split: str, sampler: TokenBucketBatchSampler, cls=DataLoader) -> DataLoader:
        raise NotImplementedError

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
