"""The bundle format: a trained model as plain files that load without pickle. Write (atomically), read, verify.

A bundle folder holds
  model.safetensors   the weights (fp32 or bf16); tied tensors are stored once (config.json "weights.tied")
  config.json         format marker, model config (incl. the k heads), tokenizer sha256 + special ids,
                      sha256 of model.safetensors, training provenance
  tokenizer.model     the sentencepiece model the weights were trained with; for an imported model (hf:...)
                      instead tokenizer/, its own tokenizer files (format_version 3; config.json "tokenizer":
                      file "tokenizer", sha256 over the files, meta with kind and languages)
  README.md           model card (regime, data, and the evaluation table when a report exists)
  manifest.json       sha256 of each file above (tokenizer/ file by file; format_version >= 2), written last
`load_bundle` checks every file, hash and tensor shape before it builds the model, and reads nothing with
pickle. Which folder is a bundle is decided here (`is_bundle`); turning a run or checkpoint into one is
bpd_train/app/export.py, and loading any model (a bundle among others) is bpd_train/sources/loading.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from bpd_train._version import __version__
from bpd_train.data.hf_tokenizer import TokenizerError, tokenizer_files, tokenizer_folder_hash
from bpd_train.families import family_of
from bpd_train.io import atomic_dir, atomic_write_json, atomic_write_text, outside, sha256_file, umask
from bpd_train.model import build_model, config_from_dict
from bpd_train.model.mt.config import BPDConfig
from bpd_train.sources.checkpoint import CheckpointError

BUNDLE_FORMAT = "bpd-train-bundle"
BUNDLE_VERSION = 3  # 3: tokenizer/ folder of an imported model (written only then); 2: manifest.json covers
#                     config.json (an edited config is refused); 1 had no manifest
TOKENIZER_DIR = "tokenizer"
WEIGHTS, CONFIG, TOKENIZER, CARD, MANIFEST = (
    "model.safetensors",
    "config.json",
    "tokenizer.model",
    "README.md",
    "manifest.json",
)
MANIFEST_FORMAT = "bpd-train-bundle-manifest"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


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


def write_bundle(
    model,
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    provenance: dict | None = None,
    card_extra: str | None = None,
    tokenizer_meta: dict | None = None,
    decode: dict | None = None,
) -> Path:
    """Write `model` (a BPDModel) and its tokenizer as a bundle folder, atomically (temp folder + rename).
    tokenizer_path: a sentencepiece file, or an imported model's folder (its tokenizer files are copied to
    tokenizer/; tokenizer_meta: its languages). decode: the decode settings its users get by default (config.json
    "decode", as transformers' generation_config.json; {"settings": {...}, "why": "..."})."""
    from safetensors.torch import save_file

    out_dir, tokenizer_path = Path(out_dir), Path(tokenizer_path)
    folder = tokenizer_path.is_dir()
    if not (folder or tokenizer_path.is_file()):
        raise BundleError(f"tokenizer {tokenizer_path} does not exist")
    torch_dtype = _dtype(dtype)
    cfg: BPDConfig = model.config
    raw = {k: v.detach() for k, v in model.state_dict().items()}
    stored, tied = _dedup_tied(raw)
    tensors = {k: (v.to(torch_dtype) if v.is_floating_point() else v).cpu().contiguous() for k, v in stored.items()}
    if folder:
        tok_files, tok_hash, special = _folder_tokenizer(tokenizer_path, cfg, tokenizer_meta)
    else:
        tok_files, tok_hash, special = [TOKENIZER], sha256_file(tokenizer_path), _tokenizer_ids(tokenizer_path)
        if special["vocab_size"] != cfg.vocab_size:
            raise BundleError(
                f"tokenizer {tokenizer_path} has {special['vocab_size']} pieces but the model's "
                f"vocab_size is {cfg.vocab_size}: not the tokenizer this model was trained with"
            )
    check_output_dir(out_dir, overwrite)
    with atomic_dir(out_dir, overwrite=overwrite, replaceable=only_bundle_files) as tmp:
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt", "bpd_train": __version__})
        os.chmod(tmp / WEIGHTS, 0o666 & ~umask())  # safetensors creates it 0600 whatever the umask
        if folder:
            (tmp / TOKENIZER_DIR).mkdir()
            for name in tok_files:
                (tmp / TOKENIZER_DIR / name).write_bytes((tokenizer_path / name).read_bytes())
            tok_files = [f"{TOKENIZER_DIR}/{name}" for name in tok_files]
        else:
            (tmp / TOKENIZER).write_bytes(tokenizer_path.read_bytes())
        config = {
            "format": BUNDLE_FORMAT,
            "format_version": BUNDLE_VERSION if folder else 2,  # what older readers can read stays readable
            "bpd_train_version": __version__,
            "model": cfg.to_dict(),
            "heads": family_of(cfg).bundle_heads(cfg),
            "tokenizer": {"file": TOKENIZER_DIR if folder else TOKENIZER, "sha256": tok_hash, **special},
            "weights": {
                "file": WEIGHTS,
                "sha256": sha256_file(tmp / WEIGHTS),
                "dtype": str(torch_dtype).split(".")[-1],
                "tied": tied,
                "num_parameters": int(sum(t.numel() for t in tensors.values())),
            },
            "training": dict(provenance or {}),
        }
        if decode:
            config["decode"] = decode
        atomic_write_json(tmp / CONFIG, config)
        atomic_write_text(tmp / CARD, model_card(config, card_extra))
        atomic_write_json(
            tmp / MANIFEST,
            {
                "format": MANIFEST_FORMAT,
                "files": {f: sha256_file(tmp / f) for f in (CONFIG, WEIGHTS, *tok_files, CARD)},
            },
        )
    return out_dir


def _folder_tokenizer(folder: Path, cfg, meta: dict | None) -> tuple[list[str], str, dict]:
    """An imported model's tokenizer folder -> (its file names, hash, what config.json records)."""
    try:
        _, special = family_of(cfg).folder_tokenizer(folder, cfg, meta)
        return tokenizer_files(folder), tokenizer_folder_hash(folder), special
    except TokenizerError as e:
        raise BundleError(str(e)) from None


def is_bundle(path: str | os.PathLike) -> bool:
    """Is `path` meant as a bundle (a folder with config.json)? The one test every stage uses to tell a bundle from
    a checkpoint or run folder; whether it is a *valid* bundle is load_bundle's job (it names what is missing)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG).is_file()


def only_bundle_files(path: str | os.PathLike) -> bool:
    """A folder export wrote, and nothing else: the only kind `overwrite` may replace (it is deleted whole)."""
    path = Path(path)
    try:
        names = {p.name for p in path.iterdir()}
        if MANIFEST in names:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
            listed = set(manifest["files"]) if manifest.get("format") == MANIFEST_FORMAT else set()
            ours = {f.split("/")[0] for f in listed} | {MANIFEST} if listed else set()
            if (path / TOKENIZER_DIR).is_dir() and TOKENIZER_DIR in ours:  # nothing of the user's inside either
                inside = {f"{TOKENIZER_DIR}/{p.name}" for p in (path / TOKENIZER_DIR).iterdir()}
                if not inside <= listed:
                    return False
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
    if any(out_dir.iterdir()) and not only_bundle_files(out_dir):
        raise BundleError(
            f"export output {out_dir} is a folder that is not a bpd-train bundle (or holds other files "
            "too); overwrite only ever replaces a previous bundle: choose another export.output_dir"
        )


def _tokenizer_ids(path: Path) -> dict[str, int]:
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # noqa: BLE001 - sentencepiece raises OSError/RuntimeError for a bad file
        raise BundleError(f"{path} is not a readable sentencepiece model: {e}") from e
    return {
        "vocab_size": sp.get_piece_size(),
        "pad_id": sp.pad_id(),
        "bos_id": sp.bos_id(),
        "eos_id": sp.eos_id(),
        "unk_id": sp.unk_id(),
    }


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
        "from bpd_train import load_bundle",
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
    for key in (
        "vocab_size",
        "d_model",
        "n_heads",
        "n_encoder_layers",
        "n_decoder_layers",
        "d_ff",
        "block_size",
        "identity_p1",
        "head_d_hidden",
        "max_positions",
    ):
        lines.append(f"| {key} | {m.get(key)} |")
    lines += [
        f"| weights dtype | {config['weights']['dtype']} |",
        f"| parameters | {config['weights']['num_parameters']:,} |",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| regime | {regime} |",
    ]
    for key in (
        "paper_regime",
        "data",
        "src_lang",
        "tgt_lang",
        "init_from",
        "global_step",
        "epoch",
        "seed",
        "source",
        "source_id",
    ):
        if tr.get(key) is not None:
            lines.append(f"| {key} | {tr[key]} |")
    if t.get("file") == TOKENIZER_DIR:
        tm = t.get("meta") or {}
        langs = f", languages {tm.get('src_lang')} -> {tm.get('tgt_lang')}" if tm.get("tgt_lang") else ""
        what = (
            f"the imported model's own tokenizer in `{TOKENIZER_DIR}/` ({tm.get('kind')}{langs}: "
            f"{', '.join(tm.get('files') or [])}), {t['vocab_size']} model ids, sha256 `{t['sha256']}`; "
        )
    else:
        what = f"sentencepiece `tokenizer.model`, {t['vocab_size']} pieces, sha256 `{t['sha256']}`; "
    lines += [
        "",
        "## Tokenizer",
        "",
        what + f"pad={t['pad_id']} bos={t['bos_id']} eos={t['eos_id']} unk={t.get('unk_id')}.",
        "",
    ]  # an LM: none
    lines += ["## Evaluation", ""]
    lines += (
        [extra.rstrip(), ""]
        if extra
        else [
            "No evaluation report was found when this bundle was exported "
            "(run `python evaluate.py` and export again to include one).",
            "",
        ]
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- loading
def read_bundle_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"bundle {path} does not exist or is not a folder")
    missing = [f for f in (CONFIG, WEIGHTS) if not (path / f).is_file()]
    if missing:
        raise BundleError(f"bundle {path} is incomplete: missing {', '.join(missing)}")
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path / CONFIG} is not valid JSON: {e}") from e
    if isinstance(config, dict) and "model_type" in config and config.get("format") is None:
        raise BundleError(f"{path} is a transformers checkpoint, not a bpd-train bundle: pass it as hf:{path}")
    if not isinstance(config, dict) or config.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{path / CONFIG} is not a bpd-train bundle config (format != {BUNDLE_FORMAT!r})")
    tok = config.get("tokenizer") if isinstance(config.get("tokenizer"), dict) else {}
    want = TOKENIZER_DIR if tok.get("file") == TOKENIZER_DIR else TOKENIZER
    if not ((path / want).is_dir() if want == TOKENIZER_DIR else (path / want).is_file()):
        raise BundleError(f"bundle {path} is incomplete: missing {want}")
    if config.get("format_version", 0) > BUNDLE_VERSION:
        raise BundleError(
            f"bundle {path} has format_version {config['format_version']}; this bpd-train reads "
            f"up to {BUNDLE_VERSION}: upgrade bpd-train"
        )
    for key in ("model", "tokenizer", "weights"):
        if not isinstance(config.get(key), dict):
            raise BundleError(f"{path / CONFIG} has no '{key}' section")
    return config


def load_bundle(path: str | os.PathLike, map_location: str | torch.device = "cpu", dtype: str | None = "float32"):
    """-> (model, tokenizer, meta). model: BPDModel in eval mode (fp32 unless dtype=None keeps the stored dtype);
    tokenizer: sentencepiece.SentencePieceProcessor, or an imported model's HFTokenizer (the same methods);
    meta: config.json plus 'tokenizer_hash' and 'path'."""
    import sentencepiece as spm
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_bundle_config(path)
    for name in (CONFIG, WEIGHTS, TOKENIZER, TOKENIZER_DIR, CARD, MANIFEST):  # tokenizer/'s files: tokenizer_files
        if (path / name).is_symlink() and (why := outside(path, name)):
            raise BundleError(f"bundle {path}: refusing to read outside the bundle folder: {why}")
    verify_manifest(path, config)
    folder = config["tokenizer"].get("file") == TOKENIZER_DIR
    tok_path = path / (TOKENIZER_DIR if folder else TOKENIZER)
    if folder:
        try:
            tok_hash = tokenizer_folder_hash(tok_path)
        except TokenizerError as e:
            raise BundleError(f"bundle {path}: {e}") from None
    else:
        tok_hash = sha256_file(tok_path)
    if tok_hash != config["tokenizer"].get("sha256"):
        raise BundleError(
            f"{tok_path} (sha256 {tok_hash[:12]}) is not the tokenizer this bundle was exported "
            f"with (sha256 {str(config['tokenizer'].get('sha256'))[:12]}): the file was replaced or "
            "modified"
        )
    w_hash = sha256_file(path / WEIGHTS)
    if w_hash != config["weights"].get("sha256"):
        raise BundleError(
            f"{path / WEIGHTS} (sha256 {w_hash[:12]}) does not match the sha256 recorded in config.json "
            f"({str(config['weights'].get('sha256'))[:12]}): the file is corrupt or was modified"
        )
    try:
        cfg = config_from_dict(dict(config["model"]))  # its family's config (bpd_train/families)
    except (TypeError, ValueError) as e:
        raise BundleError(f"{path / CONFIG} has an invalid model config: {e}") from e
    if folder:
        tok = _bundle_hf_tokenizer(tok_path, config["tokenizer"].get("meta") or {}, cfg)
        ids, want = family_of(cfg).tokenizer_ids(tok, cfg)
    else:
        tok = spm.SentencePieceProcessor(model_file=str(tok_path))
        ids = {
            "vocab_size": tok.get_piece_size(),
            "pad_id": tok.pad_id(),
            "bos_id": tok.bos_id(),
            "eos_id": tok.eos_id(),
        }
        want = {"vocab_size": cfg.vocab_size, "pad_id": cfg.pad_id, "bos_id": cfg.bos_id, "eos_id": cfg.eos_id}
        if not family_of(cfg).pad_is_token:  # a sentinel (-1: decoder-only), never a token: not the tokenizer's
            ids.pop("pad_id")
            want.pop("pad_id")
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
    check_buildable(cfg, tensors, where=f"{path / CONFIG} and {WEIGHTS}")
    model = build_model(cfg)
    check_state_shapes(model, tensors, where=str(path / WEIGHTS))
    stored_dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    target = _dtype(dtype) if dtype is not None else stored_dtype
    model.to(target)
    model.load_state_dict(tensors, strict=True)  # copies (and casts) into the model's own tensors, keeps ties
    model = model.to(map_location).eval()
    meta = dict(config)
    meta.update(tokenizer_hash=tok_hash, path=str(path), regime=config.get("training", {}).get("regime"))
    return model, tok, meta


def _bundle_hf_tokenizer(folder: Path, meta: dict, cfg):
    """A bundle's tokenizer/ folder, as its model's family reads it (checked against the model's vocabulary)."""
    try:
        return family_of(cfg).folder_tokenizer(folder, cfg, meta)[0]
    except TokenizerError as e:
        raise BundleError(f"bundle {folder.parent}: {e}") from None


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
            raise BundleError(
                f"{path / name} does not match the sha256 in {path / MANIFEST}: the file was edited "
                "after export; re-export the bundle (python export.py) instead of editing it"
            )


# A config's position table may take this much memory, or as much as the weights, whichever is more: enough for any
# real model (opus-mt: 1 MiB; a 16k-position, 1024-wide one: 64 MiB), never the gigabytes an edited config asks for.
MAX_TABLE_BYTES = 64 << 20


def check_buildable(config, state: dict[str, torch.Tensor], where: str, optional: tuple[str, ...] = ()) -> None:
    """Before a model is built from a config someone else wrote (a bundle, a checkpoint, an hf: folder): its
    sizes must be the weights' (checked on a model on the meta device: nothing is allocated), and what it
    allocates beyond the weights (the position table) must stay in proportion. One BundleError line otherwise.
    `optional`: name prefixes the state may lack (fresh heads)."""
    import dataclasses

    weights = sum(t.numel() * t.element_size() for t in state.values())
    positions = int(config.max_positions)
    table = family_of(config).position_table_bytes(config)  # the encoder-decoder's sinusoid table; LMs: none
    if table > max(MAX_TABLE_BYTES, weights):
        raise BundleError(
            f"{where}: max_positions={positions} would allocate a {table / 2**20:,.0f} MiB position "
            f"table for {weights / 2**20:,.1f} MiB of weights: not this model's config (edited?)"
        )
    try:
        small = dataclasses.replace(config, max_positions=max(1, min(positions, 8)))  # shapes do not depend on it
        with torch.device("meta"):
            shadow = build_model(small)
    except (RuntimeError, ValueError, TypeError, OverflowError) as e:
        raise BundleError(
            f"{where}: the model config cannot be built ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
        ) from None
    check_state_shapes(shadow, state, where, optional=optional)


def check_state_shapes(model, state: dict[str, torch.Tensor], where: str, optional: tuple[str, ...] = ()) -> None:
    """Names and shapes of `state` must be exactly the model's (but for names starting with `optional`, which it
    may lack): one message listing what differs."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    missing = sorted(k for k in set(expected) - set(got) if not (optional and k.startswith(optional)))
    unexpected = sorted(set(got) - set(expected))
    wrong = [
        f"{k}: {got[k]} (model expects {expected[k]})"
        for k in sorted(set(got) & set(expected))
        if got[k] != expected[k]
    ]
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            parts.append("shape mismatch " + "; ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else ""))
        if missing:
            parts.append(f"missing {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
        raise BundleError(f"{where} does not fit the model config: " + ", ".join(parts))
