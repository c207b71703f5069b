"""Pure-torch model: configs, encoder-decoder Transformer and decoder-only LM with BPD heads, decoding KV cache."""
from bpd_train.model.cache import DecoderState, Memory
from bpd_train.model.config import BPDConfig
from bpd_train.model.lm import LMModel
from bpd_train.model.lm_config import LMConfig
from bpd_train.model.transformer import BPDModel


def config_from_dict(d: dict) -> "BPDConfig | LMConfig":
    """A saved model config -> its family's dataclass (bpd_train/families: `arch: lm` is the decoder-only family,
    no arch the encoder-decoder)."""
    from bpd_train.families import family_of

    d = dict(d)
    return family_of(d).config_from_dict(d)


def build_model(config: "BPDConfig | LMConfig | dict"):
    """The model of a config (or a saved config dict) of either family."""
    from bpd_train.families import family_of

    if isinstance(config, dict):
        config = config_from_dict(config)
    return family_of(config).build(config)


__all__ = ["BPDConfig", "BPDModel", "DecoderState", "LMConfig", "LMModel", "Memory", "build_model",
           "config_from_dict"]
