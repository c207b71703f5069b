# python bench/engine.py [--threads 1 2] [--sizes demo base] [--skip-ct2] [--profile]   (~3-6 min on 2 cores)
# python bench/engine.py --threads 1 --regimes RUN... [--batch 1 32]          (trained runs: speedups by decoder)
# python bench/engine.py --threads 1 --kernels [--sizes demo base]           (one linear per kernel family and rows,
#                                                                              fp32 from 4-bit codes too)
# python bench/engine.py --sizes lm-demo --threads 1 --skip-ct2 --lm-decode  (a random decoder-only LM: step costs,
#                                                      greedy vs blockwise at batch 1, torch path vs native engine)
"""The CPU decode engine, measured in one run.

1. Step cost: one blockwise step at batch 1 (decode k tokens + head 1 at the k positions + heads 2..k at the
   accepted position) in units of one greedy step (decode 1 token + head 1), timed by bench/protocol.py's
   measure() (one untimed warm-up pass, then --passes passes of ceil(--reps / --passes) calls of every step, the
   steps taking turns call by call): the median over calls of each call's ratio, quartiles and min-max beside it;
   random weights, at demo size (d 128, 3+3 layers, V 4k) and Transformer-base size (d 512, 6+6, ffn 2048,
   V 32k), k = 2, 4, 8, 1 and 2 threads: this project's engine (packed kernels) vs torch's F.linear path,
   and with the proposal pass over a draft vocabulary of the V/4 most frequent ids.
   lm-demo / lm-base: the same step costs for a random decoder-only (Llama-style) model; with --lm-decode also
   greedy vs exact blockwise at batch 1 on random prompts, torch's fp32 path vs the native engine per --dtype
   (bench/protocol.py's measure(), the prompts as units: medians over >= 3 passes, speedups the median over prompts).
2. Greedy tokens/s against CTranslate2 (fp32 and int8) on the SAME weights (our model written as a
   CTranslate2 Transformer spec), batch 1 and 32, tokens checked identical in fp32 (bench/engine_ct2.py, on
   bench/protocol.py's measure(): medians over >= 3 passes, the batches as units).
--kernels: one kernel's cost, a round being its mean over an inner loop of calls, timed as the step costs are (the
kernels taking turns round by round): the median round, min-max beside it; no round is picked as the best.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# bench.*: bench/ has no __init__.py, so with the checkout on sys.path it imports as a namespace package,
# however this file was loaded (a script, bench/decode.py --engine, or by path as the tests do)
from bench.engine_ct2 import bench_bundle, bench_ct2  # noqa: E402
from bench.engine_kernels import (  # noqa: E402, F401
    KERNEL_SHAPES,
    bench_argmax,
    bench_kernels,
    kernel_families,
    kernel_row,
    q4_linear,
    q4_weight,
    rounds,
)
from bench.engine_regimes import bench_regimes  # noqa: E402
from bench.protocol import MIN_REPS, Run, measure, speedup, spread, tok_s  # noqa: E402
from bpd_train.decoding import greedy  # noqa: E402
from bpd_train.engine.fastlinear import cpu_model, engine_name, native_kernels  # noqa: E402
from bpd_train.engine.packed import DecodeOptions  # noqa: E402
from bpd_train.engine.weights import PackedWeights  # noqa: E402
from bpd_train.model import BPDConfig, BPDModel  # noqa: E402

SIZES = {
    "demo": dict(vocab_size=4000, d_model=128, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=512),
    "base": dict(vocab_size=32000, d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, d_ff=2048),
}
# decoder-only (model/lm/model.py, Llama-style: RMSNorm, rotary, GQA, SwiGLU, tied output): random weights, BPD heads
LM_SIZES = {
    "lm-demo": dict(vocab_size=4000, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=352),
    "lm-base": dict(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1408),
}


def make_model(size: str, k: int = 8, head_hidden: int = 128, seed: int = 0, chain: bool = False):
    torch.manual_seed(seed)
    if size in LM_SIZES:
        from bpd_train.model import LMConfig, LMModel

        m = LMModel(
            LMConfig(**LM_SIZES[size], block_size=k, head_d_hidden=head_hidden, max_positions=512, eos_id=2)
        ).eval()
        if m.heads is not None:
            with torch.no_grad():
                torch.nn.init.normal_(m.heads.fc2.weight, std=0.02)
        return m
    m = BPDModel(
        BPDConfig(**SIZES[size], block_size=k, head_d_hidden=head_hidden, dropout=0.0, head_chain=chain and k > 1)
    ).eval()
    if m.heads is not None:  # random, but not zero-initialised future heads (real proposals, real cost)
        with torch.no_grad():
            if chain:
                torch.nn.init.normal_(m.heads.w2, std=0.02)
                torch.nn.init.normal_(m.heads.tok, std=0.02)
            else:
                torch.nn.init.normal_(m.heads.fc2.weight, std=0.02)
    return m


PHASES = ("embed", "decoder linears", "attention", "norms/residuals", "head 1", "heads FFN", "proposal proj")


def step_costs(
    models: dict[int, BPDModel],
    options: DecodeOptions,
    reps: int = 40,
    src_len: int = 25,
    cached: int = 20,
    loop_steps: int = 16,
    profile: bool = False,
    passes: int = MIN_REPS,
    clock=None,
):
    """(greedy step ms, {k: blockwise step / greedy step}, the same for the native loops: {"greedy_ms", k: ...})
    at batch 1, each figure a protocol.spread dict (step_table). One step through Python (model.decode + head-1
    argmax + proposals), and per step of the native loops the decoders run (DecodeWeights.greedy_steps /
    block_steps, `loop_steps` steps per call). Timed by engine_kernels.rounds(): one untimed warm-up pass, then
    `passes` passes of ceil(reps / passes) calls of every step, the steps taking turns call by call.
    profile: also print where a native-loop step's time goes (csrc/step.h's profile, read by profile()).
    A loop's blockwise step verifies lazily (head 1 only as far as proposals are accepted): random heads
    rarely agree, so these steps mostly pay one verification pass; each accepted pair of proposals adds one.
    models: {k: a model with block_size k} (same backbone size): a k-wide step runs on a k-head model, whose
    heads' hidden layer is k x head_hidden wide (a k = 8 model's would cost a k = 4 step twice the heads' FFN);
    greedy steps run on the smallest."""
    ks = sorted(models)
    m = models[ks[0]]
    v = m.config.vocab_size
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, v, (1, src_len), generator=g)
    src[0, -1] = m.config.eos_id
    with torch.inference_mode():
        states = {}
        for k, mk in models.items():
            wk = PackedWeights(options).get(mk)  # freshly packed for these options
            st_k = mk.start_decoding(mk.encode(src), cached + 16 + loop_steps * k, weights=wk)
            mk.decode(st_k, torch.randint(4, v, (1, cached), generator=torch.Generator().manual_seed(2)))
            states[k] = st_k
        st = states[ks[0]]
        w = st.weights

        def greedy_step(x=torch.tensor([[5]])):  # noqa: B008 - one tensor for every call, made once
            st.lengths = cached
            h = m.decode(st, x)
            w.head1_argmax(h[:, 0]).cpu().numpy()

        def block_step(k):
            x = torch.randint(4, v, (1, k), generator=g)
            mk, sk = models[k], states[k]

            def f():
                sk.lengths = cached
                h = mk.decode(sk, x)
                sk.weights.head1_argmax(h).cpu().numpy()  # verify at the k positions
                sk.weights.propose(h[:, 1], 1, k).cpu().numpy()  # heads 2..k at the accepted one

            return f

        fs = {"greedy": greedy_step, **{k: block_step(k) for k in ks}}
        if w.native_loop is not None and loop_steps:
            # the native loops decoders use (DecodeWeights.greedy_steps / block_steps), per step over
            # loop_steps steps that never end early (eos -1)
            room = np.array([10**6])

            def greedy_loop():
                st.lengths = cached
                w.greedy_steps(m, st, torch.tensor([5]), room, loop_steps, eos=-1)

            def block_loop(k):
                x = torch.randint(4, v, (k,), generator=g).numpy()
                mk, sk = models[k], states[k]

                def f():
                    sk.lengths = cached
                    sk.weights.block_steps(mk, sk, x, 10**6, loop_steps, eos=-1)

                return f

            fs.update({"loop greedy": greedy_loop, **{("loop", k): block_loop(k) for k in ks}})
        ext = w.ext if profile else None
        phases = {n: [] for n in fs}
        if ext is not None:  # profiling switched on and read around each call (inside its time, as is the profiling)

            def profiled(n, f):
                def run():
                    ext.profile(True, True)
                    f()
                    p, steps = ext.profile(False, True)
                    phases[n].append([x / max(steps, 1) for x in p])

                return run

            fs = {n: profiled(n, f) for n, f in fs.items()}
        t = rounds(fs, reps, passes, clock=clock or time.perf_counter)
    if ext is not None:
        # where a native-loop step's time goes: mean per phase over the faster half of the timed calls (the
        # slower half is where other work on the machine took the core); calls in the order measure() made them
        for n in [n for n in fs if n == "loop greedy" or isinstance(n, tuple)]:
            secs = [s for rep in t[n].seconds for s in rep]
            timed = phases[n][len(phases[n]) - len(secs) :]  # the warm-up pass's calls come first
            idx = np.argsort(secs)[: max(1, len(secs) // 2)]
            per = np.mean(np.array(timed)[idx], axis=0) * 1e6
            wall = float(np.mean(np.array(secs)[idx])) / loop_steps * 1e6
            label = "greedy" if n == "loop greedy" else f"k={n[1]}"
            print(
                f"  profile {label:6s} {wall:8.1f} us/step: "
                + "  ".join(f"{name} {v:.1f}" for name, v in zip(PHASES, per))
                + f"  rest {wall - per.sum():.1f}",
                flush=True,
            )
    return step_table(t, ks, loop_steps)


def step_table(t: dict, ks, loop_steps: int = 16):
    """step_costs' figures from rounds()' timings: greedy_ms = one greedy step's ms per pass (its mean over the
    pass's calls), median with min-max over passes; k = one k-wide step in greedy steps, the median over calls of
    each call's ratio (its median over passes), with quartiles and min-max over calls (protocol.speedup); the
    native loops' the same per step of the loop."""
    g = t["greedy"]
    gms = spread([1e3 * sum(rep) / len(rep) for rep in g.seconds])
    loop = {}
    if "loop greedy" in t:
        lg = t["loop greedy"]
        loop = {
            "greedy_ms": spread([1e3 * sum(rep) / len(rep) / loop_steps for rep in lg.seconds]),
            **{k: speedup(t[("loop", k)], lg) for k in ks},
        }
    return gms, {k: speedup(t[k], g) for k in ks}, loop


def _cost_fields(gms: dict, ratio: dict) -> dict:
    """A step-cost row's figures: greedy_ms and k<k> the medians (as before), with their spreads beside them."""

    def r(d, n):
        return {key: round(val, n) for key, val in d.items()}

    return dict(
        greedy_ms=round(gms["median"], 3),
        **{f"k{k}": round(c["median"], 2) for k, c in ratio.items()},
        greedy_ms_range=[round(gms["min"], 3), round(gms["max"], 3)],
        **{f"k{k}_spread": r(c, 3) for k, c in ratio.items()},
    )


def bench_steps(sizes, threads, reps, profile=False, dtypes=("fp32",), chain=False, passes=MIN_REPS):
    rows = []
    for size in sizes:
        models = {k: make_model(size, k, chain=chain) for k in (2, 4, 8)}  # a k-wide step on a k-head model
        draft = tuple(range(models[2].config.vocab_size // 4))
        for t, dt, engine in [(t, dt, e) for t in threads for dt in dtypes for e in ("native", "torch")]:
            torch.set_num_threads(t)
            if engine == "native" and native_kernels() is None:
                continue
            if engine == "torch" and dt != "fp32":  # torch's path is the fp32 "before" row only
                continue
            for label, opts in (
                ("full", DecodeOptions(dtype=dt)),
                ("draft V/4", DecodeOptions(dtype=dt, draft_vocab=draft)),
                ("draft V/4 + int8 proposals", DecodeOptions(dtype=dt, draft_vocab=draft, proposal_dtype="int8")),
            ):
                if engine == "torch" and label != "full" or dt == "int8" and "int8 proposals" in label:
                    continue
                with _engine(engine):
                    gms, ratio, loop = step_costs(
                        models, opts, reps=reps, profile=profile and engine == "native", passes=passes
                    )
                per_pass = max(1, -(-reps // passes))
                costs = [(engine, gms, ratio)]
                if loop:
                    costs.append(
                        ("native loop", loop["greedy_ms"], {k: c for k, c in loop.items() if k != "greedy_ms"})
                    )
                for who, ms, cost in costs:
                    row = dict(size=size, threads=t, dtype=dt, engine=who, proposals=label, **_cost_fields(ms, cost))
                    rows.append({**row, "passes": passes, "calls_per_pass": per_pass})
                    print(
                        f"step cost  {size:4s} threads={t} {dt:4s} {who.replace('native ', ''):6s} proposals={label:9s} greedy "
                        f"{ms['median']:7.3f} ms ({ms['min']:.3f}-{ms['max']:.3f})  "
                        + "  ".join(
                            f"k={k}: {c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f})" for k, c in cost.items()
                        ),
                        flush=True,
                    )
    return rows


def bench_lm_decode(
    sizes, threads: int, dtypes, n_prompts: int = 8, max_len: int = 48, k: int = 4, passes: int = MIN_REPS, clock=None
):
    """Decoder-only models: greedy and exact blockwise (k heads) at batch 1 on random prompts (4-24 tokens), the
    torch path (fp32) vs the native engine (each --dtype), every (engine, precision, decoder) timed by
    bench/protocol.py's measure() with the prompts as units (a full warm-up pass, then `passes` >= 3 passes, taking
    turns prompt by prompt). seconds / tokens_per_s: the median pass (tok_s_spread: its spread);
    speedup_vs_torch_greedy: the median over prompts of the rate ratio to torch's greedy (vs_torch_greedy: with the
    quartiles). Random heads are rarely accepted (k-hat near 1): this measures the engine, not trained heads."""
    torch.set_num_threads(threads)
    from bpd_train.decoding import blockwise

    rows = []
    for size in sizes:
        m = make_model(size, k)
        g = np.random.default_rng(0)
        v = m.config.vocab_size
        prompts = [g.integers(3, v, size=int(g.integers(4, 25))).tolist() for _ in range(n_prompts)]
        runs = [("torch", "fp32")] + [("native", dt) for dt in dtypes if native_kernels() is not None]
        weights, stats = {}, {}
        for engine, dt in runs:  # weights built under each engine, kept for the timed passes (one cache each)
            weights[(engine, dt)] = PackedWeights(DecodeOptions(dtype=dt))
            with _engine(engine):
                weights[(engine, dt)].get(m)

        def decoder(engine, dt, dec):
            key = (engine, dt, dec)
            stats[key] = {}

            def run(unit):
                i, p = unit
                pw = weights[(engine, dt)]
                if dec == "greedy":
                    r = greedy(m, [p], max_len=max_len, weights=pw)
                else:
                    r = blockwise(m, [p], max_len=max_len, weights=pw)
                stats[key][i] = (r.mean_accepted * r.row_steps, r.row_steps)
                return Run([r.tokens[0]], r.row_steps)

            return run

        fns = {(e, dt, dec): decoder(e, dt, dec) for e, dt in runs for dec in ("greedy", "blockwise")}
        kw = {} if clock is None else {"clock": clock}
        t = measure(fns, list(enumerate(prompts)), passes, **kw)
        base = t[("torch", "fp32", "greedy")]
        for (engine, dt, dec), tm in t.items():
            same = float(np.mean([a == b for a, b in zip(tm.tokens, t[(engine, dt, "greedy")].tokens)]))
            acc, steps = (sum(x) for x in zip(*stats[(engine, dt, dec)].values()))
            rate, vs = tok_s(tm), speedup(base, tm)
            sec = statistics.median(sum(rep) for rep in tm.seconds)
            row = dict(
                size=size,
                threads=threads,
                engine=engine,
                dtype=dt,
                decoder=dec,
                batch=1,
                reps=passes,
                seconds=round(sec, 4),
                tokens_per_s=round(rate["median"], 1),
                tok_s_spread={x: round(y, 1) for x, y in rate.items()},
                speedup_vs_torch_greedy=round(vs["median"], 2),
                vs_torch_greedy={x: round(y, 3) for x, y in vs.items()},
                khat=round(acc / max(steps, 1), 3),
                same_as_greedy=same,
            )
            rows.append(row)
            print(
                f"lm decode  {size:7s} threads={threads} {engine:6s} {dt:4s} {dec:9s} {sec * 1e3:8.1f} ms "
                f"({rate['median']:7.1f} tok/s, {rate['min']:.1f}-{rate['max']:.1f})  x{vs['median']:.2f} "
                f"[{vs['p25']:.2f}-{vs['p75']:.2f}] vs torch greedy  k-hat {row['khat']:.2f}  same {same:.2f}",
                flush=True,
            )
    return rows


class _engine:
    """Temporarily decode with torch's F.linear instead of the native kernels (for the A/B)."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        import bpd_train.engine.fastlinear as fl

        self.saved = (fl._ext, fl._ext_tried)
        if self.name == "torch":
            fl._ext, fl._ext_tried = None, True

    def __exit__(self, *exc):
        import bpd_train.engine.fastlinear as fl

        fl._ext, fl._ext_tried = self.saved


def _command(argv) -> str:
    """The command line as a user would type it, for the tables' header (run folders relative to the checkout)."""
    args = sys.argv[1:] if argv is None else list(argv)
    rel = []
    for a in args:
        p = Path(a)
        if p.is_absolute():
            try:
                a = str(p.resolve().relative_to(ROOT))
            except ValueError:
                a = p.name
        rel.append(a)
    return " ".join(["python bench/engine.py", *rel])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--sizes",
        nargs="+",
        default=["demo", "base"],
        choices=sorted(SIZES) + sorted(LM_SIZES),
        help="model sizes; lm-demo / lm-base: decoder-only (Llama-style) models, step costs and "
        "greedy vs blockwise at batch 1 (--lm-decode), no CTranslate2 comparison",
    )
    ap.add_argument(
        "--lm-decode",
        action="store_true",
        help="lm-* sizes: also time greedy vs blockwise on random prompts at batch 1, torch vs native",
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=40,
        help="timed calls of each step (--kernels: rounds of each kernel), over --passes",
    )
    ap.add_argument("--skip-ct2", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-phase time of the native loops' steps")
    ap.add_argument("--quick", action="store_true", help="demo size, 1 thread, few reps, small CT2 run")
    ap.add_argument("--bundle", default=None, help="also compare on a trained bundle (e.g. make demo's export/best)")
    ap.add_argument(
        "--regimes",
        nargs="+",
        default=None,
        metavar="RUN",
        help="only: greedy vs blockwise (plain / adaptive / draft vocabulary) on trained runs, e.g. "
        "artifacts/demo/bible_en_fr/heads/*-k4, at --batch sizes",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="batch sizes for --regimes")
    ap.add_argument(
        "--passes",
        type=int,
        default=MIN_REPS,
        help=f"timed passes after one warm-up pass (>= {MIN_REPS}): step costs, --kernels, --lm-decode, --regimes",
    )
    ap.add_argument(
        "--rules",
        nargs="+",
        default=[],
        metavar="RULE",
        help="--regimes: also blockwise under these acceptance rules (e.g. top2 distance:1; output may "
        "differ from greedy's), with the draft vocabulary and int8 proposals",
    )
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="only: one linear's cost per kernel family (fp32 / bf16 / int8, vdpbf16ps / VNNI / AMX) and rows",
    )
    ap.add_argument(
        "--dtype",
        nargs="+",
        default=["fp32"],
        choices=["fp32", "bf16", "int8"],
        help="decode precision(s) (decode.dtype) for the step costs and --regimes",
    )
    ap.add_argument("--chain", action="store_true", help="step costs with chained heads (model.head_chain)")
    a = ap.parse_args(argv)
    if a.passes < MIN_REPS:
        ap.error(f"--passes {a.passes}: the protocol times at least {MIN_REPS} passes (a median needs them)")
    if a.quick:
        a.threads, a.sizes, a.reps = [1], ["demo"], 5
    if a.kernels or a.regimes:  # one bench alone: its rows, with the machine and the command that made them
        print(
            f"CPU: {cpu_model()} ({os.cpu_count()} cores), torch {torch.__version__}, engine {engine_name()}, "
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        if a.kernels:
            key, rows = "kernels", bench_kernels(a.sizes, threads=a.threads[0], reps=a.reps, passes=a.passes)
        else:
            opts = dict(threads=a.threads[0], batch_sizes=a.batch, reps=a.passes, rules=tuple(a.rules))
            key, rows = "regimes", [r for dt in a.dtype for r in bench_regimes(a.regimes, dtype=dt, **opts)]
        print(
            json.dumps(
                {
                    "cpu": cpu_model(),
                    "engine": engine_name(),
                    "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d", time.gmtime()),
                    "command": _command(argv),
                    key: rows,
                }
            )
        )
        return 0
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores), torch {torch.__version__}, engine {engine_name()}", flush=True)
    result = {
        "cpu": cpu_model(),
        "engine": engine_name(),
        "step_cost": bench_steps(a.sizes, a.threads, a.reps, a.profile, a.dtype, a.chain, a.passes),
    }
    lm_sizes = [s for s in a.sizes if s in LM_SIZES]
    if a.lm_decode and lm_sizes:
        result["lm_decode"] = bench_lm_decode(
            lm_sizes, a.threads[0], a.dtype, n_prompts=4 if a.quick else 8, passes=a.passes
        )
    if not a.skip_ct2 and any(s in SIZES for s in a.sizes):
        result["ctranslate2"] = [
            row
            for size in a.sizes
            if size in SIZES
            for row in (
                bench_ct2(
                    lambda: make_model(size, k=1),
                    a.threads,
                    [1, 32] if not a.quick else [4],
                    n_sent=64 if not a.quick else 8,
                    size=size,
                )
                or []
            )
        ]
    if a.bundle:
        result["bundle"] = bench_bundle(a.bundle, threads=a.threads[0])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
