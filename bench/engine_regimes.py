"""Greedy against exact blockwise on trained runs (bench/engine.py --regimes): speedups by decoder, batch size
and decode precision on the bundled validation sources."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import torch

from bpd_train.decoding import greedy
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights

ROOT = Path(__file__).resolve().parent.parent


def bench_regimes(
    runs: list[str],
    threads: int = 1,
    batch_sizes=(1, 32),
    reps: int = 2,
    n_sent: int = 80,
    draft_vocab: int = 1000,
    dtype: str = "fp32",
    rules=(),
):
    """Trained runs (e.g. make demo's heads/*-k4, or make demo-lm's) on the bundled validation sources: greedy vs
    exact blockwise (plain, adaptive, and both with the draft vocabulary), every decoder on the same batches, taking
    turns by chunks of ~1/8 of them (order reversed every chunk), the first pass a warm-up; speedup = greedy seconds /
    decoder seconds,
    greedy of the same `dtype`; with dtype bf16 / int8 also greedy fp32 and every decoder's speedup over it; `rules`
    (e.g. top2, distance:1): also blockwise under those acceptance rules (draft vocabulary, int8 proposals). A
    decoder-only run is prompted with each English source as its prompt-format translation into French (what
    make demo-lm trains and evaluates); its family's text adapter makes the ids either way."""
    import gzip

    from bpd_train.decoding import blockwise
    from bpd_train.decoding.common import decoding_mode, start_rows, stop_ids
    from bpd_train.decoding.settings import draft_vocabulary
    from bpd_train.sources.loading import load

    torch.set_num_threads(threads)
    with gzip.open(ROOT / "data" / "bible-en-fr" / "validation.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = [json.loads(x)["translation"]["en"] for x in f]
    rows = []
    for run in runs:
        loaded = load(run, map_location="cpu")
        m = loaded.model.eval()
        family = loaded.family
        text = family.text_adapter(loaded, "en", "fr") if family.prompted else family.text_adapter(loaded)
        stops = stop_ids(m)
        # each decoder's own packed weights (one cache per set of options): fp32 greedy (the reference of a lower
        # precision), `dtype`, the draft vocabulary, and the draft vocabulary with int8 proposals (head 1 still
        # verifies in `dtype`)
        wf = PackedWeights(DecodeOptions()) if dtype != "fp32" else None
        w = PackedWeights(DecodeOptions(dtype=dtype))
        wd = PackedWeights(DecodeOptions(dtype=dtype, draft_vocab=draft_vocabulary(text.sp, draft_vocab, stops)))
        wp = PackedWeights(
            DecodeOptions(dtype=dtype, draft_vocab=draft_vocabulary(text.sp, draft_vocab, stops), proposal_dtype="int8")
        )
        step = max(1, len(lines) // n_sent)
        srcs = sorted((text.source_ids(t) for t in lines[::step][:n_sent]), key=len)
        ml = (1.5, 10)
        fns = {
            "greedy": lambda s: greedy(m, s, max_len=ml, weights=w),
            "plain": lambda s: blockwise(m, s, max_len=ml, weights=w),
            "adaptive": lambda s: blockwise(m, s, max_len=ml, adaptive=True, weights=w),
            f"draft {draft_vocab}": lambda s: blockwise(m, s, max_len=ml, weights=wd),
            f"draft {draft_vocab} adaptive": lambda s: blockwise(m, s, max_len=ml, adaptive=True, weights=wd),
            f"draft {draft_vocab} int8 proposals": lambda s: blockwise(m, s, max_len=ml, weights=wp),
            f"draft {draft_vocab} int8 proposals adaptive": lambda s: blockwise(
                m, s, max_len=ml, adaptive=True, weights=wp
            ),
        }
        for rule in rules:
            fns[f"draft {draft_vocab} int8 proposals {rule}"] = lambda s, r=rule: blockwise(
                m, s, max_len=ml, accept=r, weights=wp
            )
        if wf is not None:
            fns["greedy fp32"] = lambda s: greedy(m, s, max_len=ml, weights=wf)

        def prefill(s):  # what every decoder does before its first step: the source's encoder / the prompt's cache
            with decoding_mode(m, w) as sw:
                rows = start_rows(m, s, ml)
                return m.start_decoding(m.encode(rows.src, sw), rows.cap, weights=sw)

        fns["prefill"] = prefill
        for bs in batch_sizes:
            batches = [text.batch(srcs[i : i + bs]) for i in range(0, len(srcs), bs)]  # padded as evaluate pads
            sec = {k: 0.0 for k in fns}
            out = {k: [] for k in fns}
            hist = {k: collections.Counter() for k in fns}
            per_pass = {k: [0.0] * reps for k in fns}
            # decoders take turns by chunks of ~1/8 of the batches (order reversed every chunk), each turn after one
            # untimed call: a decoder serves its batches as a server would, its own weights warm in the caches
            # (interleaved per batch, every call started on caches another copy of the weights had filled); whole
            # passes per decoder (~0.5 s each) let the machine's drift move single decoders by 10-30%
            size = max(1, len(batches) // 8)
            chunks = [batches[i : i + size] for i in range(0, len(batches), size)]
            turns = [
                (rep, name, chunk)
                for rep in range(reps + 1)
                for ci, chunk in enumerate(chunks)
                for name in (list(fns) if (rep * len(chunks) + ci) % 2 == 0 else list(fns)[::-1])
            ]
            for rep, name, chunk in turns:
                fns[name](chunk[0])  # untimed: the turn starts on warm caches, whichever decoder came before
                for b in chunk:
                    t0 = time.perf_counter()
                    r = fns[name](b)
                    el = time.perf_counter() - t0
                    if rep:
                        sec[name] += el
                        per_pass[name][rep - 1] += el
                    if rep == reps and name != "prefill":
                        out[name] += r.tokens
                        hist[name].update(r.accepted_hist)
            pre = sec.pop("prefill")
            # BPD changes only the steps after the prefill: their speedup, greedy's steps over the decoder's
            print(
                f"regime {Path(run).name:12s} {dtype:4s} batch {bs:2d} prefill (encoder / prompt) "
                f"{pre / sec['greedy']:.0%} of greedy's time",
                flush=True,
            )
            for name in [n for n in fns if n != "prefill"]:
                h = hist[name]
                khat = sum(k * v for k, v in h.items()) / max(1, sum(h.values()))
                same = sum(a == b for a, b in zip(out[name], out["greedy"])) / len(srcs)
                row = dict(
                    run=Path(run).name,
                    batch=bs,
                    threads=threads,
                    dtype=dtype,
                    decoder=name,
                    speedup=round(sec["greedy"] / sec[name], 3),
                    khat=round(khat, 2),
                    same=round(same, 3),
                    seconds=round(sec[name] / reps, 3),
                    steps_speedup=round((sec["greedy"] - pre) / max(sec[name] - pre, 1e-9), 3),
                    prefill_share=round(pre / sec["greedy"], 3),
                    pass_speedups=[round(g / d, 3) for g, d in zip(per_pass["greedy"], per_pass[name])],
                )
                if wf is not None:
                    row["speedup_vs_fp32_greedy"] = round(sec["greedy fp32"] / sec[name], 3)
                rows.append(row)
                vs = f"  {row['speedup_vs_fp32_greedy']:.3f}x vs greedy fp32" if wf is not None else ""
                print(
                    f"regime {row['run']:12s} {dtype:4s} batch {bs:2d} {name:22s} {row['speedup']:.3f}x "
                    f"(steps {row['steps_speedup']:.3f}x; passes {min(row['pass_speedups']):.2f}-"
                    f"{max(row['pass_speedups']):.2f}x)  k^ {khat:.2f}  "
                    f"same as greedy {same:.0%}  ({sec[name] / reps:.3f} s per pass){vs}",
                    flush=True,
                )
    return rows
