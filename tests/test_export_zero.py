"""Export from a real DeepSpeed ZeRO-2 checkpoint made on CPU (bpd_train.training.zero_cpu): a frozen-regime run
initialised from the smoke base model, so the folder also holds frozen parameters. The bundle must give exactly
the logits of Lightning's own ZeRO consolidation, and keep the frozen backbone bit-identical to the base."""

import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, offline_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def zero_run(smoke_base, tmp_path_factory):
    _, base_run = smoke_base
    art = tmp_path_factory.mktemp("zero") / "artifacts"
    corpus = art / base_run.parent.name
    shutil.copytree(base_run, corpus / "base")
    shutil.copytree(base_run.parent / "spm", corpus / "spm")  # same tokenizer cache: no retraining
    cmd = [
        sys.executable,
        "-m",
        "bpd_train.app.zero_cpu",
        "+regime=frozen",
        "experiment=smoke",
        "strategy=deepspeed_zero2",
        "trainer.max_steps=2",
        "logger=csv",
        f"paths.artifacts={art}",
        f"hydra.run.dir={art}/hydra",
    ]
    r = subprocess.run(
        cmd, cwd=REPO_ROOT, env=offline_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-5000:]
    run = corpus / "heads" / "frozen-k4"
    assert (run / "checkpoints" / "last.ckpt" / "latest").is_file()
    return corpus, run


def _logits(model, vocab):
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(4, vocab, (2, 11), generator=g), torch.randint(4, vocab, (2, 6), generator=g)
    tgt[:, 0] = 1
    with torch.no_grad():
        return model(src, tgt)


def test_zero_export_matches_lightning_consolidation(zero_run, tmp_path):
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    from bpd_train.app.export import export_checkpoint, load_bundle
    from bpd_train.model import BPDModel
    from bpd_train.sources.loading import load as load_any
    from bpd_train.sources.loading import load as load_model

    corpus, run = zero_run
    bundle = export_checkpoint(run, tmp_path / "bundle")  # the run folder: its best.ckpt/ ZeRO folder
    model, _, meta = load_bundle(bundle)
    assert meta["training"]["regime"] == "frozen" and meta["training"]["source"].endswith("best.ckpt")

    # independent consolidation with Lightning's utility (it unpickles; fine for our own test files)
    convert_zero_checkpoint_to_fp32_state_dict(str(run / "checkpoints" / "best.ckpt"), str(tmp_path / "fp32.pt"))
    state = torch.load(tmp_path / "fp32.pt", map_location="cpu", weights_only=False)["state_dict"]
    ref = BPDModel(model.config)
    ref.load_state_dict({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")})
    ref.eval()
    v = model.config.vocab_size
    assert torch.equal(_logits(model, v), _logits(ref, v))
    # the frozen backbone came through ZeRO's frozen-parameter path unchanged
    base = load_model(corpus / "base").model.state_dict()
    assert all(torch.equal(t, base[k]) for k, t in model.state_dict().items() if not k.startswith("heads."))
    # evaluation reads ZeRO folders directly too
    assert torch.equal(_logits(load_any(run).model, v), _logits(model, v))


def test_broken_zero_folder_is_one_clear_error(zero_run, tmp_path):
    from bpd_train.app.export import export_checkpoint
    from bpd_train.sources.checkpoint import CheckpointError

    _, run = zero_run
    broken = tmp_path / "last.ckpt"
    shutil.copytree(run / "checkpoints" / "last.ckpt", broken)
    for f in (broken / "checkpoint").glob("*optim_states.pt"):
        f.unlink()
    with pytest.raises(CheckpointError, match="cannot consolidate ZeRO checkpoint"):
        export_checkpoint(broken, tmp_path / "out")
    (broken / "latest").write_text("global_step999")
    with pytest.raises(CheckpointError, match="tag folder .* does not exist"):
        export_checkpoint(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_head_regime_starts_from_a_zero_run(zero_run):
    # init_from accepts a DeepSpeed run folder (consolidated on the fly); before, it stopped with "no checkpoint".
    from conftest import run_train

    from bpd_train.sources.loading import load as load_model

    corpus, run = zero_run
    run_train(
        "+regime=finetune",
        "experiment=smoke",
        f"regime.init_from={run}",
        "trainer.max_steps=1",
        "trainer.val_check_interval=1",
        artifacts=corpus.parent,
    )
    new = load_model(corpus / "heads" / "finetune-k4" / "checkpoints" / "last.ckpt")
    assert new.config.block_size == 4 and str(run) in str(new.meta.get("init_from"))


def _zero_cpu(*overrides, art, stage, devices, name):
    cmd = [
        sys.executable,
        "-m",
        "bpd_train.app.zero_cpu",
        f"--stage={stage}",
        f"--devices={devices}",
        *overrides,
        "experiment=smoke",
        "logger=csv",
        f"paths.artifacts={art}",
        f"hydra.run.dir={art}/hydra-{name}",
    ]
    r = subprocess.run(
        cmd, cwd=REPO_ROOT, env=offline_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-5000:]
    return r


def test_zero3_two_ranks_base_frozen_export(smoke_base, tmp_path):
    """ZeRO-3 on 2 CPU ranks (parameters partitioned): a base run, then a frozen-regime run initialised from
    that ZeRO-3 folder with the in-training blockwise evaluation on (it decodes outside DeepSpeed's hooks, so
    it needs the gathered copy), then export. The tied projection and the heads' weight slices are used outside
    module forwards; the losses and the exported weights must still be right."""
    import csv

    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    from bpd_train.app.export import export_checkpoint, load_bundle
    from bpd_train.model import BPDModel
    from bpd_train.sources.loading import load as load_any

    _, base_run = smoke_base
    art = tmp_path / "artifacts"
    corpus = art / base_run.parent.name
    shutil.copytree(base_run.parent / "spm", corpus / "spm")  # same tokenizer cache: no retraining
    _zero_cpu("+regime=base", "trainer.max_steps=3", art=art, stage=3, devices=2, name="base")
    base_files = {p.name for p in (corpus / "base" / "checkpoints" / "last.ckpt" / "checkpoint").iterdir()}
    assert {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)} <= base_files  # really stage 3, 2 ranks
    _zero_cpu(
        "+regime=frozen",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        art=art,
        stage=3,
        devices=2,
        name="frozen",
    )
    run = corpus / "heads" / "frozen-k4"
    rows = [r for f in run.rglob("metrics.csv") for r in csv.DictReader(f.open())]
    khat = [float(r["val/mean_accepted"]) for r in rows if r.get("val/mean_accepted")]
    agree = [float(r["val/agreement"]) for r in rows if r.get("val/agreement")]
    assert khat and khat[-1] >= 1.0 and agree == [100.0] * len(agree) and agree

    bundle = export_checkpoint(run, tmp_path / "bundle")
    model, _, _ = load_bundle(bundle)
    convert_zero_checkpoint_to_fp32_state_dict(str(run / "checkpoints" / "best.ckpt"), str(tmp_path / "fp32.pt"))
    state = torch.load(tmp_path / "fp32.pt", map_location="cpu", weights_only=False)["state_dict"]
    ref = BPDModel(model.config)
    ref.load_state_dict({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")})
    v = model.config.vocab_size
    assert torch.equal(_logits(model, v), _logits(ref.eval(), v))
    base = load_any(corpus / "base").model.state_dict()
    assert all(torch.equal(t, base[k]) for k, t in model.state_dict().items() if not k.startswith("heads."))
    heads = {k: t for k, t in model.state_dict().items() if k.startswith("heads.fc2")}
    assert heads and any(t.abs().sum() > 0 for t in heads.values()), "the heads did not train under ZeRO-3"
