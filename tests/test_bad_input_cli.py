"""Bad input through the real command lines: every corpus problem stops train.py / evaluate.py with one error line
naming the file and exit status 2 (no Hydra traceback); export.py refuses to replace what is not a bundle."""

import json
import subprocess
import sys

import pytest

from _eval_tiny import build_tiny
from conftest import REPO_ROOT, offline_env

GOOD = json.dumps({"translation": {"en": "hello", "fr": "bonjour"}})

# case -> (format, {file: bytes}, what the error line must say)
CASES = {
    "malformed json": ("jsonl", {"train.jsonl": f"{GOOD}\n{{oops\n".encode()}, r"train.jsonl:2: malformed JSON"),
    "tsv without tab": ("tsv", {"train.tsv": b"a\tb\nno tab here\n"}, r"train.tsv:2: 1 tab-separated fields"),
    "empty side": (
        "jsonl",
        {"train.jsonl": b'{"translation": {"en": "a", "fr": " "}}\n'},
        r"train.jsonl:1: empty 'fr' side",
    ),
    "invalid utf-8": (
        "jsonl",
        {"train.jsonl": b'{"translation": {"en": "caf\xe9", "fr": "x"}}\n'},
        r"train.jsonl:1: invalid UTF-8",
    ),
    "missing file": ("jsonl", {}, r"train.jsonl does not exist"),
    "empty file": ("jsonl", {"train.jsonl": b""}, r"train.jsonl is empty"),
    "parallel mismatch": (
        "parallel_text",
        {"train.en": b"a\nb\nc\n", "train.fr": b"x\nz\n"},
        r"train.en has 3 lines, .*train.fr has 2",
    ),
}


def _write(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def _run(script, *overrides, tmp):
    cmd = [
        sys.executable,
        str(REPO_ROOT / script),
        *overrides,
        "experiment=smoke",
        f"paths.artifacts={tmp}/art",
        f"hydra.run.dir={tmp}/hydra",
    ]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=300)


def _one_error_line(r, pattern):
    import re

    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and re.search(pattern, errors[0]), r.stderr[-3000:]


@pytest.mark.parametrize("case", CASES)
def test_train_bad_corpus_one_line(tmp_path, case):
    fmt, files, pattern = CASES[case]
    data = tmp_path / "data"
    _write(data, files)
    train = {"jsonl": "train.jsonl", "tsv": "train.tsv", "parallel_text": "train"}[fmt]
    r = _run(
        "train.py",
        "+regime=base",
        "data=local",
        f"data.path={data}",
        f"data.format={fmt}",
        f"data.splits={{train:{train},validation:{train},test:{train}}}",
        tmp=tmp_path,
    )
    _one_error_line(r, pattern)


@pytest.mark.parametrize("case", ["malformed json", "empty file"])
def test_evaluate_bad_corpus_one_line(tmp_path_factory, tmp_path, case):
    fmt, files, pattern = CASES[case]
    data = tmp_path / "data"
    _write(data, {name.replace("train", "test"): b for name, b in files.items()})
    tiny = build_tiny(tmp_path_factory)
    r = _run(
        "evaluate.py",
        f"evaluate.inputs=[{tiny['run']}]",
        "data=local",
        f"data.path={data}",
        "data.splits={train:test.jsonl,validation:test.jsonl,test:test.jsonl}",
        "evaluate.split=test",
        tmp=tmp_path,
    )
    _one_error_line(r, pattern.replace("train", "test"))


def test_export_refuses_to_replace_a_user_folder(tmp_path_factory, tmp_path):
    tiny = build_tiny(tmp_path_factory)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    r = _run(
        "export.py",
        f"export.checkpoint={tiny['run']}",
        f"export.output_dir={mine}",
        "export.overwrite=true",
        tmp=tmp_path,
    )
    _one_error_line(r, "is a folder that is not a bpd-train bundle")
    assert [p.name for p in mine.iterdir()] == ["keep.txt"]
