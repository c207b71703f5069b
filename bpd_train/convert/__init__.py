"""Conversions between this project's models and other formats (transformers checkpoints: hf.py)."""
from bpd_train.convert.hf import ConvertError, from_hf, load_hf, to_hf

__all__ = ["ConvertError", "from_hf", "load_hf", "to_hf"]
