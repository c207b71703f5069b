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
