"""Distillation runs on the bundled corpus with a tiny teacher: manifest, resume after SIGKILL, ranks and array
tasks equal one process, every bad input. A random tiny teacher keeps these fast; the smoke test at the end
uses the real smoke base model (session fixture `smoke_base`)."""

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from bpd_train.data.distilled import (
    DistillError,
    find_distilled_corpus,
    load_distilled_corpus,
    read_manifest,
)
from bpd_train.distillation import run
from bpd_train.io import sha256_file
from bpd_train.model import BPDConfig, BPDModel
from bpd_train.sources.checkpoint import write_checkpoint
from bpd_train.sources.loading import load as load_model

REPO = Path(__file__).resolve().parent.parent
CORPUS = "bible_en_fr"
N, SHARD = 40, 8  # 5 shards


def offline_env(**extra):
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="offline",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def _spm(path: Path, texts: list[str], vocab: int) -> Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=str(path / "spm"),
        vocab_size=vocab,
        model_type="unigram",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    return path / "spm.model"


def _tiny_teacher(ckpt: Path, tok: Path, seed: int = 0) -> Path:
    import sentencepiece as spm

    v = spm.SentencePieceProcessor(model_file=str(tok)).get_piece_size()
    torch.manual_seed(seed)
    m = BPDModel(
        BPDConfig(
            vocab_size=v,
            d_model=32,
            n_heads=2,
            n_encoder_layers=1,
            n_decoder_layers=1,
            d_ff=64,
            max_positions=128,
            dropout=0.0,
        )
    )
    return write_checkpoint(ckpt, m, tok, regime="base")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """Artifacts folder with a random tiny base model at <art>/bible_en_fr/base (no corpus tokenizer yet)."""
    art = tmp_path_factory.mktemp("distill_art")
    with gzip.open(REPO / "data/bible-en-fr/train.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line)["translation"] for _, line in zip(range(1500), f)]
    (art / "tok").mkdir()
    tok = _spm(art / "tok", [t[k] for t in rows for k in ("en", "fr")], 300)
    _tiny_teacher(art / CORPUS / "base/checkpoints/best.ckpt", tok)
    return art


def base_overrides(art: Path, *extra: str) -> list[str]:
    return [
        "experiment=smoke",
        f"paths.artifacts={art}",
        f"distill.limit={N}",
        f"distill.shard_size={SHARD}",
        "distill.max_len=[1.0,6]",
        "distill.max_sentences=16",
        "distill.num_threads=1",
        "distill.progress=false",
        *extra,
    ]


def _cfg(overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("distill", overrides=list(overrides))


def run_inproc(overrides):
    return run(_cfg(overrides), overrides=list(overrides))


def run_cli(overrides, tmp: Path, env=None, wait=True):
    cmd = [sys.executable, str(REPO / "distill.py"), *overrides, f"hydra.run.dir={tmp}/hydra-{time.time_ns()}"]
    p = subprocess.Popen(
        cmd, cwd=REPO, env=env or offline_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if not wait:
        return p
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.jsonl"))}


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(teacher):
    """One uninterrupted single-process run into the default (teacher-id) folder."""
    summary = run_inproc(base_overrides(teacher))
    return Path(summary["out_dir"]), summary


# ------------------------------------------------------------------------------------------------ runs


def test_manifest_and_corpus(teacher, reference):
    out, summary = reference
    assert summary["complete"] and summary["decoded_shards"] == N // SHARD
    assert out.parent == teacher / CORPUS / "distill"
    m = read_manifest(out)
    ckpt = teacher / CORPUS / "base/checkpoints/best.ckpt"
    assert m["teacher_sha256"] == sha256_file(ckpt)
    assert m["tokenizer_hash"] == sha256_file(teacher / "tok/spm.model")
    assert (m["beam_size"], m["length_penalty"], m["max_len"], m["split"]) == (4, 0.6, [1.0, 6.0], "train")
    assert (m["num_examples"], m["num_shards"], m["complete"]) == (N, N // SHARD, True)
    assert [s["state"] for s in m["shards"]] == ["done"] * (N // SHARD)
    assert all(s["sha256"] == sha256_file(out / s["file"]) for s in m["shards"])
    assert set(m["teacher_bleu"]) >= {"bleu", "bleu_signature", "chrf", "num_sentences"}
    assert m["teacher_id"] == out.name and m["command"].startswith("python distill.py experiment=smoke")
    # readable by datasets, in the translation schema; ids and sources are the split's first N rows
    ds = load_distilled_corpus(out)
    with gzip.open(REPO / "data/bible-en-fr/train.jsonl.gz", "rt", encoding="utf-8") as f:
        gold = [json.loads(line) for _, line in zip(range(N), f)]
    assert ds["id"] == [g["id"] for g in gold]
    assert [t["en"] for t in ds["translation"]] == [g["translation"]["en"] for g in gold]
    assert ds["gold"] == [g["translation"]["fr"] for g in gold]
    sp = load_model(ckpt).tokenizer()
    assert all(t["fr"] == sp.decode(ids) for t, ids in zip(ds["translation"], ds["teacher_ids"]))
    assert find_distilled_corpus(teacher / CORPUS) == out
    # a rerun finds it complete and decodes nothing
    again = run_inproc(base_overrides(teacher))
    assert again["complete"] and again["decoded"] == 0


def test_sigkill_then_resume_equals_uninterrupted(teacher, reference, tmp_path):
    ref_out, _ = reference
    out = tmp_path / "killed"
    ov = base_overrides(teacher, f"distill.output_dir={out}")
    p = run_cli(ov, tmp_path, env=offline_env(BPD_DISTILL_TEST_SHARD_DELAY="2"), wait=False)
    deadline = time.time() + 120
    while len(list(out.glob("shard-*.jsonl"))) < 2 and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    done = sorted(out.glob("shard-*.jsonl"))
    assert 2 <= len(done) < N // SHARD and not read_manifest(out)["complete"]
    with pytest.raises(DistillError, match="not complete.*python distill.py"):
        load_distilled_corpus(out)
    # what a kill can leave: a temp file of the shard being written; plus a shard damaged behind our back
    missing = sorted(set(ref_out.glob("shard-*.jsonl")) - {ref_out / d.name for d in done})[0].name
    (out / f".{missing}.bpd-{socket.gethostname()}-{p.pid}-abc123.tmp").write_text('{"id": "partial"')  # (dead)
    done[0].write_text(done[0].read_text().splitlines(keepends=True)[0])
    summary = run_inproc(ov)
    assert summary["complete"] and summary["skipped"] == len(done) - 1
    assert not list(out.glob(".*.tmp"))
    assert shard_bytes(out) == shard_bytes(ref_out)
    ids = load_distilled_corpus(out)["id"]
    assert len(ids) == len(set(ids)) == N


@pytest.mark.slow
def test_two_ranks_equal_one_process(teacher, reference, tmp_path):
    ref_out, _ = reference
    out = tmp_path / "ranks"
    ov = base_overrides(teacher, f"distill.output_dir={out}")
    procs = [
        run_cli(ov, tmp_path, env=offline_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r)), wait=False)
        for r in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, e) in zip(procs, results):
        assert p.returncode == 0, e[-3000:]
    summaries = [json.loads(o.strip().splitlines()[-1]) for o, _ in results]
    assert sorted(s["worker"] for s in summaries) == [0, 1]
    assert sum(s["decoded_shards"] for s in summaries) == N // SHARD  # every shard exactly once
    assert read_manifest(out)["complete"]
    assert shard_bytes(out) == shard_bytes(ref_out)


@pytest.mark.slow
def test_lightning_ddp_equals_one_process(teacher, reference, tmp_path):
    ref_out, _ = reference
    out = tmp_path / "lightning"
    rc, o, e = run_cli(
        base_overrides(
            teacher,
            f"distill.output_dir={out}",
            "distill.launcher=lightning",
            "distill.devices=2",
            "distill.device=cpu",
        ),
        tmp_path,
    )
    assert rc == 0, e[-3000:]
    assert read_manifest(out)["complete"]
    assert shard_bytes(out) == shard_bytes(ref_out)


def test_slurm_array_tasks_then_verify(teacher, reference, tmp_path, monkeypatch):
    ref_out, _ = reference
    out = tmp_path / "array"
    ov = base_overrides(teacher, f"distill.output_dir={out}", "distill.verify=false")
    for task in range(3):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(task))
        monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
        monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "0")
        s = run_inproc(ov)
        assert s["worker"] == task and s["decoded_shards"] == len(range(task, N // SHARD, 3))
    assert not read_manifest(out)["complete"]
    for k in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN"):
        monkeypatch.delenv(k)
    s = run_inproc([f"distill.output_dir={out}", "distill.action=verify"])  # the dependent step: no teacher needed
    assert s["complete"] and read_manifest(out)["complete"]
    assert shard_bytes(out) == shard_bytes(ref_out)


# ------------------------------------------------------------------------------------------ bad input


def _expect_error(overrides, match, root: Path):
    before = snapshot(root)
    with pytest.raises(DistillError, match=match):
        run_inproc(overrides)
    assert snapshot(root) == before, "a refused run changed files"


def test_missing_base_checkpoint(tmp_path):
    _expect_error(
        ["experiment=smoke", f"paths.artifacts={tmp_path}"],
        r"no base model at .*`python train.py \+regime=base experiment=smoke paths.artifacts=",
        tmp_path,
    )
    _expect_error(
        ["experiment=smoke", f"paths.artifacts={tmp_path}", f"distill.teacher={tmp_path}/nope.ckpt"],
        "does not exist",
        tmp_path,
    )


def test_teacher_and_tokenizer_mismatch(teacher, tmp_path):
    # the tokenizer beside the checkpoint is not the one it was trained with
    bad = tmp_path / "swapped"
    bad.mkdir()
    shutil.copy(teacher / CORPUS / "base/checkpoints/best.ckpt", bad / "best.ckpt")
    (bad / "tokenizer.model").write_bytes(b"another tokenizer")
    _expect_error(base_overrides(teacher, f"distill.teacher={bad / 'best.ckpt'}"), "is not the one", teacher)
    # a teacher trained with another tokenizer than the corpus's own
    other = tmp_path / "other"
    other.mkdir()
    tok = _spm(other, ["au commencement dieu créa les cieux", "in the beginning god created the heavens"] * 50, 40)
    _tiny_teacher(other / "best.ckpt", tok)
    corpus_art = tmp_path / "art"
    shutil.copytree(teacher / CORPUS / "base", corpus_art / CORPUS / "base")
    from bpd_train.data.corpus import load_corpus
    from bpd_train.data.tokenizer import spm_settings, tokenizer_key

    cfg = _cfg(base_overrides(corpus_art))
    key = tokenizer_key(load_corpus(cfg.data)["train"], "en", "fr", spm_settings(cfg.data))
    (corpus_art / CORPUS / "spm" / key).mkdir(parents=True)
    shutil.copy(teacher / "tok/spm.model", corpus_art / CORPUS / "spm" / key / "spm.model")
    _expect_error(
        base_overrides(corpus_art, f"distill.teacher={other / 'best.ckpt'}"),
        "uses tokenizer .* but corpus 'bible_en_fr' uses",
        corpus_art,
    )


def test_folder_made_by_another_teacher(teacher, reference, tmp_path):
    ref_out, _ = reference
    loaded = load_model(teacher / CORPUS / "base")
    with torch.no_grad():
        next(loaded.model.parameters()).add_(0.01)
    other = write_checkpoint(tmp_path / "t2" / "best.ckpt", loaded.model, loaded.tokenizer_path, regime="base")
    _expect_error(
        base_overrides(teacher, f"distill.teacher={other}", f"distill.output_dir={ref_out}"),
        "another teacher or setting.*teacher_sha256",
        teacher,
    )
    _expect_error(
        base_overrides(teacher, "distill.beam_size=2", f"distill.output_dir={ref_out}"),
        "another teacher or setting.*beam_size",
        teacher,
    )
    _expect_error(base_overrides(teacher, "distill.limit=24"), "different selection.*num_examples", teacher)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    _expect_error(
        base_overrides(teacher, f"distill.output_dir={tmp_path / 'junk'}"), "not a distilled corpus", tmp_path
    )


def test_empty_or_unknown_split(teacher):
    _expect_error(
        base_overrides(teacher, "distill.split=validation", "+data.limit.validation=0"),
        "split 'validation' of corpus 'bible_en_fr' is empty",
        teacher,
    )
    _expect_error(base_overrides(teacher, "distill.split=dev"), "has no split 'dev'", teacher)
    _expect_error(base_overrides(teacher, "distill.limit=0"), "limit must be >= 1", teacher)


def test_cli_reports_bad_input_in_one_line(tmp_path):
    rc, out, err = run_cli(["experiment=smoke", f"paths.artifacts={tmp_path}"], tmp_path)
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: no base model at")


# ----------------------------------------------------------------------------------------------- smoke


@pytest.mark.slow
def test_smoke_distill_on_smoke_base(smoke_base, tmp_path):
    """`python distill.py experiment=smoke` after the smoke base run: a complete corpus the data module reads."""
    art, base = smoke_base
    mine = tmp_path / "art"  # smoke_base is shared and read-only: distill into a copy
    shutil.copytree(art / CORPUS / "spm", mine / CORPUS / "spm")
    shutil.copytree(base, mine / CORPUS / "base")
    rc, out, err = run_cli(["experiment=smoke", f"paths.artifacts={mine}"], tmp_path)
    assert rc == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["complete"]
    found = find_distilled_corpus(mine / CORPUS)
    m = read_manifest(found)
    assert m["tokenizer_hash"] == sha256_file(base / "tokenizer.model")
    assert m["teacher_bleu"]["num_sentences"] == m["num_examples"] == len(load_distilled_corpus(found))
