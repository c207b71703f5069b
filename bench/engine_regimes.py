"""Greedy against exact blockwise on trained runs (bench/engine.py --regimes): speedups by decoder, batch size
and decode precision on the bundled validation sources."""

from __future__ import annotations

import collections
import json
import statistics
import time
from pathlib import Path

import torch

from bench.protocol import MIN_REPS, Run, Timing, matches, measure, speedup, spread
from bpd_train.decoding import greedy
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights

ROOT = Path(__file__).resolve().parent.parent


def bench_regimes(
    runs: list[str],
    threads: int = 1,
    batch_sizes=(1, 32),
    reps: int = MIN_REPS,
    n_sent: int = 80,
    draft_vocab: int = 1000,
    dtype: str = "fp32",
    rules=(),
):
    """Trained runs (e.g. make demo's heads/*-k4, or make demo-lm's) on the bundled validation sources: greedy vs
    exact blockwise (plain, adaptive, and both with the draft vocabulary), every decoder on the same batches, timed by
    bench/protocol.py's measure() with the batches as units (time_regime); speedup over greedy of the same `dtype`,
    the median over batches of the rate ratio; with dtype bf16 / int8 also greedy fp32 and every decoder's speedup
    over it; `rules` (e.g. top2, distance:1): also blockwise under those acceptance rules (draft vocabulary, int8
    proposals). A decoder-only run is prompted with each English source as its prompt-format translation into French (what
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
            t, hist = time_regime(fns, batches, reps)
            timed = regime_rows(t, hist, fp32="greedy fp32" in fns)
            # BPD changes only the steps after the prefill: their speedup, greedy's steps over the decoder's
            share = timed[0]["prefill_share"]
            print(
                f"regime {Path(run).name:12s} {dtype:4s} batch {bs:2d} prefill (encoder / prompt) "
                f"{share:.0%} of greedy's time",
                flush=True,
            )
            for fields in timed:
                row = dict(run=Path(run).name, batch=bs, threads=threads, dtype=dtype, **fields)
                rows.append(row)
                vs = f"  {row['speedup_vs_fp32_greedy']:.3f}x vs greedy fp32" if wf is not None else ""
                print(
                    f"regime {row['run']:12s} {dtype:4s} batch {bs:2d} {row['decoder']:22s} {row['speedup']:.3f}x "
                    f"[{row['speedup_spread']['p25']:.2f}-{row['speedup_spread']['p75']:.2f}] "
                    f"(steps {row['steps_speedup']:.3f}x; passes {min(row['pass_speedups']):.2f}-"
                    f"{max(row['pass_speedups']):.2f}x)  k^ {row['khat']:.2f}  "
                    f"same as greedy {row['same']:.0%}  ({row['seconds']:.3f} s per pass){vs}",
                    flush=True,
                )
    return rows


def time_regime(fns: dict, batches: list, reps: int = MIN_REPS, clock=time.perf_counter):
    """Every decoder (name -> batch -> DecodeResult; "prefill": batch -> anything) over the same batches, timed by
    bench/protocol.py's measure() with the batches as units: one untimed warm-up pass, then `reps` >= 3 passes, the
    decoders taking turns batch by batch (the first rotating). Returns (name -> Timing, name -> its accepted-block
    histogram over the batches)."""
    hists: dict[str, dict[int, dict]] = {n: {} for n in fns}

    def engine(name):
        def run(unit):
            i, b = unit
            r = fns[name](b)
            if name == "prefill":  # no tokens: its time is what every decoder spends before its first step
                return Run([])
            hists[name][i] = r.accepted_hist
            return Run(r.tokens, r.calls)

        return run

    t = measure({n: engine(n) for n in fns}, list(enumerate(batches)), reps, clock=clock)
    hist = {n: sum((collections.Counter(h) for h in hs.values()), collections.Counter()) for n, hs in hists.items()}
    return t, hist


def _steps_rates(t: Timing, pre: Timing) -> list[float]:
    """Each batch's tokens/s over the steps after the prefill: its median time less the prefill's median time."""
    med = lambda tm, i: statistics.median(rep[i] for rep in tm.seconds)  # noqa: E731
    return [t.unit_tokens(i) / max(med(t, i) - med(pre, i), 1e-9) for i in range(len(t.runs))]


def regime_rows(t: dict[str, Timing], hist: dict, fp32: bool = False) -> list[dict]:
    """time_regime's result as one row per decoder (greedy included, prefill left out): speedup over greedy (the
    median over batches of the rate ratio, speedup_spread its quartiles and min-max), steps_speedup (the same for
    the steps after the prefill), prefill_share (of greedy's time, median over passes), pass_speedups (each pass's
    rate ratio, to show the noise), seconds (the median pass), khat, same (share of sentences identical to
    greedy's); with fp32, speedup_vs_fp32_greedy over the decoder "greedy fp32"."""
    g, pre = t["greedy"], t["prefill"]
    share = spread([sum(p) / sum(a) for p, a in zip(pre.seconds, g.seconds)])["median"]
    g_steps = _steps_rates(g, pre)
    rows = []
    for name, tm in t.items():
        if name == "prefill":
            continue
        h = hist[name]
        up = speedup(g, tm)
        steps = [b / a for a, b in zip(g_steps, _steps_rates(tm, pre)) if a > 0 and b > 0]  # non-empty: as speedup()
        row = dict(
            decoder=name,
            speedup=round(up["median"], 3),
            speedup_spread={x: round(y, 3) for x, y in up.items()},
            khat=round(sum(k * v for k, v in h.items()) / max(1, sum(h.values())), 2),
            same=round(matches(tm, g)[0] / len(g.tokens), 3),
            seconds=round(statistics.median(sum(rep) for rep in tm.seconds), 3),
            steps_speedup=round(statistics.median(steps), 3),
            prefill_share=round(share, 3),
            pass_speedups=[
                round((tm.n_tokens / sum(d)) / (g.n_tokens / sum(a)), 3) for a, d in zip(g.seconds, tm.seconds)
            ],
            reps=len(tm.seconds),
        )
        if fp32:
            row["speedup_vs_fp32_greedy"] = round(speedup(t["greedy fp32"], tm)["median"], 3)
        rows.append(row)
    return rows
