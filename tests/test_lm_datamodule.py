"""Prompt/response data for decoder-only LMs (bpd_train/data/lm.py) on the bundled corpus and real jsonl files."""
from __future__ import annotations

import gzip
import itertools
import json
import logging
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from bpd_train.data.lm import IGNORE_INDEX, LMDataError, collate_lm, encode_rows, prompt_ids, read_jsonl, translation_prompts
from bpd_train.data.tokenizer import Tokenizer
from tests._eval_tiny import train_spm

REPO = Path(__file__).resolve().parent.parent
BOS, EOS, PAD = 1, 2, 0


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(train_spm(tmp_path_factory.mktemp("lmtok"), vocab_size=300))


@pytest.fixture(scope="module")
def bible_rows() -> Dataset:
    with gzip.open(REPO / "data/bible-en-fr/validation.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in itertools.islice(f, 20)]
    return Dataset.from_list(rows)


def test_translation_prompts_and_encoding(tok, bible_rows):
    ds = translation_prompts(bible_rows, "en", "fr")
    assert len(ds) == 20 and ds[0]["id"] == bible_rows[0]["id"]
    assert ds[0]["prompt"] == f"English: {bible_rows[0]['translation']['en']}\nFrench:"
    assert ds[0]["response"] == " " + bible_rows[0]["translation"]["fr"]
    enc, stats = encode_rows(ds, tok, eos_id=EOS, bos_id=BOS, max_len=1024)
    assert stats == {"rows": 20, "truncated": 0, "dropped": 0}
    r = enc[3]
    p, resp = ds[3]["prompt"], ds[3]["response"]
    assert r["ids"] == [BOS] + tok.encode(p) + tok.encode(resp) + [EOS]
    assert r["n_prompt"] == 1 + len(tok.encode(p)) and r["length"] == len(r["ids"])
    assert prompt_ids([r]) == [[BOS] + tok.encode(p)]


def test_collate_masks_response_only(tok, bible_rows):
    enc, _ = encode_rows(translation_prompts(bible_rows, "en", "fr"), tok, eos_id=EOS, bos_id=BOS, max_len=1024)
    rows = [enc[i] for i in range(4)]
    b = collate_lm(rows, PAD)
    longest = max(len(r["ids"]) for r in rows)
    assert b["inp"].shape == b["tgt_out"].shape == (4, longest - 1)
    for i, r in enumerate(rows):
        ids, n = r["ids"], r["n_prompt"]
        counted = b["tgt_out"][i] != IGNORE_INDEX
        assert b["tgt_out"][i][counted].tolist() == ids[n:]  # exactly the response tokens and the final eos
        assert counted.nonzero()[0].item() == n - 1             # first counted target: after the last prompt token
        assert b["inp"][i, : len(ids) - 1].tolist() == ids[:-1]
        assert (b["inp"][i, len(ids) - 1:] == PAD).all() and not counted[len(ids) - 1:].any()


def test_overflow_policies(tok, caplog):
    long_prompt = "In the beginning God created the heavens and the earth. " * 8
    ds = Dataset.from_dict({"id": ["a", "b"], "prompt": [long_prompt, "Hi"], "response": [" Au commencement.", " Oui."]})
    n_resp = len(tok.encode(" Au commencement.")) + 1
    with pytest.raises(LMDataError, match=r"1 row\(s\) longer than the context of 40 tokens: a \(") as e:
        encode_rows(ds, tok, eos_id=EOS, bos_id=BOS, max_len=40, overflow="refuse")
    assert "\n" not in str(e.value) and "truncate_left" in str(e.value)
    with caplog.at_level(logging.WARNING):
        enc, stats = encode_rows(ds, tok, eos_id=EOS, bos_id=BOS, max_len=40, overflow="truncate_left")
    assert stats == {"rows": 2, "truncated": 1, "dropped": 0} and "1 of 2 prompts truncated" in caplog.text
    a = enc[0]
    assert a["length"] == 40 and a["ids"][0] == BOS                 # BOS kept, the left of the prompt dropped
    assert a["ids"][1:a["n_prompt"]] == tok.encode(long_prompt)[-(a["n_prompt"] - 1):]
    assert a["ids"][a["n_prompt"]:] == tok.encode(" Au commencement.") + [EOS]
    assert len(a["ids"]) - a["n_prompt"] == n_resp
    with caplog.at_level(logging.WARNING):  # a response that alone does not fit: dropped, counted, logged
        enc, stats = encode_rows(ds, tok, eos_id=EOS, bos_id=BOS, max_len=n_resp + 1, overflow="truncate_left")
    assert stats["dropped"] == 1 and enc["id"] == ["b"] and "1 of 2 rows dropped" in caplog.text
    with pytest.raises(LMDataError, match="overflow="):
        encode_rows(ds, tok, eos_id=EOS, bos_id=BOS, max_len=40, overflow="drop")


def test_empty_response_is_an_error(tok):
    ds = Dataset.from_dict({"id": ["x1", "x2", "x3"], "prompt": ["a", "b", "c"], "response": [" ok", "  ", ""]})
    with pytest.raises(LMDataError, match=r"2 row\(s\) with an empty response: x2, x3"):
        encode_rows(ds, tok, eos_id=EOS, bos_id=BOS, max_len=64)


def test_read_jsonl_prompt_response_and_chats(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "P1", "response": "R1"}) + "\n\n"
                 + json.dumps({"id": "c", "messages": [{"role": "system", "content": "S"},
                                                       {"role": "user", "content": "U"},
                                                       {"role": "assistant", "content": "A"}]}) + "\n")
    render = lambda msgs: "".join(f"<{m['role']}>{m['content']}" for m in msgs) + "<assistant>"  # noqa: E731
    ds = read_jsonl(f, render_chat=render)
    assert ds["id"] == ["d.jsonl:1", "c"]
    assert ds["prompt"] == ["P1", "<system>S<user>U<assistant>"] and ds["response"] == ["R1", "A"]
    with pytest.raises(LMDataError, match=r"d.jsonl:3: this row is a chat but the tokenizer has no chat template"):
        read_jsonl(f)


@pytest.mark.parametrize("line,msg", [
    ("{not json", "not a JSON line"),
    (json.dumps({"prompt": "p"}), "expected string fields 'prompt' and 'response'"),
    (json.dumps({"messages": [{"role": "user", "content": "u"}, {"role": "user", "content": "v"}]}),
     "last message must be the assistant's"),
    (json.dumps([1, 2]), "expected a JSON object"),
])
def test_read_jsonl_bad_rows_name_the_line(tmp_path, line, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n" + line + "\n")
    with pytest.raises(LMDataError, match=msg) as e:
        read_jsonl(f, render_chat=lambda m: "x")
    assert "bad.jsonl:2" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(LMDataError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_collate_is_what_a_causal_lm_trains_on(tok, bible_rows):
    """Targets are the inputs shifted by one, with the eos id counted even when it is also the pad id."""
    enc, _ = encode_rows(translation_prompts(bible_rows, "en", "fr"), tok, eos_id=EOS, bos_id=None, max_len=1024)
    assert enc[0]["ids"][0] != BOS  # bos_id=None: no BOS prepended
    b = collate_lm([enc[0], enc[1]], pad_id=EOS)
    ids = enc[0]["ids"]
    n = len(ids) - 1
    assert torch.equal(b["inp"][0, 1:n], b["tgt_out"][0, : n - 1].where(b["tgt_out"][0, : n - 1] != IGNORE_INDEX,
                                                                          b["inp"][0, 1:n]))
    assert b["tgt_out"][0, n - 1].item() == EOS


# ---- LMDataModule: the bundled corpus as prompt-format translation, resumable batches, self-distilled rows ----
def _data_cfg(**lm):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "conf/data/bible_en_fr.yaml")
    cfg.limit = {"train": 120, "validation": 16, "test": 8}
    cfg.spm.vocab_size = 300
    cfg.num_proc = 1
    cfg.lm = lm
    return cfg


def test_lm_datamodule_on_the_bundled_corpus(tmp_path):
    from bpd_train.data import LMDataModule

    dm = LMDataModule(_data_cfg(max_len=96), tmp_path / "art", seed=3, max_tokens=600, cache_dir=tmp_path / "hf")
    dm.prepare_data()
    dm.setup()
    dropped = {k: s["dropped"] for k, s in dm.stats.items()}
    assert {k: len(v) + dropped[k] for k, v in dm.datasets.items()} == {"train": 120, "validation": 16, "test": 8}
    assert 0 < dropped["train"] < 20                          # the longest verses do not fit 96 tokens
    assert dm.corpus["validation"][0]["prompt"].startswith("English: ") and dm.corpus["validation"][0]["prompt"].endswith("\nFrench:")
    assert all(n <= 96 for n in dm.datasets["train"]["length"])
    loader = dm.train_dataloader()
    batches = list(loader)
    assert sum(b["inp"].shape[0] for b in batches) == len(dm.datasets["train"])  # every row once per epoch
    for b in batches:
        assert b["inp"].numel() <= 600                          # the token budget holds
        assert (b["tgt_out"] != IGNORE_INDEX).sum(1).min() >= 2  # at least one response token + eos per row
    # mid-epoch resume: the state after 2 batches gives exactly the remaining batches
    dm2 = LMDataModule(_data_cfg(max_len=96), tmp_path / "art", seed=3, max_tokens=600, cache_dir=tmp_path / "hf")
    dm2.setup()
    it = iter(dm2.train_dataloader())
    next(it), next(it)
    state = dm2.state_dict()
    dm3 = LMDataModule(_data_cfg(max_len=96), tmp_path / "art", seed=3, max_tokens=600, cache_dir=tmp_path / "hf")
    dm3.setup()
    dm3.load_state_dict(state)
    rest = list(dm3.train_dataloader())
    assert len(rest) == len(batches) - 2
    assert all(torch.equal(a["inp"], b["inp"]) for a, b in zip(rest, batches[2:]))


def test_lm_datamodule_self_distilled_train_split(tmp_path):
    from bpd_train.data import LMDataModule

    cfg = _data_cfg(max_len=96)
    dm = LMDataModule(cfg, tmp_path / "art", source="distilled", distilled_dir=tmp_path / "none",
                      cache_dir=tmp_path / "hf")
    with pytest.raises(LMDataError, match="run distill.py with the model as teacher first"):
        dm.setup()
    d = tmp_path / "distilled"
    d.mkdir()
    (d / "shard-0.jsonl").write_text(json.dumps({"id": "7", "prompt": "English: Hi\nFrench:", "response": " Salut"}) + "\n")
    dm = LMDataModule(cfg, tmp_path / "art", source="distilled", distilled_dir=d, cache_dir=tmp_path / "hf")
    dm.setup()
    assert len(dm.datasets["train"]) == 1 and dm.datasets["train"][0]["id"] == "7"
    assert len(dm.datasets["validation"]) + dm.stats["validation"]["dropped"] == 16  # still the references
