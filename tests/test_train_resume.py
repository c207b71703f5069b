"""Kill a run mid-epoch (SIGKILL, no cleanup), resume with ckpt_path=last, and end with exactly the weights
of the uninterrupted run -- the shared base smoke run (same command, CPU, one thread, deterministic)."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import run_train

from bpd_train.sources.checkpoint import read_checkpoint


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(smoke_base, tmp_path):
    _, base = smoke_base  # experiment=smoke: 40 steps, validation (and last.ckpt) at steps 20 and 40
    art = tmp_path / "art"
    shutil.copytree(base.parent / "spm", art / base.parent.name / "spm")  # same tokenizer, no retraining
    run = art / base.parent.name / "base"

    killed = run_train(
        "+regime=base",
        "experiment=smoke",
        "+callbacks.kill._target_=bpd_train.training.callbacks.KillAtStep",
        "+callbacks.kill.step=30",
        artifacts=art,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    mid = read_checkpoint(run / "checkpoints" / "last.ckpt")
    assert mid["global_step"] == 20
    sampler = mid["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert sampler["epoch"] == 0 and 0 < sampler["consumed"] < 1000  # mid-epoch

    run_train("+regime=base", "experiment=smoke", "ckpt_path=last", artifacts=art)
    resumed = read_checkpoint(run / "checkpoints" / "last.ckpt")
    reference = read_checkpoint(base / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == reference["global_step"] == 40
    assert resumed["state_dict"].keys() == reference["state_dict"].keys()
    for name, t in reference["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], t), f"{name} differs after resume"


def test_last_ckpt_follows_training_when_the_metric_stops_improving(smoke_base, tmp_path):
    """last.ckpt is the latest validation's weights even when best.ckpt stays behind (Lightning 2.6's save_last
    only rewrote last.ckpt together with a new best, so a resume started from a stale step)."""
    _, base = smoke_base
    art = tmp_path / "art"
    shutil.copytree(base.parent / "spm", art / base.parent.name / "spm")
    # mode=max on val/loss: the loss falls, so the step-20 checkpoint stays "best" and step 40 never improves it
    run_train(
        "+regime=base",
        "experiment=smoke",
        "checkpoint.monitor=val/loss",
        "checkpoint.mode=max",
        "logger=none",
        artifacts=art,
    )
    ckpts = art / base.parent.name / "base" / "checkpoints"
    assert read_checkpoint(ckpts / "best.ckpt")["global_step"] == 20
    assert read_checkpoint(ckpts / "last.ckpt")["global_step"] == 40


@pytest.mark.slow
def test_without_a_metric_best_is_the_latest_and_resume_works(smoke_base, tmp_path):
    """checkpoint.monitor=null (what `both` and `distill` use): best.ckpt and last.ckpt are both the latest
    validation's. Both callbacks are then metric-less; Lightning refused two such ModelCheckpoints ("more than one
    stateful callback") until best.ckpt's got its own state key. A resume restores both and goes on."""
    _, base = smoke_base
    art = tmp_path / "art"
    shutil.copytree(base.parent / "spm", art / base.parent.name / "spm")
    run_train("+regime=base", "experiment=smoke", "checkpoint.monitor=null", "logger=none", artifacts=art)
    ckpts = art / base.parent.name / "base" / "checkpoints"
    assert (
        read_checkpoint(ckpts / "best.ckpt")["global_step"] == read_checkpoint(ckpts / "last.ckpt")["global_step"] == 40
    )
    run_train(
        "+regime=base",
        "experiment=smoke",
        "checkpoint.monitor=null",
        "logger=none",
        "ckpt_path=last",
        "steps.base=60",
        artifacts=art,
    )
    assert (
        read_checkpoint(ckpts / "best.ckpt")["global_step"] == read_checkpoint(ckpts / "last.ckpt")["global_step"] == 60
    )
