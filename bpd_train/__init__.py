"""bpd-train: train Blockwise Parallel Decoding heads and decode several tokens per step, exactly."""
from pathlib import Path

__version__ = "0.1.0"

# The repository root (this package is installed editable); the bundled corpus lives under it.
REPO_ROOT = Path(__file__).resolve().parent.parent


def _register_resolvers() -> None:
    # Hydra configs say ${repo_root:} so the bundled data is found whatever the working directory.
    try:
        from omegaconf import OmegaConf
    except ImportError:  # the pure-torch parts must import without omegaconf
        return
    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", lambda: str(REPO_ROOT))


_register_resolvers()


def __getattr__(name: str):
    # `from bpd_train import load_bundle` without importing torch for every `import bpd_train`
    if name == "load_bundle":
        from bpd_train.bundle import load_bundle

        return load_bundle
    raise AttributeError(f"module 'bpd_train' has no attribute {name!r}")
