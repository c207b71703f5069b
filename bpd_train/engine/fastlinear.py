"""Packed linear layers for decoding: the one place that decides how a decode step multiplies by a weight.

`PackedLinear(weight, bias, dtype)` is built once per weight version and called like F.linear. On a CPU with
AVX2/AVX-512 it uses our kernel (csrc/: linear.cpp and the parts it includes, compiled on first use with the system
C++ compiler and cached in TORCH_EXTENSIONS_DIR): fp32, bf16 or int8 weights, every output row computed the same way
whatever the number of rows (so greedy and blockwise see bit-identical logits). Elsewhere (CUDA, no
compiler, other CPUs, BPD_DECODE_ENGINE=torch) it is F.linear on a weight of the requested precision.

Precision (`dtype`): "fp32" (default), "bf16" (weights rounded to bfloat16; on a CPU with AVX512_BF16 the
activations are rounded to bfloat16 too and the kernels multiply with vdpbf16ps, twice the fp32 FMA rate, see
`bf16_compute`; elsewhere activations stay fp32), "int8" (weights quantised per output row, each activation
row quantised to int8 with its own scale; the kernels multiply with vpdpbusd on AVX512_VNNI, with vpmaddwd on AVX2,
the same integer sums either way, see `int8_compute`; BPD_INT8_COMPUTE=0: weight-only int8, activations fp32),
"q4" (weights as 4-bit codes with a half-precision scale and offset per 32 weights of a row: a GGUF's own Q4_0 /
Q4_1 blocks where the weights are such blocks, else quantised so at load; activations quantised to int8 per block
of 32; vpdpbusd on AVX512_VNNI, vpmaddubsw on AVX2, the same bits either way; see `q4_weight`).
Exact blockwise decoding equals greedy decoding of the same precision.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from bpd_train.decode_settings import DTYPES  # noqa: F401 - the decode precisions, declared with the settings
from bpd_train.engine.q4blocks import (  # the 4-bit blocks: their recognition and packed layouts
    Q4_GROUP,
    pack_q4,
    pack_q4q,
    pack_q4qk,
    q4_blocks,
    q4_weight,
    q4k_form,
)

log = logging.getLogger(__name__)

_MODE = {"fp32": 0, "bf16": 1, "int8": 2}
_COMPUTE_MODE = {"bf16": 3, "int8": 4}  # csrc/vec.h Mode BF16D / I8D: activations in that precision too
_BF16_AMX = 5  # csrc/vec.h Mode BF16A: bf16 x bf16 on AMX tiles, every row count
Q4F = 6  # csrc/vec.h Mode Q4F: fp32 arithmetic over 4-bit codes (weights that are such blocks exactly)
_Q4Q = 7  # csrc/vec.h Mode Q4Q: 4-bit codes (half-precision d, m per 32) x int8 activations per block of 32
_Q4QF = 8  # csrc/vec.h Mode Q4QF: the same with float32 d, m
_Q4QK = 9  # csrc/vec.h Mode Q4QK: the same with a GGUF's Q4_K scales as the file holds them
_lock = threading.Lock()
_ext = None
_ext_tried = False
_ext_error: str | None = None


def _cpu_tag() -> str:
    """The CPU's feature flags in the extension name: a cached build from another CPU is never loaded."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def cpu_model() -> str:
    """The CPU for the header of every table a speed goes into: /proc/cpuinfo's model name, its family and model
    numbers and the widest vector instructions (a VM may name only the vendor: "AMD EPYC")."""
    try:
        info = dict(
            line.split(":", 1)
            for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
            if ":" in line
        )
    except OSError:
        info = {}
    info = {k.strip(): v.strip() for k, v in info.items()}
    if "model name" not in info:
        import platform

        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = [f for f in ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2") if f in flags][:3] or ["no AVX2"]
    return (
        f"{info['model name']} (family {info.get('cpu family', '?')} model {info.get('model', '?')}; {', '.join(isa)})"
    )


_L2: int | None = None


def l2_bytes() -> int:
    """One core's L2 cache in bytes (Linux sysfs; 1 MiB where it cannot be read): a weight matrix larger than this
    is read from L3 or memory on every pass over it, so a pass costs about the same for 1 row as for 8
    (engine/packed.py verify_groups)."""
    global _L2
    if _L2 is None:
        _L2 = 1 << 20
        try:
            for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
                if (idx / "level").read_text().strip() == "2" and (idx / "type").read_text().strip() != "Instruction":
                    size = (idx / "size").read_text().strip().upper()
                    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
                    _L2 = int(size.rstrip("KMG")) * mult
                    break
        except (OSError, ValueError):
            pass
    return _L2


def source_digest(csrc: Path, flags: list[str]) -> str:
    """8 hex digits over every source in `csrc` (each file's name and bytes, headers included), the checkout's path
    and the compiler flags: part of the extension's name, so a change to any of them builds it anew."""
    parts = sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))
    blob = b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in parts)
    return hashlib.sha1(blob + str(csrc.resolve()).encode() + " ".join(flags).encode()).hexdigest()[:8]


def native_kernels():
    """The compiled kernel module, or None where it cannot be built (then decoding uses torch)."""
    global _ext, _ext_tried
    if _ext_tried:
        return _ext
    with _lock:
        if _ext_tried:
            return _ext
        _ext_tried = True
        if os.environ.get("BPD_DECODE_ENGINE", "auto").lower() == "torch":
            return None
        if os.uname().machine not in ("x86_64", "AMD64"):
            return None
        csrc = Path(__file__).with_name("csrc")
        src = csrc / "linear.cpp"  # one translation unit: it includes every other part
        try:
            from torch.utils.cpp_extension import _get_build_directory, load

            # CPU flags, sources (every file in csrc/, headers included) and checkout in the name: a build for
            # another CPU or an older source is never loaded, and two checkouts never rebuild into (and wait on the
            # lock of) one folder
            # -ffp-contract=off: no multiply and add merged into one FMA behind our back, so the native embedding
            # (embed * scale, then + pe) rounds twice as BPDModel.decode's torch ops do; the kernels' FMAs are explicit.
            # -fopenmp: at::parallel_for is header code that runs on OpenMP only where the extension is built with it;
            # without it the kernels run on one thread whatever torch.set_num_threads says
            # BPD_NATIVE_MARCH (default native): build for an older instruction set on this CPU, e.g. "haswell" for
            # the AVX2 kernels, "skylake-avx512" for AVX-512 without bf16 / VNNI / AMX (tests and benchmarks of the
            # other kernel families)
            march = os.environ.get("BPD_NATIVE_MARCH", "native").strip() or "native"
            flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp"]
            name = f"bpd_decode_{_cpu_tag()}_{source_digest(csrc, flags)}"
            build = Path(_get_build_directory(name, verbose=False))
            lock = build / "lock"
            if lock.exists() and time.time() - lock.stat().st_mtime > 600:
                # a build killed midway leaves its lock behind, and torch would wait for it forever
                log.warning("removing a stale build lock %s (older than 10 min)", lock)
                lock.unlink(missing_ok=True)
            if not any(build.glob("*.so")):
                print(
                    f"bpd-train: compiling the CPU decode kernels once (~40 s; cached in {build.parent})",
                    file=sys.stderr,
                    flush=True,
                )
            _ext = load(name=name, sources=[str(src)], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
            _ext.set_huge_pages(env_on("BPD_HUGEPAGES"))  # packed weights in 2 MiB pages where the kernel allows
        except Exception as e:  # no compiler, no AVX2, read-only cache, ...: correct but slower
            global _ext_error
            _ext_error = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            log.warning("native decode kernels unavailable (%s); decoding uses torch's F.linear", _ext_error)
            _ext = None
    return _ext


def native_build_error() -> str | None:
    """Why the last native_kernels() build failed (None: it built, or was never tried / turned off)."""
    return _ext_error


def loaded_kernels():
    """The kernel module if this process has already loaded it, else None (never starts a build: for callers that
    only use it to go faster, e.g. on a GPU model that never needed the CPU kernels)."""
    return _ext if _ext_tried else None


def engine_name() -> str:
    """What CPU decoding runs on in this process: "native-amx" (AVX-512 kernels, and AMX tiles for bf16 and int8
    compute), "native-avx512", "native-avx2" or "torch"."""
    ext = native_kernels()
    if ext is None:
        return "torch"
    return "native-amx" if amx() else f"native-{ext.isa()}"


def amx() -> bool:
    """Whether bf16 / int8 compute run on AMX tiles (Sapphire Rapids and later; BPD_AMX=0 turns it off): a tile
    multiplies 16 activation rows for about the price of one, so a k-token verification or a batch costs about
    what one token costs. Needs bf16 compute (AMX tiles take bf16 / int8 activations)."""
    ext = native_kernels()
    on = ext is not None and bool(ext.amx()) and env_on("BPD_AMX")
    if ext is not None:
        ext.set_amx(on)
    return on


def env_on(var: str) -> bool:
    return os.environ.get(var, "1").strip().lower() not in ("0", "false", "no", "off")


def bf16_compute() -> bool:
    """Whether "bf16" computes in bf16 (activations rounded, vdpbf16ps) rather than upconverting bf16 weights to
    fp32 FMAs: needs a build with AVX512_BF16 (the extension is compiled with -march=native and tagged with the
    CPU's flags, so a CPU without it gets the upconvert kernels). BPD_BF16_COMPUTE=0 turns it off."""
    ext = native_kernels()
    return ext is not None and bool(ext.bf16_dot()) and env_on("BPD_BF16_COMPUTE")


def int8_compute() -> bool:
    """Whether "int8" computes in int8 (each activation row quantised to int8 with its own scale; vpdpbusd with
    AVX512_VNNI, vpmaddwd on AVX2: the same integer sums, so the same bits on every x86 CPU) rather than weight-only
    int8 with fp32 FMAs. BPD_INT8_COMPUTE=0 turns it off."""
    ext = native_kernels()
    return ext is not None and bool(ext.i8_dot()) and env_on("BPD_INT8_COMPUTE")


def check_dtype(dtype: str) -> str:
    d = str(dtype).lower()
    if d not in DTYPES:
        raise ValueError(f"decode dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return d


def bf16_exact(w: Tensor) -> bool:
    """Whether every weight of w (float32) is a bfloat16 value (a bf16 checkpoint loaded in fp32): then bf16 storage,
    widened in registers (csrc Mode BF16, the fp32 kernels' FMA chain), gives the fp32 bits from half the bytes."""
    return w.dtype == torch.float32 and bool((w.contiguous().view(torch.int32) & 0xFFFF).eq(0).all())


class PackedLinear:
    """y = x . W^T + b for decoding, with W packed once (see the module docstring)."""

    __slots__ = (
        "out_features", "in_features", "mode", "data", "scale", "bias", "weight", "native", "lin", "screened", "q4"
    )  # fmt: skip

    def __init__(
        self, weight: Tensor, bias: Tensor | None = None, dtype: str = "fp32", screen: bool = False, quantize=True
    ):
        """quantize (q4): weights that are not 4-bit blocks are quantised to them (True) or run in int8 (False)."""
        dtype = check_dtype(dtype)
        w = weight.detach()
        self.out_features, self.in_features = w.shape
        # q4: "file" (the weights are 4-bit blocks, kept), "load" (quantised to them here), None (not q4)
        self.q4: str | None = None
        q4 = None
        if dtype == "q4":
            q4 = q4_weight(w.cpu(), quantize) if w.dtype == torch.float32 else None
            if q4 is None:  # not blocks (quantize=False), K not a multiple of 32, beyond half precision: int8
                dtype = "int8"
            else:
                self.q4 = "file" if q4[3] else "load"
        self.mode = (_Q4QF if q4[1].dtype == torch.float32 else _Q4Q) if q4 is not None else _MODE[dtype]
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        ext = native_kernels() if w.device.type == "cpu" and w.dtype == torch.float32 else None
        self.native = ext
        self.data = self.scale = self.weight = self.lin = None
        self.screened = False
        if ext is not None:
            if (dtype == "bf16" and bf16_compute()) or (dtype == "int8" and int8_compute()):
                self.mode = _COMPUTE_MODE[dtype]
                if dtype == "bf16" and amx():
                    self.mode = _BF16_AMX
                elif dtype == "int8":
                    amx()  # int8 takes the tiles from 4 rows on (the same bits): follow BPD_AMX now
            lossless = dtype == "fp32" and not screen and env_on("BPD_COMPACT")
            blocks = q4_blocks(w) if lossless else None
            kq = q4k_form(w.cpu(), *q4[:3]) if q4 is not None and self.mode == _Q4QF else None
            if kq is not None:  # Q4_K blocks with the file's own scales: 0.578 bytes a weight
                self.mode = _Q4QK
                packed = [pack_q4qk(*kq)]
            elif q4 is not None:  # 4-bit codes x int8 activations per block of 32
                packed = [pack_q4q(*q4[:3])]
            elif blocks is not None:  # 4-bit blocks exactly (a GGUF's Q4 tensors): the fp32 bits from 1/5 the bytes
                self.mode = Q4F
                packed = [pack_q4(*blocks)]
            else:
                if lossless and bf16_exact(w):  # a bf16 checkpoint's weights: the bf16 kernels widen them exactly
                    self.mode = _MODE["bf16"]
                packed = ext.pack(w, self.mode)
            self.data = ext.huge_pages(packed[0])  # streamed every step: 2 MiB pages spare a TLB miss per 4 KiB
            self.scale = packed[1] if len(packed) > 1 else None
            # the C++ object the fused step functions chain (DecodeWeights.head1_argmax / propose)
            self.lin = ext.Lin(self.data, self.scale, self.bias, self.out_features, self.in_features, self.mode)
            if screen and self.mode == _MODE["fp32"] and ext.i8_dot() and env_on("BPD_SCREEN"):
                # an output projection's argmax (head 1) read through an int8 copy and a proven error bound, the
                # few outputs that can win computed in fp32: the same ids and bits (csrc/screen.h)
                self.lin.add_screen(w.float().contiguous())
                self.screened = self.lin.screened()  # (not where a weight is inf / NaN)
        elif q4 is not None:  # q4 on torch: the 4-bit weights dequantised, activations fp32 (correct, not faster)
            codes, d, m, _ = q4
            g = self.in_features // Q4_GROUP
            rows = codes.view(-1, g, Q4_GROUP).float() * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)
            self.weight = rows.view(self.out_features, self.in_features).to(w.device)
        elif dtype == "fp32":
            self.weight = w
        elif dtype == "bf16":
            self.weight = w.to(torch.bfloat16)
            if self.bias is not None:
                self.bias = self.bias.to(torch.bfloat16)
        else:  # int8 on torch: the same per-row quantisation, dequantised (correct, not faster)
            scale = (w.abs().amax(1) / 127.0).clamp_min(1e-30)
            self.weight = (torch.round(w / scale[:, None]).clamp(-127, 127) * scale[:, None]).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes a pass over the weights reads (packed data, or the torch weight)."""
        w = self.data if self.data is not None else self.weight
        return w.numel() * w.element_size()

    @property
    def argmax_bytes(self) -> int:
        """Bytes an argmax pass reads: the int8 copy where the projection is screened, else `nbytes`."""
        return self.out_features * self.in_features if self.screened else self.nbytes

    def __call__(self, x: Tensor) -> Tensor:
        if self.lin is not None:
            return self.lin(x)
        if self.weight.dtype == torch.bfloat16:
            return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)
