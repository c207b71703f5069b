"""decode.dtype=q4 (engine/q4blocks.py q4_weight / pack_q4q, csrc/kernels_q4q.h): 4-bit weights with a half-precision
scale and offset per 32 weights of a row (a GGUF's own Q4_0 / Q4_1 blocks, or weights quantised so at load) times
activations quantised to int8 per block of 32. Every row's outputs are the same bits alone, in any batch, in any
order and at any thread count, so exact blockwise decoding (alone, in batches, with lookup and trees) is q4 greedy
decoding token for token; weights whose rows cannot be such blocks run in int8, with one log line."""

import logging

import pytest
import torch

from bpd_train.decoding import blockwise, greedy
from bpd_train.decoding.settings import DecodeSettings
from bpd_train.engine.fastlinear import PackedLinear, native_kernels
from bpd_train.engine.packed import DecodeOptions, parse_tree
from bpd_train.engine.q4blocks import pack_q4q, q4_weight, q4k_form
from bpd_train.engine.weights import PackedWeights
from bpd_train.model import LMConfig, LMModel
from bpd_train.sources.convert.gguf import load_gguf
from tests.test_lm_engine import prompts

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native decode kernels not built on this machine")

Q4, Q4F32, Q4K = 7, 8, 9  # fastlinear._Q4Q / _Q4QF / _Q4QK (csrc/vec.h Modes Q4Q, Q4QF, Q4QK)
SIZES = [(100, 64), (192, 576), (64, 1536), (70, 32)]
K_SIZES = [(100, 256), (192, 512), (64, 1536), (70, 256)]  # Q4_K: rows of whole 256-weight blocks


def reference(x: torch.Tensor, codes, d, m) -> tuple[torch.Tensor, torch.Tensor]:
    """The q4 product in float64 from the same int8 activation blocks, and the sum of its terms' magnitudes (the
    kernels round each block's float steps in float32: equal to rounding, at most (2 G + 1) ulps of that sum)."""
    n, k = codes.shape
    g = k // 32
    w = codes.view(n, g, 32).double()
    out, mag = [], []
    for row in x:
        xb = row.view(g, 32)
        amax = xb.abs().amax(-1)
        inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))  # (127 / t: 1/t * 127)
        q = (xb * inv.unsqueeze(-1)).round().clamp(-127, 127).double()
        dx = (amax / 127).double()
        terms = torch.stack([(w * q).sum(-1) * d.double() * dx, m.double() * dx * q.sum(-1)])
        out.append(terms.sum((0, -1)))
        mag.append(terms.abs().sum((0, -1)))
    return torch.stack(out), torch.stack(mag)


def gguf_weight(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    qt = gguf.GGMLQuantizationType[qtype]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    return torch.from_numpy(dequantize(quantize(w, qt), qt).copy())


@pytest.mark.parametrize("source", ["Q4_0", "Q4_1", "Q4_K", "fp32"])
def test_q4_rows_are_the_same_bits_alone_in_batches_any_order_and_thread_count(source):
    kq = source == "Q4_K"  # the file's 6-bit scales and offsets per 32 (mode Q4QK, 0.578 bytes a weight)
    for n, k in K_SIZES if kq else SIZES:
        if kq:
            pytest.importorskip("gguf")
            from _gguf_files import q4_k_weight

            w = q4_k_weight(n, k, n + k)
        else:
            w = gguf_weight(source, n, k, n + k) if source != "fp32" else torch.randn(n, k)
        b = torch.randn(n)
        lin = PackedLinear(w, b, "q4")
        assert lin.mode == (Q4K if kq else Q4) and lin.q4 == ("load" if source == "fp32" else "file")
        codes, d, m, kept = q4_weight(w)
        assert d.dtype == m.dtype == (torch.float32 if kq else torch.float16)
        if kq:  # the kernel's form: the file's codes, d = d256 * sc and m = -(dmin256 * mn)
            codes, d256, sc, m256, mn = q4k_form(w, codes, d, m)
            d = d256.float().repeat_interleave(8, 1) * sc.float()
            m = -(m256.float().repeat_interleave(8, 1) * mn.float())
        if kept:  # the file's weights exactly: d * code + m in exact arithmetic (Q4_K: then rounded to float32)
            rebuilt = codes.view(n, -1, 32).double() * d.double().unsqueeze(-1) + m.double().unsqueeze(-1)
            assert torch.equal(rebuilt.view(n, k).float() if kq else rebuilt.view(n, k), w if kq else w.double())
        else:  # quantised at load: within half a step of each weight
            step = d.float().repeat_interleave(32, 1)
            rebuilt = codes.float() * step + m.float().repeat_interleave(32, 1)
            assert ((rebuilt - w).abs() <= 0.51 * step + 1e-3).all()
        # 4-bit codes, two halves per 32: 0.625 bytes a weight (Q4_K: two bytes per 32, two halves per 256: 0.578)
        assert lin.nbytes == -(-n // 64) * 64 * k * (37 if kq else 40) // 64
        x = torch.randn(11, k) * torch.linspace(0.1, 3.0, k)  # blocks of different scales
        y = lin(x)
        ref, mag = reference(x, codes, d, m)
        assert ((y.double() - ref - b.double()).abs() <= 1.2e-7 * (k // 16 + 2) * (mag + b.double().abs())).all()
        for rows in range(1, 10):  # one row, 2-4 row blocks, 5-8 row half blocks, 8 + 1
            got = lin(x[:rows])
            assert torch.equal(got.view(torch.int32), y[:rows].view(torch.int32)), (n, k, rows)
            for i in range(rows):
                assert torch.equal(lin(x[i : i + 1])[0], y[i])
        perm = torch.randperm(11)
        assert torch.equal(lin(x[perm]), y[perm])
        many = torch.cat([x, x, x])  # more rows than one pass takes (8 + 8 + ... + 1)
        assert torch.equal(lin(many), torch.cat([y, y, y]))
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            assert torch.equal(lin(x), y)
        finally:
            torch.set_num_threads(before)


def test_q4_k_scales_as_the_file_holds_them_give_the_float32_scales_bits():
    """Mode Q4QK (d = d256 * sc, m = -(dmin256 * mn) formed in the kernel) gives the bits of mode Q4QF (d and m
    stored as float32) for the same codes, d and m: the products are exact; and where a group's offset is not a
    6-bit multiple of a half per 256, the float32 form stays."""
    pytest.importorskip("gguf")
    from _gguf_files import q4_k_weight

    ext = native_kernels()
    for n, k, seed in [(100, 256, 0), (64, 1536, 2), (70, 512, 3)]:
        w = q4_k_weight(n, k, seed)
        lin = PackedLinear(w, None, "q4", quantize=False)
        assert lin.mode == Q4K
        codes, d256, sc, m256, mn = q4k_form(w, *q4_weight(w)[:3])
        d = d256.float().repeat_interleave(8, 1) * sc.float()
        m = -(m256.float().repeat_interleave(8, 1) * mn.float())
        ref = ext.Lin(pack_q4q(codes, d, m), None, None, n, k, Q4F32)
        x = torch.randn(11, k, generator=torch.Generator().manual_seed(seed))
        for rows in range(1, 12):
            assert torch.equal(lin(x[:rows]).view(torch.int32), ref(x[:rows]).view(torch.int32)), (n, k, rows)
    g = torch.Generator().manual_seed(5)  # float32 scales that are not 6-bit multiples of a half: Q4QF
    codes = torch.randint(0, 16, (64, 8, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    dd = torch.rand(64, 8, 1, generator=g).mul(0.01).add(0.001).view(torch.int32).bitwise_and(~15).view(torch.float32)
    lin = PackedLinear((dd * codes - 0.03).view(64, 256), None, "q4", quantize=False)
    assert lin.mode == Q4F32


def test_weights_that_cannot_be_q4_blocks_run_in_int8():
    assert PackedLinear(torch.randn(40, 64), None, "q4", quantize=False).q4 is None  # not blocks, not quantised
    w = torch.randn(40, 48)  # 48 inputs: not whole blocks of 32
    lin = PackedLinear(w, None, "q4")
    assert lin.q4 is None and lin.mode in (2, 4)
    assert lin(torch.randn(3, 48)).shape == (3, 40)
    huge = torch.randn(64, 64)
    huge[0, 0] = 1e6  # beyond half precision
    assert PackedLinear(huge, None, "q4").q4 is None


def q4_lm(seed=0, heads="bpd", k=4, vocab=12, kv=2, qkv_bias=False, tie=True, d_ff=64, **kw):
    """tests/test_lm_engine.py's small random LM with inner sizes that are whole blocks of 32."""
    torch.manual_seed(seed)
    c = LMConfig(
        vocab_size=vocab,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=kv,
        d_ff=d_ff,
        block_size=k,
        heads=heads,
        head_d_hidden=32,
        eos_id=2,
        max_positions=96,
        qkv_bias=qkv_bias,
        o_bias=qkv_bias,
        tie_output=tie,
        **kw,
    )
    m = LMModel(c).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.4 if p.dim() >= 2 else 0.1)
        for layer in m.layers:
            layer.norm1.weight.add_(1.0)
            layer.norm2.weight.add_(1.0)
        m.norm.weight.add_(1.0)
    return m


CONFIGS = [  # (heads, kv, qkv bias, tied, extra)
    ("bpd", 2, False, True, {}),
    ("bpd", 4, True, False, {}),
    ("medusa", 1, True, True, {}),
    ("chain", 2, False, True, {}),
]


@pytest.mark.parametrize("cfg", range(len(CONFIGS)))
def test_exact_blockwise_is_q4_greedy_alone_in_batches_with_lookup(cfg, caplog):
    heads, kv, bias, tie, extra = CONFIGS[cfg]
    m = q4_lm(10 + cfg, heads, kv=kv, qkv_bias=bias, tie=tie, **extra)
    src = prompts(6, 20 + cfg, longest=12)
    pw_m = PackedWeights(DecodeOptions(dtype="q4"))
    with caplog.at_level(logging.INFO, logger="bpd_train.engine.lm"):
        w = pw_m.get(m)
    assert {lin.mode for layer in w.lin for lin in layer} == {Q4}
    assert {lin.q4 for layer in w.lin for lin in layer} == {"load"}  # random weights: quantised at load
    assert [r.getMessage() for r in caplog.records if "q4" in r.getMessage()] == [
        "decode dtype q4: the model holds no Q4_0 / Q4_1 / Q4_K blocks of 32; 8 of its 8 layer linears are "
        "quantised to 4-bit blocks at load (as gguf's Q4_1)"
    ]
    g = greedy(m, src, max_len=30, weights=pw_m)
    for opts in (dict(), dict(lookup=3), dict(proposal_dtype="int8"), dict(draft_vocab=tuple(range(0, 12, 2)))):
        pw_m = PackedWeights(DecodeOptions(dtype="q4", **opts))
        assert blockwise(m, src, max_len=30, weights=pw_m).tokens == g.tokens, opts
        for p, want in zip(src, g.tokens):
            assert blockwise(m, [p], max_len=30, adaptive=False, weights=pw_m).tokens[0] == want, opts
    # greedy of each row alone is the batch's
    pw_m = PackedWeights(DecodeOptions(dtype="q4"))
    assert [greedy(m, [p], max_len=30, weights=pw_m).tokens[0] for p in src] == g.tokens


def test_trees_keep_q4_greedy_output():
    for i, (heads, kv, bias, tie, extra) in enumerate([CONFIGS[0], CONFIGS[2]]):
        m = q4_lm(40 + i, heads, kv=kv, qkv_bias=bias, tie=tie, **extra)
        src = prompts(5, 50 + i, longest=10)
        pw_m = PackedWeights(DecodeOptions(dtype="q4"))
        g = greedy(m, src, max_len=30, weights=pw_m)
        for lookup in (0, 3):
            pw_m = PackedWeights(DecodeOptions(dtype="q4", lookup=lookup, tree=parse_tree("0,0,0;1;2;1,0")))
            assert [blockwise(m, [p], max_len=30, weights=pw_m).tokens[0] for p in src] == g.tokens, (heads, lookup)


def q4_gguf(tmp_path, monkeypatch, caplog, qtypes: dict, default: str = "F32", **hf_kw):
    """A tiny llama GGUF file with `qtypes` (name prefix -> type), loaded; its q4 weights packed: (model, tokenizer,
    q4 weights, their PackedWeights, the q4 log lines)."""
    pytest.importorskip("gguf")
    from _gguf_files import bpe, hf_model, write_gguf

    monkeypatch.setenv("BPD_CACHE", str(tmp_path / "cache"))
    tokens, merges, types = bpe(320)
    eos = tokens.index("<|im_end|>")
    hf = hf_model("llama", len(tokens), eos=eos, **hf_kw)
    path = tmp_path / "q4.gguf"
    write_gguf(path, hf, tokens, merges, types, arch="llama", eos=eos, qtypes=qtypes, default=default)
    model, tok, _ = load_gguf(path, block_size=3, heads="medusa")
    pw_model = PackedWeights(DecodeOptions(dtype="q4"))
    with caplog.at_level(logging.INFO, logger="bpd_train.engine.lm"):
        w = pw_model.get(model)
    return model, tok, w, pw_model, [r.getMessage() for r in caplog.records if "q4" in r.getMessage()]


def blockwise_is_greedy(model, tok, pw_model) -> list:
    """With random Medusa heads, exact blockwise decoding in a batch and alone is q4 greedy decoding; the rows."""
    with torch.no_grad():
        for p in model.head_parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    rows = tok.encode(["the quick brown fox", "hello world, how", "good morning to you 12345 and"])
    g = greedy(model, rows, max_len=24, weights=pw_model)
    assert blockwise(model, rows, max_len=24, weights=pw_model).tokens == g.tokens
    for p, want in zip(rows, g.tokens):
        assert blockwise(model, [p], max_len=24, adaptive=False, weights=pw_model).tokens[0] == want
    return rows


KEPT_6_OF_8 = (
    "decode dtype q4: 6 of 8 layer linears keep the file's 4-bit blocks; the other 2 (not Q4_0 / Q4_1 / Q4_K "
    "blocks of 32: Q5 / Q6 / Q8 types, F16 / F32 tensors) run in int8"
)


def test_a_q4_gguf_keeps_its_4bit_blocks_and_decodes_exactly(tmp_path, monkeypatch, caplog):
    qtypes = {"blk.0.attn": "Q8_0", "blk.0.ffn": "Q4_0", "blk.1.attn": "Q4_1", "blk.1.ffn": "Q4_1", "output": "Q8_0"}
    model, tok, w, pw_model, said = q4_gguf(tmp_path, monkeypatch, caplog, qtypes, seed=0)
    # blk.0's attention is Q8_0: int8, not 4 bits again
    assert [[lin.q4 for lin in layer] for layer in w.lin] == [[None, None, "file", "file"], ["file"] * 4]
    assert [[lin.mode for lin in layer] for layer in w.lin] == [[4, 4, Q4, Q4], [Q4] * 4]
    assert w.proj.mode in (2, 4)  # the vocabulary projection in int8
    assert said == [KEPT_6_OF_8]
    rows = blockwise_is_greedy(model, tok, pw_model)
    # q4's decoder output is near fp32's (4-bit weights, 8-bit activations: a few per cent here)
    with torch.inference_mode():
        src = torch.full((len(rows), max(map(len, rows))), -1, dtype=torch.long)
        for r, p in enumerate(rows):
            src[r, : len(p)] = torch.tensor(p)
        _w = pw_model.get(model)
        state = model.start_decoding(model.encode(src, _w), 8, weights=_w)
        h = model.decode(state, state.first)[:, 0]
        ref = torch.stack([model.features(torch.tensor([p]))[0, -1] for p in rows])
    assert float((h - ref).norm() / ref.norm()) < 0.08  # (int8: 0.037, this q4: 0.036)


def test_a_k_quant_gguf_keeps_its_q4_k_blocks_and_decodes_exactly(tmp_path, monkeypatch, caplog):
    """Q4_K tensors keep their 4-bit codes and 6-bit scales in q4 (mode Q4QK); Q6_K runs in int8; exact blockwise
    decoding is q4 greedy decoding, alone and in a batch."""
    qtypes = {"blk.0.attn": "Q4_K", "blk.0.ffn": "Q6_K", "blk.1": "Q4_K", "output": "Q8_0"}
    model, tok, w, pw_model, said = q4_gguf(
        tmp_path, monkeypatch, caplog, qtypes, default="F16", d=256, d_ff=512, heads=4, kv=2, seed=3
    )
    assert [[lin.mode for lin in layer] for layer in w.lin] == [[Q4K, Q4K, 4, 4], [Q4K] * 4]
    assert said == [KEPT_6_OF_8]
    blockwise_is_greedy(model, tok, pw_model)


AVX2_Q4 = """
import os, torch
from bpd_train.engine.fastlinear import PackedLinear, native_kernels
assert native_kernels().isa() == "avx2" and not native_kernels().q4q_vnni()
g = torch.Generator().manual_seed(0)
w, b, x = torch.randn(300, 96, generator=g), torch.randn(300, generator=g), torch.randn(11, 96, generator=g)
lin = PackedLinear(w, b, "q4")
assert lin.mode == 7
y = lin(x)
for rows in range(1, 10):
    assert torch.equal(lin(x[:rows]), y[:rows])
    assert all(torch.equal(lin(x[i:i + 1])[0], y[i]) for i in range(rows))
torch.save(y, os.environ["AVX2_Q4_OUT"])
print("ok")
"""


@pytest.mark.slow
def test_the_avx2_build_gives_this_cpus_q4_bits(tmp_path):
    """BPD_NATIVE_MARCH=haswell builds the AVX2 kernels (vpmaddubsw): row-exact, and the same bits as this CPU's
    build (VNNI where present): the integer sums are exact and the float steps the same."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "avx2_q4.pt"
    env = {**os.environ, "BPD_NATIVE_MARCH": "haswell", "PYTHONPATH": str(root), "AVX2_Q4_OUT": str(out)}
    proc = subprocess.run(
        [sys.executable, "-c", AVX2_Q4], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(300, 96, generator=g), torch.randn(300, generator=g), torch.randn(11, 96, generator=g)
    assert torch.equal(torch.load(out, weights_only=True), PackedLinear(w, b, "q4")(x))


def test_q4_is_a_decode_dtype_everywhere():
    assert DecodeSettings(dtype="q4").dtype == "q4"
    assert DecodeSettings(dtype="Q4").dtype == "q4" and DecodeOptions(dtype="q4").dtype == "q4"  # options: derived data
