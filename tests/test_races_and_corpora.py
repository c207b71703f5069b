"""What a second writer, a careless user or an edited file can do to outputs and corpora: an output folder that
appears while an export runs is never replaced, two exports to one folder never both succeed, an edited distilled
shard is refused by its sha256, distill.overwrite and stale-temp removal delete only files of ours (of processes
that are gone), and translate stops on Ctrl-C / a non-finite --max-len with one line."""

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _eval_tiny import build_tiny
from conftest import REPO_ROOT, offline_env

from bpd_train.app.export import export_checkpoint, load_bundle
from bpd_train.data import distilled
from bpd_train.data.distilled import (
    DistillError,
    TeacherSettings,
    load_distilled_corpus,
    new_manifest,
    read_manifest,
    verify_corpus,
    write_manifest,
    write_shard,
)
from bpd_train.io import atomic_dir, atomic_write_text, sha256_file


def _dead_pid() -> int:
    return int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )


# ------------------------------------------------------------------------------------------ atomic_dir races
def test_folder_that_appears_while_writing_is_never_replaced(tmp_path):
    """Someone else creates the output (with files, or empty) after the write started: it is left as it is, the
    write fails with FileExistsError and its temp folder is gone."""
    out = tmp_path / "out"
    with pytest.raises(FileExistsError, match="appeared or changed while"):
        with atomic_dir(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"new")
            out.mkdir()
            (out / "thesis.tex").write_text("years of work")
    assert [p.name for p in out.iterdir()] == ["thesis.tex"] and (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    out2 = tmp_path / "out2"
    with pytest.raises(FileExistsError):  # even an empty folder is not ours to replace
        with atomic_dir(out2) as tmp:
            out2.mkdir()
    assert out2.is_dir() and not any(out2.iterdir())


def test_overwrite_replaces_only_the_folder_it_checked(tmp_path):
    """overwrite=True was given for a previous output of ours; while writing, it is swapped for a user's folder:
    the user's folder is put back untouched and nothing is replaced."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "ours.txt").write_text("previous output")
    ours = lambda p: {q.name for q in p.iterdir()} <= {"ours.txt"}  # noqa: E731
    with pytest.raises(FileExistsError, match="appeared or changed while"):
        with atomic_dir(out, overwrite=True, replaceable=ours) as tmp:
            (tmp / "ours.txt").write_text("new output")
            os.rename(out, tmp_path / "moved-away")
            out.mkdir()
            (out / "ours.txt").write_text("a user's folder that happens to look like ours")
    assert (out / "ours.txt").read_text().startswith("a user's")
    with atomic_dir(out, overwrite=True, replaceable=ours) as tmp:  # the folder it checked: replaced
        (tmp / "ours.txt").write_text("new output")
    assert (out / "ours.txt").read_text() == "new output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moved-away", "out"]


def test_two_concurrent_exports_one_wins(tmp_path_factory, tmp_path):
    """Two export.py to one output at the same time: exactly one exits 0, the other exits 2 with one error line,
    and the output is the winner's whole bundle."""
    tiny = build_tiny(tmp_path_factory)
    out = tmp_path / "bundle"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO_ROOT / "export.py"),
                f"export.checkpoint={tiny['run']}",
                f"export.output_dir={out}",
                "export.overwrite=false",
                "experiment=smoke",
                f"paths.artifacts={tmp_path}/art",
                f"hydra.run.dir={tmp_path}/hydra{i}",
            ],
            cwd=REPO_ROOT,
            env=offline_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    assert sorted(r[0] for r in results) == [0, 2], results
    _, _, err = next(r for r in results if r[0] == 2)
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    load_bundle(out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp folder left


# ------------------------------------------------------------------------------------- temp files of ours
def test_stale_temp_files_only_of_dead_processes(tmp_path):
    """atomic_write_* names its temp files with host and pid; only a gone process's are stale."""
    from bpd_train.io import stale_temp_files

    host = socket.gethostname()
    dead = tmp_path / f".data.json.bpd-{host}-{_dead_pid()}-abc123.tmp"
    live = tmp_path / f".data.json.bpd-{host}-{os.getpid()}-def456.tmp"
    elsewhere = tmp_path / f".data.json.bpd-another-host-{_dead_pid()}-ghi789.tmp"
    unknown = tmp_path / ".data.json.xyz.tmp"
    for p in (dead, live, elsewhere, unknown):
        p.write_text("partial")
    assert stale_temp_files(tmp_path, "data.json") == [dead]
    atomic_write_text(tmp_path / "data.json", "whole")
    assert (tmp_path / "data.json").read_text() == "whole" and len(list(tmp_path.iterdir())) == 5


# ------------------------------------------------------------------------------------------- distilled corpora
V = 50  # the teacher's vocabulary


def _corpus(folder: Path, n: int = 12, shard_size: int = 4) -> Path:
    """A complete, verified distilled corpus written the way distill.py writes one."""
    settings = TeacherSettings(
        teacher_sha256="t" * 64,
        tokenizer_hash="k" * 64,
        beam_size=1,
        length_penalty=0.0,
        max_len=[1.0, 6],
        split="train",
        src_lang="en",
        tgt_lang="fr",
    )
    ids = [f"ex{i}" for i in range(n)]
    m = new_manifest(
        settings, ids, shard_size, corpus="tiny", teacher_path="teacher", limit=None, command="python distill.py"
    )
    m["vocab_size"] = V  # what distill.py records: the teacher's vocabulary
    folder.mkdir(parents=True)
    write_manifest(folder, m)
    for s in m["shards"]:
        write_shard(
            folder / s["file"],
            [
                {
                    "id": ids[i],
                    "translation": {"en": f"source {i}", "fr": f"cible {i}"},
                    "teacher_ids": [5 + i % 7, 9, 2],
                    "teacher_score": -1.0,
                    "gold": f"gold {i}",
                }
                for i in range(s["start"], s["stop"])
            ],
        )
    verify_corpus(folder, bleu=False)
    return folder


def _rewrite(folder: Path, shard: str, old: str, new: str, rehash: bool) -> None:
    p = folder / shard
    p.write_text(p.read_text().replace(old, new, 1))
    if rehash:  # the manifest made to agree, as a careful attacker would
        m = read_manifest(folder)
        s = next(s for s in m["shards"] if s["file"] == shard)
        s.update(sha256=sha256_file(p), bytes=p.stat().st_size, mtime_ns=p.stat().st_mtime_ns)
        write_manifest(folder, m)


def test_same_size_edit_of_a_shard_is_refused(tmp_path):
    c = _corpus(tmp_path / "c")
    assert len(load_distilled_corpus(c)) == 12
    shard = read_manifest(c)["shards"][1]["file"]
    before = (c / shard).stat().st_size
    _rewrite(c, shard, "cible 5", "CIBLE 5", rehash=False)  # same size, different training target
    assert (c / shard).stat().st_size == before
    with pytest.raises(DistillError, match=f"{shard} was modified after the corpus was verified"):
        load_distilled_corpus(c)


def test_out_of_range_teacher_ids_are_one_line(tmp_path):
    c = _corpus(tmp_path / "c")
    shard = read_manifest(c)["shards"][0]["file"]
    _rewrite(c, shard, "[5, 9, 2]", f"[5, {V + 1000}, 2]", rehash=False)
    with pytest.raises(DistillError, match="changed since the corpus was verified"):
        load_distilled_corpus(c)
    _rewrite(c, shard, f"[5, {V + 1000}, 2]", f"[5, {V + 1000}, 2]", rehash=True)
    with pytest.raises(
        DistillError,
        match=rf"record 0 \(id 'ex0'\) has teacher_ids outside the vocabulary "
        rf"\[0, {V}\)",
    ):
        load_distilled_corpus(c)
    with pytest.raises(DistillError, match="outside the vocabulary"):
        load_distilled_corpus(c, vocab_size=V + 1000)  # the caller's vocabulary counts too
    assert len(load_distilled_corpus(c, vocab_size=V + 1001)) == 12


def test_shard_hashes_cost_once(tmp_path, monkeypatch):
    """Files with the size and mtime verification recorded are not hashed again; a copy (new mtimes) is hashed
    once per process, then remembered by (path, mtime_ns, size)."""
    c = _corpus(tmp_path / "c")
    calls = []
    real = distilled.sha256_file
    monkeypatch.setattr(distilled, "sha256_file", lambda p: calls.append(Path(p).name) or real(p))
    load_distilled_corpus(c)
    assert calls == []
    now = time.time() + 5
    for s in read_manifest(c)["shards"]:
        os.utime(c / s["file"], (now, now))  # e.g. copied without keeping times: content unchanged
    load_distilled_corpus(c)
    assert len(calls) == 3
    load_distilled_corpus(c)
    assert len(calls) == 3


# ------------------------------------------------------------------------------------------ distill.overwrite
CORPUS = "bible_en_fr"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    import sentencepiece as spm

    from bpd_train.model import BPDConfig, BPDModel
    from bpd_train.sources.checkpoint import write_checkpoint

    art = tmp_path_factory.mktemp("overwrite_art")
    with gzip.open(REPO_ROOT / "data/bible-en-fr/train.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line)["translation"] for _, line in zip(range(800), f)]
    (art / "tok").mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([t[k] for t in rows for k in ("en", "fr")]),
        model_prefix=str(art / "tok/spm"),
        vocab_size=200,
        model_type="unigram",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    torch.manual_seed(0)
    m = BPDModel(
        BPDConfig(
            vocab_size=200,
            d_model=16,
            n_heads=2,
            n_encoder_layers=1,
            n_decoder_layers=1,
            d_ff=32,
            max_positions=128,
            dropout=0.0,
        )
    )
    write_checkpoint(art / CORPUS / "base/checkpoints/best.ckpt", m, art / "tok/spm.model", regime="base")
    return art


def _distill(art: Path, out: Path, *extra: str):
    from hydra import compose, initialize_config_dir

    from bpd_train.distillation import run

    ov = [
        "experiment=smoke",
        f"paths.artifacts={art}",
        "distill.limit=6",
        "distill.shard_size=3",
        "distill.beam_size=1",
        "distill.max_len=[1.0,4]",
        "distill.num_threads=1",
        "distill.progress=false",
        f"distill.output_dir={out}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return run(compose("distill", overrides=ov), overrides=ov)


def test_distill_overwrite_deletes_only_what_distillation_wrote(teacher, tmp_path):
    out = tmp_path / "corpus"
    assert _distill(teacher, out)["complete"]
    (out / "notes.md").write_text("my notes on this corpus")
    (out / "analysis").mkdir()
    (out / "analysis" / "plot.png").write_bytes(b"png")
    (out / "shard-00000-of-00002.jsonl.bak").write_text("my backup")
    host = socket.gethostname()
    live = out / f".shard-00000-of-00002.jsonl.bpd-{host}-{os.getpid()}-abc123.tmp"  # a live writer's: not stale
    live.write_text("partial")
    assert _distill(teacher, out, "distill.overwrite=true")["complete"]
    assert (out / "notes.md").read_text() == "my notes on this corpus" and (out / "analysis" / "plot.png").exists()
    assert (out / "shard-00000-of-00002.jsonl.bak").read_text() == "my backup" and live.exists()
    assert len(load_distilled_corpus(out)) == 6
    assert read_manifest(out)["vocab_size"] == 200  # the teacher's: teacher ids are checked against it


# ------------------------------------------------------------------------------------------------- translate
@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tiny = build_tiny(tmp_path_factory)
    return export_checkpoint(tiny["run"], tmp_path_factory.mktemp("ctrlc") / "bundle")


@pytest.mark.parametrize("bad", [["nan", "5"], ["1", "inf"]])
def test_translate_non_finite_max_len(bundle, bad):
    import io

    from bpd_train.app.translate import main

    out, err = io.StringIO(), io.StringIO()
    rc = main(["--bundle", str(bundle), "--max-len", *bad], stdin=io.StringIO("hello\n"), stdout=out, stderr=err)
    assert rc == 2 and out.getvalue() == "" and err.getvalue().count("\n") == 1
    assert err.getvalue().startswith(f"error: max_len={bad!r}: expected finite numbers")  # the settings' one line


def test_translate_ctrl_c_reports_lines_written(bundle):
    """SIGINT while translate waits for more input: exit 130, one line 'interrupted: N of M lines written', no
    traceback, and stdout holds exactly the first N translations."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bpd_train.translate",
            "--bundle",
            str(bundle),
            "--batch-size",
            "1",
            "--max-len",
            "1",
            "3",
            "--quiet",
        ],
        cwd=REPO_ROOT,
        env=offline_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # (a background shell
    # starts children with SIGINT ignored, and Python then keeps ignoring it)
    p.stdin.write("In the beginning.\nAnd God said.\n")
    p.stdin.flush()
    first = p.stdout.readline()  # the first translation is out: the loop is running
    second = p.stdout.readline()
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    # (a first run on a machine may print one note first, while it compiles the decode kernels)
    m = re.fullmatch(r"interrupted: (\d+) of (\d+) lines written", err.splitlines()[-1])
    assert m and (int(m[1]), int(m[2])) == (2, 2), err
    assert first and second and rest == ""


def test_previous_output_removed_meanwhile_then_a_folder_appears(tmp_path):
    """overwrite=True over our previous output; during the write it is removed and a user's folder takes its
    place after the check: nothing of the user's moves, and the run fails."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FileExistsError, match="appeared or changed while"):
        with atomic_dir(out, overwrite=True) as tmp:
            (tmp / "f").write_text("new")
            out.rmdir()
            out.mkdir()
            (out / "user.txt").write_text("mine")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "user.txt").read_text() == "mine"
