"""Find and load a trained model: a Lightning checkpoint file, a run folder, or an exported bundle.

The one place every later stage (heads init, distillation teacher, evaluation, export) loads a model.
Checkpoint layout (written by the LightningModule's on_save_checkpoint):
  ckpt["state_dict"]        model weights, keys prefixed "model."
  ckpt["bpd"]               {"model_config": BPDConfig dict, "tokenizer_hash": sha256 of tokenizer.model,
                             "tokenizer_file": absolute path at save time, "regime": name, ...}
  tokenizer.model           beside the checkpoint file or in its parent run folder.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bpd_train.io import atomic_write_bytes, sha256_file
from bpd_train.model.config import BPDConfig

CKPT_META_KEY = "bpd"
STATE_PREFIX = "model."


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not match what the caller expects."""


@dataclass
class LoadedModel:
    model: Any                      # BPDModel, eval mode, on the requested device
    tokenizer_path: Path
    tokenizer_hash: str
    source: Path                    # the file or folder it came from
    meta: dict = field(default_factory=dict)

    @property
    def config(self) -> BPDConfig:
        return self.model.config

    def tokenizer(self):
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=str(self.tokenizer_path))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A .ckpt file as is; a run folder -> its best checkpoint, else last. Bundles are folders with config.json."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if p.is_file():
        return p
    if (p / "config.json").exists() and (p / "model.safetensors").exists():
        return p  # a bundle
    for cand in ("checkpoints/best.ckpt", "best.ckpt", "checkpoints/last.ckpt", "last.ckpt"):
        if (p / cand).is_file():
            return p / cand
    if (p / "checkpoints").is_dir():
        ckpts = sorted((p / "checkpoints").glob("*.ckpt"), key=lambda f: f.stat().st_mtime)
        if ckpts:
            return ckpts[-1]
    raise CheckpointError(f"no checkpoint found in {p} (looked for checkpoints/best.ckpt and checkpoints/last.ckpt)")


def read_checkpoint(path: str | os.PathLike) -> dict:
    """torch.load with weights_only=True: checkpoints are data, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - one clear message for every way a file can be unreadable
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e


def find_tokenizer(ckpt_path: Path, meta: dict) -> Path:
    for cand in (ckpt_path.parent / "tokenizer.model", ckpt_path.parent.parent / "tokenizer.model",
                 Path(meta.get("tokenizer_file", "")) if meta.get("tokenizer_file") else None):
        if cand is not None and cand.is_file():
            return cand
    raise CheckpointError(f"no tokenizer.model beside {ckpt_path} (nor at {meta.get('tokenizer_file')})")


def load_model(path: str | os.PathLike, map_location: str | torch.device = "cpu",
               expect_tokenizer_hash: str | None = None) -> LoadedModel:
    """Load a model for inference from a checkpoint file, a run folder or a bundle."""
    from bpd_train.model import BPDModel

    src = resolve_checkpoint(path)
    if src.is_dir():  # bundle
        from bpd_train.export import load_bundle

        model, _tok, meta = load_bundle(src)
        tok_path = src / "tokenizer.model"
        loaded = LoadedModel(model.to(map_location).eval(), tok_path, meta["tokenizer_hash"], src, meta)
    else:
        ckpt = read_checkpoint(src)
        meta = ckpt.get(CKPT_META_KEY)
        if not isinstance(meta, dict) or "model_config" not in meta:
            raise CheckpointError(f"{src} is not a bpd-train checkpoint (no '{CKPT_META_KEY}' metadata)")
        cfg = BPDConfig.from_dict(dict(meta["model_config"]))
        model = BPDModel(cfg)
        state = {k[len(STATE_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(STATE_PREFIX)}
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"weights in {src} do not fit its own model config: {e}") from e
        tok_path = find_tokenizer(src, meta)
        tok_hash = sha256_file(tok_path)
        if meta.get("tokenizer_hash") and meta["tokenizer_hash"] != tok_hash:
            raise CheckpointError(f"tokenizer {tok_path} (sha256 {tok_hash[:12]}) is not the one {src} was trained "
                                  f"with (sha256 {meta['tokenizer_hash'][:12]})")
        loaded = LoadedModel(model.to(map_location).eval(), tok_path, tok_hash, src, dict(meta))
    if expect_tokenizer_hash is not None and loaded.tokenizer_hash != expect_tokenizer_hash:
        raise CheckpointError(f"{src} uses tokenizer {loaded.tokenizer_hash[:12]} but this run uses "
                              f"{expect_tokenizer_hash[:12]}: they were built from different corpora or settings")
    return loaded


def write_checkpoint(path: str | os.PathLike, model, tokenizer_path: str | os.PathLike, **meta) -> Path:
    """Write a minimal checkpoint in the same layout the LightningModule saves (atomic).

    Used to turn consolidated DeepSpeed weights into a loadable checkpoint and to make test fixtures.
    """
    import io

    path = Path(path)
    tokenizer_path = Path(tokenizer_path)
    payload = {
        "state_dict": {STATE_PREFIX + k: v.detach().cpu() for k, v in model.state_dict().items()},
        CKPT_META_KEY: {"model_config": model.config.to_dict(), "tokenizer_hash": sha256_file(tokenizer_path),
                        "tokenizer_file": str(tokenizer_path.resolve()), **meta},
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(path, buf.getvalue())
    dest_tok = path.parent / "tokenizer.model"
    if not dest_tok.exists():
        atomic_write_bytes(dest_tok, tokenizer_path.read_bytes())
    return path
