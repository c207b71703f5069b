"""`LMDataModule`: the decoder-only family's batches. Prompt/response records (encoded by data/lm/processing.py) ->
tokens/targets batches, token-bucketed, sharded and resumable as data/batches.py makes every family's.

Config (`data.lm`, all optional):
  files           {train: file(s), validation: file(s)} jsonl records (prompt/response or chat messages); null
                  (default): the configured translation corpus as prompts ("English: <src>\\nFrench:" -> " <tgt>")
  max_len         context in tokens (prompt + response + eos); null: the model's max_positions
  context_policy  truncate_left (drop the prompt's oldest tokens, counted and logged) | refuse (one error)
source=distilled reads the model's own responses (`*.jsonl` prompt/response records that distill.py writes with
the model as its own teacher) for the train split; validation stays on the references.

The tokenizer: the imported model's (LMTokenizer), or for a model trained from scratch on a translation corpus
the corpus's sentencepiece model behind `SpmLMTokenizer` (BOS 1 prepended, EOS 2).
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from datasets import Dataset
import torch
from torch.utils.data import DataLoader

from bpd_train.data import distilled
from bpd_train.data.corpus import cfg_get, load_corpus
from bpd_train.data.batches import TokenBatchesDataModule
from bpd_train.data.hf_tokenizer import TokenizerError
from bpd_train.data.lm.processing import (CONTEXT_POLICIES, LMDataError, LMEncoder, ResponseTooLong, collate_lm,
                                       load_lm_jsonl)
from bpd_train.data.tokenizer import BOS_ID, EOS_ID, Tokenizer, get_tokenizer

log = logging.getLogger(__name__)


class SpmLMTokenizer:
    """This project's sentencepiece model with the LMTokenizer interface that data/lm/processing.py and the decoders
    use."""

    kind = "spm"
    meta = None  # checkpoints record no tokenizer_meta: the run's tokenizer.model is the corpus's (loading.py)

    def __init__(self, tok: Tokenizer):
        self.sp = tok
        self.path, self.hash = tok.path, tok.hash
        self.bos_id, self.eos_id, self.pad_id = BOS_ID, EOS_ID, None
        self.vocab_size = tok.vocab_size
        self.has_chat_template = False

    def encode(self, text: str | Sequence[str], add_special_tokens: bool = True):
        if isinstance(text, (list, tuple)):
            return [self.encode(t, add_special_tokens) for t in text]
        return ([BOS_ID] if add_special_tokens else []) + self.sp.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.sp.decode([int(i) for i in ids if not skip_special_tokens or int(i) > EOS_ID])

    def render_chat(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        raise TokenizerError(f"the sentencepiece model {self.path} has no chat template: give the data as plain "
                             "prompt/response records")


def lm_settings(data_cfg: Any) -> dict:
    lm = cfg_get(data_cfg, "lm") or {}
    policy = str(cfg_get(lm, "context_policy", "truncate_left") or "truncate_left")
    if policy not in CONTEXT_POLICIES:
        raise LMDataError(f"data.lm.context_policy={policy!r}; expected one of {', '.join(CONTEXT_POLICIES)}")
    max_len = cfg_get(lm, "max_len")
    return {"files": cfg_get(lm, "files"), "max_len": int(max_len) if max_len else None, "context_policy": policy}


class LMDataModule(TokenBatchesDataModule):
    def __init__(self, data_cfg: Any, artifacts_dir: str | os.PathLike, seed: int = 0, source: str = "gold",
                 distilled_dir: str | os.PathLike | None = None, max_tokens: int | None = None,
                 num_workers: int | None = None, tokenizer: Any = None, max_positions: int = 2048,
                 tokenizer_path: str | os.PathLike | None = None, eval_max_tokens: int | None = None,
                 cache_dir: str | os.PathLike | None = None):
        if source not in ("gold", "distilled"):
            raise LMDataError(f"source={source!r}; a language model trains on 'gold' or 'distilled' (its own) data")
        super().__init__(data_cfg, artifacts_dir, seed=seed, source=source, distilled_dir=distilled_dir,
                         max_tokens=max_tokens, num_workers=num_workers, tokenizer_path=tokenizer_path,
                         eval_max_tokens=eval_max_tokens, cache_dir=cache_dir)
        self.lm = lm_settings(data_cfg)
        self.context = min(int(max_positions), self.lm["max_len"] or int(max_positions))
        self.tokenizer = tokenizer
        self.records: dict[str, Dataset] = {}  # the records as read (prompts for evaluation / self-distillation)

    def prepare_data(self) -> None:
        # the one process per node that may train the corpus's sentencepiece model, before the ranks' setup()
        if self.tokenizer is None and self.tokenizer_path is None and self.lm["files"] is None:
            corpus = load_corpus(self.data_cfg, cache_dir=self.cache_dir, splits=("train",))
            get_tokenizer(self.data_cfg, self.artifacts_dir, corpus["train"])

    def _read(self) -> dict[str, Dataset]:
        files = self.lm["files"]
        if files is not None:
            rows = dict(load_lm_jsonl({split: f for split, f in dict(files).items() if f}))
        else:
            rows = dict(load_corpus(self.data_cfg, cache_dir=self.cache_dir))
            if self.tokenizer is None:
                sp = (Tokenizer(self.tokenizer_path) if self.tokenizer_path is not None
                      else get_tokenizer(self.data_cfg, self.artifacts_dir, rows["train"]))
                self.tokenizer = SpmLMTokenizer(sp)
        if self.source == "distilled":
            rows["train"] = self._distilled()
        if "train" not in rows:
            raise LMDataError("data.lm.files has no train split")
        if self.tokenizer is None:
            raise LMDataError("prompt/response files need the model's tokenizer (regime.init_from=hf:<folder> "
                              "brings it)")
        return rows

    def _distilled(self) -> Dataset:
        """The model's own responses: distill.py's corpus (regime.distilled_dir, else the corpus's one complete
        distilled corpus; its manifest's tokenizer must be this run's), or a folder of *.jsonl records without a
        manifest (responses made elsewhere). Prompts the model answered with nothing are left out, counted."""
        folder = self.distilled_dir
        if folder is None:
            try:
                folder = distilled.find_distilled_corpus(self.corpus_artifacts_dir)
            except distilled.DistillError as e:
                raise LMDataError(f"regime.source=distilled: {e}") from None
        if (Path(folder) / distilled.MANIFEST).is_file():
            m = distilled.read_manifest(folder)
            if m.get("kind") != "lm":
                raise LMDataError(f"{folder} holds a translation teacher's corpus; a decoder-only model trains on "
                                  "its own answers (python distill.py with the model as its teacher)")
            if self.tokenizer is not None and m.get("tokenizer_hash") not in (None, self.tokenizer.hash):
                raise LMDataError(f"the distilled corpus {folder} was made with tokenizer sha256 "
                                  f"{str(m['tokenizer_hash'])[:12]}, but this run uses {self.tokenizer.hash[:12]}")
            ds = distilled.load_distilled_corpus(folder, vocab_size=getattr(self.tokenizer, "vocab_size", None))
        else:
            found = sorted(Path(folder).glob("*.jsonl"))
            if not found:
                raise LMDataError(f"regime.source=distilled needs the model's own responses (*.jsonl) in "
                                  f"{folder}; run distill.py with the model as its teacher first")
            ds = load_lm_jsonl({"train": [str(f) for f in found]})["train"]
        if "response" in ds.column_names:
            n = len(ds)
            ds = ds.filter(lambda r: r.get("messages") is not None or bool((r["response"] or "").strip()))
            if len(ds) < n:
                log.warning("distilled corpus %s: %d prompt(s) the model answered with nothing are left out",
                            folder, n - len(ds))
        log.info("train source: the model's own responses in %s (%d records)", folder, len(ds))
        return ds

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        self.records = self._read()
        src, tgt = cfg_get(self.data_cfg, "src_lang"), cfg_get(self.data_cfg, "tgt_lang")
        for split, ds in self.records.items():
            enc = LMEncoder(self.tokenizer, self.context, self.lm["context_policy"], src_lang=src, tgt_lang=tgt)
            ids, plen, row_ids = [], [], []
            too_long = 0
            names = ds["id"] if "id" in ds.column_names else range(len(ds))
            for i, (name, rec) in enumerate(zip(names, ds)):
                try:
                    e = enc.encode(rec, where=f"{split} record {name}")
                except ResponseTooLong:
                    # a translation corpus's over-long pairs are filtered (as data.filter does for the
                    # encoder-decoder family) and counted; the user's own prompt/response files must fit
                    if self.lm["files"] is not None and not (split == "train" and self.source == "distilled"):
                        raise
                    too_long += 1
                    continue
                ids.append(e["ids"])
                plen.append(e["prompt_len"])
                row_ids.append(i)
            enc.report()
            if too_long:
                log.warning("%s: %d record(s) whose response alone exceeds the context of %d were left out",
                            split, too_long, self.context)
            self.datasets[split] = Dataset.from_dict({"row": row_ids, "ids": ids, "prompt_len": plen,
                                                      "length": [len(x) for x in ids]})
            self.stats[split] = {"rows": len(ids), "truncated": enc.truncated, "too_long": too_long}
            if not ids:
                raise LMDataError(f"split {split!r} has no records")

    def _loader(self, split: str, sampler, cls=DataLoader) -> DataLoader:
        ds = self.datasets[split].select_columns(["ids", "prompt_len"])
        return cls(ds, batch_sampler=sampler, num_workers=self.num_workers, collate_fn=functools.partial(collate_lm),
                   persistent_workers=False, pin_memory=torch.cuda.is_available())
