"""Bundles: export from a Lightning checkpoint reloads with identical logits; every bad input is one clear error."""

import json
import shutil

import pytest
import torch

from _eval_tiny import build_tiny

from bpd_train.app.export import BundleError, export_checkpoint, load_bundle
from bpd_train.sources.checkpoint import CheckpointError
from bpd_train.sources.loading import load as load_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory)


@pytest.fixture(scope="session")
def bundle(tiny, tmp_path_factory):
    return export_checkpoint(tiny["run"], tmp_path_factory.mktemp("bundles") / "frozen-k4")


def _logits(model, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (3, 9), generator=g)
    src[0, 6:] = 0  # padding
    tgt = torch.randint(4, vocab, (3, 7), generator=g)
    tgt[:, 0] = 1
    with torch.no_grad():
        return model(src, tgt)


def test_bundle_layout_and_identical_logits(tiny, bundle):
    src = load_model(tiny["ckpt"])
    model, tok, meta = load_bundle(bundle)
    assert sorted(p.name for p in bundle.iterdir()) == [
        "README.md",
        "config.json",
        "manifest.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    assert torch.equal(_logits(model, tiny["vocab"]), _logits(src.model, tiny["vocab"]))
    cfg = json.loads((bundle / "config.json").read_text())
    assert cfg["model"] == src.config.to_dict()
    assert cfg["heads"]["block_size"] == 4 and cfg["weights"]["dtype"] == "float32"
    assert cfg["tokenizer"]["sha256"] == src.tokenizer_hash == meta["tokenizer_hash"]
    assert (cfg["tokenizer"]["pad_id"], cfg["tokenizer"]["bos_id"], cfg["tokenizer"]["eos_id"]) == (0, 1, 2)
    assert cfg["training"]["regime"] == "frozen" and cfg["training"]["source_id"].startswith("sha256:")
    assert tok.get_piece_size() == tiny["vocab"] and not model.training
    card = (bundle / "README.md").read_text()
    assert "frozen" in card and "No evaluation report" in card and "python -m bpd_train.translate" in card
    # loading.load takes bundles too (it calls load_bundle)
    again = load_model(bundle, expect_tokenizer_hash=src.tokenizer_hash)
    assert torch.equal(_logits(again.model, tiny["vocab"]), _logits(src.model, tiny["vocab"]))
    # no stray temp folders from the atomic write
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".")]


def test_bf16_export_and_reexport(tiny, bundle, tmp_path):
    b16 = export_checkpoint(tiny["ckpt"], tmp_path / "bf16", dtype="bfloat16")
    cfg = json.loads((b16 / "config.json").read_text())
    assert cfg["weights"]["dtype"] == "bfloat16"
    assert (b16 / "model.safetensors").stat().st_size < 0.6 * (bundle / "model.safetensors").stat().st_size
    model, _, _ = load_bundle(b16)
    ref = _logits(load_model(tiny["ckpt"]).model, tiny["vocab"])
    assert next(model.parameters()).dtype == torch.float32
    assert torch.allclose(_logits(model, tiny["vocab"]), ref, atol=0.1)
    # a bundle is a valid export source too (re-export keeps the provenance)
    again = export_checkpoint(bundle, tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["training"]["regime"] == "frozen"
    assert torch.equal(_logits(load_bundle(again)[0], tiny["vocab"]), ref)


def _copy(bundle, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    return dst


def _edit_config(b, cfg, rehash=True):
    """Write config.json; with rehash, also update manifest.json (to reach the checks behind the manifest)."""
    from bpd_train.io import sha256_file

    (b / "config.json").write_text(json.dumps(cfg))
    if rehash:
        manifest = json.loads((b / "manifest.json").read_text())
        manifest["files"]["config.json"] = sha256_file(b / "config.json")
        (b / "manifest.json").write_text(json.dumps(manifest))


def test_missing_file(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    (b / "tokenizer.model").unlink()
    with pytest.raises(BundleError, match="incomplete: missing tokenizer.model"):
        load_bundle(b)
    with pytest.raises(BundleError, match="does not exist"):
        load_bundle(tmp_path / "nope")


def test_tampered_weights(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    data = bytearray((b / "model.safetensors").read_bytes())
    data[-5] ^= 0x55
    (b / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="model.safetensors .* does not match the sha256 recorded"):
        load_bundle(b)


def test_tokenizer_hash_mismatch(tiny, bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    shutil.copy(tiny["tok2"], b / "tokenizer.model")
    with pytest.raises(BundleError, match="is not the tokenizer this bundle was exported with"):
        load_bundle(b)


def test_shape_mismatch(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    cfg = json.loads((b / "config.json").read_text())
    cfg["model"]["d_ff"] = 48
    _edit_config(b, cfg)
    with pytest.raises(BundleError, match=r"shape mismatch .*\(model expects"):
        load_bundle(b)
    cfg["model"]["block_size"] = 2  # fewer heads than the weights hold
    cfg["model"]["d_ff"] = 64
    _edit_config(b, cfg)
    with pytest.raises(BundleError, match="does not fit the model config"):
        load_bundle(b)


def test_edited_config_same_shapes_is_refused(bundle, tmp_path):
    # n_heads 2 -> 4 keeps every tensor shape (d_model 32): it used to load and silently change the output.
    b = _copy(bundle, tmp_path)
    cfg = json.loads((b / "config.json").read_text())
    cfg["model"]["n_heads"] = 4
    _edit_config(b, cfg, rehash=False)
    with pytest.raises(BundleError, match=r"config\.json does not match the sha256 in .*manifest\.json"):
        load_bundle(b)
    (b / "manifest.json").unlink()
    with pytest.raises(BundleError, match="no readable manifest.json"):
        load_bundle(b)


def test_not_a_bundle_config(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    (b / "config.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(b)


def test_unreadable_checkpoint_and_existing_output(tiny, bundle, tmp_path):
    bad = tmp_path / "run" / "checkpoints" / "last.ckpt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        export_checkpoint(bad, tmp_path / "out")
    with pytest.raises(CheckpointError, match="does not exist"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out")
    with pytest.raises(FileExistsError, match="already exists"):
        export_checkpoint(tiny["ckpt"], bundle)
    assert not (tmp_path / "out").exists()


def test_checkpoint_with_foreign_tokenizer(tiny, tmp_path):
    """A tokenizer.model beside the checkpoint that is not the one it was trained with."""
    run = tmp_path / "run"
    shutil.copytree(tiny["run"], run)
    shutil.copy(tiny["tok2"], run / "checkpoints" / "tokenizer.model")
    with pytest.raises(CheckpointError, match="is not the one .* was trained with"):
        export_checkpoint(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_overwrite_never_replaces_a_non_bundle(tiny, bundle, tmp_path):
    """overwrite=True replaces a previous bundle only: a user's folder (or a bundle holding a user's file) and a
    regular file are refused with nothing deleted; an empty folder is fine."""
    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    with pytest.raises(BundleError, match="not a bpd-train bundle"):
        export_checkpoint(tiny["ckpt"], user, overwrite=True)
    assert (user / "thesis.tex").read_text() == "years of work" and len(list(tmp_path.iterdir())) == 1
    b = _copy(bundle, tmp_path)
    (b / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match="not a bpd-train bundle"):
        export_checkpoint(tiny["ckpt"], b, overwrite=True)
    assert (b / "notes.txt").exists()
    (b / "notes.txt").unlink()
    assert export_checkpoint(tiny["ckpt"], b, overwrite=True) == b  # a previous bundle: replaced
    f = tmp_path / "file"
    f.write_text("data")
    with pytest.raises(BundleError, match="not a folder"):
        export_checkpoint(tiny["ckpt"], f, overwrite=True)
    assert f.read_text() == "data"
    (tmp_path / "empty").mkdir()
    load_bundle(export_checkpoint(tiny["ckpt"], tmp_path / "empty", overwrite=True))


def test_killed_export_temp_folders_cleaned_and_umask_respected(tiny, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()  # a pid that no longer runs, as after kill -9
    host = socket.gethostname()
    stale = tmp_path / f".out.bpd-tmp-{host}-{dead}-abc123"
    live = tmp_path / f".out.bpd-tmp-{host}-{os.getpid()}-abc123"  # a running export's folder: not ours to touch
    other = tmp_path / ".out.backup"  # the user's, despite the dot
    for d in (stale, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    old = os.umask(0o027)
    try:
        out = export_checkpoint(tiny["ckpt"], tmp_path / "out")
    finally:
        os.umask(old)
    assert not stale.exists() and live.exists() and other.exists()
    assert (out.stat().st_mode & 0o777) == 0o750
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == dict.fromkeys(
        ["README.md", "config.json", "manifest.json", "model.safetensors", "tokenizer.model"], 0o640
    )
