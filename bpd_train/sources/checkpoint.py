"""The Lightning checkpoint file format: what the LightningModule writes, read back without pickle.

Checkpoint layout (written by the LightningModule's on_save_checkpoint):
  ckpt["state_dict"]        model weights, keys prefixed "model."
  ckpt["bpd"]               {"model_config": BPDConfig dict, "tokenizer_hash": sha256 of tokenizer.model,
                             "tokenizer_file": absolute path at save time, "regime": name, ...}
  tokenizer.model           beside the checkpoint file or in its parent run folder.
Finding and loading a model from any source (this format among others) is bpd_train/sources/loading.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bpd_train.io import atomic_write_bytes, sha256_file

CKPT_META_KEY = "bpd"
STATE_PREFIX = "model."


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not match what the caller expects."""


def read_checkpoint(path: str | os.PathLike) -> dict:
    """torch.load with weights_only=True: checkpoints are data, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - one clear message for every way a file can be unreadable
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e


def checkpoint_meta(ckpt: dict, where: str | os.PathLike) -> dict:
    """The bpd metadata of a read checkpoint; refuses a file that bpd-train did not write."""
    meta = ckpt.get(CKPT_META_KEY) if isinstance(ckpt, dict) else None
    if not isinstance(meta, dict) or "model_config" not in meta:
        raise CheckpointError(f"{where} is not a bpd-train checkpoint (no '{CKPT_META_KEY}' metadata)")
    return dict(meta)


def model_state(ckpt: dict) -> dict[str, torch.Tensor]:
    """The BPDModel's own tensors (the LightningModule may hold others under other prefixes)."""
    return {k[len(STATE_PREFIX) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(STATE_PREFIX)}


def write_checkpoint(path: str | os.PathLike, model, tokenizer_path: str | os.PathLike, **meta) -> Path:
    """Write a minimal checkpoint in the same layout the LightningModule saves (atomic).

    Used to turn consolidated DeepSpeed weights into a loadable checkpoint and to make test fixtures.
    """
    import io

    path = Path(path)
    tokenizer_path = Path(tokenizer_path)
    payload = {
        "state_dict": {STATE_PREFIX + k: v.detach().cpu() for k, v in model.state_dict().items()},
        CKPT_META_KEY: {
            "model_config": model.config.to_dict(),
            "tokenizer_hash": sha256_file(tokenizer_path),
            "tokenizer_file": str(tokenizer_path.resolve()),
            **meta,
        },
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(path, buf.getvalue())
    dest_tok = path.parent / "tokenizer.model"
    if not dest_tok.exists():
        atomic_write_bytes(dest_tok, tokenizer_path.read_bytes())
    return path
