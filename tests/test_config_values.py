"""Config values the code would refuse are refused before anything heavy is imported or loaded: one `error:` line
naming the key, the value and the choices, exit status 2, about a second (torch is never imported), and nothing on
disk. A corpus path that is not there is named before the accelerator is checked; a CPU-only machine running the
GPU default is told what to add. A run refused later (inside the command) removes the run folder Hydra made."""

import importlib
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, offline_env

# Budget of the check itself: about a second; loose here, the machine running the tests may be shared.
BUDGET_S = 6.0


def _run(script, *args, tmp, **env):
    cmd = [sys.executable, str(REPO_ROOT / script), *args, f"paths.root={tmp}/root"]
    # no CUDA device, whatever machine runs the tests: the device check is deterministic
    t0 = time.perf_counter()
    r = subprocess.run(
        cmd, cwd=tmp, env=offline_env(CUDA_VISIBLE_DEVICES="", **env), capture_output=True, text=True, timeout=300
    )
    return r, time.perf_counter() - t0


CASES = {
    "bleu_sentences not a number": (
        "evaluate.py",
        ["evaluate.bleu_sentences=abc"],
        r"^error: evaluate\.bleu_sentences must be `all`, null or a positive number of "
        r"sentences, got 'abc'",
    ),
    "bleu_sentences zero": (
        "evaluate.py",
        ["evaluate.bleu_sentences=0"],
        r"evaluate\.bleu_sentences must be .*, got 0;",
    ),
    "data format": (
        "train.py",
        ["+regime=base", "experiment=smoke", "data.format=csv"],
        r"^error: data\.format=csv: not a choice; choose one of hf, jsonl, tsv, parallel_text",
    ),
    "decode dtype": (
        "evaluate.py",
        ["decode.dtype=fp16"],
        r"^error: decode\.dtype=fp16: not a choice; choose one of fp32, bf16, int8, q4, auto "
        r"\(did you mean decode\.dtype=bf16\?\)",
    ),
    "head loss": (
        "train.py",
        ["+regime=frozen", "experiment=smoke", "regime.head_loss=foo"],
        r"^error: regime\.head_loss=foo: not a choice; choose one of random, mean, weighted",
    ),
    "head loss through loss.": (
        "train.py",
        ["+regime=frozen", "experiment=smoke", "loss.head_loss=avg"],
        r"loss\.head_loss=avg: not a choice",
    ),
    "export format": ("export.py", ["export.format=onnx"], r"export\.format=onnx: not a choice; choose one of bundle"),
    "distill action": (
        "distill.py",
        ["distill.action=runn"],
        r"distill\.action=runn: .*did you mean distill\.action=run",
    ),
    "k for the base model": (
        "train.py",
        ["+regime=base", "experiment=smoke", "model.block_size=8"],
        r"^error: model\.block_size=8: regime base trains the base model, head 1 alone; k is "
        r"for the head regimes",
    ),
    "k set on the regime": (
        "train.py",
        ["+regime=frozen", "experiment=smoke", "regime.block_size=3"],
        r"^error: regime\.block_size=3: the number of heads is set as model\.block_size",
    ),
    "schedule": (
        "train.py",
        ["+regime=base", "experiment=smoke", "optim.schedule.name=linear"],
        r"optim\.schedule\.name=linear: not a choice; choose one of inverse_sqrt, cosine, constant",
    ),
    "missing corpus": (
        "train.py",
        ["+regime=base", "data=local", "data.path=/nonexistent"],
        r"^error: data\.path=/nonexistent: no such file or folder",
    ),
    "missing corpus, evaluate": (
        "evaluate.py",
        ["data=local", "data.path=/nonexistent/corpus"],
        r"data\.path=/nonexistent/corpus: no such file or folder",
    ),
    "corpus not given": (
        "train.py",
        ["+regime=base", "experiment=smoke", "data=local"],
        r"data\.path is not set: data\.format=jsonl reads the corpus from data\.path=DIR",
    ),
    "cluster default on a CPU machine": (
        "train.py",
        ["+regime=base"],
        r"^error: trainer=gpu \(the default\) but this machine has no CUDA device: "
        r"add experiment=smoke or experiment=demo .*or trainer=cpu",
    ),
    "gpu asked for explicitly": (
        "train.py",
        ["+regime=base", "trainer.accelerator=gpu", "model=tiny"],
        r"^error: trainer\.accelerator=gpu but this machine has no CUDA device",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_value_is_one_line_before_any_work(tmp_path, case):
    script, args, pattern = CASES[case]
    r, seconds = _run(script, *args, tmp=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(pattern, lines[0]), r.stderr
    assert seconds < BUDGET_S, f"{seconds:.1f} s"
    assert not (tmp_path / "root").exists()  # no outputs/<job>/<time>/, no artifacts


def test_corpus_path_is_named_before_the_device(tmp_path):
    """The GPU default and a missing corpus: the corpus is what the user gets to fix first."""
    r, _ = _run("train.py", "+regime=base", "data=local", "data.path=/nonexistent", tmp=tmp_path)
    assert r.returncode == 2 and "data.path=/nonexistent" in r.stderr and "CUDA" not in r.stderr, r.stderr


def test_checks_import_nothing_heavy(tmp_path):
    """The whole check (compose, values, paths, device) runs without torch, Lightning or transformers."""
    code = (
        "import sys; from bpd_train.app.cli import check_config\n"
        "try:\n    check_config('train', ['+regime=base', 'data.format=csv'], 'python train.py')\n"
        "except SystemExit as e:\n    assert e.code == 2\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'transformers', 'datasets') if m in sys.modules)\n"
        "assert not heavy, heavy\nprint('ok')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_valid_values_pass(tmp_path):
    from bpd_train.app.cli import check_config

    check_config("evaluate", ["evaluate.bleu_sentences=all", "decode.dtype=int8"], "python evaluate.py")
    check_config("evaluate", ["decode.dtype=auto"], "python evaluate.py")  # by the model's file type
    check_config("evaluate", ["evaluate.bleu_sentences=200", "decode=greedy"], "python evaluate.py")
    check_config(
        "train",
        ["+regime=both", "experiment=smoke", "regime.head_loss=weighted", "data.format=jsonl"],
        "python train.py",
    )
    check_config("train", ["+regime=base", "trainer=cpu"], "python train.py")
    check_config("train", ["+regime=base", "data=local", f"data.path={tmp_path}", "trainer=cpu"], "python train.py")
    check_config("export", ["export.format=vllm"], "python export.py")


# where the code that reads each key keeps its choices: the pre-check's table must say the same
SOURCES = {
    "data.format": ("bpd_train.data.corpus", "FORMATS"),
    "regime.head_loss": ("bpd_train.training.losses", "HEAD_LOSSES"),  # the same tuple, imported (configs.py)
    "loss.head_loss": ("bpd_train.training.losses", "HEAD_LOSSES"),
    "regime.trainable": ("bpd_train.training.regimes", "TRAINABLE"),
    "regime.source": ("bpd_train.training.regimes", "SOURCES"),
    "optim.schedule.name": ("bpd_train.training.optim", "SCHEDULES"),
    "model.heads": ("bpd_train.model.lm.config", "HEAD_TYPES"),
    "decode.dtype": ("bpd_train.decode_settings", "DTYPE_CHOICES"),
    "export.format": ("bpd_train.app.export", "FORMATS"),
    "distill.action": ("bpd_train.distillation.job", "ACTIONS"),
}


@pytest.mark.parametrize("key", SOURCES)
def test_pre_check_choices_match_the_code(key):
    from bpd_train.app.cli import CHOICES

    module, name = SOURCES[key]
    assert set(CHOICES[key]) == set(getattr(importlib.import_module(module), name)), key


def test_refused_inside_the_run_leaves_no_run_folder(tmp_path):
    """A mistake only the command itself finds (here: a checkpoint that is not there) is one line too, and the
    outputs/<job>/<time>/ folder Hydra made for the run is removed; a folder that was there before stays."""
    keep = tmp_path / "root" / "outputs" / "export" / "earlier"
    r, _ = _run("export.py", "experiment=smoke", "export.checkpoint=/nonexistent/run", tmp=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: checkpoint"), r.stderr[-2000:]
    assert not (tmp_path / "root").exists(), sorted(map(str, (tmp_path / "root").rglob("*")))
    keep.mkdir(parents=True)
    r, _ = _run("export.py", "experiment=smoke", "export.checkpoint=/nonexistent/run", tmp=tmp_path)
    assert r.returncode == 2
    root = tmp_path / "root"
    assert sorted(root.rglob("*")) == sorted([root / "outputs", root / "outputs" / "export", keep])


@pytest.mark.parametrize(
    "config, override, line",
    [
        ("evaluate", "decode.lookup=9", "decode.lookup=9: expected an int in 0..8 (0: off)"),  # the settings' words
        ("evaluate", "decode.adaptive=2", "decode.adaptive=2: expected true, false, auto (None) or a threshold"),
        ("evaluate", "decode.draft_vocab=30", "decode.draft_vocab is now decode.draft_top_tokens"),
        ("train", "loss.draft_vocab=30", "loss.draft_vocab is now loss.draft_lowest_ids"),
    ],
)
def test_decode_values_are_checked_by_their_declaration_before_torch(config, override, line, capsys):
    from bpd_train.app.cli import check_config

    args = [override] + (["+regime=frozen"] if config == "train" else [])
    with pytest.raises(SystemExit) as e:
        check_config(config, args, f"python {config}.py", environment=False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {line}") and err.count("\n") == 1, err
