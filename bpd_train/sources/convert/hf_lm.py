"""The documented import path of the decoder-only transformers reader and writer (they live in convert/hf/lm.py)."""

from bpd_train.sources.convert.hf.lm import load_hf_lm, to_hf_lm

__all__ = ["load_hf_lm", "to_hf_lm"]
