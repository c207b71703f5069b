"""Corpus loading: the bundled Bible corpus, every local format, the wmt14 code path offline, bad input."""

import gzip
import importlib.util
import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import bpd_train
from bpd_train.data import load_corpus

REPO = Path(bpd_train.__file__).resolve().parent.parent
BIBLE = REPO / "data" / "bible-en-fr"


def _cfg(tmp_path, **kw):
    base = {
        "name": "t",
        "format": "jsonl",
        "path": str(tmp_path),
        "src_lang": "en",
        "tgt_lang": "fr",
        "splits": {"train": "train.jsonl"},
        "on_bad_line": "error",
    }
    base.update(kw)
    return OmegaConf.create(base)


def _jsonl(path, rows):
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows), encoding="utf-8"
    )


def _pair(i, en="hello", fr="bonjour"):
    return {"id": f"x{i}", "translation": {"en": f"{en} {i}", "fr": f"{fr} {i}"}}


# ------------------------------------------------------------------------------------------ bundled corpus
def test_bundled_corpus_schema_and_book_split(tmp_path):
    cfg = OmegaConf.load(REPO / "conf" / "data" / "bible_en_fr.yaml")
    ds = load_corpus(cfg, cache_dir=tmp_path)
    assert set(ds) == {"train", "validation", "test"}
    assert 25_000 < len(ds["train"]) < 31_000
    for split in ("validation", "test"):
        assert 1000 <= len(ds[split]) <= 2000
    books = {}
    for split, d in ds.items():
        assert d.column_names == ["id", "translation"]
        ids = d["id"]
        assert len(set(ids)) == len(ids)
        books[split] = {int(i.split(".")[0]) for i in ids}
        for tr in d["translation"][:200]:
            assert set(tr) == {"en", "fr"} and tr["en"].strip() and tr["fr"].strip()
    assert not books["train"] & books["validation"]
    assert not books["train"] & books["test"]
    assert not books["validation"] & books["test"]
    ex = ds["train"][0]
    assert ex["id"] == "1.1.1"
    assert ex["translation"] == {
        "en": "In the beginning God created the heavens and the earth.",
        "fr": "Au commencement, Dieu créa les cieux et la terre.",
    }


def test_bundled_files_are_reproducible_gzip():
    for f in sorted(BIBLE.glob("*.jsonl.gz")):
        head = f.read_bytes()[:10]
        assert head[:2] == b"\x1f\x8b"
        assert head[4:8] == b"\0\0\0\0", f"{f.name}: gzip mtime must be 0 for byte-identical rebuilds"
        assert head[3] & 0x08 == 0, f"{f.name}: no file name in the gzip header"
    text = gzip.open(BIBLE / "test.jsonl.gz", "rt", encoding="utf-8").read()
    for marker in ("`", "[", "(1:", "dummy verses"):  # markup the builder strips
        assert marker not in text


def _prepare_module():
    spec = importlib.util.spec_from_file_location("prepare_bible", REPO / "data" / "prepare_bible.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prepare_bible_cleaning_and_deterministic_gzip():
    m = _prepare_module()
    assert (
        m.clean_en("As an offering of first -[fruits] you shall offer them. the priest`s", 3, 2)
        == "As an offering of first-fruits you shall offer them. the priest's"
    )
    assert (
        m.clean_en("Blessed are all those who take refuge in him. Psalm 3 A Psalm by David.", 19, 2)
        == "Blessed are all those who take refuge in him."
    )
    assert m.clean_en("Don`t utterly forsake me. BEIT", 19, 119) == "Don't utterly forsake me."
    assert m.clean_fr("(7:26) L'Éternel dit à Moïse:", 2, 1) == "L'Éternel dit à Moïse:"
    assert (
        m.clean_fr("(3:1) Psaume de David. (3:2) Éternel, que mes ennemis sont nombreux!", 19, 1)
        == "Éternel, que mes ennemis sont nombreux!"
    )
    rows = [{"id": "1.1.1", "translation": {"en": "a", "fr": "é"}}]
    assert m.gzip_jsonl(rows) == m.gzip_jsonl(rows)
    assert gzip.decompress(m.gzip_jsonl(rows)).decode() == '{"id": "1.1.1", "translation": {"en": "a", "fr": "é"}}\n'


# ---------------------------------------------------------------------------------------------- formats
def test_jsonl_direction_and_ids_from_config(tmp_path):
    _jsonl(tmp_path / "train.jsonl", [_pair(i) for i in range(5)] + [{"translation": {"en": "a", "fr": "b"}}])
    ds = load_corpus(_cfg(tmp_path, src_lang="fr", tgt_lang="en"), cache_dir=tmp_path / "c")["train"]
    assert len(ds) == 6
    assert ds[0]["translation"] == {"fr": "bonjour 0", "en": "hello 0"}
    assert ds[0]["id"] == "x0" and ds[5]["id"] == "train.jsonl:6"


def test_tsv_and_parallel_text(tmp_path):
    (tmp_path / "train.tsv").write_text("bonjour\thello\nmerci\tthanks\n", encoding="utf-8")
    cfg = _cfg(tmp_path, format="tsv", columns=["fr", "en"], splits={"train": "train.tsv"})
    ds = load_corpus(cfg, cache_dir=tmp_path / "c")["train"]
    assert ds["translation"] == [{"en": "hello", "fr": "bonjour"}, {"en": "thanks", "fr": "merci"}]

    (tmp_path / "train.en").write_text("hello\nthanks\n", encoding="utf-8")
    (tmp_path / "train.fr").write_text("bonjour\nmerci\n", encoding="utf-8")
    cfg = _cfg(
        tmp_path, format="parallel_text", splits={"train": "train", "test": {"en": "train.en", "fr": "train.fr"}}
    )
    dd = load_corpus(cfg, cache_dir=tmp_path / "c")
    assert dd["train"]["translation"] == ds["translation"] == dd["test"]["translation"]


def test_cache_sees_edited_file(tmp_path):
    f = tmp_path / "train.jsonl"
    _jsonl(f, [_pair(i) for i in range(3)])
    cfg = _cfg(tmp_path)
    assert len(load_corpus(cfg, cache_dir=tmp_path / "c")["train"]) == 3
    _jsonl(f, [_pair(i) for i in range(4)])
    assert len(load_corpus(cfg, cache_dir=tmp_path / "c")["train"]) == 4


def test_wmt14_code_path_on_a_local_file(tmp_path):
    # Same schema as load_dataset("wmt14", "de-en"): translation {de, en}, no id column. Only the name differs.
    for split, n in (("train", 6), ("validation", 2), ("test", 3)):
        _jsonl(
            tmp_path / f"{split}.jsonl", [{"translation": {"de": f"hallo {i}", "en": f"hello {i}"}} for i in range(n)]
        )
    cfg = OmegaConf.load(REPO / "conf" / "data" / "wmt14_en_de.yaml")
    assert (cfg.format, cfg.hf_name, cfg.hf_config, cfg.src_lang, cfg.tgt_lang) == ("hf", "wmt14", "de-en", "en", "de")
    cfg.hf_name, cfg.hf_config = "json", None
    cfg.hf_kwargs = {"data_files": {s: str(tmp_path / f"{s}.jsonl") for s in ("train", "validation", "test")}}
    ds = load_corpus(cfg, cache_dir=tmp_path / "c")
    assert {k: len(v) for k, v in ds.items()} == {"train": 6, "validation": 2, "test": 3}
    assert ds["train"][1] == {"id": "train-1", "translation": {"en": "hello 1", "de": "hallo 1"}}
    cfg.src_lang = "fr"
    with pytest.raises(ValueError, match="language key 'fr'"):
        load_corpus(cfg, cache_dir=tmp_path / "c")


# -------------------------------------------------------------------------------------------- bad input
def _bad_cases(tmp_path):
    good = [json.dumps(_pair(i)) for i in range(4)]
    return {
        "malformed": (good[:2] + ['{"translation": {"en": "x", "fr": '] + good[2:], r"train\.jsonl:3: malformed JSON"),
        "empty_side": (
            good[:1] + [json.dumps({"translation": {"en": "x", "fr": "  "}})] + good[1:],
            r"train\.jsonl:2: empty 'fr' side",
        ),
        "unknown_lang": (
            good[:3] + [json.dumps({"translation": {"en": "x", "de": "y"}})] + good[3:],
            r"train\.jsonl:4: language key 'fr' not in translation \(keys: de, en\)",
        ),
    }


@pytest.mark.parametrize("case", ["malformed", "empty_side", "unknown_lang", "utf8"])
def test_bad_line_error_and_skip(tmp_path, case, caplog):
    if case == "utf8":
        lines = [json.dumps(_pair(i)).encode() for i in range(4)]
        lines.insert(1, b'{"translation": {"en": "caf\xe9", "fr": "x"}}')
        (tmp_path / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        pattern = r"train\.jsonl:2: invalid UTF-8 at byte"
    else:
        lines, pattern = _bad_cases(tmp_path)[case]
        _jsonl(tmp_path / "train.jsonl", lines)
    with pytest.raises(ValueError, match=pattern):
        load_corpus(_cfg(tmp_path), cache_dir=tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger="bpd_train.data.corpus"):
        ds = load_corpus(_cfg(tmp_path, on_bad_line="skip"), cache_dir=tmp_path / "c")["train"]
    assert len(ds) == 4
    assert "skipped 1 bad line(s) of 5" in caplog.text
    assert all(tr["en"] and tr["fr"] for tr in ds["translation"])


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_parallel_files_with_different_line_counts(tmp_path, policy):
    # One line missing in the middle of the target: 'skip' used to keep every later pair shifted by one.
    en = [f"line {i}" for i in range(1, 298)]
    (tmp_path / "train.en").write_text("\n".join(en) + "\n", encoding="utf-8")
    (tmp_path / "train.fr").write_text("\n".join(en[:100] + en[101:]) + "\n", encoding="utf-8")
    cfg = _cfg(tmp_path, format="parallel_text", splits={"train": "train"}, on_bad_line=policy)
    with pytest.raises(ValueError, match=r"train\.en has 297 lines, .*train\.fr has 296; .*never skipped"):
        load_corpus(cfg, cache_dir=tmp_path / "c")


def test_empty_or_missing_split_file_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"data\.splits\.train: .*train\.jsonl is empty"):
        load_corpus(_cfg(tmp_path), cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=r"data\.splits\.train: .*nope\.jsonl does not exist"):
        load_corpus(_cfg(tmp_path, splits={"train": "nope.jsonl"}), cache_dir=tmp_path / "c")


def test_tsv_bad_fields_and_unknown_column_language(tmp_path):
    (tmp_path / "train.tsv").write_text("a\tb\nonly-one-field\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"train\.tsv:2: 1 tab-separated fields, expected 2"):
        load_corpus(_cfg(tmp_path, format="tsv", splits={"train": "train.tsv"}), cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="no language key 'fr'"):
        load_corpus(
            _cfg(tmp_path, format="tsv", columns=["en", "de"], splits={"train": "train.tsv"}), cache_dir=tmp_path / "c"
        )


def test_many_bad_lines_one_error_with_count(tmp_path):
    _jsonl(tmp_path / "train.jsonl", ["nope"] * 9 + [json.dumps(_pair(0))])
    with pytest.raises(ValueError, match=r"^9 bad line\(s\) in split 'train'.*\(and 4 more\)"):
        load_corpus(_cfg(tmp_path), cache_dir=tmp_path / "c")
