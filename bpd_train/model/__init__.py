"""Pure-torch model: configs, encoder-decoder Transformer and decoder-only LM with BPD heads, decoding KV cache."""
from bpd_train.model.cache import DecoderState, Memory
from bpd_train.model.config import BPDConfig
from bpd_train.model.lm import LMModel
from bpd_train.model.lm_config import LMConfig
from bpd_train.model.transformer import BPDModel


def config_from_dict(d: dict) -> "BPDConfig | LMConfig":
    """A saved model config -> its dataclass: `arch: lm` is the decoder-only family, no arch the encoder-decoder."""
    d = dict(d)
    return LMConfig.from_dict(d) if d.get("arch") == "lm" else BPDConfig.from_dict(d)


def build_model(config: "BPDConfig | LMConfig | dict"):
    """The model of a config (or a saved config dict) of either family."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    return LMModel(config) if isinstance(config, LMConfig) else BPDModel(config)


__all__ = ["BPDConfig", "BPDModel", "DecoderState", "LMConfig", "LMModel", "Memory", "build_model",
           "config_from_dict"]
