"""transformers' own `generate()` with bpd-train heads: `write_custom_generate(folder)` puts generate.py (in this
package; self-contained) into an `export.format=hf` folder of a decoder-only model as custom_generate/generate.py,
which `from_pretrained(folder, trust_remote_code=True)` then runs for `generate()`."""
from __future__ import annotations

import shutil
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "generate.py"


def write_custom_generate(folder: str | Path) -> Path:
    """Copy the blockwise generate function into folder/custom_generate/generate.py; returns that path."""
    dest = Path(folder) / "custom_generate" / "generate.py"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TEMPLATE, dest)
    return dest
