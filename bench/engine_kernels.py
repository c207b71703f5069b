"""bench/engine.py --kernels: one linear per kernel family and row count (fp32 / bf16 / int8, vdpbf16ps / VNNI / AMX
where present, fp32 from 4-bit codes), and head 1's argmax fp32 against the int8 screen. A kernel's cost is the median
over interleaved rounds of its mean over an inner loop of calls (a micro-timing of one kernel; no round is picked as
the best)."""

from __future__ import annotations

import statistics
import time

import torch

from bpd_train.engine.fastlinear import PackedLinear, native_kernels


def kernel_row(size: str, n: int, k: int, threads: int, kernel: str, rows: int, rounds: list[float]) -> dict:
    """One kernel timing: `us` the median over rounds (each round a mean over an inner loop), min-max beside it."""
    return dict(
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


def bench_argmax(size: str, n: int, k: int, threads: int, rows, reps: int) -> list[dict]:
    """Head 1's argmax (layer norm, output projection, argmax) over an n x k fp32 projection, every logit in fp32
    against the int8 screen (csrc/screen.h Screen: the same ids). Random weights and activations: a trained model's
    logits are less flat, so fewer tokens reach the fp32 pass than here. Timed as bench_kernels times: the median
    over `reps` interleaved rounds of the mean over an inner loop."""
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
        rounds = {"argmax fp32": [], "argmax fp32, int8 screen": []}
        inner = max(1, int(2e6 // (n * k * r)))
        for _ in range(reps):
            for name, lin in (("argmax fp32", full), ("argmax fp32, int8 screen", scr)):
                t0 = time.perf_counter()
                for _ in range(inner):
                    ext.norm_project_argmax(x, nw, nb, 1e-5, lin)
                rounds[name].append((time.perf_counter() - t0) / inner * 1e6)
        out += [kernel_row(size, n, k, threads, name, r, us) for name, us in rounds.items()]
    for name in ("argmax fp32", "argmax fp32, int8 screen"):
        us = {row["rows"]: row["us"] for row in out if row["kernel"] == name}
        print(
            f"kernel  {size:4s} {n:5d}x{k:<4d} threads={threads} {name:30s} "
            + "  ".join(f"{r:3d} rows {us[r]:8.1f} us ({us[r] / us[1]:4.1f}x)" for r in rows),
            flush=True,
        )
    return out


def bench_kernels(sizes, threads: int = 1, rows=(1, 4, 8, 16, 32, 128), reps: int = 30):
    """Cost of one packed linear per kernel family and number of activation rows (1: a greedy step at batch 1; k: a
    blockwise verification; 32 / 4 x 32: greedy / blockwise at batch 32): microseconds and the ratio to one row.
    A micro-timing of one kernel: per round, the mean over an inner loop of calls (~2M multiply-adds); the kernels
    take turns round by round, and `us` is the median over `reps` rounds (us_min / us_max beside it), never the
    best round. Where rows are nearly free (AMX), a k-wide step costs about what a greedy step does."""
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
            for r in rows:
                x = torch.randn(r, k)
                rounds = {name: [] for name, _, _ in fams}
                inner = max(1, int(2e6 // (n * k * r)))
                for _ in range(reps):
                    for name, _, tiles in fams:
                        ext.set_amx(tiles)
                        t0 = time.perf_counter()
                        for _ in range(inner):
                            lins[name](x)
                        rounds[name].append((time.perf_counter() - t0) / inner * 1e6)
                out += [kernel_row(size, n, k, threads, name, r, rounds[name]) for name, _, _ in fams]
            ext.set_amx(ext.amx())
            for name, _, _ in fams:
                us = {row["rows"]: row["us"] for row in out if row["shape"] == f"{n}x{k}" and row["kernel"] == name}
                print(
                    f"kernel  {size:4s} {n:5d}x{k:<4d} threads={threads} {name:30s} "
                    + "  ".join(f"{r:3d} rows {us[r]:8.1f} us ({us[r] / us[1]:4.1f}x)" for r in rows),
                    flush=True,
                )
        out += bench_argmax(size, *KERNEL_SHAPES[size][0], threads, rows, reps)
    from bpd_train.engine.fastlinear import amx

    amx()  # back to what BPD_AMX says
    return out
