"""What the shipped Hydra configs offer, read from conf/ without Hydra or torch: the front ends (bpd_train/cli.py)
check a command line with it before anything heavy loads, and training/regimes.py names the regimes with it."""

from __future__ import annotations

from pathlib import Path

from bpd_train import REPO_ROOT


def config_dir() -> Path:
    """The folder of Hydra configs: the clone's conf/, or the copy an installed wheel ships (bpd_train/_build.py)."""
    return REPO_ROOT / "conf"


def regime_names() -> list[str]:
    """The regimes `+regime=` can pick: conf/regime/*.yaml (conf/regime/_*.yaml hold what several share)."""
    return sorted(p.stem for p in (config_dir() / "regime").glob("*.yaml") if not p.stem.startswith("_"))
