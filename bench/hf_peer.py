"""transformers' `generate` as an engine for bench/real.py, on the same GGUF file (transformers reads it with `gguf`):
fp32 greedy. transformers keeps no prompt cache between calls, so in its cell our decoder runs without its prefix
cache too (without_prefix_cache). bench/protocol.py times it exactly as ours.
"""

from __future__ import annotations

import os

import torch

from bench.protocol import Run


def transformers_engine(hf, eos: int, new: int):
    def run(unit) -> Run:
        out = []
        for p in unit:
            with torch.no_grad():
                ids = hf.generate(
                    torch.tensor([p]), do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=eos
                )[0, len(p) :].tolist()
            out.append(ids[: ids.index(eos)] if eos in ids else ids)
        return Run(out)

    return run


def without_prefix_cache(fn):
    """fn with our prefix cache off for its calls (BPD_PREFIX_CACHE is read at every prefill)."""

    def run(unit) -> Run:
        before = os.environ.get("BPD_PREFIX_CACHE")
        os.environ["BPD_PREFIX_CACHE"] = "0"
        try:
            return fn(unit)
        finally:
            if before is None:
                os.environ.pop("BPD_PREFIX_CACHE", None)
            else:
                os.environ["BPD_PREFIX_CACHE"] = before

    return run
