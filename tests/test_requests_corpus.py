"""The general chat-request corpus (bpd_train/data/requests/build.py) built from the real inputs (the bundled topic
lists, this Python's standard library, the bundled Bible corpus), the driver's prompt files made from it, and a
user's own requests file (--requests): good files split, bad ones refused in one line with nothing written."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO_ROOT

from bpd_train.app.real_model import general_prompts, main, prompts_stage
from bpd_train.data.requests import KINDS, RequestsError, build_general, kind_balanced, read_requests, split_requests
from bpd_train.data.requests.build import held_out_topic

TOPICS = REPO_ROOT / "data" / "general-requests" / "topics.txt"
BIBLE = REPO_ROOT / "data" / "bible-en-fr"


@pytest.fixture(scope="module")
def built():
    return build_general(TOPICS, BIBLE)


def _users(rec: dict) -> str:
    return " ".join(" ".join(m["content"] for m in rec["messages"] if m["role"] == "user").lower().split())


def test_the_corpus_has_30_kinds_5000_requests_and_two_held_out_splits(built):
    recs, manifest = built
    train_kinds = {r["kind"] for r in recs["train"]}
    assert len(train_kinds) >= 30 and len(recs["train"]) >= 5000
    assert manifest["counts"] == {s: len(r) for s, r in recs.items()}
    assert sum(manifest["kinds"]["train"].values()) == len(recs["train"])
    # the unseen split: only held-out kinds, none of them trained; the seen split: only training kinds
    unseen_kinds = {r["kind"] for r in recs["unseen"]}
    assert unseen_kinds == {k.name for k in KINDS if k.held_out} and not unseen_kinds & train_kinds
    assert {r["kind"] for r in recs["seen"]} <= train_kinds and len(recs["seen"]) >= 300
    assert all(manifest["kinds"]["unseen"][k] >= 3 for k in unseen_kinds)  # the chain evaluates 3 of each
    # every kind phrased more than one way somewhere, multi-turn kinds end with the request
    multi = [r for r in recs["train"] if len(r["messages"]) > 1]
    assert {r["kind"] for r in multi} == {"followup_code", "followup_verse"}
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant", "user"] for r in multi)
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in recs["train"] if r not in multi)
    # held-out records end with a reference turn (evaluate.py needs one), after their request
    for r in recs["seen"] + recs["unseen"]:
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-2]["role"] == "user"
    assert not manifest["python_modules_missing"]


def test_held_out_topics_are_disjoint_from_training_topics_by_construction(built):
    recs, manifest = built
    pct = manifest["held_out_percent"]
    train_keys = {k for r in recs["train"] for k in r["topic"].split(" | ")}
    held_keys = {k for s in ("seen", "unseen") for r in recs[s] for k in r["topic"].split(" | ")}
    assert train_keys and held_keys and not train_keys & held_keys
    assert not any(held_out_topic(k, pct) for k in train_keys)
    assert all(held_out_topic(k, pct) for k in held_keys)
    # a topic's text never appears as a whole training topic under another pool either
    names = lambda keys: {k.split(":", 1)[1].lower() for k in keys}  # noqa: E731
    assert not names(train_keys) & names(held_keys)


def test_the_corpus_is_deduplicated_and_deterministic(built):
    recs, manifest = built
    texts = [_users(r) for s in recs.values() for r in s]
    assert len(texts) == len(set(texts))
    ids = [r["id"] for s in recs.values() for r in s]
    assert len(ids) == len(set(ids))
    again, manifest2 = build_general(TOPICS, BIBLE)
    assert again == recs and manifest2 == manifest


def test_a_kind_balanced_subset_spreads_over_every_kind(built):
    recs, _ = built
    kinds = {r["kind"] for r in recs["train"]}
    sub = kind_balanced(recs["train"], 2 * len(kinds))
    assert len(sub) == 2 * len(kinds) and all(sum(r["kind"] == k for r in sub) == 2 for k in kinds)
    assert kind_balanced(recs["train"], 10**6) and len(kind_balanced(recs["train"], 10**6)) == len(recs["train"])
    assert kind_balanced(recs["train"], 5) == kind_balanced(recs["train"], 9)[:5]


def test_the_driver_writes_the_general_prompt_files_readable_as_chat_records(tmp_path):
    cfg = SimpleNamespace(data=SimpleNamespace(path=str(BIBLE), src_lang="en"))
    spec = {"source": "general", "topics": str(TOPICS), "train": 80, "validation": 18}
    out = tmp_path / "prompts"
    prompts_stage(cfg, spec, out)
    files = {p.name for p in out.iterdir()}
    assert files == {f"{s}.jsonl" for s in ("corpus", "train", "validation", "unseen", "seen")} | {"manifest.json"}
    rows = {
        s: [json.loads(x) for x in (out / f"{s}.jsonl").read_text("utf-8").splitlines()]
        for s in ("corpus", "train", "validation", "unseen", "seen")
    }
    assert len(rows["train"]) == 80 and len(rows["validation"]) == 18 and len(rows["corpus"]) >= 5000
    assert len({r["kind"] for r in rows["train"]}) >= 30 and len({r["kind"] for r in rows["validation"]}) == 9
    assert all(r["messages"][0]["role"] == "user" for s in rows.values() for r in s)  # bench/real.py --prompts
    manifest = json.loads((out / "manifest.json").read_text("utf-8"))
    assert manifest["train"] == 80 and manifest["corpus"]["counts"]["train"] == len(rows["corpus"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    prompts_stage(cfg, spec, out)  # the same settings: skipped, nothing rewritten
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    recs, _ = general_prompts(BIBLE, spec)
    assert recs["train"] == rows["train"]


# ------------------------------------------------------------------------------------------------ --requests


def test_a_requests_file_as_text_or_chat_records(tmp_path):
    text = tmp_path / "log.txt"
    text.write_text(
        "".join(f"Request number {i}: help me with task {i}\n" for i in range(30)) + "\nRequest number 0: "
        "help me with task 0\n",
        encoding="utf-8",
    )
    recs, digest = read_requests(text)
    assert len(recs) == 30 and len(digest) == 64  # the repeated line dropped, blank lines skipped
    train, held = split_requests(recs, 8, text)
    assert len(held) == 6 and len(train) == 24  # at most a fifth of the file
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert all(r["messages"][-1]["role"] == "assistant" for r in held)
    assert split_requests(recs, 8, text) == (train, held)

    chat = tmp_path / "log.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]} for i in range(9)
    ]
    lines.append({"prompt": "a plain prompt"})
    lines.append({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    chat.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    recs, _ = read_requests(chat)
    assert len(recs) == 11 and recs[0]["messages"] == [{"role": "user", "content": "q0"}]  # the answer dropped
    assert recs[9]["messages"] == [{"role": "user", "content": "a plain prompt"}]
    assert recs[10]["messages"][0]["role"] == "system"


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "no such file"),
        (b"", "the file is empty"),
        (b"\n  \n", "the file is empty"),
        (b"caf\xe9 au lait\n", "not UTF-8 text"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n', ":2: not a JSON line"),
        (b'{"messages": [{"role": "assistant", "content": "hi"}]}\n', ":1: the conversation does not end"),
        (b'{"text": "hi"}\n', ":1: a record needs"),
        (b'{"messages": [{"role": "user"}]}\n', ":1: every message needs"),
        ("".join(f"request {i}\n" for i in range(9)).encode(), "9 different request"),
        (b"same\n" * 40, "1 different request"),
    ],
)
def test_a_bad_requests_file_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, content, match):
    log = tmp_path / "log.jsonl"
    if content is not None:
        log.write_bytes(content)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # only its presence is checked before the requests file
    art = tmp_path / "art"
    with pytest.raises(SystemExit) as e:
        main(["--run", "--gguf", str(gguf), "--requests", str(log), f"paths.artifacts={art}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --requests ") and match in err and "\n" not in err, err
    assert not art.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["model.gguf", *(["log.jsonl"] if content is not None else [])]
    )


def test_requests_errors_are_value_errors_with_the_file_name(tmp_path):
    with pytest.raises(RequestsError, match=str(tmp_path / "nope.txt")):
        read_requests(Path(tmp_path / "nope.txt"))


def test_the_corpus_files_are_byte_identical_across_processes_and_hash_seeds(tmp_path):
    import os
    import subprocess
    import sys

    outs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(
            [sys.executable, "-m", "bpd_train.data.requests", str(out)],
            check=True,
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
        )
        outs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outs[0] == outs[1] and set(outs[0]) == {"train.jsonl", "seen.jsonl", "unseen.jsonl", "manifest.json"}
