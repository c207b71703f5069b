"""Bundles: a trained model as plain files that load without pickle, and the checkpoint -> bundle export.

A bundle folder holds
  model.safetensors   the weights (fp32 or bf16); tied tensors are stored once (config.json "weights.tied")
  config.json         format marker, model config (incl. the k heads), tokenizer sha256 + special ids,
                      sha256 of model.safetensors, training provenance
  tokenizer.model     the sentencepiece model the weights were trained with
  README.md           model card (regime, data, and the evaluation table when a report exists)
  manifest.json       sha256 of each of the four files above (format_version >= 2), written last
`load_bundle` checks every file, hash and tensor shape before it builds the model, and reads nothing with
pickle. A Lightning checkpoint is read with weights_only=True; a DeepSpeed ZeRO folder is consolidated with
DeepSpeed's own zero_to_fp32, but with every torch.load it makes forced to weights_only=True and only DeepSpeed's
few plain state classes allowed (`_zero_weights_only`), so a crafted ZeRO folder is refused, never run.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from bpd_train import __version__
from bpd_train.checkpoint import CKPT_META_KEY, STATE_PREFIX, CheckpointError, load_model, resolve_checkpoint
from bpd_train.io import atomic_dir, atomic_write_json, atomic_write_text, sha256_file, umask
from bpd_train.model.config import BPDConfig

BUNDLE_FORMAT = "bpd-train-bundle"
BUNDLE_VERSION = 2  # 2: manifest.json covers config.json (an edited config is refused); 1 had no manifest
WEIGHTS, CONFIG, TOKENIZER, CARD, MANIFEST = ("model.safetensors", "config.json", "tokenizer.model", "README.md",
                                              "manifest.json")
MANIFEST_FORMAT = "bpd-train-bundle-manifest"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# Prefixes wrappers put in front of the model's own parameter names (LightningModule, DeepSpeed, Lightning's
# old DeepSpeed wrapper); stripped in this order when every key carries them.
_PREFIXES = ("_forward_module.", "module.", STATE_PREFIX)


class BundleError(CheckpointError):
    """A bundle that is missing a file, was modified, or does not match its own config."""


# ----------------------------------------------------------------------------------------------------- writing
def _dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def _dedup_tied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory (tied embedding/projection): keep each storage once."""
    kept: dict[tuple, str] = {}
    out, tied = {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in kept:
            tied[name] = kept[key]
        else:
            kept[key] = name
            out[name] = t
    return out, tied


def export_bundle(model, tokenizer_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
                  overwrite: bool = False, provenance: dict | None = None, card_extra: str | None = None) -> Path:
    """Write `model` (a BPDModel) and its tokenizer as a bundle folder, atomically (temp folder + rename)."""
    from safetensors.torch import save_file

    out_dir, tokenizer_path = Path(out_dir), Path(tokenizer_path)
    if not tokenizer_path.is_file():
        raise BundleError(f"tokenizer {tokenizer_path} does not exist")
    torch_dtype = _dtype(dtype)
    cfg: BPDConfig = model.config
    raw = {k: v.detach() for k, v in model.state_dict().items()}
    stored, tied = _dedup_tied(raw)
    tensors = {k: (v.to(torch_dtype) if v.is_floating_point() else v).cpu().contiguous() for k, v in stored.items()}
    tok_hash = sha256_file(tokenizer_path)
    special = _tokenizer_ids(tokenizer_path)
    if special["vocab_size"] != cfg.vocab_size:
        raise BundleError(f"tokenizer {tokenizer_path} has {special['vocab_size']} pieces but the model's vocab_size "
                          f"is {cfg.vocab_size}: not the tokenizer this model was trained with")
    check_output_dir(out_dir, overwrite)
    with atomic_dir(out_dir, overwrite=overwrite, replaceable=is_bundle_dir) as tmp:
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt", "bpd_train": __version__})
        os.chmod(tmp / WEIGHTS, 0o666 & ~umask())  # safetensors creates it 0600 whatever the umask
        (tmp / TOKENIZER).write_bytes(tokenizer_path.read_bytes())
        config = {
            "format": BUNDLE_FORMAT,
            "format_version": BUNDLE_VERSION,
            "bpd_train_version": __version__,
            "model": cfg.to_dict(),
            "heads": {"block_size": cfg.block_size, "identity_p1": cfg.identity_p1, "head_hidden": cfg.head_hidden},
            "tokenizer": {"file": TOKENIZER, "sha256": tok_hash, **special},
            "weights": {"file": WEIGHTS, "sha256": sha256_file(tmp / WEIGHTS), "dtype": str(torch_dtype).split(".")[-1],
                        "tied": tied, "num_parameters": int(sum(t.numel() for t in tensors.values()))},
            "training": dict(provenance or {}),
        }
        atomic_write_json(tmp / CONFIG, config)
        atomic_write_text(tmp / CARD, model_card(config, card_extra))
        atomic_write_json(tmp / MANIFEST, {"format": MANIFEST_FORMAT, "files": {
            f: sha256_file(tmp / f) for f in (CONFIG, WEIGHTS, TOKENIZER, CARD)}})
    return out_dir


def is_bundle_dir(path: str | os.PathLike) -> bool:
    """A folder export wrote, and nothing else: the only kind `overwrite` may replace (it is deleted whole)."""
    path = Path(path)
    try:
        names = {p.name for p in path.iterdir()}
        if MANIFEST in names:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
            ours = set(manifest["files"]) | {MANIFEST} if manifest.get("format") == MANIFEST_FORMAT else set()
        else:  # format_version 1
            ours = {CONFIG, WEIGHTS, TOKENIZER, CARD}
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return isinstance(config, dict) and config.get("format") == BUNDLE_FORMAT and bool(ours) and names <= ours


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool) -> None:
    """Before any work: an existing output is refused unless overwrite is on and it is a previous bundle."""
    out_dir = Path(out_dir)
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise BundleError(f"export output {out_dir} exists and is not a folder; choose another export.output_dir")
    if not overwrite:
        raise FileExistsError(f"{out_dir} already exists; pass overwrite=true (export.overwrite=true) to replace it")
    if any(out_dir.iterdir()) and not is_bundle_dir(out_dir):
        raise BundleError(f"export output {out_dir} is a folder that is not a bpd-train bundle (or holds other files "
                          "too); overwrite only ever replaces a previous bundle: choose another export.output_dir")


def _tokenizer_ids(path: Path) -> dict[str, int]:
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # noqa: BLE001 - sentencepiece raises OSError/RuntimeError for a bad file
        raise BundleError(f"{path} is not a readable sentencepiece model: {e}") from e
    return {"vocab_size": sp.get_piece_size(), "pad_id": sp.pad_id(), "bos_id": sp.bos_id(), "eos_id": sp.eos_id(),
            "unk_id": sp.unk_id()}


def model_card(config: dict, extra: str | None = None) -> str:
    m, t, tr = config["model"], config["tokenizer"], config.get("training", {})
    k = m["block_size"]
    regime = tr.get("regime", "unknown")
    lines = [
        f"# bpd-train model: {tr.get('name', regime)} (k = {k})",
        "",
        "An encoder-decoder Transformer with Blockwise Parallel Decoding heads (Stern, Shazeer & Uszkoreit, 2018): "
        f"{k} head(s) propose {k} tokens per decoder call; head 1 verifies them, so `Exact` acceptance "
        "reproduces the model's greedy output while using fewer decoder calls.",
        "",
        "## Use",
        "",
        "```bash",
        f"python -m bpd_train.translate --bundle {tr.get('bundle_name', '.')} --block-size {k} --accept exact "
        "< input.txt > output.txt",
        "```",
        "",
        "```python",
        "from bpd_train.decoding import Exact, blockwise",
        "from bpd_train.export import load_bundle",
        f"model, sp, meta = load_bundle('{tr.get('bundle_name', 'path/to/bundle')}')  # checks files, hashes, shapes",
        "src = [sp.encode('In the beginning God created the heavens and the earth.') + [sp.eos_id()]]",
        f"r = blockwise(model, src, block_size={k}, accept=Exact())   # == greedy output, fewer decoder calls",
        "print(sp.decode(r.tokens[0]), r.mean_accepted)",
        "```",
        "",
        "## Model",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    for key in ("vocab_size", "d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff", "block_size",
                "identity_p1", "head_d_hidden", "max_positions"):
        lines.append(f"| {key} | {m.get(key)} |")
    lines += [f"| weights dtype | {config['weights']['dtype']} |",
              f"| parameters | {config['weights']['num_parameters']:,} |", "",
              "## Training", "", "| | |", "|---|---|", f"| regime | {regime} |"]
    for key in ("paper_regime", "data", "src_lang", "tgt_lang", "init_from", "global_step", "epoch", "seed", "source",
                "source_id"):
        if tr.get(key) is not None:
            lines.append(f"| {key} | {tr[key]} |")
    lines += ["", "## Tokenizer", "",
              f"sentencepiece `tokenizer.model`, {t['vocab_size']} pieces, sha256 `{t['sha256']}`; "
              f"pad={t['pad_id']} bos={t['bos_id']} eos={t['eos_id']} unk={t['unk_id']}.", ""]
    lines += ["## Evaluation", ""]
    lines += [extra.rstrip(), ""] if extra else ["No evaluation report was found when this bundle was exported "
                                                 "(run `python evaluate.py` and export again to include one).", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- loading
def read_bundle_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"bundle {path} does not exist or is not a folder")
    missing = [f for f in (CONFIG, WEIGHTS, TOKENIZER) if not (path / f).is_file()]
    if missing:
        raise BundleError(f"bundle {path} is incomplete: missing {', '.join(missing)}")
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path / CONFIG} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or config.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{path / CONFIG} is not a bpd-train bundle config (format != {BUNDLE_FORMAT!r})")
    if config.get("format_version", 0) > BUNDLE_VERSION:
        raise BundleError(f"bundle {path} has format_version {config['format_version']}; this bpd-train reads "
                          f"up to {BUNDLE_VERSION}: upgrade bpd-train")
    for key in ("model", "tokenizer", "weights"):
        if not isinstance(config.get(key), dict):
            raise BundleError(f"{path / CONFIG} has no '{key}' section")
    return config


def load_bundle(path: str | os.PathLike, map_location: str | torch.device = "cpu", dtype: str | None = "float32"):
    """-> (model, tokenizer, meta). model: BPDModel in eval mode (fp32 unless dtype=None keeps the stored dtype);
    tokenizer: sentencepiece.SentencePieceProcessor; meta: config.json plus 'tokenizer_hash' and 'path'."""
    import sentencepiece as spm
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from bpd_train.model import BPDModel

    path = Path(path)
    config = read_bundle_config(path)
    verify_manifest(path, config)
    tok_hash = sha256_file(path / TOKENIZER)
    if tok_hash != config["tokenizer"].get("sha256"):
        raise BundleError(f"{path / TOKENIZER} (sha256 {tok_hash[:12]}) is not the tokenizer this bundle was exported "
                          f"with (sha256 {str(config['tokenizer'].get('sha256'))[:12]}): the file was replaced or "
                          "modified")
    w_hash = sha256_file(path / WEIGHTS)
    if w_hash != config["weights"].get("sha256"):
        raise BundleError(f"{path / WEIGHTS} (sha256 {w_hash[:12]}) does not match the sha256 recorded in config.json "
                          f"({str(config['weights'].get('sha256'))[:12]}): the file is corrupt or was modified")
    try:
        cfg = BPDConfig.from_dict(dict(config["model"]))
    except (TypeError, ValueError) as e:
        raise BundleError(f"{path / CONFIG} has an invalid model config: {e}") from e
    tok = spm.SentencePieceProcessor(model_file=str(path / TOKENIZER))
    ids = {"vocab_size": tok.get_piece_size(), "pad_id": tok.pad_id(), "bos_id": tok.bos_id(), "eos_id": tok.eos_id()}
    want = {"vocab_size": cfg.vocab_size, "pad_id": cfg.pad_id, "bos_id": cfg.bos_id, "eos_id": cfg.eos_id}
    if ids != want:
        raise BundleError(f"bundle {path}: tokenizer ids {ids} do not match the model config {want}")
    try:
        tensors = load_file(path / WEIGHTS, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise BundleError(f"cannot read {path / WEIGHTS}: {e}") from e
    for alias, target in config["weights"].get("tied", {}).items():
        if target not in tensors:
            raise BundleError(f"{path / CONFIG} ties {alias} to {target}, which is not in {WEIGHTS}")
        tensors[alias] = tensors[target]
    model = BPDModel(cfg)
    check_state_shapes(model, tensors, where=str(path / WEIGHTS))
    stored_dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    target = _dtype(dtype) if dtype is not None else stored_dtype
    model.to(target)
    model.load_state_dict(tensors, strict=True)  # copies (and casts) into the model's own tensors, keeps ties
    model = model.to(map_location).eval()
    meta = dict(config)
    meta.update(tokenizer_hash=tok_hash, path=str(path), regime=config.get("training", {}).get("regime"))
    return model, tok, meta


def verify_manifest(path: Path, config: dict) -> None:
    """manifest.json covers config.json and the model card (weights and tokenizer are covered by config.json's own
    hashes, checked next): an edited config that keeps tensor shapes (n_heads, ...) would change the output."""
    if config.get("format_version", 1) < 2:
        return  # exported before manifests existed
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict) or CONFIG not in files:
            raise ValueError("not a bundle manifest")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise BundleError(f"bundle {path} has no readable {MANIFEST} ({type(e).__name__}: {e}): re-export it") from None
    for name in (CONFIG, CARD):
        if name in files and sha256_file(path / name) != files[name]:
            raise BundleError(f"{path / name} does not match the sha256 in {path / MANIFEST}: the file was edited "
                              "after export; re-export the bundle (python export.py) instead of editing it")


def check_state_shapes(model, state: dict[str, torch.Tensor], where: str) -> None:
    """Names and shapes of `state` must be exactly the model's: one message listing what differs."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = [f"{k}: {got[k]} (model expects {expected[k]})" for k in sorted(set(got) & set(expected))
             if got[k] != expected[k]]
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            parts.append("shape mismatch " + "; ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else ""))
        if missing:
            parts.append(f"missing {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
        raise BundleError(f"{where} does not fit the model config: " + ", ".join(parts))


# ------------------------------------------------------------------------------------------- DeepSpeed ZeRO folders
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
            state = {k[len(prefix):]: v for k, v in state.items()}
        elif any(k.startswith(prefix) for k in state) and prefix == STATE_PREFIX:
            # a LightningModule may hold other modules (teacher, metrics): keep only the model's tensors
            state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return state


def _zero_tag_dir(zero_dir: Path, tag: str | None) -> Path:
    if tag is None:
        latest = zero_dir / "latest"
        if latest.is_file():
            tag = latest.read_text().strip()
        else:
            steps = sorted(zero_dir.glob("global_step*"),
                           key=lambda d: int("".join(c for c in d.name if c.isdigit()) or 0))
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
    return CheckpointError(f"refusing {where}: it holds pickled objects that are not tensors or DeepSpeed state "
                           f"({what}); bpd-train never unpickles checkpoint files, since that can run code")


def _zero_meta(tag_dir: Path) -> dict:
    """The bpd metadata the training run put into DeepSpeed's client state (in the rank-0 model-states file)."""
    files = sorted(tag_dir.glob("*model_states.pt"))
    if not files:
        raise CheckpointError(f"{tag_dir} has no *model_states.pt file: not a DeepSpeed checkpoint")
    try:
        with _zero_weights_only():
            states = torch.load(files[0], map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused(files[0], e) from None
    except Exception as e:  # noqa: BLE001 - one clear message for every way a file can be unreadable
        raise CheckpointError(f"cannot read {files[0]}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                              ) from e
    if not isinstance(states, dict):
        raise CheckpointError(f"{files[0]} is not a DeepSpeed model-states file")
    meta = states.get(CKPT_META_KEY)
    if not isinstance(meta, dict):
        client = states.get("client_state")
        meta = client.get(CKPT_META_KEY) if isinstance(client, dict) else None
    if not isinstance(meta, dict) or "model_config" not in meta:
        raise CheckpointError(f"{files[0]} carries no '{CKPT_META_KEY}' metadata (model config, tokenizer hash): "
                              "it was not saved by bpd-train")
    return dict(meta)


def consolidate_zero(path: str | os.PathLike, tag: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """-> (fp32 state dict of the BPDModel, bpd metadata) from a DeepSpeed ZeRO-1/2/3 checkpoint folder."""
    zero_dir = find_zero_dir(path)
    if zero_dir is None:
        raise CheckpointError(f"{path} is not a DeepSpeed ZeRO checkpoint folder (no 'latest' file or global_step*/)")
    tag_dir = _zero_tag_dir(zero_dir, tag)
    if not torch.cuda.is_available():  # consolidation needs no accelerator; don't let DeepSpeed go looking for one
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    meta = _zero_meta(tag_dir)  # (imports DeepSpeed for its allow-list: after DS_ACCELERATOR is decided)
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
        raise CheckpointError(f"cannot consolidate ZeRO checkpoint {zero_dir} ({tag_dir.name}): "
                              f"{type(e).__name__}: {e}") from e
    return _strip_prefixes(dict(state)), meta


def load_zero_model(path: str | os.PathLike, tag: str | None = None, map_location="cpu"):
    """A LoadedModel (see checkpoint.py) from a ZeRO folder: consolidated weights + the run's tokenizer."""
    from bpd_train.checkpoint import LoadedModel, find_tokenizer
    from bpd_train.model import BPDModel

    state, meta = consolidate_zero(path, tag)
    model = BPDModel(BPDConfig.from_dict(dict(meta["model_config"])))
    check_state_shapes(model, state, where=f"consolidated ZeRO checkpoint {path}")
    model.load_state_dict(state, strict=True)
    zero_dir = find_zero_dir(path)
    # beside the ZeRO folder or up to three levels above (the run folder), else the path recorded at save time
    cands = [d / TOKENIZER for d in (zero_dir, *list(zero_dir.parents)[:3])]
    tok = next((c for c in cands if c.is_file()), None) or find_tokenizer(zero_dir / "latest", meta)
    tok_hash = sha256_file(tok)
    if meta.get("tokenizer_hash") and meta["tokenizer_hash"] != tok_hash:
        raise CheckpointError(f"tokenizer {tok} (sha256 {tok_hash[:12]}) is not the one {path} was trained with "
                              f"(sha256 {meta['tokenizer_hash'][:12]})")
    return LoadedModel(model.to(map_location).eval(), tok, tok_hash, Path(path), meta)


# ----------------------------------------------------------------------------------------------------- any source
def resolve_source(path: str | os.PathLike) -> tuple[str, Path]:
    """-> ("bundle" | "zero" | "ckpt", path) for a bundle, a ZeRO folder, a .ckpt file, or a run folder (its best
    checkpoint, else last; either may be a Lightning DeepSpeed folder)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if p.is_dir() and (p / CONFIG).is_file():
        return "bundle", p
    if find_zero_dir(p) is not None:
        return "zero", p
    if p.is_file():
        return "ckpt", p
    for cand in ("checkpoints/best.ckpt", "best.ckpt", "checkpoints/last.ckpt", "last.ckpt"):
        c = p / cand
        if c.is_file():
            return "ckpt", c
        if c.is_dir() and find_zero_dir(c) is not None:
            return "zero", c
    c = resolve_checkpoint(p)  # newest checkpoints/*.ckpt, or a clear error
    return ("zero" if c.is_dir() and find_zero_dir(c) is not None else "ckpt"), c


def load_any(path: str | os.PathLike, map_location="cpu", expect_tokenizer_hash: str | None = None):
    """checkpoint.load_model plus DeepSpeed ZeRO folders (and run folders whose checkpoints are ZeRO folders)."""
    kind, p = resolve_source(path)
    if kind == "zero":
        loaded = load_zero_model(p, map_location=map_location)
        if expect_tokenizer_hash is not None and loaded.tokenizer_hash != expect_tokenizer_hash:
            raise CheckpointError(f"{p} uses tokenizer {loaded.tokenizer_hash[:12]} but this run uses "
                                  f"{expect_tokenizer_hash[:12]}")
        return loaded
    return load_model(p, map_location=map_location, expect_tokenizer_hash=expect_tokenizer_hash)


def source_id(path: str | os.PathLike) -> str:
    """A content id for a model source, so an evaluation report can be matched to the export of the same weights."""
    kind, p = resolve_source(path)
    if kind == "bundle":
        return "sha256:" + sha256_file(p / WEIGHTS)
    if kind == "zero":
        files = sorted(_zero_tag_dir(find_zero_dir(p), None).glob("*model_states.pt"))
        if not files:
            raise CheckpointError(f"{p} has no *model_states.pt file: not a DeepSpeed checkpoint")
        return "sha256:" + sha256_file(files[0])
    return "sha256:" + sha256_file(p)


def provenance(loaded, name: str | None = None) -> dict[str, Any]:
    meta = loaded.meta or {}
    keep = ("regime", "paper_regime", "data", "data_name", "src_lang", "tgt_lang", "init_from", "global_step", "epoch",
            "seed", "head_loss", "trainable", "wandb_run_id", "wandb_project")
    out = {k: meta[k] for k in keep if k in meta and isinstance(meta[k], (str, int, float, bool))}
    if meta.get("training") and isinstance(meta["training"], dict):  # re-exporting a bundle
        out = {**meta["training"], **out}
    out["source"] = str(loaded.source)
    if name:
        out["name"] = name
    return out


def export_checkpoint(source: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
                      overwrite: bool = False, report: str | os.PathLike | None = None, tag: str | None = None,
                      name: str | None = None) -> Path:
    """A Lightning checkpoint / run folder / ZeRO folder / bundle -> a bundle at `out_dir`."""
    from bpd_train.evaluation.report import card_section

    source = Path(source)
    kind, resolved = resolve_source(source)
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)  # before the (slow) load
    loaded = load_zero_model(resolved, tag=tag) if kind == "zero" else load_model(resolved)
    prov = provenance(loaded, name)
    sid = source_id(source)
    prov["source_id"] = sid
    prov["bundle_name"] = out_dir.name
    card = card_section(report, sid) if report else None
    return export_bundle(loaded.model, loaded.tokenizer_path, out_dir, dtype=dtype, overwrite=overwrite,
                         provenance=prov, card_extra=card)
