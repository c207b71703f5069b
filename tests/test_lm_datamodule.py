"""LMDataModule (bpd_train/data/lm/datamodule.py): the bundled corpus as prompt-format translation through
BPDDataModule's token-bucketed, resumable batches; self-distilled train records; the sentencepiece adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bpd_train.data.lm.processing import IGNORE, LMDataError

REPO = Path(__file__).resolve().parent.parent


def _data_cfg(**lm):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "conf/data/bible_en_fr.yaml")
    cfg.limit = {"train": 120, "validation": 16, "test": 8}
    cfg.spm.vocab_size = 300
    cfg.num_proc = 1
    cfg.lm = lm
    return cfg


def _dm(tmp_path, **kw):
    from bpd_train.data import LMDataModule

    return LMDataModule(
        _data_cfg(), tmp_path / "art", seed=3, max_tokens=900, cache_dir=tmp_path / "hf", max_positions=400, **kw
    )


def test_lm_datamodule_on_the_bundled_corpus(tmp_path):
    dm = _dm(tmp_path)
    dm.prepare_data()
    dm.setup()
    assert {k: len(v) for k, v in dm.datasets.items()} == {"train": 120, "validation": 16, "test": 8}
    tok = dm.tokenizer
    pair = dm.records["validation"][0]["translation"]
    row = dm.datasets["validation"][0]
    prompt = f"English: {pair['en'].strip()}\nFrench:"
    assert row["ids"][: row["prompt_len"]] == [1] + tok.sp.encode(prompt)  # BOS + the prompt
    assert row["ids"][row["prompt_len"] :] == tok.sp.encode(" " + pair["fr"].strip()) + [2]  # response + EOS
    assert tok.decode(row["ids"][row["prompt_len"] :]) == pair["fr"].strip()
    batches = list(dm.train_dataloader())
    assert sum(b["tokens"].shape[0] for b in batches) == 120  # every row once per epoch
    for b in batches:
        assert b["tokens"].numel() <= 900  # the token budget holds
        counted = b["targets"] != IGNORE
        assert counted.sum(1).min() >= 2  # >= one response token + EOS per row
        for r, p in enumerate(b["prompts"]):  # no prompt token is ever a target
            assert not counted[r, : len(p) - 1].any() and counted[r, len(p) - 1]
    # mid-epoch resume: the state after 2 batches gives exactly the remaining batches
    dm2 = _dm(tmp_path)
    dm2.setup()
    it = iter(dm2.train_dataloader())
    next(it), next(it)
    dm3 = _dm(tmp_path)
    dm3.setup()
    dm3.load_state_dict(dm2.state_dict())
    rest = list(dm3.train_dataloader())
    assert len(rest) == len(batches) - 2
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(rest, batches[2:]))


def test_lm_datamodule_self_distilled_train_split(tmp_path):
    dm = _dm(tmp_path, source="distilled", distilled_dir=tmp_path / "none")
    with pytest.raises(LMDataError, match="run distill.py with the model as its teacher first"):
        dm.setup()
    d = tmp_path / "distilled"
    d.mkdir()
    (d / "shard-00000-of-00001.jsonl").write_text(
        json.dumps({"id": "7", "prompt": "English: Hi\nFrench:", "response": " Salut"}) + "\n"
    )
    dm = _dm(tmp_path, source="distilled", distilled_dir=d)
    dm.setup()
    assert len(dm.datasets["train"]) == 1 and dm.records["train"][0]["response"] == " Salut"
    assert len(dm.datasets["validation"]) == 16  # evaluation stays on the references
    with pytest.raises(LMDataError, match="'gold' or 'distilled'"):
        _dm(tmp_path, source="mixed")


def test_context_policy_is_checked_and_applied(tmp_path):
    from bpd_train.data import LMDataModule

    with pytest.raises(LMDataError, match="data.lm.context_policy='drop'"):
        LMDataModule(_data_cfg(context_policy="drop"), tmp_path / "art")
    cfg = _data_cfg(max_len=60, context_policy="refuse")
    dm = LMDataModule(cfg, tmp_path / "art", cache_dir=tmp_path / "hf")
    with pytest.raises(LMDataError, match=r"train record [0-9.]+: .*context of 60"):
        dm.setup()
