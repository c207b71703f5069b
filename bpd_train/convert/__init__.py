"""Conversions between this project's models and other formats: transformers checkpoints of the encoder-decoder
family (hf.py) and the decoder-only family (hf_lm.py), on what both share (common.py); vLLM Medusa heads
(vllm_medusa.py)."""
from bpd_train.convert.hf import ConvertError, from_hf, load_hf, to_hf

__all__ = ["ConvertError", "from_hf", "load_hf", "to_hf"]
