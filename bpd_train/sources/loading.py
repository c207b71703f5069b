"""Where a model gets loaded: a user's path or id -> a typed Source (resolved once) -> `load(source)`.

Every stage loads through here: head regimes' init_from (training/run.py), the distillation teacher
(distillation/job.py), evaluation (evaluation/runner.py), export (export.py); translate reads bundles only
(bundle.load_bundle). Kinds of source and the file formats they are read with:
  ckpt     a Lightning checkpoint file (checkpoint.py), torch.load(weights_only=True)
  zero     a DeepSpeed ZeRO checkpoint folder (zero.py), consolidated with every torch.load weights_only=True
  bundle   an exported bundle folder (bundle.py), safetensors + hashes, no pickle at all
  hf       `hf:<folder or hub id>[@<src_lang>:<tgt_lang>]`, a transformers Marian / M2M100 / NLLB checkpoint
           (bpd_train/sources/convert/hf/mt.py), safetensors or torch.load(weights_only=True); NLLB / M2M100 need the
           languages, e.g. hf:facebook/nllb-200-distilled-600M@eng_Latn:deu_Latn
  gguf     `gguf:<file>`, a llama.cpp model file (Llama / Qwen2 architectures, bpd_train/sources/convert/gguf.py), checked
           against its size, then read with the gguf package and dequantized to fp32; its tokenizer is written
           once into a cache folder
A run folder (what train.py writes) resolves to its best checkpoint, else its last (RUN_CANDIDATES), else the
newest checkpoints/*.ckpt; any of those may be a file or a Lightning DeepSpeed folder.

Adding a kind (e.g. `hf:<folder or hub id>`, bpd_train/sources/convert/hf/mt.py): register a resolver for its prefix in
PREFIXES (text after the prefix -> Source(kind, ...)) and a reader in READERS (Source, map_location -> Read);
`load` then gives it the same tokenizer check and LoadedModel as every other kind. A tokenizer that is a folder
(an imported model's own tokenizer files) is hashed file by file, over its tokenizer files only. Such a model
brings its tokenizer with it (`LoadedModel.own_tokenizer`): training, distillation and evaluation use that one
instead of the corpus's sentencepiece model, and runs, checkpoints and bundles made from it carry it on
(a `tokenizer/` folder; the languages in `tokenizer_meta`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from bpd_train.data.hf_tokenizer import tokenizer_folder_hash
from bpd_train.families import family_of, get_family
from bpd_train.io import sha256_file
from bpd_train.model import build_model, config_from_dict
from bpd_train.sources.bundle import TOKENIZER, WEIGHTS, check_buildable, check_state_shapes, is_bundle, load_bundle
from bpd_train.sources.checkpoint import CheckpointError, checkpoint_meta, model_state, read_checkpoint
from bpd_train.sources.convert import hf_format_of
from bpd_train.sources.convert.common import folder_file
from bpd_train.sources.convert.common import resolve as resolve_hf
from bpd_train.sources.convert.gguf import GGUFError, load_gguf
from bpd_train.sources.zero import consolidate_zero, find_zero_dir, model_states_file, zero_tag_dir

# Where a run folder keeps an imported model's tokenizer files (a native run has tokenizer.model).
TOKENIZER_DIR = "tokenizer"
# Which checkpoint of a run folder a stage uses, in order of preference.
RUN_CANDIDATES = ("checkpoints/best.ckpt", "best.ckpt", "checkpoints/last.ckpt", "last.ckpt")


@dataclass(frozen=True)
class Source:
    """A resolved model source. `path` is what gets read (a run folder has become its checkpoint)."""

    kind: str  # "ckpt" | "zero" | "bundle" | a kind registered in PREFIXES/READERS
    path: Path
    given: str = ""  # what the user wrote, for messages
    tag: str | None = None  # ZeRO: the global_step tag to read (None: the folder's 'latest')
    options: tuple = ()  # (name, value) pairs a prefixed kind reads (hf: src_lang, tgt_lang)
    spec: str | None = None  # what resolves to this source again from anywhere (hf: the prefixed, absolute form)

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    @cached_property
    def id(self) -> str:
        """A content id, so an evaluation report can be matched to the export of the same weights."""
        if self.kind == "bundle":
            return "sha256:" + sha256_file(self.path / WEIGHTS)
        if self.kind == "zero":
            return "sha256:" + sha256_file(model_states_file(zero_tag_dir(find_zero_dir(self.path), self.tag)))
        if self.kind in IDS:
            return IDS[self.kind](self)
        return "sha256:" + sha256_file(self.path)


@dataclass
class LoadedModel:
    model: Any  # BPDModel or LMModel, eval mode, on the requested device
    tokenizer_path: Path
    tokenizer_hash: str
    source: Source  # behaves as its path (str, os.fspath)
    meta: dict = field(default_factory=dict)
    tokenizer_meta: dict | None = None  # an imported model's tokenizer: kind, src_lang, tgt_lang, files

    @property
    def config(self):
        return self.model.config

    @property
    def family(self):
        """The model's family (bpd_train/families): what every stage asks instead of checking the model's kind."""
        return family_of(self.model.config)

    @property
    def weight_type(self) -> str | None:
        """A GGUF file's weight type (e.g. "Q4_1", "Q8_0", "F16": the type most of its matrices have), which dtype
        "auto" decodes by (decoding/settings.py AUTO_DTYPE); None for an hf: folder and a model of ours."""
        return self.meta.get("weight_type") if self.source.kind == "gguf" else None

    @property
    def is_lm(self) -> bool:
        """A decoder-only language model (LMModel): prompts in, responses out. Kept for callers of the earlier API;
        the pipeline asks `family`."""
        return self.family.prompted

    def lm_tokenizer(self):
        """The decoder-only family's tokenizer (the LMTokenizer interface) for this model; for a decoder-only model
        the same as tokenizer()."""
        return get_family("lm").tokenizer(self)

    @property
    def own_tokenizer(self) -> bool:
        """The model brings its own tokenizer (an imported model's files), not a corpus's sentencepiece model."""
        return self.tokenizer_path.is_dir()

    def tokenizer(self):
        """The family's tokenizer: sentencepiece, an imported model's HFTokenizer (the same methods, the model's
        ids), or a decoder-only model's LMTokenizer."""
        return self.family.tokenizer(self)

    def data_tokenizer(self):
        """The tokenizer a training run on this model must use, with the data pipeline's API
        (hf_tokenizer.ModelTokenizer, data/lm/tokenizer.RunLMTokenizer), or None: the run uses its corpus's
        sentencepiece model, checked by hash."""
        if not self.own_tokenizer:
            return None
        return self.family.data_tokenizer(self)


class Read(NamedTuple):
    """What a reader hands to `load`: the model, its tokenizer, the tokenizer hash recorded at save time."""

    model: Any
    tokenizer_path: Path
    recorded_tokenizer_hash: str | None
    meta: dict
    tokenizer_meta: dict | None = None


# ------------------------------------------------------------------------------------------------------ resolve
def _kind(p: Path) -> str | None:
    if is_bundle(p):
        return "bundle"
    if find_zero_dir(p) is not None:
        return "zero"
    if p.is_file():
        return "ckpt"
    return None


PREFIXES: dict[str, Callable[[str], Source]] = {}  # "hf:" -> _resolve_hf (registered below the readers)
IDS: dict[str, Callable[[Source], str]] = {}  # kind -> content id, for kinds whose path is not one file


def resolve(spec: str | os.PathLike | Source, tag: str | None = None) -> Source:
    """A user's path or id -> Source. A Source passes through, so callers may resolve early and load later."""
    if isinstance(spec, Source):
        return spec
    text = str(spec)
    for prefix, resolver in PREFIXES.items():
        if text.startswith(prefix):
            return resolver(text[len(prefix) :])
    p = Path(text)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    kind = _kind(p)
    if kind is None:  # a run folder
        for cand in RUN_CANDIDATES:
            if (p / cand).exists() and (kind := _kind(p / cand)) in ("ckpt", "zero"):
                p = p / cand
                break
        else:
            newest = (
                sorted((p / "checkpoints").glob("*.ckpt"), key=lambda f: f.stat().st_mtime)
                if (p / "checkpoints").is_dir()
                else []
            )
            newest = [c for c in newest if _kind(c) in ("ckpt", "zero")]
            if not newest:
                raise CheckpointError(
                    f"no checkpoint found in {p} (looked for checkpoints/best.ckpt and checkpoints/last.ckpt)"
                )
            p = newest[-1]
            kind = _kind(p)
    return Source(kind, p, text, tag)


def run_checkpoints(run: str | os.PathLike) -> list[Source]:
    """Every checkpoint of a run folder (checkpoints/*.ckpt, files or ZeRO folders, each weight file once), for
    evaluating a whole training run; [] when it has none."""
    d = Path(run) / "checkpoints"
    if not d.is_dir():
        return []
    seen, out = set(), []
    for p in sorted(d.iterdir()):
        if p.suffix == ".ckpt" and _kind(p) in ("ckpt", "zero") and p.resolve() not in seen:
            seen.add(p.resolve())  # best.ckpt may be a link to an epoch checkpoint
            out.append(Source(_kind(p), p, str(p)))
    return out


def source_id(spec: str | os.PathLike | Source) -> str:
    return resolve(spec).id


# ------------------------------------------------------------------------------------------------------ readers
def _find_tokenizer(start: Path, levels: int, meta: dict, where: Path) -> Path:
    """tokenizer.model in `start` or up to `levels` folders above it (the run folder), else the recorded path;
    for a model trained from an imported one (meta tokenizer_meta), its tokenizer/ folder instead."""
    folder = bool(meta.get("tokenizer_meta"))
    name = TOKENIZER_DIR if folder else TOKENIZER
    cands = [d / name for d in (start, *list(start.parents)[:levels])]
    if meta.get("tokenizer_file"):
        cands.append(Path(meta["tokenizer_file"]))
    found = next((c for c in cands if (c.is_dir() if folder else c.is_file())), None)
    if found is None:
        raise CheckpointError(f"no {name} beside {where} (nor at {meta.get('tokenizer_file')})")
    return found


def _build(meta: dict, state: dict, where: str):
    try:
        config = config_from_dict(dict(meta["model_config"]))  # its family's config (bpd_train/families)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: the saved model config is invalid ({e})") from None
    check_buildable(config, state, where=where)  # before anything the config sizes is allocated
    model = build_model(config)
    check_state_shapes(model, state, where=where)
    model.load_state_dict(state, strict=True)
    return model


def read_ckpt(src: Source, map_location) -> Read:
    ckpt = read_checkpoint(src.path)
    meta = checkpoint_meta(ckpt, src.path)
    model = _build(meta, model_state(ckpt), where=f"weights in {src.path}")
    return Read(
        model,
        _find_tokenizer(src.path.parent, 1, meta, src.path),
        meta.get("tokenizer_hash"),
        meta,
        meta.get("tokenizer_meta"),
    )


def read_zero(src: Source, map_location) -> Read:
    state, meta = consolidate_zero(src.path, src.tag)
    model = _build(meta, state, where=f"consolidated ZeRO checkpoint {src.path}")
    # beside the ZeRO folder or up to three levels above (the run folder), else the path recorded at save time
    tok = _find_tokenizer(find_zero_dir(src.path), 3, meta, src.path)
    return Read(model, tok, meta.get("tokenizer_hash"), meta, meta.get("tokenizer_meta"))


def read_bundle(src: Source, map_location) -> Read:
    model, _tok, meta = load_bundle(src.path, map_location=map_location)
    t = meta["tokenizer"]
    return Read(model, src.path / t.get("file", TOKENIZER), t.get("sha256"), meta, t.get("meta"))


# hf:<folder or hub id>[@<src_lang>:<tgt_lang>]: the languages of M2M100 / NLLB models (Hydra overrides take
# neither '=' nor '#', so they are not a query string)
_LANGS = re.compile(r"^(?P<where>.+)@(?P<src>[\w-]+):(?P<tgt>[\w-]+)$")


def _resolve_hf(text: str) -> Source:
    where, options = text, ()
    m = _LANGS.match(text)
    if m and not Path(text).expanduser().is_dir():
        where, options = m["where"], (("src_lang", m["src"]), ("tgt_lang", m["tgt"]))
    folder, hub_id = resolve_hf(where)
    spec = "hf:" + (hub_id or str(folder.resolve())) + (f"@{options[0][1]}:{options[1][1]}" if options else "")
    return Source("hf", folder, "hf:" + text, options=options, spec=spec)


def read_hf(src: Source, map_location) -> Read:
    """The family whose transformers adapter claims the folder reads it (convert/hf/lm.py: Llama / Qwen2 / Mistral;
    convert/hf/mt.py: Marian / M2M100 / NLLB)."""
    return Read(*hf_format_of(src.path).read(src, map_location))


def _hf_id(src: Source) -> str:
    """sha256 over config.json and the weight files: the same weights give the same id wherever the folder is."""
    import hashlib

    h = hashlib.sha256()
    names = [
        "config.json",
        *sorted(p.name for p in src.path.iterdir() if p.suffix == ".safetensors" or p.name.startswith("pytorch_model")),
    ]
    for name in names:
        if (src.path / name).is_file():
            h.update(f"{name}\0{sha256_file(folder_file(src.path, name))}\n".encode())
    return "sha256:" + h.hexdigest()


def _resolve_gguf(text: str) -> Source:
    p = Path(text).expanduser()
    if not p.is_file():
        raise GGUFError(f"gguf:{text}: no such file (gguf:<path to a .gguf model file>)")
    return Source("gguf", p, "gguf:" + text, spec="gguf:" + str(p.resolve()))


def read_gguf(src: Source, map_location) -> Read:
    """A decoder-only model from a GGUF file; its tokenizer folder is the file's tokenizer, written once."""
    model, tok, meta = load_gguf(src.path, map_location=map_location, file_hash=src.id)
    return Read(model, tok.folder, None, meta, tok.meta())


READERS: dict[str, Callable[[Source, Any], Read]] = {
    "ckpt": read_ckpt,
    "zero": read_zero,
    "bundle": read_bundle,
    "hf": read_hf,
    "gguf": read_gguf,
}
PREFIXES["hf:"] = _resolve_hf
PREFIXES["gguf:"] = _resolve_gguf
IDS["hf"] = _hf_id


# ------------------------------------------------------------------------------------------------------ load
def tokenizer_hash(path: str | os.PathLike) -> str:
    """sha256 of a tokenizer file; of a tokenizer folder, over its tokenizer files' names and hashes (an imported
    model's folder also holds its weights: they are not part of the tokenizer)."""
    p = Path(path)
    if not p.is_dir():
        return sha256_file(p)
    return tokenizer_folder_hash(p)


def check_tokenizer(
    model: object,
    trained_with: str | None,
    user: str,
    tokenizer: object,
    have: str,
    *,
    error: type[ValueError] = CheckpointError,
    hint: str = "",
) -> None:
    """The one tokenizer check: `model` was trained with tokenizer hash `trained_with`; `user` (a run, a corpus,
    the model's own folder) uses `tokenizer` whose hash is `have`. Token ids only mean something with the
    tokenizer they were trained with, so any difference stops here."""
    if trained_with and have != trained_with:
        raise error(
            f"{model} uses tokenizer sha256 {trained_with[:12]} but {user} uses {tokenizer} "
            f"(sha256 {have[:12]}): it is not the one {model} was trained with{hint}"
        )


def load(
    spec: str | os.PathLike | Source, map_location: str | torch.device = "cpu", expect_tokenizer_hash: str | None = None
) -> LoadedModel:
    """Load a model for inference from any source: eval mode, on `map_location`, its tokenizer checked against
    the hash recorded at save time and, if given, against `expect_tokenizer_hash` (this run's tokenizer)."""
    src = resolve(spec)
    read = READERS[src.kind](src, map_location)
    have = tokenizer_hash(read.tokenizer_path)
    check_tokenizer(src, read.recorded_tokenizer_hash, "its folder", read.tokenizer_path, have)
    if expect_tokenizer_hash is not None:
        check_tokenizer(
            src,
            have,
            "this run",
            "a tokenizer",
            expect_tokenizer_hash,
            hint=": they were built from different corpora or settings",
        )
    return LoadedModel(
        read.model.to(map_location).eval(), read.tokenizer_path, have, src, dict(read.meta), read.tokenizer_meta
    )
