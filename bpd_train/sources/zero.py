"""DeepSpeed ZeRO checkpoint folders: find one, read its bpd metadata, consolidate its shards into one state dict.

Consolidation uses DeepSpeed's own zero_to_fp32, but with every torch.load it makes forced to weights_only=True and
only DeepSpeed's few plain state classes allowed (`_zero_weights_only`), so a crafted ZeRO folder is refused, never
run. Building a model from the result is bpd_train/sources/loading.py's job.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from pathlib import Path

import torch

from bpd_train.sources.checkpoint import CKPT_META_KEY, STATE_PREFIX, CheckpointError

# Prefixes wrappers put in front of the model's own parameter names (LightningModule, DeepSpeed, Lightning's
# old DeepSpeed wrapper); stripped in this order when every key carries them.
_PREFIXES = ("_forward_module.", "module.", STATE_PREFIX)
# Client-state key of the frozen parameters' fp32 values (model-relative names): DeepSpeed with bf16/fp16 keeps
# only a rounded copy of parameters that do not train (training/module.py keep_frozen_fp32 writes it).
FROZEN_FP32_KEY = "bpd_frozen_fp32"


def find_zero_dir(path: str | os.PathLike) -> Path | None:
    """The folder holding DeepSpeed's `latest` file (a Lightning DeepSpeed `*.ckpt/` folder has it under
    `checkpoint/`), or None when `path` is not a ZeRO checkpoint."""
    p = Path(path)
    if not p.is_dir():
        return None
    for cand in (p, p / "checkpoint"):
        if (cand / "latest").is_file() or any(cand.glob("global_step*/*model_states.pt")):
            return cand
    return None


def _strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix in _PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
        elif any(k.startswith(prefix) for k in state) and prefix == STATE_PREFIX:
            # a LightningModule may hold other modules (teacher, metrics): keep only the model's tensors
            state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    return state


def zero_tag_dir(zero_dir: Path, tag: str | None) -> Path:
    if tag is None:
        latest = zero_dir / "latest"
        if latest.is_file():
            tag = latest.read_text().strip()
        else:
            steps = sorted(
                zero_dir.glob("global_step*"), key=lambda d: int("".join(c for c in d.name if c.isdigit()) or 0)
            )
            if not steps:
                raise CheckpointError(f"{zero_dir} has no 'latest' file and no global_step* folder")
            tag = steps[-1].name
    d = zero_dir / tag
    if not d.is_dir():
        raise CheckpointError(f"ZeRO checkpoint tag folder {d} does not exist")
    return d


def _zero_safe_globals() -> list:
    """The non-tensor objects real DeepSpeed ZeRO-1/2/3 files hold (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on CPU ZeRO-2/3 runs): plain state, no code runs when
    they are rebuilt."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # without deepspeed a ZeRO folder cannot be consolidated anyway; the metadata needs none
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def _zero_weights_only():
    """Inside: every torch.load is weights_only=True, even DeepSpeed's own `torch.load(..., weights_only=False)`
    in zero_to_fp32 (TORCH_FORCE_WEIGHTS_ONLY_LOAD is read on each call), with DeepSpeed's state classes allowed."""
    saved = {k: os.environ.pop(k, None) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_zero_safe_globals()):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _refused(where: Path, e: BaseException) -> CheckpointError:
    found = re.search(r"Unsupported global: GLOBAL (\S+)|unsupported (?:GLOBAL|REDUCE)[^\n]*", str(e), re.I)
    what = found.group(1) or found.group(0) if found else type(e).__name__
    return CheckpointError(
        f"refusing {where}: it holds pickled objects that are not tensors or DeepSpeed state "
        f"({what}); bpd-train never unpickles checkpoint files, since that can run code"
    )


def model_states_file(tag_dir: Path) -> Path:
    """The rank-0 model-states file of a tag folder: it holds the bpd metadata and identifies the weights."""
    files = sorted(tag_dir.glob("*model_states.pt"))
    if not files:
        raise CheckpointError(f"{tag_dir} has no *model_states.pt file: not a DeepSpeed checkpoint")
    return files[0]


def _zero_meta(tag_dir: Path) -> dict:
    """The bpd metadata the training run put into DeepSpeed's client state (in the rank-0 model-states file)."""
    return _zero_client_state(tag_dir)[0]


def _zero_client_state(tag_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(bpd metadata, fp32 values of the frozen parameters or {}) from DeepSpeed's client state."""
    files = [model_states_file(tag_dir)]
    try:
        with _zero_weights_only():
            states = torch.load(files[0], map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused(files[0], e) from None
    except Exception as e:  # noqa: BLE001 - one clear message for every way a file can be unreadable
        raise CheckpointError(
            f"cannot read {files[0]}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    if not isinstance(states, dict):
        raise CheckpointError(f"{files[0]} is not a DeepSpeed model-states file")
    client = states.get("client_state")
    client = client if isinstance(client, dict) else {}
    meta = states.get(CKPT_META_KEY)
    if not isinstance(meta, dict):
        meta = client.get(CKPT_META_KEY)
    if not isinstance(meta, dict) or "model_config" not in meta:
        raise CheckpointError(
            f"{files[0]} carries no '{CKPT_META_KEY}' metadata (model config, tokenizer hash): "
            "it was not saved by bpd-train"
        )
    frozen = states.get(FROZEN_FP32_KEY, client.get(FROZEN_FP32_KEY)) or {}
    if not isinstance(frozen, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in frozen.items()):
        raise CheckpointError(f"{files[0]}: '{FROZEN_FP32_KEY}' is not a name -> tensor mapping")
    return dict(meta), dict(frozen)


def consolidate_zero(path: str | os.PathLike, tag: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """-> (fp32 state dict of the BPDModel, bpd metadata) from a DeepSpeed ZeRO-1/2/3 checkpoint folder."""
    zero_dir = find_zero_dir(path)
    if zero_dir is None:
        raise CheckpointError(f"{path} is not a DeepSpeed ZeRO checkpoint folder (no 'latest' file or global_step*/)")
    tag_dir = zero_tag_dir(zero_dir, tag)
    if not torch.cuda.is_available():  # consolidation needs no accelerator; don't let DeepSpeed go looking for one
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    meta, frozen = _zero_client_state(tag_dir)  # (imports DeepSpeed for its allow-list: after DS_ACCELERATOR)
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as e:
        raise CheckpointError("consolidating a ZeRO checkpoint needs deepspeed: pip install -e '.[deepspeed]'") from e
    try:
        with _zero_weights_only():
            state = get_fp32_state_dict_from_zero_checkpoint(str(zero_dir), tag=tag_dir.name)
    except pickle.UnpicklingError as e:
        raise _refused(tag_dir, e) from None
    except Exception as e:  # noqa: BLE001 - surface DeepSpeed's reason in one line
        raise CheckpointError(
            f"cannot consolidate ZeRO checkpoint {zero_dir} ({tag_dir.name}): {type(e).__name__}: {e}"
        ) from e
    return _restore_frozen(_strip_prefixes(dict(state)), frozen, tag_dir), meta


def _restore_frozen(
    state: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], where: Path
) -> dict[str, torch.Tensor]:
    """The frozen parameters' saved fp32 values in place of DeepSpeed's rounded copies: a frozen backbone exports
    bit-identical to the model it came from."""
    for name, value in frozen.items():
        have = state.get(name)
        if have is None or tuple(have.shape) != tuple(value.shape):
            raise CheckpointError(
                f"{where}: frozen parameter {name} {tuple(value.shape)} does not match the "
                f"consolidated weights ({'absent' if have is None else tuple(have.shape)})"
            )
        state[name] = value.to(torch.float32)
    return state
