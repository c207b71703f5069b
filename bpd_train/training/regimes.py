"""Regimes are data: what trains, on which data, from which weights, with which head loss.

Paper Table 1 names: frozen = Regular, finetune = Fine Tuning, distill = Distillation, both = Both.
The yaml files in conf/regime/ are the source of truth; bpd_train/configs.py types and checks them (`Regime`, once,
without torch: the command line's pre-check reads the same choices).
"""

from __future__ import annotations

from bpd_train.configs import (  # noqa: F401 - the regime's record and choices, declared once (torch-free)
    HEAD_LOSSES,
    SOURCES,
    TRAINABLE,
    Regime,
    regime_names,
)


def available_regimes() -> list[str]:
    """The regimes `+regime=` can pick (conf/regime)."""
    return regime_names()
