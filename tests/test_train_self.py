"""Regime `self` (heads on the init_from model's own greedy output) through the real entry points at smoke size."""

from __future__ import annotations

import subprocess
import sys

import torch

from conftest import REPO_ROOT, copy_smoke_base, offline_env, run_train

from bpd_train.data.distilled import read_manifest
from bpd_train.sources.checkpoint import read_checkpoint
from bpd_train.sources.loading import load as load_model


def test_self_regime_asks_for_then_trains_on_its_models_greedy_output(smoke_base, tmp_path):
    art = tmp_path / "art"
    corpus = copy_smoke_base(smoke_base, art)

    # no corpus of the base's greedy output yet: one line, exit 2, with the command that makes it
    r = run_train("+regime=self", "experiment=smoke", artifacts=art, check=False)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert "own greedy output" in lines[0] and "distill.beam_size=1" in lines[0] and "experiment=smoke" in lines[0]

    d = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "distill.py"),
            "experiment=smoke",
            f"paths.artifacts={art}",
            f"teacher={corpus / 'base'}",
            "distill.beam_size=1",
            "distill.limit=96",
            f"hydra.run.dir={art}/hydra/self-distill",
        ],
        cwd=REPO_ROOT,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert d.returncode == 0, d.stderr[-3000:]
    (made,) = [m.parent for m in (corpus / "distill").glob("*/manifest.json")]
    assert read_manifest(made)["beam_size"] == 1 and read_manifest(made)["complete"]

    r = run_train("+regime=self", "experiment=smoke", artifacts=art)
    run = corpus / "heads" / "self-k4"
    assert f"own greedy output, {made}" in r.stderr + r.stdout
    meta = read_checkpoint(run / "checkpoints" / "last.ckpt")["bpd"]
    assert meta["regime"] == "self" and meta["global_step"] > 0
    base, heads = load_model(corpus / "base"), load_model(run / "checkpoints" / "last.ckpt")
    hsd = heads.model.state_dict()
    for name, t in base.model.state_dict().items():  # frozen backbone: greedy output unchanged
        assert torch.equal(hsd[name], t), f"backbone tensor {name} changed"
    assert any(not torch.equal(p, torch.zeros_like(p)) for p in heads.model.heads.fc2.parameters()), "heads untrained"

    # make demo's `self` stage: the whole model on the same corpus (Medusa-2's joint self-distillation), head 1 at 0.5
    joint = corpus / "heads" / "self-all"
    r = run_train(
        "+regime=self",
        "experiment=smoke",
        "regime.trainable=all",
        "loss.p1_weight=0.5",
        f"run_dir={joint}",
        artifacts=art,
    )
    assert f"own greedy output, {made}" in r.stderr + r.stdout  # the base's corpus again: init_from is the base
    meta = read_checkpoint(joint / "checkpoints" / "last.ckpt")["bpd"]
    assert meta["regime"] == "self" and meta["global_step"] > 0
    jsd = load_model(joint / "checkpoints" / "last.ckpt").model.state_dict()
    moved = [n for n, t in base.model.state_dict().items() if not torch.equal(jsd[n], t)]
    assert any(n.startswith("decoder_layers.") for n in moved) and any(
        n.startswith("encoder_layers.") for n in moved
    ), moved
    assert not torch.equal(jsd["heads.fc2.weight"], hsd["heads.fc2.weight"])
