"""bench/real.py --profile: where a greedy step and a k-row blockwise step spend their time, by phase (the native
engine's profile counters); a breakdown of one decoder's step, not a comparison of engines."""

from __future__ import annotations

import json
import time

from bpd_train.decoding import Exact
from bpd_train.engine.fastlinear import native_kernels

PHASES = ("embed", "decoder linears", "attention", "norms etc.", "head 1", "heads FFN", "proposal proj")


def phases(a, b, prompts, new: int, k: int) -> dict:
    """Where a greedy step (decoder a) and a k-row blockwise step (decoder b; bench/real.py Decoder) spend their
    time: ms per step per phase (csrc/step.h's profile), and the screened argmax's rows / full passes / candidates (fp32)."""
    ext = native_kernels()
    out = {}
    for name, run in (
        ("greedy", lambda p: a.greedy([p], max_len=new)),
        (f"k={k}", lambda p: b.blockwise([p], block_size=k, accept=Exact(), max_len=new)),
    ):
        run(prompts[0])
        ext.screen_stats(True)
        ext.profile(True, True)
        calls = 0
        t = time.perf_counter()
        for p in prompts:
            calls += run(p).calls
        wall = time.perf_counter() - t
        ph, _ = ext.profile(False, True)
        rows, full, cands = ext.screen_stats(True)
        out[name] = {
            "ms_per_step": wall * 1e3 / calls,
            **{n: v * 1e3 / calls for n, v in zip(PHASES, ph)},
            "screen": {"rows": rows, "full_pass": full, "candidates_per_row": cands / max(rows - full, 1)},
        }
        print(f"  profile {name}: " + json.dumps(out[name]), flush=True)
    return out
