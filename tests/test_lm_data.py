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
    assert stats == {"rows": 20, "truncated": 0}
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
    assert stats == {"rows": 2, "truncated": 1} and "1 of 2 prompts truncated" in caplog.text
    a = enc[0]
    assert a["length"] == 40 and a["ids"][0] == BOS                 # BOS kept, the left of the prompt dropped
    assert a["ids"][1:a["n_prompt"]] == tok.encode(long_prompt)[-(a["n_prompt"] - 1):]
    assert a["ids"][a["n_prompt"]:] == tok.encode(" Au commencement.") + [EOS]
    assert len(a["ids"]) - a["n_prompt"] == n_resp
    with pytest.raises(LMDataError, match="responses alone do not fit"):
        encode_rows(ds, tok, eos_id=EOS, bos_id=BOS, max_len=n_resp + 1, overflow="truncate_left")
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
