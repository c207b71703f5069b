"""Pure-torch model: one folder per family with the same files (mt/: the encoder-decoder Transformer, lm/: the
decoder-only LM; config.py and model.py in each), what both share (common.py, heads.py, layers.py), the decoding
KV cache (cache.py)."""

from typing import Any, Mapping

from bpd_train.model.cache import DecoderState, Memory
from bpd_train.model.lm.config import LMConfig
from bpd_train.model.lm.model import LMModel
from bpd_train.model.mt.config import BPDConfig
from bpd_train.model.mt.model import BPDModel

# Each saved config's `arch` and its config and model classes (None: the encoder-decoder, whose configs carry no
# arch); bpd_train/families names the same classes per family.
ARCHS: dict = {"lm": (LMConfig, LMModel), None: (BPDConfig, BPDModel)}


def config_arch(x: Any) -> "str | None":
    """The `arch` of a config dict, a config dataclass or a Hydra node (None when it has none)."""
    if isinstance(x, Mapping):  # a dict or a Hydra DictConfig
        a = x.get("arch")
    else:
        a = getattr(x, "arch", None)
    return None if a is None or str(a) in ("", "None") else str(a)


def _classes(config: Any) -> tuple:
    arch = config_arch(config)
    if arch not in ARCHS:
        raise ValueError(f"unknown model arch {arch!r}; known: " + ", ".join(repr(a) for a in ARCHS))
    return ARCHS[arch]


def config_from_dict(d: dict) -> "BPDConfig | LMConfig":
    """A saved model config -> its family's dataclass (`arch: lm` is the decoder-only family, no arch the
    encoder-decoder)."""
    d = dict(d)
    return _classes(d)[0].from_dict(d)


def build_model(config: "BPDConfig | LMConfig | dict"):
    """The model of a config (or a saved config dict) of either family."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    return _classes(config)[1](config)


__all__ = [
    "ARCHS",
    "BPDConfig",
    "BPDModel",
    "DecoderState",
    "LMConfig",
    "LMModel",
    "Memory",
    "build_model",
    "config_arch",
    "config_from_dict",
]
