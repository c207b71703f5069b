"""transformers' own `generate()` with bpd-train heads: generate.py (in this package; self-contained) is what every
`export.format=hf` folder with a heads file carries as custom_generate/generate.py (convert/common.py
write_hf_folder), for decoder-only and encoder-decoder models alike; `from_pretrained(folder, trust_remote_code=True)`
then runs it for `generate()`. `write_custom_generate(folder)` adds it to a folder written otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "generate.py"
CUSTOM_GENERATE = "custom_generate/generate.py"  # where transformers looks for it, relative to the model folder


def write_custom_generate(folder: str | Path) -> Path:
    """Copy the blockwise generate function into folder/custom_generate/generate.py; returns that path."""
    dest = Path(folder) / CUSTOM_GENERATE
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TEMPLATE, dest)
    return dest
