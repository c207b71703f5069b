"""bpd-train: train Blockwise Parallel Decoding heads and decode several tokens per step, exactly.

The public names: `Translator` and `Output` (text in, text out; docs/api.md), `load_bundle` (a bundle's model,
tokenizer and metadata), `corpus_name`, `REPO_ROOT`, `INSTALLED`, `work_root`. The first three import torch, so
they load on first use; `import bpd_train` alone stays light (the commands check their configs before torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bpd_train._version import __version__
from bpd_train.configs import INSTALLED, REPO_ROOT, corpus_name, register_resolvers, work_root

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ below imports them on first use
    from bpd_train.app.api import Output, Translator
    from bpd_train.sources.bundle import load_bundle

__all__ = ["INSTALLED", "REPO_ROOT", "Output", "Translator", "corpus_name", "load_bundle", "work_root", "__version__"]

# REPO_ROOT, INSTALLED, work_root and corpus_name live in bpd_train/configs.py (below every layer, which imports them
# from there); importing the package registers the Hydra resolvers ${repo_root:}, ${work_root:}, ${corpus_name:}
register_resolvers()


def __getattr__(name: str) -> Any:
    # `from bpd_train import load_bundle` (or Translator) without importing torch for every `import bpd_train`
    if name == "load_bundle":
        from bpd_train.sources.bundle import load_bundle

        return load_bundle
    if name in ("Translator", "Output"):  # the Python API that takes strings (bpd_train/app/api.py, docs/api.md)
        from bpd_train.app import api

        return getattr(api, name)
    raise AttributeError(f"module 'bpd_train' has no attribute {name!r}")
