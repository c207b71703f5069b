"""Training: one LightningModule for every regime, regimes as data, losses, optimisation, callbacks.

from bpd_train.training import BPDLightningModule, Regime, train
"""

from bpd_train.training.losses import bpd_loss, head_stats, head_targets, head_weights
from bpd_train.training.module import BPDLightningModule
from bpd_train.training.regimes import Regime, available_regimes

__all__ = [
    "BPDLightningModule",
    "Regime",
    "available_regimes",
    "bpd_loss",
    "head_stats",
    "head_targets",
    "head_weights",
    "train",
]


def train(cfg, **trainer_overrides):
    from bpd_train.training.run import train as _train

    return _train(cfg, **trainer_overrides)
