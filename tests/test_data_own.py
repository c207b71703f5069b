"""A user's own corpus in one line: split files found by name and format, flat jsonl, tsv with a header, validation
and test carved from a lone train file, a default corpus name that cannot collide, any `datasets` dataset (a local
dataset folder, offline), and duplicate example ids refused."""

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, offline_env

from bpd_train import corpus_name
from bpd_train.data.corpus import CorpusError, load_corpus

ROWS = [{"en": f"sentence number {i}", "fr": f"phrase numéro {i}"} for i in range(30)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def _cfg(**kw):
    return {"format": "jsonl", "src_lang": "en", "tgt_lang": "fr", "splits": None, "name": "c", **kw}


def _pairs(ds):
    return [(t["en"], t["fr"]) for t in ds["translation"]]


def test_flat_jsonl_found_by_name(tmp_path):
    _jsonl(tmp_path / "train.jsonl", ROWS)
    _jsonl(tmp_path / "dev.jsonl", ROWS[:4])
    c = load_corpus(_cfg(path=str(tmp_path)), cache_dir=tmp_path / "cache")
    assert set(c) == {"train", "validation"}  # no test file: no test split, nothing to configure
    assert _pairs(c["validation"]) == [(r["en"], r["fr"]) for r in ROWS[:4]]


def test_tsv_header_names_the_columns(tmp_path):
    # the header says fr comes first: without reading it, en and fr would be swapped and the header a sentence
    (tmp_path / "train.tsv").write_text("fr\ten\n" + "".join(f"{r['fr']}\t{r['en']}\n" for r in ROWS))
    (tmp_path / "validation.tsv").write_text("".join(f"{r['en']}\t{r['fr']}\n" for r in ROWS[:3]))
    c = load_corpus(_cfg(format="tsv", path=str(tmp_path)), cache_dir=tmp_path / "cache")
    assert _pairs(c["train"]) == [(r["en"], r["fr"]) for r in ROWS]
    assert _pairs(c["validation"]) == [(r["en"], r["fr"]) for r in ROWS[:3]]


def test_split_from_train_is_deterministic_and_disjoint(tmp_path):
    _jsonl(tmp_path / "all.jsonl", ROWS)
    cfg = _cfg(path=str(tmp_path / "all.jsonl"), split_from_train=4)
    a = load_corpus(cfg, cache_dir=tmp_path / "c1")
    b = load_corpus(cfg, cache_dir=tmp_path / "c2")
    assert {k: len(v) for k, v in a.items()} == {"train": 22, "validation": 4, "test": 4}
    ids = {k: list(v["id"]) for k, v in a.items()}
    assert ids == {k: list(v["id"]) for k, v in b.items()}
    assert not set(ids["train"]) & set(ids["validation"]) and not set(ids["validation"]) & set(ids["test"])
    assert sorted(ids["train"] + ids["validation"] + ids["test"]) == sorted(f"all.jsonl:{i}" for i in range(1, 31))
    # train is the same whichever splits a stage asks for (distill reads train alone)
    assert list(load_corpus(cfg, cache_dir=tmp_path / "c1", splits=("train",))["train"]["id"]) == ids["train"]


def test_split_from_train_keeps_a_split_that_has_a_file(tmp_path):
    _jsonl(tmp_path / "train.jsonl", ROWS)
    _jsonl(tmp_path / "valid.jsonl", ROWS[:2])
    c = load_corpus(_cfg(path=str(tmp_path), split_from_train=5), cache_dir=tmp_path / "cache")
    assert {k: len(v) for k, v in c.items()} == {"train": 25, "validation": 2, "test": 5}


@pytest.mark.parametrize(
    "setup, pattern",
    [
        ("tsv files, jsonl asked", r"no train file .*looked for train\.jsonl.*found train\.tsv \(data\.format=tsv\)"),
        ("no validation", r"no validation split .*data\.split_from_train=N"),
        ("no path", r"data\.path is not set"),
        ("other keys", r"no 'translation' object and no 'en'/'fr' keys \(keys: source, target\).*data\.columns"),
        ("duplicate ids", r"split 'train' has duplicate example ids \(2: '0', '1'\)"),
    ],
)
def test_own_corpus_mistakes_are_named(tmp_path, setup, pattern):
    cfg = _cfg(path=str(tmp_path), split_from_train=2)
    if setup == "tsv files, jsonl asked":
        (tmp_path / "train.tsv").write_text("a\tb\n")
    elif setup == "no validation":
        _jsonl(tmp_path / "train.jsonl", ROWS)
        cfg["split_from_train"] = None
    elif setup == "no path":
        cfg["path"] = None
    elif setup == "other keys":
        _jsonl(tmp_path / "train.jsonl", [{"source": "a", "target": "b"}])
    else:
        _jsonl(tmp_path / "train.jsonl", [{"id": str(i % 4), **r} for i, r in enumerate(ROWS[:6])])
        _jsonl(tmp_path / "validation.jsonl", ROWS[:2])
        cfg["split_from_train"] = None
    with pytest.raises(CorpusError, match=pattern):
        load_corpus(cfg, cache_dir=tmp_path / "cache")


def test_jsonl_columns_map_other_keys(tmp_path):
    _jsonl(tmp_path / "train.jsonl", [{"source": r["en"], "target": r["fr"]} for r in ROWS])
    c = load_corpus(
        _cfg(path=str(tmp_path / "train.jsonl"), columns={"en": "source", "fr": "target"}, split_from_train=3),
        cache_dir=tmp_path / "cache",
    )
    assert sorted(_pairs(c["train"]) + _pairs(c["validation"]) + _pairs(c["test"])) == sorted(
        (r["en"], r["fr"]) for r in ROWS
    )


def test_any_datasets_dataset_from_a_local_folder(tmp_path):
    # what docs/data.md shows: a dataset by name (here a save_to_disk folder, so the test runs offline) whose two
    # text columns are named in data.columns; its own split names are used, the missing test split is carved
    import datasets

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"src": [r["en"] for r in ROWS], "tgt": [r["fr"] for r in ROWS]}),
            "dev": datasets.Dataset.from_dict({"src": ["hello"], "tgt": ["bonjour"]}),
        }
    ).save_to_disk(str(tmp_path / "ds"))
    cfg = _cfg(
        format="hf", hf_name=str(tmp_path / "ds"), columns={"en": "src", "fr": "tgt"}, split_from_train={"test": 5}
    )
    c = load_corpus(cfg, cache_dir=tmp_path / "cache")
    assert {k: len(v) for k, v in c.items()} == {"train": 25, "validation": 1, "test": 5}
    assert _pairs(c["validation"]) == [("hello", "bonjour")]


def test_any_datasets_builder_by_name_and_config(tmp_path):
    # load_dataset("json", data_files=...): a builder by name with its arguments, flat language columns
    _jsonl(tmp_path / "tr.jsonl", ROWS)
    _jsonl(tmp_path / "va.jsonl", ROWS[:2])
    cfg = _cfg(
        format="hf",
        hf_name="json",
        hf_kwargs={"data_files": {"train": str(tmp_path / "tr.jsonl"), "validation": str(tmp_path / "va.jsonl")}},
    )
    c = load_corpus(cfg, cache_dir=tmp_path / "cache")
    assert _pairs(c["validation"]) == [(r["en"], r["fr"]) for r in ROWS[:2]] and len(c["train"]) == 30


def test_default_corpus_name_cannot_collide(tmp_path):
    from hydra import compose, initialize_config_dir

    (tmp_path / "a" / "news").mkdir(parents=True)
    (tmp_path / "b" / "news").mkdir(parents=True)
    names = []
    for folder in (tmp_path / "a" / "news", tmp_path / "b" / "news"):
        with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=["+regime=base", "data=local", f"data.path={folder}"])
        names.append(cfg.data.name)
    assert names[0] != names[1] and all(re.fullmatch(r"news-en-fr-[0-9a-f]{6}", n) for n in names), names
    assert names[0] == corpus_name(tmp_path / "a" / "news", None, None, "en", "fr")  # stable


def _train(tmp_path, *overrides):
    cmd = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        "+regime=base",
        "experiment=smoke",
        "data=local",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        f"paths.artifacts={tmp_path}/art",
        f"hydra.run.dir={tmp_path}/hydra",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=offline_env(), capture_output=True, text=True, timeout=300)


def _bible_rows(n):
    import gzip

    with gzip.open(REPO_ROOT / "data" / "bible-en-fr" / "train.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line)["translation"] for _, line in zip(range(n), f)]


def test_own_tsv_corpus_trains_in_one_line(tmp_path):
    # the issue's command: a folder, a format, two languages; here a single tsv file with a header
    rows = _bible_rows(400)
    (tmp_path / "corpus.tsv").write_text(
        "en\tfr\n" + "".join(f"{r['en']}\t{r['fr']}\n" for r in rows), encoding="utf-8"
    )
    r = _train(tmp_path, f"data.path={tmp_path / 'corpus.tsv'}", "data.format=tsv", "data.split_from_train=16")
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((tmp_path / "art").glob("corpus-en-fr-*/base/checkpoints/last.ckpt"))
    assert len(runs) == 1, list((tmp_path / "art").rglob("*"))[:20]


def test_duplicate_ids_refused_by_train(tmp_path):
    rows = [{"id": "same" if i in (3, 7) else str(i), "translation": t} for i, t in enumerate(_bible_rows(40))]
    _jsonl(tmp_path / "train.jsonl", rows)
    _jsonl(tmp_path / "validation.jsonl", [{"translation": t} for t in _bible_rows(4)])
    r = _train(tmp_path, f"data.path={tmp_path}")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and "duplicate example ids (1: 'same')" in errors[0], r.stderr[-3000:]
