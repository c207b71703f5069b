"""Distillation bookkeeping without a model: worker detection, shard plan, manifest, verify, find/load."""

import json

import pytest

from bpd_train.data.distilled import (
    DistillError,
    TeacherSettings,
    check_compatible,
    find_distilled_corpus,
    load_distilled_corpus,
    new_manifest,
    plan_shards,
    read_manifest,
    remove_stale_temps,
    shard_is_done,
    shards_for_worker,
    verify_corpus,
    write_manifest,
    write_shard,
)
from bpd_train.data.sampler import length_batches as token_batches
from bpd_train.distillation.job import command_from_overrides
from bpd_train.distillation.workers import detect_worker

SETTINGS = TeacherSettings("a" * 64, "b" * 64, 4, 0.6, [1.5, 10], "train", "en", "fr")


# ------------------------------------------------------------------------------------------- workers


@pytest.mark.parametrize(
    "env,expect",
    [
        ({}, (0, 1)),
        ({"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1"}, (1, 3)),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, (2, 4)),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1"}, (0, 1)),  # the batch script
        ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "0"}, (5, 8)),
        (
            {
                "SLURM_ARRAY_TASK_ID": "3",
                "SLURM_ARRAY_TASK_COUNT": "3",
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_MAX": "3",
            },
            (2, 3),
        ),
        (
            {
                "SLURM_ARRAY_TASK_ID": "4",
                "SLURM_ARRAY_TASK_COUNT": "3",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_ARRAY_TASK_MAX": "4",
            },
            (2, 3),
        ),  # --array=0-4:2
        (
            {
                "SLURM_ARRAY_TASK_ID": "1",
                "SLURM_ARRAY_TASK_COUNT": "2",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2",
            },
            (3, 4),
        ),  # array task x srun rank
        ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, (0, 2)),  # torchrun wins
    ],
)
def test_detect_worker(env, expect):
    w = detect_worker(env)
    assert (w.index, w.count) == expect


def test_detect_worker_explicit_and_errors():
    assert (detect_worker({"RANK": "1", "WORLD_SIZE": "2"}, 3, 5).index) == 3
    for kw in ({"index": 1, "count": None}, {"index": 2, "count": 2}):
        with pytest.raises(DistillError):
            detect_worker({}, **kw)
    with pytest.raises(DistillError, match="SLURM_ARRAY_TASK_COUNT"):
        detect_worker({"SLURM_ARRAY_TASK_ID": "0"})
    with pytest.raises(DistillError, match="not an integer"):
        detect_worker({"RANK": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("n_shards,workers", [(1, 1), (7, 2), (7, 3), (3, 5), (10, 10)])
def test_every_shard_exactly_once(n_shards, workers):
    got = sorted(s for w in range(workers) for s in shards_for_worker(n_shards, w, workers))
    assert got == list(range(n_shards))


# ---------------------------------------------------------------------------------------------- plan


def test_plan_and_teacher_id():
    ids = [f"x{i}" for i in range(23)]
    shards = plan_shards(ids, 10)
    assert [(s["start"], s["stop"]) for s in shards] == [(0, 10), (10, 20), (20, 23)]
    assert shards == plan_shards(list(ids), 10)  # deterministic
    assert shards[2]["file"] == "shard-00002-of-00003.jsonl"
    tid = SETTINGS.teacher_id
    assert tid.startswith("train-b4-a0.6-") and tid == TeacherSettings(*SETTINGS.__dict__.values()).teacher_id
    for change in (
        {"teacher_sha256": "c" * 64},
        {"tokenizer_hash": "d" * 64},
        {"beam_size": 5},
        {"length_penalty": 1.0},
        {"max_len": 200},
        {"split": "validation"},
        {"tgt_lang": "de"},
    ):
        assert TeacherSettings(**{**SETTINGS.__dict__, **change}).teacher_id != tid, change


def test_token_batches():
    lengths = [5, 1, 9, 3, 3, 7, 2, 8]
    batches = token_batches(lengths, max_tokens=16, max_sentences=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 16)
    assert batches[0][0] == 2  # longest first
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat, reverse=True)
    assert token_batches([50], 4, 4) == [[0]]  # an over-long row still gets a batch


def test_new_manifest_errors():
    with pytest.raises(DistillError, match="no examples"):
        new_manifest(SETTINGS, [], 10, corpus="c", teacher_path="t", limit=None, command="c")
    with pytest.raises(DistillError, match=r"duplicate example ids \(1: 'a'\)"):
        new_manifest(SETTINGS, ["a", "b", "a"], 10, corpus="c", teacher_path="t", limit=None, command="c")


def test_check_compatible(tmp_path):
    ids = [str(i) for i in range(5)]
    m = new_manifest(SETTINGS, ids, 2, corpus="c", teacher_path="t", limit=None, command="python distill.py")
    check_compatible(m, json.loads(json.dumps(m)), tmp_path)
    other = new_manifest(
        TeacherSettings(**{**SETTINGS.__dict__, "teacher_sha256": "f" * 64}),
        ids,
        2,
        corpus="c",
        teacher_path="t2",
        limit=None,
        command="x",
    )
    with pytest.raises(DistillError, match="another teacher.*teacher_sha256"):
        check_compatible(m, other, tmp_path)
    fewer = new_manifest(SETTINGS, ids[:3], 2, corpus="c", teacher_path="t", limit=3, command="x")
    with pytest.raises(DistillError, match="different selection.*overwrite"):
        check_compatible(m, fewer, tmp_path)


def test_command_from_overrides():
    cmd = command_from_overrides(
        [
            "experiment=smoke",
            "distill.worker_index=1",
            "distill.limit=5",
            "distill.action=run",
            "hydra.run.dir=x",
            "distill.teacher=/a b",
        ]
    )
    assert cmd == "python distill.py experiment=smoke distill.limit=5 'distill.teacher=/a b'"
    assert command_from_overrides(["num_threads=1", "distill.limit=5"]) == "python distill.py distill.limit=5"


def test_num_threads_is_one_override_for_every_entry_point():
    """`num_threads=1` on make demo's command line goes to every stage: distill.py takes it as train.py and
    evaluate.py do (distill.num_threads follows it unless set itself)."""
    from bpd_train.app.pipeline import compose

    for name in ("train", "evaluate", "distill"):
        assert compose(name, ["num_threads=1"]).num_threads == 1
    assert compose("distill", ["num_threads=1"]).distill.num_threads == 1
    assert compose("distill", ["num_threads=1", "distill.num_threads=2"]).distill.num_threads == 2
    assert compose("distill", []).distill.num_threads is None


# ------------------------------------------------------------------------------------ verify / load


def _record(i):
    hyp = f"the teacher says hyp {i} here"
    return {
        "id": i,
        "translation": {"en": f"src {i}", "fr": hyp},
        "teacher_ids": [5, 6],
        "teacher_score": -1.5,
        "gold": hyp if int(i.split(".")[-1]) % 2 else f"gold {i}",
    }


def _fake_corpus(root, n=7, shard_size=3, write=True):
    ids = [f"1.1.{i}" for i in range(n)]
    out = root / "bible" / "distill" / SETTINGS.teacher_id
    m = new_manifest(
        SETTINGS,
        ids,
        shard_size,
        corpus="bible",
        teacher_path="t",
        limit=None,
        command="python distill.py experiment=smoke",
    )
    write_manifest(out, m)
    if write:
        for s in m["shards"]:
            write_shard(out / s["file"], [_record(i) for i in ids[s["start"] : s["stop"]]])
    return out, m, ids


def test_verify_find_load(tmp_path):
    out, m, ids = _fake_corpus(tmp_path)
    with pytest.raises(DistillError, match="not complete.*python distill.py experiment=smoke"):
        find_distilled_corpus(tmp_path / "bible")
    with pytest.raises(DistillError, match="not complete"):
        load_distilled_corpus(out)
    done = verify_corpus(out)
    assert done["complete"] and {s["state"] for s in done["shards"]} == {"done"}
    b = done["teacher_bleu"]
    assert 0 < b["bleu"] < 100 and "nrefs:1" in b["bleu_signature"] and b["num_sentences"] == 7
    assert read_manifest(out)["complete"]
    assert find_distilled_corpus(tmp_path / "bible") == out
    ds = load_distilled_corpus(out)
    assert ds["id"] == ids and ds[0]["translation"] == {"en": "src 1.1.0", "fr": "the teacher says hyp 1.1.0 here"}
    assert ds[0]["teacher_ids"] == [5, 6] and ds[0]["gold"] == "gold 1.1.0"
    assert set(ds.column_names) == {"id", "translation", "teacher_ids", "teacher_score", "gold"}


def test_verify_finds_missing_bad_and_duplicate_shards(tmp_path):
    out, m, ids = _fake_corpus(tmp_path)
    (out / m["shards"][1]["file"]).unlink()
    with pytest.raises(DistillError, match=r"incomplete: 2/3 shards done.*shard-00001-of-00003.jsonl: missing"):
        verify_corpus(out)
    assert read_manifest(out)["shards"][1]["state"] == "missing" and not read_manifest(out)["complete"]
    # a shard holding another shard's ids (duplicates across shards) or a truncated one is "bad"
    write_shard(out / m["shards"][1]["file"], [{"id": ids[0], "translation": {"en": "", "fr": ""}, "gold": ""}] * 3)
    with pytest.raises(DistillError, match="ids differ"):
        verify_corpus(out)
    (out / m["shards"][1]["file"]).write_text("{not json\n")
    with pytest.raises(DistillError, match="unreadable"):
        verify_corpus(out)
    assert not shard_is_done(out, m["shards"][1]) and shard_is_done(out, m["shards"][0])


def test_load_refuses_changed_shard(tmp_path):
    out, m, _ = _fake_corpus(tmp_path)
    verify_corpus(out)
    with open(out / m["shards"][0]["file"], "a") as f:
        f.write("\n")
    with pytest.raises(DistillError, match="changed since"):
        load_distilled_corpus(out)


def test_find_errors(tmp_path):
    with pytest.raises(DistillError, match="no distilled corpus.*python distill.py experiment=smoke"):
        find_distilled_corpus(tmp_path / "bible", command="python distill.py experiment=smoke")
    out, _, _ = _fake_corpus(tmp_path)
    verify_corpus(out)
    other = out.parent / "train-b1-a0-000000000000"
    other.mkdir()
    m2 = read_manifest(out)
    write_manifest(other, m2)
    with pytest.raises(DistillError, match="2 complete distilled corpora"):
        find_distilled_corpus(tmp_path / "bible")
    m2["split"] = "validation"
    write_manifest(other, m2)
    assert find_distilled_corpus(tmp_path / "bible") == out  # the train split is the one to train on
    assert find_distilled_corpus(tmp_path / "bible", split="validation") == other


def test_remove_stale_temps(tmp_path):
    """Only our temp files (host and pid in the name) of a process that is gone: a live writer's, another shard's
    and a file not named by us stay."""
    import os
    import socket
    import subprocess
    import sys

    host = socket.gethostname()
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    (tmp_path / f".shard-00000-of-00002.jsonl.bpd-{host}-{dead}-abc123.tmp").write_text("partial")
    live = tmp_path / f".shard-00000-of-00002.jsonl.bpd-{host}-{os.getpid()}-def456.tmp"
    live.write_text("being written")
    other = tmp_path / f".shard-00001-of-00002.jsonl.bpd-{host}-{dead}-ghi789.tmp"
    other.write_text("another shard's")
    foreign = tmp_path / ".shard-00000-of-00002.jsonl.abc.tmp"
    foreign.write_text("not named by us")
    assert remove_stale_temps(tmp_path, ["shard-00000-of-00002.jsonl"]) == 1
    assert live.exists() and other.exists() and foreign.exists()


def test_find_self_corpus_takes_only_that_models_greedy_output(tmp_path):
    """Regime source `self`: a corpus counts only when written by that very model (sha256) with beam 1 and no
    sampling; other corpora under distill/ (the teacher's beam output, another model's) are ignored, a wrong one
    given explicitly is refused, and none found names the command that makes it."""
    from bpd_train.data.distilled import FORMAT_VERSION, find_self_corpus

    root = tmp_path / "bible" / "distill"
    me, other = "c" * 64, "d" * 64

    def corpus(name, sha, beam, complete=True, **extra):
        m = {
            "teacher_sha256": sha,
            "beam_size": beam,
            "split": "train",
            "complete": complete,
            "teacher_path": f"/runs/{name}",
            "num_shards": 1,
            "num_done_shards": int(complete),
            "shards": [],
            "format": FORMAT_VERSION,
            **extra,
        }
        write_manifest(root / name, m)
        return root / name

    beam4 = corpus("mine-beam4", me, 4)
    corpus("other-greedy", other, 1)
    corpus("mine-sampled", me, 1, kind="lm", temperature=0.7)
    with pytest.raises(
        DistillError,
        match=r"no corpus of /runs/me's own greedy output.*teacher=/runs/me "
        r"distill.beam_size=1",
    ):
        find_self_corpus(tmp_path / "bible", me, model="/runs/me")
    half = corpus("mine-greedy", me, 1, complete=False)
    with pytest.raises(DistillError, match="not complete"):
        find_self_corpus(tmp_path / "bible", me, model="/runs/me")
    done = corpus("mine-greedy", me, 1)
    assert done == half and find_self_corpus(tmp_path / "bible", me, model="/runs/me") == done
    assert find_self_corpus(tmp_path / "bible", me, model="/runs/me", given=done) == done
    with pytest.raises(
        DistillError,
        match=r"mine-beam4 is not /runs/me's own greedy output \(teacher /runs/mine-beam4, "
        r"beam 4\)",
    ):
        find_self_corpus(tmp_path / "bible", me, model="/runs/me", given=beam4)
    corpus("mine-greedy-2", me, 1)
    with pytest.raises(DistillError, match="2 complete corpora.*regime.distilled_dir"):
        find_self_corpus(tmp_path / "bible", me, model="/runs/me")
