"""fp32 decoding from fewer bytes (engine/q4blocks.py q4_blocks, fastlinear.py bf16_exact, csrc/kernels_q4.h):
weights that are a GGUF's 4-bit groups or bf16 values exactly are packed as such and give the fp32 kernels' bits, for
any number of rows and threads; any other weight stays plain fp32."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bpd_train.engine.fastlinear import PackedLinear, native_kernels

native = pytest.mark.skipif(native_kernels() is None, reason="native decode kernels not built on this machine")


@native
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
def test_4bit_gguf_blocks_run_on_their_codes_with_the_fp32_bits(monkeypatch, qtype):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    from bpd_train.engine.q4blocks import q4_blocks

    qt = gguf.GGMLQuantizationType[qtype]
    rng = torch.Generator().manual_seed(0)
    for n, k in [(100, 64), (192, 576), (64, 1536)]:  # rows padded to 64, one / several groups of 32 per row
        w = torch.from_numpy(dequantize(quantize(torch.randn(n, k, generator=rng).numpy(), qt), qt).copy())
        b = torch.randn(n, generator=rng)
        assert q4_blocks(w) is not None
        lin = PackedLinear(w, b, "fp32")
        monkeypatch.setenv("BPD_COMPACT", "0")
        ref = PackedLinear(w, b, "fp32")
        monkeypatch.delenv("BPD_COMPACT")
        assert (lin.mode, ref.mode) == (6, 0)
        assert lin.nbytes * 5 < ref.nbytes
        x = torch.randn(9, k, generator=rng)
        for m in range(1, 10):  # one row, 2-4 row blocks, 5-8 row half blocks, 8 + 1
            assert torch.equal(lin(x[:m]).view(torch.int32), ref(x[:m]).view(torch.int32)), (n, k, m)
        assert torch.allclose(lin(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
        before = torch.get_num_threads()
        try:  # blocks of 64 rows split over threads: the same bits with 2
            torch.set_num_threads(2)
            assert torch.equal(lin(x), ref(x))
        finally:
            torch.set_num_threads(before)
    # weights that are not 4-bit blocks, or one weight off by an ulp, stay fp32
    assert q4_blocks(torch.randn(64, 64, generator=rng)) is None
    w[5, 7] = torch.nextafter(w[5, 7], torch.tensor(1.0))
    assert q4_blocks(w) is None and PackedLinear(w, None, "fp32").mode == 0


@native
def test_q4_k_blocks_run_on_their_codes_with_the_fp32_bits(monkeypatch):
    """A K-quant's 4-bit groups have float32 scales and offsets (a half-precision scale per 256 times a 6-bit one
    per 32) and need not hold code 0: recognised all the same, decoded with the fp32 kernels' bits."""
    pytest.importorskip("gguf")
    from _gguf_files import q4_k_weight

    from bpd_train.engine.q4blocks import q4_blocks

    rng = torch.Generator().manual_seed(1)
    for n, k, seed in [(100, 256, 0), (192, 512, 1), (64, 1536, 2)]:
        w = q4_k_weight(n, k, seed)
        codes, d, m = q4_blocks(w)
        rebuilt = (codes.view(n, -1, 32).float() * d.unsqueeze(-1) + m.unsqueeze(-1)).view(n, k)
        assert torch.equal(rebuilt, w)
        assert not torch.equal(d.half().float(), d)  # not half-precision scales: the Q4_0 / Q4_1 search alone fails
        lin = PackedLinear(w, None, "fp32")
        monkeypatch.setenv("BPD_COMPACT", "0")
        ref = PackedLinear(w, None, "fp32")
        monkeypatch.delenv("BPD_COMPACT")
        assert (lin.mode, ref.mode) == (6, 0) and lin.nbytes * 5 < ref.nbytes
        x = torch.randn(9, k, generator=rng)
        for rows in range(1, 10):
            assert torch.equal(lin(x[:rows]).view(torch.int32), ref(x[:rows]).view(torch.int32)), (n, k, rows)
    w[3, 100] = torch.nextafter(w[3, 100], torch.tensor(1.0))  # one weight an ulp off: not blocks, stays fp32
    assert q4_blocks(w) is None and PackedLinear(w, None, "fp32").mode == 0


@native
def test_bf16_valued_weights_decode_from_two_bytes_with_the_fp32_bits(monkeypatch):
    torch.manual_seed(0)
    w = torch.randn(100, 72).bfloat16().float()  # a bf16 checkpoint loaded in fp32
    b = torch.randn(100)
    lin = PackedLinear(w, b, "fp32")
    monkeypatch.setenv("BPD_COMPACT", "0")
    ref = PackedLinear(w, b, "fp32")
    assert (lin.mode, ref.mode) == (1, 0) and lin.nbytes * 2 == ref.nbytes
    x = torch.randn(9, 72)
    for m in range(1, 10):
        assert torch.equal(lin(x[:m]).view(torch.int32), ref(x[:m]).view(torch.int32))
    w[3, 3] += 1e-3  # one weight that bf16 cannot hold: plain fp32
    monkeypatch.delenv("BPD_COMPACT")
    assert PackedLinear(w, b, "fp32").mode == 0


def _thp_eligible(ptr: int) -> bool | None:
    """What /proc/self/smaps says of the mapping holding address ptr (None where it says nothing)."""
    try:
        text = open("/proc/self/smaps").read()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split()[0] if line.split() else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


# The check runs in a fresh interpreter: in a long-lived test process, memory an earlier region was advised on can
# come back from the allocator to an ordinary tensor, which then reads as eligible too.
HUGE_PAGES_CHECK = """
import torch
from test_engine_compact import _thp_eligible
from bpd_train.engine.fastlinear import PackedLinear, native_kernels
ext = native_kernels()
w = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(1))  # 8 MiB packed: streamed every step
lin = PackedLinear(w, None, "fp32")
ext.set_huge_pages(False)
ref = PackedLinear(w, None, "fp32")
ext.set_huge_pages(True)
x = torch.randn(5, 1024)
print(lin.data.data_ptr() % 4096, torch.equal(lin(x), ref(x)), _thp_eligible(lin.data.data_ptr()),
      _thp_eligible(ref.data.data_ptr()))
"""


@native
def test_large_packed_weights_sit_in_memory_advised_for_huge_pages():
    r = subprocess.run(
        [sys.executable, "-c", HUGE_PAGES_CHECK], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    offset, same, eligible, ref_eligible = r.stdout.split()[-4:]
    assert offset == "0"  # page-aligned, in a region of 2 MiB pages
    assert same == "True"  # the same bits either way
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        thp = "[never]"  # no transparent huge pages on this system: alignment and bits are all there is to check
    if "[never]" not in thp and eligible != "None":
        assert eligible == "True", "the packed weight's mapping is not eligible for transparent huge pages"
        if "[madvise]" in thp:  # our advice is what makes it so
            assert ref_eligible == "False"
