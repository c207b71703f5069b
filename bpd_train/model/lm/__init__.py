"""The decoder-only language-model family: its config (config.py) and model (model.py); the same file names as
model/mt/."""

from bpd_train.model.lm.config import LMConfig
from bpd_train.model.lm.model import LMModel

__all__ = ["LMConfig", "LMModel"]
