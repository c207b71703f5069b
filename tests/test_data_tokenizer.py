"""Joint sentencepiece: special ids, round trip, small corpora, cache reuse keyed by corpus + settings."""

from pathlib import Path

import pytest
from datasets import Dataset
from omegaconf import OmegaConf

import bpd_train
from bpd_train.data import encode_source, get_tokenizer, load_corpus, tokenize_split
from bpd_train.data import tokenizer as tokmod
from bpd_train.io import sha256_file

REPO = Path(bpd_train.__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bible_cfg():
    cfg = OmegaConf.load(REPO / "conf" / "data" / "bible_en_fr.yaml")
    cfg.limit = {"train": 600, "validation": 50, "test": 50}
    cfg.spm.vocab_size = 8000  # far more than 600 verses can give: must still work
    return cfg


@pytest.fixture(scope="module")
def corpus(bible_cfg, tmp_path_factory):
    return load_corpus(bible_cfg, cache_dir=tmp_path_factory.mktemp("hf"))


def test_train_roundtrip_and_cache_reuse(bible_cfg, corpus, tmp_path, monkeypatch):
    tok = get_tokenizer(bible_cfg, tmp_path, corpus["train"])
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.sp.id_to_piece(0) == "<pad>" and tok.sp.id_to_piece(2) == "</s>"
    assert 100 < tok.vocab_size < 8000
    assert tok.path.name == "spm.model" and tok.path.parent.parent == tmp_path / "bible_en_fr" / "spm"
    assert tok.hash == sha256_file(tok.path)
    for split in ("train", "validation"):
        for tr in corpus[split]["translation"][:50]:
            for text in tr.values():
                assert tok.decode(tok.encode(text)) == text
    ids = encode_source(tok, "Au commencement")
    assert ids[-1] == tok.eos_id and tok.decode(ids) == "Au commencement"

    # reuse: same corpus + settings never retrains
    monkeypatch.setattr(tokmod, "_train", lambda *a, **k: pytest.fail("retrained a cached tokenizer"))
    again = get_tokenizer(bible_cfg, tmp_path, corpus["train"])
    assert again.path == tok.path and again.hash == tok.hash
    monkeypatch.undo()

    # another setting or another corpus is another key
    other = bible_cfg.copy()
    other.spm.vocab_size = 300
    tok2 = get_tokenizer(other, tmp_path, corpus["train"])
    assert tok2.path != tok.path and tok2.vocab_size <= 300
    tok3 = get_tokenizer(bible_cfg, tmp_path, corpus["train"].select(range(400)))
    assert tok3.path.parent != tok.path.parent
    assert sorted(p.name for p in (tmp_path / "bible_en_fr" / "spm").iterdir()) == sorted(
        {tok.path.parent.name, tok2.path.parent.name, tok3.path.parent.name}
    )  # no temp folders left


def test_pickles_by_path(bible_cfg, corpus, tmp_path):
    import pickle

    tok = get_tokenizer(bible_cfg, tmp_path, corpus["train"])
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("Dieu créa") == tok.encode("Dieu créa") and clone.hash == tok.hash


@pytest.mark.parametrize("model_type", ["bpe", "char"])
def test_other_model_types_on_a_tiny_corpus(tmp_path, model_type):
    ds = Dataset.from_dict({"translation": [{"en": f"the cat sat {i}", "fr": f"le chat {i}"} for i in range(30)]})
    cfg = OmegaConf.create(
        {"name": "tiny", "src_lang": "en", "tgt_lang": "fr", "spm": {"vocab_size": 60, "model_type": model_type}}
    )
    tok = get_tokenizer(cfg, tmp_path, ds)
    assert tok.decode(tok.encode("le chat 7")) == "le chat 7"


def test_tokenize_filters_train_and_logs_counts(bible_cfg, corpus, tmp_path, caplog):
    tok = get_tokenizer(bible_cfg, tmp_path, corpus["train"])
    cfg = bible_cfg.copy()
    cfg.filter = {"min_len": 3, "max_len": 40, "max_ratio": 1.5}
    with caplog.at_level("INFO", logger="bpd_train.data.mt.processing"):
        enc, stats = tokenize_split(corpus["train"], tok, cfg, "train", num_proc=2)
    d = stats["dropped"]
    assert d["max_len"] > 0 and d["max_ratio"] > 0
    assert stats["kept"] == len(enc) == stats["rows"] - sum(d.values())
    assert "filter train: kept" in caplog.text and "max_ratio" in caplog.text
    for row in enc.select(range(50)):
        assert row["src"][-1] == tok.eos_id
        assert row["length"] == max(len(row["src"]), len(row["tgt"]) + 1) <= 40
        text = corpus["train"][row["row"]]["translation"]
        assert row["tgt"] == tok.encode(text["fr"]) and row["src"][:-1] == tok.encode(text["en"])
    # validation is not filtered by min_len / max_ratio, only rows the model cannot read (longer than max_len)
    # are left out and counted; num_proc 1 and 2 give the same rows
    val, vstats = tokenize_split(corpus["validation"], tok, cfg, "validation", num_proc=1)
    val2, _ = tokenize_split(corpus["validation"], tok, cfg, "validation", num_proc=2)
    assert vstats["dropped"]["min_len"] == vstats["dropped"]["max_ratio"] == 0
    assert len(val) == len(corpus["validation"]) - vstats["dropped"]["max_len"] and max(val["length"]) <= 40
    assert val["src"] == val2["src"] and val["tgt"] == val2["tgt"]
    whole, wstats = tokenize_split(corpus["validation"], tok, bible_cfg, "validation", num_proc=1)
    assert len(whole) == len(corpus["validation"]) and wstats["dropped"]["max_len"] == 0  # the default max_len


def test_tokenization_is_cached_by_datasets(bible_cfg, corpus, tmp_path, monkeypatch):
    from bpd_train.data.mt import processing

    tok = get_tokenizer(bible_cfg, tmp_path, corpus["validation"])
    first, _ = tokenize_split(corpus["validation"], tok, bible_cfg, "validation", num_proc=1)
    assert first.cache_files
    monkeypatch.setattr(processing._Encode, "__call__", lambda *a, **k: pytest.fail("re-tokenized a cached split"))
    again, _ = tokenize_split(corpus["validation"], tok, bible_cfg, "validation", num_proc=1)
    assert again.cache_files == first.cache_files and again["src"] == first["src"]
