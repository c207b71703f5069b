"""bpd-train: train Blockwise Parallel Decoding heads and decode several tokens per step, exactly.

The public names: `Translator` and `Output` (text in, text out; docs/api.md), `load_bundle` (a bundle's model,
tokenizer and metadata), `corpus_name`, `REPO_ROOT`, `INSTALLED`, `work_root`. The first three import torch, so
they load on first use; `import bpd_train` alone stays light (the commands check their configs before torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bpd_train._version import __version__

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ below imports them on first use
    from bpd_train.api import Output, Translator
    from bpd_train.bundle import load_bundle

__all__ = ["INSTALLED", "REPO_ROOT", "Output", "Translator", "corpus_name", "load_bundle", "work_root", "__version__"]

# Where conf/ and the bundled corpus (data/) are: the clone (an editable install), or the copies a wheel ships in
# bpd_train/_root (bpd_train/_build.py). INSTALLED: no clone around, so runs write under the working directory.
_SHIPPED = Path(__file__).resolve().parent / "_root"
INSTALLED = (_SHIPPED / "conf").is_dir()
REPO_ROOT = _SHIPPED if INSTALLED else Path(__file__).resolve().parent.parent


def work_root() -> str:
    """Where artifacts/ and outputs/ go by default (conf/paths/default.yaml): the clone, else the working directory."""
    return str(Path.cwd() if INSTALLED else REPO_ROOT)


def corpus_name(
    path: object, hf_name: object = None, hf_config: object = None, src: object = None, tgt: object = None
) -> str:
    """A corpus's default name (conf/data/local.yaml): what it is plus a hash of where it is, so two corpora never
    share an artifacts folder: /data/news -> news-en-fr-1a2b3c."""
    import hashlib
    import re

    if path:
        where = str(Path(str(path)).expanduser().resolve())
        stem = Path(where).name.split(".")[0] or "corpus"
    else:
        local = Path(str(hf_name)).expanduser()
        where = f"{local.resolve() if local.exists() else hf_name}/{hf_config}"
        stem = "-".join(str(x).rstrip("/").rsplit("/", 1)[-1] for x in (hf_name, hf_config) if x)
    digest = hashlib.sha256(where.encode()).hexdigest()[:6]
    name = "-".join(str(x) for x in (stem, src, tgt, digest) if x)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _register_resolvers() -> None:
    # Hydra configs say ${repo_root:} so the bundled data is found whatever the working directory.
    try:
        from omegaconf import OmegaConf
    except ImportError:  # the pure-torch parts must import without omegaconf
        return
    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", lambda: str(REPO_ROOT))
    if not OmegaConf.has_resolver("work_root"):
        OmegaConf.register_new_resolver("work_root", work_root)
    if not OmegaConf.has_resolver("corpus_name"):
        OmegaConf.register_new_resolver("corpus_name", corpus_name)


_register_resolvers()


def __getattr__(name: str) -> Any:
    # `from bpd_train import load_bundle` (or Translator) without importing torch for every `import bpd_train`
    if name == "load_bundle":
        from bpd_train.bundle import load_bundle

        return load_bundle
    if name in ("Translator", "Output"):  # the Python API that takes strings (bpd_train/api.py, docs/api.md)
        from bpd_train import api

        return getattr(api, name)
    raise AttributeError(f"module 'bpd_train' has no attribute {name!r}")
