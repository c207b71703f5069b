"""Multi-process training on CPU, always as subprocesses of pytest: 2-rank DDP (gloo), 2-rank FSDP (gloo,
bpd_train/training/fsdp_cpu.py) and DeepSpeed ZeRO-2 through Lightning with the CPU shim
(bpd_train/training/zero_cpu.py), which writes a real ZeRO checkpoint."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, copy_smoke_base, offline_env, run_train

from bpd_train.sources.checkpoint import read_checkpoint
from bpd_train.training.module import mix_seed

K = 4


def _seed_drawing_head1(steps: int) -> int:
    """A seed whose random head schedule draws head 1 (no BPD-layer use) within `steps` steps."""
    return next(s for s in range(1234, 1334) if any(mix_seed(s, 7919, t, 0) % K == 0 for t in range(steps)))


@pytest.mark.slow
def test_ddp_two_processes_on_cpu(smoke_base, tmp_path):
    """finetune with the paper's random head: ranks draw the same head, also head 1 (which leaves the BPD
    layer unused -- DDP would hang or fail without the zero-weighted touch). With word-level distillation for
    head 1 (loss.kd_weight): each rank's frozen teacher stays outside what DDP wraps and synchronises."""
    art = tmp_path / "art"
    corpus = copy_smoke_base(smoke_base, art)
    steps = 6
    r = run_train(
        "+regime=finetune",
        "experiment=smoke",
        "strategy=ddp",
        "trainer.devices=2",
        "loss.kd_weight=0.5",
        f"trainer.max_steps={steps}",
        "trainer.val_check_interval=3",
        f"seed={_seed_drawing_head1(steps)}",
        artifacts=art,
        timeout=900,
    )
    out = r.stdout + r.stderr
    assert "MEMBER: 2/2" in out
    ck = read_checkpoint(corpus / "heads" / f"finetune-k{K}" / "checkpoints" / "last.ckpt")
    assert ck["global_step"] == steps
    assert ck["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["num_replicas"] == 2
    assert ck["bpd"]["regime"] == "finetune"


@pytest.mark.slow
def test_fsdp_two_processes_on_cpu(smoke_base, tmp_path):
    """strategy=fsdp (FULL_SHARD, 2 ranks): base, then frozen on it with the in-training blockwise evaluation,
    then a resume of that run from last.ckpt.
    Catches what a GPU cluster would hit at the first step or first validation: Lightning refuses norm
    gradient clipping under FSDP (the module clips through FSDP itself), and decoding outside the forward
    needs the gathered weights. The frozen backbone must come through FSDP bit-identical."""
    import csv

    from bpd_train.sources.loading import load as load_model

    _, base = smoke_base
    art = tmp_path / "art"
    corpus = art / base.parent.name
    shutil.copytree(base.parent / "spm", corpus / "spm")
    common = ("experiment=smoke", "strategy=fsdp", "trainer.devices=2", "trainer.gradient_clip_val=0.5")
    run_train("+regime=base", *common, "trainer.max_steps=3", artifacts=art, timeout=900)
    run_train(
        "+regime=frozen", *common, "trainer.max_steps=4", "trainer.val_check_interval=2", artifacts=art, timeout=900
    )
    b = load_model(corpus / "base" / "checkpoints" / "last.ckpt")
    f = load_model(corpus / "heads" / f"frozen-k{K}" / "checkpoints" / "last.ckpt")
    assert b.meta.get("regime") == "base" and f.meta.get("regime") == "frozen"
    fsd = f.model.state_dict()
    assert all(torch.equal(fsd[k], v) for k, v in b.model.state_dict().items())
    assert any(fsd[k].abs().sum() > 0 for k in fsd if k.startswith("heads.fc2")), "the heads did not train"
    rows = [r for m in (corpus / "heads" / f"frozen-k{K}").rglob("metrics.csv") for r in csv.DictReader(m.open())]
    agree = [float(r["val/agreement"]) for r in rows if r.get("val/agreement")]
    assert len(agree) == 2 and set(agree) == {100.0}
    # resuming restores the sharded optimizer state through FSDP's full optimizer state dict
    r = run_train(
        "+regime=frozen",
        *common,
        "trainer.max_steps=6",
        "trainer.val_check_interval=2",
        "ckpt_path=last",
        artifacts=art,
        timeout=900,
    )
    assert "Restored all states" in r.stdout + r.stderr
    ck = read_checkpoint(corpus / "heads" / f"frozen-k{K}" / "checkpoints" / "last.ckpt")
    assert ck["global_step"] == 6 and ck["optimizer_states"]


# ---- the decoder-only family (model=lm_tiny via experiment=smoke_lm) under the same strategies: the smallest LM,
# the fewest steps; each run trains its own 1000-piece sentencepiece model (~1 s) instead of needing smoke_base


def _lm_checks(corpus, run_name: str) -> None:
    """A frozen LM head run: backbone bit-identical to its base, heads trained, and the in-training blockwise
    evaluation ran on a gathered copy (agreement with greedy 100%)."""
    import csv

    from bpd_train.decoding import greedy
    from bpd_train.model import LMModel
    from bpd_train.sources.loading import load as load_model

    b, f = load_model(corpus / "base"), load_model(corpus / "heads" / run_name)
    assert isinstance(f.model, LMModel) and f.meta.get("regime") == "frozen" and f.config.block_size == K
    fsd = f.model.state_dict()
    assert all(torch.equal(fsd[k], v) for k, v in b.model.state_dict().items()), "the frozen backbone moved"
    assert any(fsd[k].abs().sum() > 0 for k in fsd if k.startswith("heads.fc2")), "the heads did not train"
    rows = [r for m in (corpus / "heads" / run_name).rglob("metrics.csv") for r in csv.DictReader(m.open())]
    agree = [float(r["val/agreement"]) for r in rows if r.get("val/agreement")]
    assert agree and set(agree) == {100.0}
    tok = b.lm_tokenizer()
    prompts = [tok.encode(f"English: {s}\nFrench:") for s in ("In the beginning", "God said")]
    assert greedy(f.model, prompts, max_len=6).tokens == greedy(b.model, prompts, max_len=6).tokens


@pytest.mark.slow
def test_fsdp_two_processes_lm_base_then_frozen(tmp_path):
    """strategy=fsdp, 2 CPU ranks, on the decoder-only family: base from scratch, then frozen heads on it with the
    in-training blockwise evaluation (decoding outside the forward needs FSDP's gathered weights; ~35 s)."""
    art = tmp_path / "art"
    common = ("experiment=smoke_lm", "strategy=fsdp", "trainer.devices=2", "trainer.gradient_clip_val=0.5")
    run_train(
        "+regime=base", *common, "trainer.max_steps=2", "trainer.val_check_interval=2", artifacts=art, timeout=600
    )
    run_train(
        "+regime=frozen", *common, "trainer.max_steps=4", "trainer.val_check_interval=2", artifacts=art, timeout=600
    )
    _lm_checks(art / "bible_en_fr", f"frozen-k{K}")


@pytest.mark.slow
def test_zero2_base_then_zero3_frozen_lm(tmp_path):
    """DeepSpeed on 2 CPU ranks (DS_ACCELERATOR=cpu) on the decoder-only family: a ZeRO-2 base run (optimizer
    state sharded), then frozen heads under ZeRO-3 (parameters partitioned) initialised from that ZeRO-2 folder,
    with the in-training evaluation on a gathered copy; the result exports to a bundle (~55 s)."""
    from bpd_train.app.export import export_checkpoint, load_bundle
    from bpd_train.model import LMModel

    art = tmp_path / "art"
    corpus = art / "bible_en_fr"

    def zero(stage, *overrides):
        cmd = [
            sys.executable,
            "-m",
            "bpd_train.app.zero_cpu",
            f"--stage={stage}",
            "--devices=2",
            *overrides,
            "experiment=smoke_lm",
            "logger=csv",
            f"paths.artifacts={art}",
            f"hydra.run.dir={art}/hydra-{stage}",
        ]
        r = subprocess.run(
            cmd, cwd=REPO_ROOT, env=offline_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-5000:]

    zero(2, "+regime=base", "trainer.max_steps=2", "trainer.val_check_interval=2")
    base = {p.name for p in (corpus / "base" / "checkpoints" / "last.ckpt" / "checkpoint").iterdir()}
    assert base == {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    }  # stage 2: one model file, sharded optimizer
    zero(3, "+regime=frozen", "trainer.max_steps=2", "trainer.val_check_interval=2")
    frozen = {
        p.name for p in (corpus / "heads" / f"frozen-k{K}" / "checkpoints" / "last.ckpt" / "checkpoint").iterdir()
    }
    assert {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)} <= frozen  # stage 3: partitioned
    _lm_checks(corpus, f"frozen-k{K}")
    model, _, _ = load_bundle(export_checkpoint(corpus / "heads" / f"frozen-k{K}", tmp_path / "bundle"))
    assert isinstance(model, LMModel) and model.config.block_size == K
