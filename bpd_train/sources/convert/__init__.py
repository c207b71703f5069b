"""Conversions between this project's models and other formats: transformers checkpoints of the encoder-decoder
family (hf/mt.py) and the decoder-only family (hf/lm.py), on what both share (common.py); GGUF files (gguf.py); vLLM
Medusa heads (vllm_medusa.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bpd_train.families import ModelFamily, families
from bpd_train.sources.convert.common import ConvertError
from bpd_train.sources.convert.hf import lm, mt
from bpd_train.sources.convert.hf.mt import from_hf, load_hf, to_hf


@dataclass(frozen=True)
class HFFormat:
    """A family's transformers adapter: which `hf:` folders it reads, how, and how it writes one (export.format=hf)."""

    claims: Callable[[Path], bool]
    read: Callable[[Any, Any], tuple]  # (loading.Source, map_location) -> loading.Read's fields
    write: Callable[..., Path]  # (model, out_dir, *, files, overwrite) -> the folder written


HF_FORMATS: dict[str, HFFormat] = {
    "lm": HFFormat(lm.claims_hf, lm.read_hf, lm.to_hf_lm),
    "mt": HFFormat(mt.claims_hf, mt.read_hf, mt.to_hf),
}


def hf_format(family: ModelFamily) -> HFFormat:
    """A family's transformers adapter."""
    return HF_FORMATS[family.name]


def hf_format_of(folder: str | Path) -> HFFormat:
    """The adapter that reads a transformers folder: the families are asked the most specific first."""
    for fam in families():
        if hf_format(fam).claims(Path(folder)):
            return hf_format(fam)
    raise AssertionError("the encoder-decoder family claims every other folder")


__all__ = ["ConvertError", "HFFormat", "HF_FORMATS", "from_hf", "hf_format", "hf_format_of", "load_hf", "to_hf"]
