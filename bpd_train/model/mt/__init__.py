"""The encoder-decoder translation family: its config (config.py) and model (model.py); the same file names as
model/lm/."""

from bpd_train.model.mt.config import BPDConfig
from bpd_train.model.mt.model import BPDModel

__all__ = ["BPDConfig", "BPDModel"]
