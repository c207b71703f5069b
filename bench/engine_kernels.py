"""bench/engine.py --kernels: one linear per kernel family and row count (fp32 / bf16 / int8, vdpbf16ps / VNNI / AMX
where present, fp32 from 4-bit codes), and head 1's argmax fp32 against the int8 screen. These timings compare
kernels (one family against another, the screen against the full argmax), so they run under bench/protocol.py's
measure() like every comparison: a round is one kernel's mean over an inner loop of calls, one untimed warm-up pass
of rounds, then at least 3 timed passes in which the kernels take turns round by round, the first rotating. A
kernel's cost is the median over its timed rounds (min-max beside it); no round is picked as the best.
rounds() is the same protocol for any functions of no argument (bench/engine.py's step costs use it too)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from bench.protocol import MIN_REPS, Run, Timing, measure
from bpd_train.engine.fastlinear import PackedLinear, native_kernels


def rounds(
    fns: dict, reps: int, passes: int = MIN_REPS, clock: Callable[[], float] = time.perf_counter
) -> dict[object, Timing]:
    """measure() over functions of no argument: every pass calls each function ceil(reps / passes) times (so about
    `reps` timed calls each in all), the functions taking turns call by call after one untimed warm-up pass.
    Each call counts as one unit of one token, so protocol.speedup() gives per-call time ratios."""
    per_pass = max(1, -(-reps // passes))
    engines = {n: (lambda _call, f=f: (f(), Run([[0]], calls=1))[1]) for n, f in fns.items()}
    return measure(engines, list(range(per_pass)), passes, clock=clock)


def kernel_row(
    size: str, n: int, k: int, threads: int, kernel: str, rows: int, rounds: list[float], passes: int | None = None
) -> dict:
    """One kernel timing: `us` the median over timed rounds (each round a mean over an inner loop), min-max beside
    it; `passes`: how many protocol passes the rounds came from."""
    row = dict(
        size=size,
        shape=f"{n}x{k}",
        threads=threads,
        kernel=kernel,
        rows=rows,
        us=round(statistics.median(rounds), 1),
        us_min=round(min(rounds), 1),
        us_max=round(max(rounds), 1),
        rounds=len(rounds),
    )
    if passes is not None:
        row["passes"] = passes
    return row


def _us(t: Timing, inner: int) -> list[float]:
    """Every timed round of t as microseconds per kernel call."""
    return [s / inner * 1e6 for rep in t.seconds for s in rep]


KERNEL_SHAPES = {"demo": [(4000, 128), (512, 128)], "base": [(32000, 512), (2048, 512)]}


Q4_NAME = "fp32 from 4-bit codes"


def q4_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random [n, k] float32 weight made of gguf Q4_1 blocks (per group of 32: half-precision scale d and offset m,
    w = (d * code) + m rounded as gguf's dequantize does), every group using codes 0 and 15 as a real file's do."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0.0, 15.0
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.001).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.05).half().float()
    return (d * codes + m).reshape(n, k)


def q4k_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random [n, k] float32 weight made of gguf Q4_K blocks (k a multiple of 256): per 256 a half-precision
    scale and offset scale, per 32 a 6-bit multiple of each, so a group's scale and offset are float32 values that
    are not half-precision ones; w = (d * code) - m rounded to float32 as gguf's dequantize does."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0.0, 15.0  # (llama.cpp's quantizer puts nearly every group's extremes there)
    ds = (torch.rand(n, k // 256, 1, generator=g) * 0.001 + 1e-4).half().float().repeat_interleave(8, 1)
    dm = (ds * (2 + 8 * torch.rand(n, k // 256, 1, generator=g)).repeat_interleave(8, 1)).half().float()
    sc = torch.randint(1, 64, (n, k // 32, 1), generator=g).float()
    mn = torch.randint(0, 64, (n, k // 32, 1), generator=g).float()
    return (ds * sc * codes - dm * mn).reshape(n, k)


def q4_linear(n: int, k: int):
    """q4_weight's PackedLinear where the engine runs it from its codes (Q4F), else None."""
    from bpd_train.engine.fastlinear import Q4F

    if k % 32:
        return None
    p = PackedLinear(q4_weight(n, k), None, "fp32")
    return p if p.lin is not None and p.mode == Q4F else None


def kernel_families():
    """The kernel families this CPU runs, as (name, pack mode, AMX on): the names reports print."""
    ext = native_kernels()
    if ext is None:
        return []
    isa = ext.isa()
    fams = [(f"fp32 {isa}", 0, False), (f"bf16 weights, fp32 {isa}", 1, False), (f"int8 weights, fp32 {isa}", 2, False)]
    if ext.bf16_dot():
        fams.append(("bf16 vdpbf16ps", 3, False))
    if ext.i8_dot():
        avx2 = bool(getattr(ext, "i8_avx2", lambda: False)())
        fams.append(("int8 vpmaddwd (AVX2)" if avx2 else "int8 vpdpbusd", 4, False))
    if ext.amx():
        fams += [("bf16 AMX tiles", 5, True), ("int8 AMX tiles (>= 4 rows)", 4, True)]
    return fams


def bench_argmax(size: str, n: int, k: int, threads: int, rows, reps: int, passes: int = MIN_REPS) -> list[dict]:
    """Head 1's argmax (layer norm, output projection, argmax) over an n x k fp32 projection, every logit in fp32
    against the int8 screen (csrc/screen.h Screen: the same ids). Random weights and activations: a trained model's
    logits are less flat, so fewer tokens reach the fp32 pass than here. Timed as bench_kernels times (rounds():
    about `reps` timed rounds each over `passes` passes, the median round reported)."""
    ext = native_kernels()
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    p = ext.pack(w, 0)
    full, scr = ext.Lin(p[0], None, None, n, k, 0), ext.Lin(p[0], None, None, n, k, 0)
    scr.add_screen(w)
    nw, nb = torch.ones(k), torch.zeros(k)
    out = []
    for r in rows:
        x = torch.randn(r, k)
        assert torch.equal(
            ext.norm_project_argmax(x, nw, nb, 1e-5, full), ext.norm_project_argmax(x, nw, nb, 1e-5, scr)
        )
        inner = max(1, int(2e6 // (n * k * r)))

        def loop(lin, x=x, inner=inner):
            for _ in range(inner):
                ext.norm_project_argmax(x, nw, nb, 1e-5, lin)

        fns = {"argmax fp32": lambda: loop(full), "argmax fp32, int8 screen": lambda: loop(scr)}
        t = rounds(fns, reps, passes, clock=time.perf_counter)
        out += [kernel_row(size, n, k, threads, name, r, _us(t[name], inner), passes) for name in fns]
    for name in ("argmax fp32", "argmax fp32, int8 screen"):
        us = {row["rows"]: row["us"] for row in out if row["kernel"] == name}
        print(
            f"kernel  {size:4s} {n:5d}x{k:<4d} threads={threads} {name:30s} "
            + "  ".join(f"{r:3d} rows {us[r]:8.1f} us ({us[r] / us[1]:4.1f}x)" for r in rows),
            flush=True,
        )
    return out


def bench_kernels(sizes, threads: int = 1, rows=(1, 4, 8, 16, 32, 128), reps: int = 30, passes: int = MIN_REPS):
    """Cost of one packed linear per kernel family and number of activation rows (1: a greedy step at batch 1; k: a
    blockwise verification; 32 / 4 x 32: greedy / blockwise at batch 32): microseconds and the ratio to one row.
    Per round, the mean over an inner loop of calls (~2M multiply-adds); rounds() times about `reps` rounds of each
    kernel over `passes` passes after a warm-up pass, the kernels taking turns round by round, and `us` is the
    median round (us_min / us_max beside it), never the best. Where rows are nearly free (AMX), a k-wide step costs
    about what a greedy step does."""
    ext = native_kernels()
    out = []
    if ext is None:
        print("kernels: the native kernels are not built here (torch path only)")
        return out
    torch.set_num_threads(threads)
    for size in sizes:
        for n, k in KERNEL_SHAPES[size]:
            fams = kernel_families()
            torch.manual_seed(0)
            w = torch.randn(n, k) * 0.05
            lins = {}
            for name, mode, _ in fams:
                p = ext.pack(w, mode)
                lins[name] = ext.Lin(p[0], p[1] if len(p) > 1 else None, None, n, k, mode)
            if (q4 := q4_linear(n, k)) is not None:  # a GGUF's Q4_0 / Q4_1 weights in fp32 (csrc/kernels_q4.h)
                fams.append((Q4_NAME, q4.mode, False))
                lins[Q4_NAME] = q4.lin
                fams.append((name := "q4 " + ("vpdpbusd" if ext.q4q_vnni() else "vpmaddubsw (AVX2)"), 7, False))
                lins[name] = PackedLinear(q4_weight(n, k), None, "q4").lin  # x int8 per 32 (csrc/kernels_q4q.h)
            if k % 256 == 0:  # a GGUF's Q4_K weights: float32 scales per 32 in fp32 (Q4F), its own scales in q4 (Q4QK)
                wk = q4k_weight(n, k)
                for name, dt in (("fp32 from Q4_K codes", "fp32"), ("q4 from Q4_K blocks", "q4")):
                    p = PackedLinear(wk, None, dt, quantize=False)
                    if p.lin is not None and p.mode in (6, 9):
                        fams.append((name, p.mode, False))
                        lins[name] = p.lin
            for r in rows:
                x = torch.randn(r, k)
                inner = max(1, int(2e6 // (n * k * r)))

                def loop(name, tiles, x=x, inner=inner):
                    ext.set_amx(tiles)  # this family's AMX setting, whichever kernel ran before
                    for _ in range(inner):
                        lins[name](x)

                fns = {name: (lambda name=name, tiles=tiles: loop(name, tiles)) for name, _, tiles in fams}
                t = rounds(fns, reps, passes, clock=time.perf_counter)
                out += [kernel_row(size, n, k, threads, name, r, _us(t[name], inner), passes) for name in fns]
            ext.set_amx(ext.amx())
            for name, _, _ in fams:
                us = {row["rows"]: row["us"] for row in out if row["shape"] == f"{n}x{k}" and row["kernel"] == name}
                print(
                    f"kernel  {size:4s} {n:5d}x{k:<4d} threads={threads} {name:30s} "
                    + "  ".join(f"{r:3d} rows {us[r]:8.1f} us ({us[r] / us[1]:4.1f}x)" for r in rows),
                    flush=True,
                )
        out += bench_argmax(size, *KERNEL_SHAPES[size][0], threads, rows, reps, passes)
    from bpd_train.engine.fastlinear import amx

    amx()  # back to what BPD_AMX says
    return out
