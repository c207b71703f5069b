"""Pure-torch model: config, encoder-decoder Transformer with BPD heads, decoding KV cache."""
from bpd_train.model.cache import DecoderState, Memory
from bpd_train.model.config import BPDConfig
from bpd_train.model.transformer import BPDModel

__all__ = ["BPDConfig", "BPDModel", "DecoderState", "Memory"]
