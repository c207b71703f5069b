"""What the first GPU run does, on CPU: the raw DeepSpeed engine (DS_ACCELERATOR=cpu, gloo, one process each run,
tests/_ds_engine.py) around the training module's own loss, with bf16 on and ZeRO-3 partitioning every parameter
(stage3_param_persistence_threshold 0: the smoke models are otherwise below DeepSpeed's threshold and never
partitioned, which real sizes are). Both model families."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, offline_env

pytest.importorskip("deepspeed")

_PORT = iter(range(29700, 29800))


def engine_run(*args: str, tmp_path=None) -> dict:
    cmd = [sys.executable, str(REPO_ROOT / "tests" / "_ds_engine.py"), *args, "--port", str(next(_PORT))]
    r = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        env=offline_env(DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and found, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(found[-1][len("RESULT ") :])


@pytest.mark.parametrize("family", ["ed", "lm"])
def test_bf16_deepspeed_train_and_validation_step(family):
    # DeepSpeed casts parameters to bf16 and leaves buffers (sinusoids) and per-call tables (RoPE) in fp32
    out = engine_run("--stage", "2", "--bf16", "--family", family, "--eval")
    assert out["dtype"] == "torch.bfloat16"
    assert all(torch.isfinite(torch.tensor(out["losses"] + [out["val"]])))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["ed", "lm"])
def test_zero3_every_parameter_partitioned(family):
    # head 1 alone first (the zero-weighted touch of the heads: nothing gathered them yet), all heads, validation
    out = engine_run(
        "--stage", "3", "--persist0", "--bf16", "--family", family, "--steps", "3", "--heads", "0/0,1,2,3/0", "--eval"
    )
    assert out["partitioned"] == out["params"] > 0
    assert all(torch.isfinite(torch.tensor(out["losses"] + [out["val"]])))


@pytest.mark.slow
def test_zero3_partitioned_trains_what_zero2_trains(tmp_path):
    # fp32: the tied projection and the heads' weight slices, read outside their modules' forwards, get the same
    # values and gradients whether or not ZeRO-3 partitioned them
    runs = {}
    for stage in ("2", "3"):
        out = engine_run("--stage", stage, "--persist0", "--family", "ed", "--dump", str(tmp_path / f"{stage}.pt"))
        runs[stage] = torch.load(tmp_path / f"{stage}.pt", weights_only=True)
        assert out["partitioned"] == (out["params"] if stage == "3" else 0)
    a, b = runs["2"], runs["3"]
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if name.endswith("qkv.bias") or name.endswith("kv.bias"):
            # the key bias has a zero gradient in exact arithmetic (softmax ignores a shift shared by every key), so
            # its float gradient is rounding noise that AdamW scales up to ~lr: it differs with the reduction order
            # of the two stages. The query and value biases are compared like every other weight.
            d = x.numel() // (3 if name.endswith("qkv.bias") else 2)
            keep = torch.ones_like(x, dtype=torch.bool)
            keep[(d if name.endswith("qkv.bias") else 0) :][:d] = False
            x, y = x[keep], y[keep]
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("stage,family", [("2", "ed"), ("3", "lm")])
def test_frozen_backbone_exact_after_bf16_deepspeed(stage, family, tmp_path):
    # DeepSpeed keeps no fp32 master of frozen parameters: the checkpoint must carry them, consolidation restore them
    out = engine_run(
        "--stage",
        stage,
        "--persist0",
        "--bf16",
        "--family",
        family,
        "--regime",
        "frozen",
        "--save",
        str(tmp_path / "ckpt"),
    )
    assert out["frozen"] > 0 and out["heads_trained"]
    assert out["backbone_exact"]


@pytest.mark.slow
def test_lightning_bf16_zero2_frozen_run_exports_the_base_backbone(smoke_base, tmp_path):
    """The GPU recipe (trainer.precision=bf16-mixed, strategy=deepspeed_zero2, a frozen regime with the in-training
    blockwise evaluation) through Lightning on CPU: the exported backbone is the base model's bit for bit (~60 s)."""
    import csv
    import shutil

    from bpd_train.app.export import export_checkpoint, load_bundle
    from bpd_train.sources.loading import load

    _, base_run = smoke_base
    art = tmp_path / "artifacts"
    corpus = art / base_run.parent.name
    shutil.copytree(base_run, corpus / "base")
    shutil.copytree(base_run.parent / "spm", corpus / "spm")
    cmd = [
        sys.executable,
        "-m",
        "bpd_train.app.zero_cpu",
        "--stage=2",
        "--precision=bf16-mixed",
        "+regime=frozen",
        "experiment=smoke",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "logger=csv",
        "progress_bar=none",
        f"paths.artifacts={art}",
        f"hydra.run.dir={art}/hydra",
    ]
    r = subprocess.run(
        cmd, cwd=REPO_ROOT, env=offline_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-5000:]
    run = corpus / "heads" / "frozen-k4"
    rows = [row for f in run.rglob("metrics.csv") for row in csv.DictReader(f.open())]
    agree = [float(row["val/agreement"]) for row in rows if row.get("val/agreement")]
    assert agree and set(agree) == {100.0}
    model, _, _ = load_bundle(export_checkpoint(run, tmp_path / "bundle"))
    base = load(corpus / "base").model.state_dict()
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items())
    assert any(t.abs().sum() > 0 for k, t in state.items() if k.startswith("heads.fc2"))


def test_frozen_fp32_values_survive_save_and_resume():
    # a resumed bf16 DeepSpeed run must keep the values it started from, never its fresh initialisation
    from bpd_train.sources.zero import FROZEN_FP32_KEY
    from bpd_train.training.module import BPDLightningModule
    from bpd_train.training.regimes import Regime

    regime = Regime(name="frozen", trainable="heads", block_size=4, init_from="base", stage="heads").to_dict()
    cfg = dict(vocab_size=40, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=48, block_size=4)
    optim = {"optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3}}
    torch.manual_seed(0)
    first = BPDLightningModule(cfg, regime, optim)
    first.keep_frozen_fp32()
    ckpt: dict = {}
    first.on_save_checkpoint(ckpt)
    saved = ckpt[FROZEN_FP32_KEY]
    assert saved and "heads.fc1.weight" not in saved and all(t.dtype == torch.float32 for t in saved.values())
    torch.manual_seed(1)
    resumed = BPDLightningModule(cfg, regime, optim)
    resumed.keep_frozen_fp32()  # setup() runs before the checkpoint is restored: this is a fresh initialisation
    resumed.on_load_checkpoint(ckpt)
    assert all(torch.equal(resumed.frozen_fp32_state()[k], v) for k, v in saved.items())
    resumed.on_load_checkpoint({})  # a checkpoint without them: keep none rather than the wrong ones
    assert resumed.frozen_fp32_state() == {}
    plain = BPDLightningModule(cfg, regime, optim)  # not captured (no DeepSpeed bf16): nothing saved
    ck2: dict = {}
    plain.on_save_checkpoint(ck2)
    assert FROZEN_FP32_KEY not in ck2
