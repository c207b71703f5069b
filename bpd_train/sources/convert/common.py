"""What the two transformers imports share (convert/hf/mt.py: encoder-decoder translation models; convert/hf/lm.py:
decoder-only models): reading a checkpoint folder (configs, weights: safetensors, sharded or not, or
pytorch_model.bin with weights_only=True) without leaving it, resolving hub ids, checking a config against the
weights before anything is allocated, and the export folder both write (config.json, generation_config.json,
model.safetensors, the heads in bpd_heads.safetensors with custom_generate/generate.py, tokenizer files),
read back by read_heads, and the check that a folder is such an export (is_hf_export).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bpd_train.data.hf_tokenizer import TokenizerError, tokenizer_files
from bpd_train.hf_generate import CUSTOM_GENERATE, TEMPLATE
from bpd_train.io import atomic_dir, outside
from bpd_train.model.mt.config import BPDConfig
from bpd_train.sources.bundle import BundleError
from bpd_train.sources.bundle import check_buildable as check

HEADS_FILE = "bpd_heads.safetensors"
HEADS_FORMAT = "bpd-train-heads"


class ConvertError(ValueError):
    """A checkpoint or model that cannot be converted (one line, for the user)."""


def check_buildable(config, state: dict[str, Tensor], folder: Path) -> None:
    """config.json's sizes against the weights, before the model is allocated (bundle.check_buildable); heads
    that are not in the checkpoint start fresh."""
    try:
        check(config, state, where=f"{Path(folder) / 'config.json'} and the weights", optional=("heads.",))
    except BundleError as e:
        raise ConvertError(str(e)) from None


# ----------------------------------------------------------------------------------------------- reading
def folder_file(folder: str | Path, name: str) -> Path:
    """folder/name, refused when it is not a file of the folder the user pointed at (a link or name leading
    outside it): nothing outside is read, or copied into a bundle or export."""
    why = outside(folder, name)
    if why is not None:
        raise ConvertError(f"refusing to read outside the model folder: {why}")
    return Path(folder) / name


def read_json(path: Path) -> dict[str, Any]:
    path = folder_file(Path(path).parent, Path(path).name)
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConvertError(
            f"{path} not found: a transformers checkpoint folder holds config.json and "
            "model.safetensors (or pytorch_model.bin)"
        ) from None
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot read {path}: {e}") from None


def read_configs(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint folder's config.json and generation_config.json (empty where absent), for both families."""
    gen = folder / "generation_config.json"
    return read_json(folder / "config.json"), read_json(gen) if gen.is_file() else {}


def read_weights(folder: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint folder as float32, without unpickling anything."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        files = [folder_file(folder, "model.safetensors")]
    elif (folder / "model.safetensors.index.json").is_file():
        files = _indexed(folder, "model.safetensors.index.json")
    elif (folder / "pytorch_model.bin").is_file():
        files = [folder_file(folder, "pytorch_model.bin")]
    elif (folder / "pytorch_model.bin.index.json").is_file():
        files = _indexed(folder, "pytorch_model.bin.index.json")
    else:
        raise ConvertError(f"{folder} holds no weights: expected model.safetensors or pytorch_model.bin")
    out: dict[str, Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ConvertError(f"{f} is listed in the checkpoint's index but missing")
        if f.suffix == ".safetensors":
            try:
                part = load_file(str(f))
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:  # a truncated or lying header
                raise ConvertError(
                    f"{f} is not a readable safetensors file ({str(e).strip().splitlines()[0]})"
                ) from None
        else:
            try:
                part = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as e:  # never fall back to unpickling arbitrary objects
                raise ConvertError(
                    f"{f} does not load with weights_only=True ({type(e).__name__}); convert it to safetensors first"
                ) from None
        out.update({k: v.float() if v.is_floating_point() else v for k, v in part.items()})
    return out


def _indexed(folder: Path, index: str) -> list[Path]:
    """The weight files a sharded checkpoint's index names, each a file of the folder."""
    idx = read_json(folder / index)
    wmap = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ConvertError(f"{folder / index} has no weight_map of tensor name -> file name")
    return [folder_file(folder, f) for f in sorted(set(wmap.values()))]


def write_hf_folder(
    out_dir: str | Path,
    cfg: dict,
    gen: dict,
    weights: dict[str, Tensor],
    heads: dict[str, Tensor] | None,
    heads_meta: dict[str, str],
    copies: dict[str, Path],
    overwrite: bool,
    replaceable=None,
) -> Path:
    """What to_hf and to_hf_lm write: config.json, generation_config.json, model.safetensors, the heads in
    bpd_heads.safetensors (None: no such file; a translation model always writes it, with its config, even without
    heads) with custom_generate/generate.py beside them (bpd_train/hf_generate: transformers' own generate() then
    decodes with the heads), and `copies` (name in the folder, which may name a subfolder -> file), atomically: the
    folder appears complete or not at all; overwrite replaces what `replaceable` accepts (io.atomic_dir)."""
    from safetensors.torch import save_file

    copies = dict(copies)
    if heads is not None:
        copies[CUSTOM_GENERATE] = TEMPLATE
    for name in copies:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ConvertError(f"refusing to write {name!r} outside the export folder")
    with atomic_dir(out_dir, overwrite=overwrite, replaceable=replaceable) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if heads is not None:
            save_file(heads, str(tmp / HEADS_FILE), metadata=heads_meta)
        for name, f in copies.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, tmp / name)
    return Path(out_dir)


def read_heads_file(folder: str | Path, key: str) -> tuple[dict, dict[str, Tensor]] | None:
    """bpd_heads.safetensors beside a checkpoint (either family) -> (the model config stored under metadata `key`
    as a dict, heads tensors); None where there is no heads file, one line where it is not ours or damaged."""
    path = Path(folder) / HEADS_FILE
    if not path.is_file() and not path.is_symlink():
        return None
    meta, tensors = read_safetensors(folder_file(folder, HEADS_FILE))
    if meta.get("format") != HEADS_FORMAT or key not in meta:
        raise ConvertError(
            f"{path} is not a bpd-train heads file for this model family (format {meta.get('format')!r}, no {key})"
        )
    try:
        config = json.loads(meta[key])
    except ValueError as e:
        raise ConvertError(f"{path} has an unreadable {key} ({e})") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{path} has an unreadable {key} (not an object)")
    return config, tensors


def read_heads(folder: str | Path, key: str, config_class: type) -> tuple[Any, dict[str, Tensor]] | None:
    """bpd_heads.safetensors beside a checkpoint -> (the config it was written with, as `config_class`, heads
    tensors); None where there is no heads file. key: where the family's exports keep the config (to_hf:
    bpd_config, to_hf_lm: lm_config)."""
    got = read_heads_file(folder, key)
    if got is None:
        return None
    meta, tensors = got
    try:
        return config_class.from_dict(meta), tensors
    except (KeyError, TypeError, ValueError) as e:
        raise ConvertError(f"{Path(folder) / HEADS_FILE} has an unreadable {key} ({e})") from None


def read_safetensors(path: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    """(metadata, tensors) of a safetensors file; one line when its header or data is damaged."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ConvertError(f"{path} is not a readable safetensors file ({str(e).strip().splitlines()[0]})") from None


# ---------------------------------------------------------------------------------------- the hf: source
_WEIGHT_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "source.spm",
    "target.spm",
    "vocab.json",
    "target_vocab.json",
    "sentencepiece.bpe.model",
    "tokenizer.json",
    "chat_template.jinja",
]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(path_or_id: str | Path) -> tuple[Path, str | None]:
    """A local folder, or a hub id fetched (or found in the local hub cache) -> (folder, hub id or None)."""
    p = Path(str(path_or_id)).expanduser()
    if p.is_dir():
        return p, None
    ident = str(path_or_id)
    if p.exists() or ident.startswith((".", "/", "~")) or ident.count("/") > 1:
        raise ConvertError(f"{ident} is not a transformers checkpoint folder")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConvertError(
            f"{ident} is not a local folder, and fetching hub ids needs huggingface_hub (pip install 'bpd-train[hf]')"
        ) from None
    try:
        folder = Path(snapshot_download(ident, allow_patterns=_WEIGHT_PATTERNS, local_files_only=_offline()))
        if not any(folder.glob("*.safetensors")):  # older repos ship only pytorch_model.bin
            folder = Path(
                snapshot_download(
                    ident, allow_patterns=_WEIGHT_PATTERNS + ["pytorch_model.bin*"], local_files_only=_offline()
                )
            )
    except Exception as e:
        if _offline():
            raise ConvertError(
                f"{ident} is not a local folder and not in the hub cache, and HF_HUB_OFFLINE=1 "
                "forbids downloading it: download it where the network allows "
                f"(hf download {ident}) and pass that folder"
            ) from None
        raise ConvertError(
            f"cannot fetch {ident} from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
        ) from None
    return folder, ident


# ------------------------------------------------------------------------------------------ the export folder
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", HEADS_FILE)
_GENERATE_DIR = CUSTOM_GENERATE.split("/")[0]


def _ours_generate_dir(path: Path) -> bool:
    """custom_generate/ as write_hf_folder writes it: a real folder holding generate.py (and Python's byte-code
    cache, should the file have been run from there), nothing else."""
    d = path / _GENERATE_DIR
    if d.is_symlink() or not d.is_dir():
        return False
    names = {p.name for p in d.iterdir()}
    gen = d / Path(CUSTOM_GENERATE).name
    return gen.name in names and gen.is_file() and not gen.is_symlink() and names <= {gen.name, "__pycache__"}


def _heads_key(path: Path) -> str | None:
    """The metadata key of the config in a folder's heads file (bpd_config, lm_config), read without its tensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(folder_file(path, HEADS_FILE)), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError):  # absent or damaged: read_heads tells which
        return None
    return "lm_config" if "lm_config" in meta else "bpd_config" if "bpd_config" in meta else None


def is_hf_export(path: str | Path) -> bool:
    """A folder export.format=hf wrote (`to_hf` or `to_hf_lm`) and nothing else (its files, custom_generate/,
    tokenizer files): the only kind overwrite replaces."""
    path = Path(path)
    try:
        names = {p.name for p in path.iterdir()}
        if _heads_key(path) == "lm_config":  # a decoder-only export (to_hf_lm); else ours (to_hf) or an error
            read_heads_file(path, "lm_config")
        else:
            read_heads(path, "bpd_config", BPDConfig)
        if _GENERATE_DIR in names and not _ours_generate_dir(path):
            return False
        rest = names - set(EXPORT_FILES) - {_GENERATE_DIR}
        tok = set(tokenizer_files(path)) if rest else set()
    except (OSError, ValueError, TokenizerError):
        return False
    return HEADS_FILE in names and rest <= tok


def check_hf_output_dir(out_dir: str | Path, overwrite: bool) -> None:
    """Before any work, as for bundles: an existing output is refused unless overwrite is on and an earlier
    export.format=hf wrote it."""
    out_dir = Path(out_dir)
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise FileExistsError(f"export output {out_dir} exists and is not a folder; choose another export.output_dir")
    if not overwrite:
        raise FileExistsError(f"{out_dir} already exists; pass export.overwrite=true to replace it")
    if any(out_dir.iterdir()) and not is_hf_export(out_dir):
        raise FileExistsError(
            f"export output {out_dir} is not a folder export.format=hf wrote (or holds other "
            "files too); overwrite only replaces an earlier export: choose another export.output_dir"
        )
