"""Multi-process training on CPU, always as subprocesses of pytest: 2-rank DDP (gloo), 2-rank FSDP (gloo,
bpd_train/training/fsdp_cpu.py) and DeepSpeed ZeRO-2 through Lightning with the CPU shim
(bpd_train/training/zero_cpu.py), which writes a real ZeRO checkpoint."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from bpd_train.checkpoint import read_checkpoint
from bpd_train.training.module import mix_seed
from conftest import REPO_ROOT, offline_env, run_train

K = 4


def _seed_drawing_head1(steps: int) -> int:
    """A seed whose random head schedule draws head 1 (no BPD-layer use) within `steps` steps."""
    return next(s for s in range(1234, 1334) if any(mix_seed(s, 7919, t, 0) % K == 0 for t in range(steps)))


@pytest.mark.slow
def test_ddp_two_processes_on_cpu(smoke_base, tmp_path):
    """finetune with the paper's random head: ranks draw the same head, also head 1 (which leaves the BPD
    layer unused -- DDP would hang or fail without the zero-weighted touch). With word-level distillation for
    head 1 (loss.kd_weight): each rank's frozen teacher stays outside what DDP wraps and synchronises."""
    _, base = smoke_base
    art = tmp_path / "art"
    corpus = art / base.parent.name
    shutil.copytree(base.parent / "spm", corpus / "spm")
    shutil.copytree(base, corpus / "base", ignore=shutil.ignore_patterns("logs"))
    steps = 6
    r = run_train("+regime=finetune", "experiment=smoke", "strategy=ddp", "trainer.devices=2", "loss.kd_weight=0.5",
                  f"trainer.max_steps={steps}", "trainer.val_check_interval=3", f"seed={_seed_drawing_head1(steps)}",
                  artifacts=art, timeout=900)
    out = r.stdout + r.stderr
    assert "MEMBER: 2/2" in out
    ck = read_checkpoint(corpus / "heads" / f"finetune-k{K}" / "checkpoints" / "last.ckpt")
    assert ck["global_step"] == steps
    assert ck["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["num_replicas"] == 2
    assert ck["bpd"]["regime"] == "finetune"


@pytest.mark.slow
def test_zero2_on_cpu_writes_a_real_zero_checkpoint(smoke_base, tmp_path):
    """Two ranks, ZeRO stage 2, a couple of optimizer steps, through Lightning's own DeepSpeed strategy."""
    _, base = smoke_base
    art = tmp_path / "art"
    shutil.copytree(base.parent / "spm", art / base.parent.name / "spm")
    cmd = [sys.executable, "-m", "bpd_train.training.zero_cpu", "--stage", "2", "--devices", "2", "+regime=base",
           "experiment=smoke", f"paths.artifacts={art}", "logger=none", "trainer.max_steps=2",
           "trainer.val_check_interval=2"]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=offline_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    ckpt = art / base.parent.name / "base" / "checkpoints" / "last.ckpt"
    assert r.stdout.strip().splitlines()[-1] == str(ckpt)
    assert (ckpt / "latest").read_text().strip() == "checkpoint"
    shards = sorted(p.name for p in (ckpt / "checkpoint").glob("zero_pp_rank_*_optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    states = torch.load(ckpt / "checkpoint" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert states["global_step"] == 2 and states["bpd"]["regime"] == "base"
    optim = torch.load(ckpt / "checkpoint" / shards[0], map_location="cpu", weights_only=False)
    assert optim["optimizer_state_dict"]["zero_stage"] == 2

    # Lightning's own consolidation gives a state dict that fits the model
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    from bpd_train.model import BPDConfig, BPDModel

    out = tmp_path / "consolidated.pt"
    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(out))
    sd = torch.load(out, map_location="cpu", weights_only=False)["state_dict"]
    model = BPDModel(BPDConfig.from_dict(states["bpd"]["model_config"]))
    model.load_state_dict({k[len("model."):]: v for k, v in sd.items()}, strict=True)


@pytest.mark.slow
def test_fsdp_two_processes_on_cpu(smoke_base, tmp_path):
    """strategy=fsdp (FULL_SHARD, 2 ranks): base, then frozen on it with the in-training blockwise evaluation,
    then a resume of that run from last.ckpt.
    Catches what a GPU cluster would hit at the first step or first validation: Lightning refuses norm
    gradient clipping under FSDP (the module clips through FSDP itself), and decoding outside the forward
    needs the gathered weights. The frozen backbone must come through FSDP bit-identical."""
    import csv

    from bpd_train.loading import load as load_model

    _, base = smoke_base
    art = tmp_path / "art"
    corpus = art / base.parent.name
    shutil.copytree(base.parent / "spm", corpus / "spm")
    common = ("experiment=smoke", "strategy=fsdp", "trainer.devices=2", "trainer.gradient_clip_val=0.5")
    run_train("+regime=base", *common, "trainer.max_steps=3", artifacts=art, timeout=900)
    run_train("+regime=frozen", *common, "trainer.max_steps=4", "trainer.val_check_interval=2", artifacts=art,
              timeout=900)
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
    r = run_train("+regime=frozen", *common, "trainer.max_steps=6", "trainer.val_check_interval=2", "ckpt_path=last",
                  artifacts=art, timeout=900)
    assert "Restored all states" in r.stdout + r.stderr
    ck = read_checkpoint(corpus / "heads" / f"frozen-k{K}" / "checkpoints" / "last.ckpt")
    assert ck["global_step"] == 6 and ck["optimizer_states"]
