"""`LMDataModule`: BPDDataModule's sharded, token-bucketed, resumable batches over prompt/response rows
(bpd_train/data/lm.py) for decoder-only language models.

Config (`data.lm`, all optional):
  files     {train: file(s), validation: file(s)} jsonl prompt/response or chat files; null (default): the
            configured translation corpus as prompts ("English: <src>\\nFrench:" -> " <tgt>")
  template  the prompt for a translation corpus ({src}, {src_name}, {tgt_name})
  max_len   context in tokens (prompt + response + eos); longer rows follow `overflow`
  overflow  truncate_left (drop prompt tokens from the left, counted and logged) | refuse (one error naming them)
source=distilled reads the model's own responses (distill.py with the model as teacher: `*.jsonl` prompt/response
rows in `distilled_dir`) for the train split.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from datasets import Dataset
from torch.utils.data import DataLoader

from .corpus import _get, load_corpus
from .datamodule import BPDDataModule
from .lm import OVERFLOW, LMDataError, collate_lm, encode_rows, read_jsonl, translation_prompts
from .tokenizer import Tokenizer, get_tokenizer

DEFAULT_TEMPLATE = "{src_name}: {src}\n{tgt_name}:"


def lm_settings(data_cfg: Any) -> dict:
    lm = _get(data_cfg, "lm") or {}
    out = {"template": str(_get(lm, "template", DEFAULT_TEMPLATE) or DEFAULT_TEMPLATE),
           "files": _get(lm, "files"),
           "max_len": int(_get(lm, "max_len", 256) or 256),
           "overflow": str(_get(lm, "overflow", "truncate_left") or "truncate_left")}
    if out["overflow"] not in OVERFLOW:
        raise LMDataError(f"data.lm.overflow={out['overflow']!r}; expected one of {OVERFLOW}")
    return out


def _value(tok: Any, name: str) -> Any:
    v = getattr(tok, name, None)
    return v() if callable(v) else v


def special_ids(tok: Any) -> tuple[int, int | None, int]:
    """(eos, bos or None, pad) of a tokenizer whose ids are attributes (LM tokenizers) or methods (spm)."""
    eos, bos, pad = _value(tok, "eos_id"), _value(tok, "bos_id"), _value(tok, "pad_id")
    if eos is None:
        raise LMDataError(f"the tokenizer {tok!r} has no eos id; a language model needs one to stop")
    pad = eos if pad is None or int(pad) < 0 else pad  # Llama-style tokenizers have no pad: pad with eos
    return int(eos), (None if bos is None or int(bos) < 0 else int(bos)), int(pad)


class LMDataModule(BPDDataModule):
    def __init__(self, data_cfg: Any, artifacts_dir: str | os.PathLike, seed: int = 0, source: str = "gold",
                 distilled_dir: str | os.PathLike | None = None, max_tokens: int | None = None,
                 num_workers: int | None = None, tokenizer: Any = None,
                 tokenizer_path: str | os.PathLike | None = None, eval_max_tokens: int | None = None,
                 cache_dir: str | os.PathLike | None = None):
        super().__init__(data_cfg, artifacts_dir, seed=seed, source=source, distilled_dir=distilled_dir,
                         max_tokens=max_tokens, num_workers=num_workers, tokenizer_path=tokenizer_path,
                         eval_max_tokens=eval_max_tokens, cache_dir=cache_dir)
        self.lm = lm_settings(data_cfg)
        self.tokenizer = tokenizer

    def prepare_data(self) -> None:
        # the one process per node that may train the corpus's sentencepiece model, before the ranks' setup()
        if self.tokenizer is None and self.tokenizer_path is None and self.lm["files"] is None:
            corpus = load_corpus(self.data_cfg, cache_dir=self.cache_dir, splits=("train",))
            get_tokenizer(self.data_cfg, self.artifacts_dir, corpus["train"])

    def _rows(self) -> dict[str, Dataset]:
        files = self.lm["files"]
        render = getattr(self.tokenizer, "render_chat", None)
        if files is not None:
            rows = {split: read_jsonl(f, render_chat=render) for split, f in dict(files).items() if f}
        else:
            corpus = load_corpus(self.data_cfg, cache_dir=self.cache_dir)
            src, tgt = str(_get(self.data_cfg, "src_lang")), str(_get(self.data_cfg, "tgt_lang"))
            if self.tokenizer is None:
                self.tokenizer = (Tokenizer(self.tokenizer_path) if self.tokenizer_path is not None
                                  else get_tokenizer(self.data_cfg, self.artifacts_dir, corpus["train"]))
            rows = {split: translation_prompts(ds, src, tgt, self.lm["template"]) for split, ds in corpus.items()}
        if self.source == "distilled":
            found = sorted(Path(self.distilled_dir).glob("*.jsonl")) if self.distilled_dir is not None else []
            if not found:
                raise LMDataError(f"regime.source=distilled needs the model's own responses (*.jsonl) in "
                                  f"{self.distilled_dir}; run distill.py with the model as teacher first")
            rows["train"] = read_jsonl(found, render_chat=render)
        if "train" not in rows:
            raise LMDataError("data.lm.files has no train split")
        return rows

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        rows = self._rows()
        if self.tokenizer is None:
            raise LMDataError("prompt/response files need the model's tokenizer: pass tokenizer=... "
                              "(regime.init_from=hf:<folder> brings it)")
        eos, bos, _ = special_ids(self.tokenizer)
        for split, ds in rows.items():
            self.datasets[split], self.stats[split] = encode_rows(
                ds, self.tokenizer, eos_id=eos, bos_id=bos, max_len=self.lm["max_len"], overflow=self.lm["overflow"])
            if len(self.datasets[split]) == 0:
                raise LMDataError(f"split {split!r} has no rows")
        self.corpus = rows

    def _loader(self, split: str, sampler, cls=DataLoader) -> DataLoader:
        ds = self.datasets[split].select_columns(["ids", "n_prompt"])
        return cls(ds, batch_sampler=sampler, num_workers=self.num_workers,
                   collate_fn=functools.partial(collate_lm, pad_id=special_ids(self.tokenizer)[2]),
                   persistent_workers=False)
