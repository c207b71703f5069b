"""One smoke run per regime on the bundled corpus (from the shared base smoke run), the frozen-backbone
guarantees, and the init_from mismatch errors."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, offline_env, run_train

from bpd_train.sources.checkpoint import read_checkpoint, write_checkpoint
from bpd_train.sources.loading import load as load_model

K = 4  # experiment=smoke's model.block_size


@pytest.fixture(scope="module")
def heads_art(smoke_base, tmp_path_factory) -> tuple[Path, Path]:
    """A private artifacts folder with the smoke tokenizer and base model (the shared one stays read-only)."""
    art0, base = smoke_base
    art = tmp_path_factory.mktemp("heads_artifacts")
    corpus = art / base.parent.name
    shutil.copytree(base.parent / "spm", corpus / "spm")
    shutil.copytree(base, corpus / "base", ignore=shutil.ignore_patterns("logs"))
    return art, corpus


def metrics(run: Path) -> list[dict[str, str]]:
    files = sorted(run.glob("logs/version_*/metrics.csv"))
    assert files, f"no metrics.csv under {run}"
    return [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(files[-1].open())]


def assert_run_folder(run: Path, regime: str, k: int) -> dict:
    for f in ("checkpoints/best.ckpt", "checkpoints/last.ckpt", "tokenizer.model", "config.yaml"):
        assert (run / f).is_file(), f"missing {run / f}"
    meta = read_checkpoint(run / "checkpoints" / "last.ckpt")["bpd"]
    assert meta["regime"] == regime and meta["block_size"] == k and meta["model_config"]["block_size"] == k
    rows = metrics(run)
    keys = set().union(*rows)
    want = {"train/loss", "train/tokens_per_s", "val/loss", "val/expected_accepted"}
    want |= {f"val/acc_head{i}" for i in range(1, k + 1)}
    assert want <= keys, want - keys
    assert any(k.startswith("train/loss_head") for k in keys)
    return meta


def val_sources(tok_path: Path, n: int = 12) -> torch.Tensor:
    import gzip
    import json

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tok_path))
    rows = []
    with gzip.open(REPO_ROOT / "data" / "bible-en-fr" / "validation.jsonl.gz", "rt") as f:
        for line, _ in zip(f, range(n)):
            rows.append(sp.encode(json.loads(line)["translation"]["en"])[:40] + [sp.eos_id()])
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def test_base_smoke_run(smoke_base):
    _, base = smoke_base
    meta = assert_run_folder(base, "base", 1)
    assert meta["tokenizer_hash"] and meta["trainable"] == "all"
    done = json.loads((base / "done.json").read_text())  # the marker `make demo` uses to skip a finished stage
    assert done["regime"] == "base" and done["global_step"] == 40 and Path(done["best_checkpoint"]).is_file()


def test_frozen_keeps_backbone_bit_identical_and_greedy_unchanged(heads_art):
    from bpd_train.decoding import greedy

    art, corpus = heads_art
    r = run_train("+regime=frozen", "experiment=smoke", artifacts=art)
    run = corpus / "heads" / f"frozen-k{K}"
    assert_run_folder(run, "frozen", K)
    assert "frozen finished after " in r.stdout and f"{run}\n" in r.stdout and "next: python evaluate.py" in r.stdout
    base, frozen = load_model(corpus / "base"), load_model(run / "checkpoints" / "last.ckpt")
    fsd = frozen.model.state_dict()
    for name, t in base.model.state_dict().items():
        assert torch.equal(fsd[name], t), f"backbone tensor {name} changed"
    src = val_sources(base.tokenizer_path)
    with torch.no_grad():  # heads start as copies of head 1 (zero-initialised output layer); training moved them
        h = frozen.model.features(frozen.model.encode(src), src[:, :5].clamp_min(1))
        assert not torch.equal(frozen.model.head_logits(h, 1), frozen.model.head_logits(h, 0)), "heads did not train"
    assert frozen.config.identity_p1 and frozen.tokenizer_hash == base.tokenizer_hash
    assert greedy(frozen.model, src, max_len=30).tokens == greedy(base.model, src, max_len=30).tokens


def test_chained_heads_train_on_a_frozen_backbone_and_decode_exactly(heads_art):
    """model.head_chain=true: heads 2..k that read the token before their own train in the frozen regime from a
    base (its backbone copied, the chained heads new), save, load back, and exact blockwise decoding is the base's
    greedy output."""
    from bpd_train.decoding import blockwise, greedy

    art, corpus = heads_art
    run_train(
        "+regime=frozen", "experiment=smoke", "model.head_chain=true", "regime.run_subdir=heads/chain-k4", artifacts=art
    )
    run = corpus / "heads" / f"chain-k{K}"
    meta = assert_run_folder(run, "frozen", K)
    assert meta["model_config"]["head_chain"] is True
    base, ch = load_model(corpus / "base"), load_model(run)
    assert ch.model.chained and ch.model.heads.tok.abs().sum() > 0  # the token maps trained
    src = val_sources(base.tokenizer_path)
    want = greedy(base.model, src, max_len=30).tokens
    assert blockwise(ch.model, src, max_len=30).tokens == want
    # a bundle keeps them; the transformers heads file has no format for them and says so before writing anything
    from bpd_train.app.export import export_checkpoint, load_bundle
    from bpd_train.sources.convert.common import ConvertError
    from bpd_train.sources.convert.hf import to_hf

    bundle = export_checkpoint(run, art / "chain-bundle")
    model, _, _ = load_bundle(bundle)
    assert model.chained and blockwise(model, src, max_len=30).tokens == want
    with pytest.raises(ConvertError, match="export.format=bundle"):
        to_hf(ch.model, art / "chain-hf")
    assert not (art / "chain-hf").exists()


def test_finetune_trains_everything(heads_art):
    art, corpus = heads_art
    run_train("+regime=finetune", "experiment=smoke", "regime.head_loss=mean", artifacts=art)
    run = corpus / "heads" / f"finetune-k{K}"
    meta = assert_run_folder(run, "finetune", K)
    assert meta["head_loss"] == "mean" and meta["trainable"] == "all"
    base, ft = load_model(corpus / "base"), load_model(run)
    changed = [n for n, t in base.model.state_dict().items() if not torch.equal(ft.model.state_dict()[n], t)]
    assert "embed.weight" in changed
    rows = metrics(run)
    # mean: every head's loss is logged at every logged step
    assert any(all(f"train/loss_head{i}" in r for i in range(1, K + 1)) for r in rows)


@pytest.mark.slow
def test_distill_and_both_train_on_the_distilled_corpus(heads_art):
    art, corpus = heads_art
    r = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "distill.py"),
            "experiment=smoke",
            f"paths.artifacts={art}",
            f"hydra.run.dir={art}/hydra/distill",
        ],
        cwd=REPO_ROOT,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for regime in ("distill", "both"):
        run_train(f"+regime={regime}", "experiment=smoke", artifacts=art)
        meta = assert_run_folder(corpus / "heads" / f"{regime}-k{K}", regime, K)
        assert meta["source"] == "distilled"


@pytest.mark.slow
def test_word_level_kd_trains_and_resumes_exactly(heads_art):
    """loss.kd_weight > 0: head 1 learns the base model's distribution too (train/kd_head1 logged); the teacher is
    not in the checkpoint, and a run stopped at step 3 and resumed (teacher rebuilt from init_from) ends with
    exactly the weights of the uninterrupted run."""
    art, corpus = heads_art
    kd = (
        "+regime=finetune",
        "experiment=smoke",
        "loss.head_loss=mean",
        "loss.p1_weight=0.5",
        "loss.kd_weight=0.5",
        "loss.kd_temperature=2.0",
        "trainer.val_check_interval=3",
    )
    whole, parts = corpus / "heads" / "kd_whole", corpus / "heads" / "kd_parts"
    run_train(*kd, "trainer.max_steps=6", f"run_dir={whole}", artifacts=art)
    run_train(*kd, "trainer.max_steps=3", f"run_dir={parts}", artifacts=art)
    run_train(*kd, "trainer.max_steps=6", f"run_dir={parts}", "ckpt_path=last", artifacts=art)
    kl = [float(r["train/kd_head1"]) for r in metrics(whole) if "train/kd_head1" in r]
    assert kl and all(math.isfinite(v) and v >= 0 for v in kl) and max(kl) > 0
    a = read_checkpoint(whole / "checkpoints" / "last.ckpt")
    b = read_checkpoint(parts / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 6
    assert not any("teacher" in n for n in a["state_dict"]), "the KD teacher leaked into the checkpoint"
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, t in a["state_dict"].items():
        assert torch.equal(b["state_dict"][name], t), f"{name} differs after resume"


# ---------------------------------------------------------------------------------------------- errors
def _error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def test_missing_base_names_the_command(heads_art, tmp_path):
    art, corpus = heads_art
    r = run_train(
        "+regime=frozen", "experiment=smoke", f"regime.init_from={tmp_path}/nothing", artifacts=art, check=False
    )
    line = _error_line(r)
    assert f"{tmp_path}/nothing" in line and "python train.py +regime=base experiment=smoke" in line


def _variant(base_run: Path, out: Path, vocab_delta: int = 0, tokenizer: Path | None = None) -> Path:
    """A base checkpoint with another vocabulary size, or trained with another tokenizer."""
    src = load_model(base_run)
    model = src.model
    if vocab_delta:
        from bpd_train.model import BPDModel

        model = BPDModel(dataclasses.replace(src.config, vocab_size=src.config.vocab_size + vocab_delta))
    return write_checkpoint(out / "checkpoints" / "last.ckpt", model, tokenizer or src.tokenizer_path)


def _train_in_process(*overrides: str):
    from hydra import compose, initialize_config_dir

    from bpd_train.training.run import train

    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3", job_name="train"):
        cfg = compose("train", overrides=list(overrides))
    return train(cfg)


def test_vocab_mismatch_is_refused(heads_art, tmp_path):
    from bpd_train.training.run import TrainError

    art, corpus = heads_art
    bad = _variant(corpus / "base", tmp_path / "bad_vocab", vocab_delta=7)
    with pytest.raises(TrainError, match="vocabulary of") as e:
        _train_in_process(
            "+regime=frozen", "experiment=smoke", f"paths.artifacts={art}", "logger=none", f"regime.init_from={bad}"
        )
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_tokenizer_hash_mismatch_is_refused(heads_art, tmp_path):
    import sentencepiece as spm

    art, corpus = heads_art
    n = load_model(corpus / "base").config.vocab_size
    text = tmp_path / "text.txt"
    import gzip
    import json

    with gzip.open(REPO_ROOT / "data" / "bible-en-fr" / "train.jsonl.gz", "rt") as f, text.open("w") as out:
        for line, _ in zip(f, range(6000)):
            t = json.loads(line)["translation"]
            out.write(t["fr"] + "\n" + t["en"] + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(tmp_path / "other"),
        vocab_size=n,
        model_type="bpe",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        num_threads=1,
        minloglevel=2,
    )
    other = tmp_path / "other.model"
    bad = _variant(corpus / "base", tmp_path / "bad_tok", tokenizer=other)
    from bpd_train.training.run import TrainError

    with pytest.raises(TrainError, match="tokenizer sha256") as e:
        _train_in_process(
            "+regime=finetune", "experiment=smoke", f"paths.artifacts={art}", "logger=none", f"regime.init_from={bad}"
        )
    assert "\n" not in str(e.value)


def test_init_from_an_exported_bundle(heads_art, tmp_path):
    """Head regimes start from a bundle as well as from a checkpoint: the backbone is copied exactly."""
    from hydra import compose, initialize_config_dir

    from bpd_train.app.export import export_bundle
    from bpd_train.data import Tokenizer
    from bpd_train.training.regimes import Regime
    from bpd_train.training.run import build_module

    art, corpus = heads_art
    base = load_model(corpus / "base")
    bundle = tmp_path / "bundle"
    export_bundle(base.model, base.tokenizer_path, bundle)
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3", job_name="train"):
        cfg = compose(
            "train",
            overrides=["+regime=frozen", "experiment=smoke", f"paths.artifacts={art}", f"regime.init_from={bundle}"],
        )
    module = build_module(cfg, Regime.from_cfg(cfg.regime), Tokenizer(base.tokenizer_path))
    sd = module.model.state_dict()
    for name, t in base.model.state_dict().items():
        assert torch.equal(sd[name], t), name
    assert module.model.config.block_size == K
    assert not any(p.requires_grad for p in module.model.backbone_parameters())
