"""Tokenization (datasets.map, num_proc, cached) and length / length-ratio filtering, plus `collate`.

Tokenized rows: `row` (index in the split as loaded), `id`, `src` (pieces + eos, what the encoder reads),
`tgt` (pieces only; collate adds bos / eos), `length` = max(len(src), len(tgt) + 1) — the longer of the
two padded tensors a row occupies, which is what the batch sampler's token budget counts.

Filters (`data.filter`, applied to the training split only, so validation/test stay comparable; validation/test
rows longer than max_len are left out too, counted and logged, because the model cannot read them):
  min_len   drop if either side has fewer pieces (without specials)
  max_len   drop if either side has more pieces + 1 special (len(src) or len(tgt_in)) than this
  max_ratio drop if max(pieces) / max(1, min(pieces)) exceeds this
The log line says how many rows each rule dropped (the first rule that fails is the one counted).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch
from datasets import Dataset

from bpd_train.data.corpus import cfg_get
from bpd_train.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

log = logging.getLogger(__name__)

DROP_REASONS = ("", "min_len", "max_len", "max_ratio")


def _filter_settings(data_cfg: Any) -> tuple[int, int | None, float | None]:
    f = cfg_get(data_cfg, "filter") or {}
    min_len = int(cfg_get(f, "min_len", 1) or 0)
    max_len = cfg_get(f, "max_len")
    max_ratio = cfg_get(f, "max_ratio")
    return min_len, (int(max_len) if max_len else None), (float(max_ratio) if max_ratio else None)


class _Encode:
    """A picklable, hashable map function (datasets fingerprints it for the cache)."""

    def __init__(self, tok: Tokenizer, src: str, tgt: str, min_len: int, max_len: int | None,
                 max_ratio: float | None):
        self.tok, self.src, self.tgt = tok, src, tgt
        self.min_len, self.max_len, self.max_ratio = min_len, max_len, max_ratio

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        # the tokenizer's special ids, not ours: an imported model's tokenizer (hf_tokenizer.ModelTokenizer) has its own
        tok = self.tok
        srcs = tok.encode_batch([tr[self.src] for tr in batch["translation"]])
        if "teacher_ids" in batch:  # a distilled corpus: the teacher's pieces are the target, as decoded
            specials = (tok.pad_id, tok.bos_id, tok.eos_id)
            tgts = [[int(i) for i in ids if i not in specials] for ids in batch["teacher_ids"]]
        else:
            tgts = tok.encode_target_batch([tr[self.tgt] for tr in batch["translation"]])
        out_src, lengths, drop = [], [], []
        for s, t in zip(srcs, tgts):
            out_src.append(s + [tok.eos_id])
            lengths.append(max(len(s), len(t)) + 1)
            ls, lt = len(s), len(t)
            if min(ls, lt) < self.min_len:
                drop.append(1)
            elif self.max_len is not None and max(ls, lt) + 1 > self.max_len:
                drop.append(2)
            elif self.max_ratio is not None and max(ls, lt) / max(1, min(ls, lt)) > self.max_ratio:
                drop.append(3)
            else:
                drop.append(0)
        return {"row": indices, "src": out_src, "tgt": tgts, "length": lengths, "drop": drop}


def tokenize_split(ds: Dataset, tok: Tokenizer, data_cfg: Any, split: str, apply_filter: bool | None = None,
                   num_proc: int | None = None) -> tuple[Dataset, dict]:
    """Tokenize one split (cached by datasets) and, for train by default, filter it. Returns (dataset, stats)."""
    src, tgt = str(cfg_get(data_cfg, "src_lang")), str(cfg_get(data_cfg, "tgt_lang"))
    min_len, max_len, max_ratio = _filter_settings(data_cfg)
    if apply_filter is None:
        apply_filter = split == "train"
    num_proc = num_proc if num_proc is not None else cfg_get(data_cfg, "num_proc")
    num_proc = int(num_proc) if num_proc and int(num_proc) > 1 and len(ds) >= 2 * int(num_proc) else None
    fn = _Encode(tok, src, tgt, min_len, max_len, max_ratio)
    enc = ds.map(fn, batched=True, batch_size=1000, with_indices=True, num_proc=num_proc,
                 remove_columns=[c for c in ds.column_names if c != "id"], desc=f"tokenize {split}")
    drops = np.asarray(enc.data.column("drop").to_numpy(zero_copy_only=False))
    counts = np.bincount(drops, minlength=len(DROP_REASONS)) if len(drops) else np.zeros(len(DROP_REASONS), int)
    stats = {"split": split, "rows": len(enc), "kept": len(enc)}
    if apply_filter and counts[1:].sum():
        keep = np.flatnonzero(drops == 0)
        enc = enc.select(keep)
        stats["kept"] = len(keep)
        stats["dropped"] = {r: int(c) for r, c in zip(DROP_REASONS[1:], counts[1:])}
        log.info("filter %s: kept %d of %d; dropped %s (min_len=%s max_len=%s max_ratio=%s)", split, len(keep),
                 stats["rows"], stats["dropped"], min_len, max_len, max_ratio)
    else:
        stats["dropped"] = {r: 0 for r in DROP_REASONS[1:]}
        if apply_filter:
            log.info("filter %s: kept all %d rows", split, stats["rows"])
        elif max_len is not None:
            # Evaluation splits keep every row the model can read: a row longer than max_len (which must not exceed
            # the model's positions) would stop training at its first validation, after all its steps.
            lengths = np.asarray(enc["length"])
            keep = np.flatnonzero(lengths <= max_len)
            if len(keep) < len(enc):
                shown = ", ".join(str(i) for i in np.asarray(enc["id"])[lengths > max_len][:3])
                log.warning("%s: left out %d of %d rows longer than data.filter.max_len=%d pieces (first: %s)",
                            split, len(enc) - len(keep), len(enc), max_len, shown)
                enc = enc.select(keep)
                stats["kept"] = len(keep)
                stats["dropped"]["max_len"] = stats["rows"] - len(keep)
    enc = enc.remove_columns("drop")
    return enc, stats


def collate(examples: Sequence[dict], pad_id: int = PAD_ID, bos_id: int = BOS_ID, eos_id: int = EOS_ID) -> dict:
    """Rows with `src` (ids + eos) and `tgt` (ids) -> padded `src`, `tgt_in` (bos + ids), `tgt_out` (ids + eos).

    `idx` holds each row's index in its split as loaded (before filtering), for bookkeeping. Targets for the
    k heads are shifted views of `tgt_out`, made in the loss, not here.
    """
    b = len(examples)
    s_len = max(len(e["src"]) for e in examples)
    t_len = max(len(e["tgt"]) for e in examples) + 1
    src = torch.full((b, s_len), pad_id, dtype=torch.long)
    tgt_in = torch.full((b, t_len), pad_id, dtype=torch.long)
    tgt_out = torch.full((b, t_len), pad_id, dtype=torch.long)
    for i, e in enumerate(examples):
        s, t = e["src"], e["tgt"]
        src[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        tgt_in[i, 0] = bos_id
        tgt_out[i, len(t)] = eos_id
        if len(t):
            tt = torch.as_tensor(t, dtype=torch.long)
            tgt_in[i, 1: len(t) + 1] = tt
            tgt_out[i, : len(t)] = tt
    idx = torch.as_tensor([int(e.get("row", e.get("idx", i))) for i, e in enumerate(examples)], dtype=torch.long)
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out, "idx": idx}
