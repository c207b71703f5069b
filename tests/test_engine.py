"""The CPU decode engine (engine/fastlinear.py, engine/packed.py): packed kernels, the weight cache, precision,
draft vocabulary and adaptive feeding — every variant keeps exact blockwise == greedy."""

import copy

import pytest
import torch
import torch.nn.functional as F

from bpd_train.decoding import Exact, TopK, blockwise, greedy
from bpd_train.engine.fastlinear import PackedLinear, amx, bf16_compute, int8_compute, native_kernels
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights, default_weights
from bpd_train.model import BPDConfig, BPDModel
from tests.test_decoding import random_model, random_sources

native = pytest.mark.skipif(native_kernels() is None, reason="native decode kernels not built on this machine")


@native
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_packed_linear_rows_are_bit_identical_whatever_the_batch(dtype):
    torch.manual_seed(0)
    # ragged K and N, tiny and odd shapes, and larger K (the AVX2 kernels: several sub-block passes per row group)
    for n, k in [(100, 130), (64, 16), (300, 48), (5, 7), (70, 300), (600, 512)]:
        w, b = torch.randn(n, k), torch.randn(n)
        lin = PackedLinear(w, b, dtype)
        x = torch.randn(11, k)
        full = lin(x)
        assert full.shape == (11, n)
        for i in range(11):  # alone, and inside 4-row blocks or tails
            assert torch.equal(lin(x[i : i + 1])[0], full[i])
        assert torch.equal(lin(x[3:8])[2], full[5])
        ref = {"fp32": w, "bf16": w.to(torch.bfloat16).float()}.get(dtype)
        if ref is None:  # int8: per-row symmetric quantisation
            s = w.abs().amax(1, keepdim=True) / 127
            ref = torch.round(w / s).clamp(-127, 127) * s
        if lin.mode in (3, 5):  # bf16 compute: activations rounded too
            x = x.to(torch.bfloat16).float()
        elif lin.mode == 4:  # int8 compute: each row quantised on its own
            s = x.abs().amax(1, keepdim=True) / 127
            x = torch.round(x / s).clamp(-127, 127) * s
        torch.testing.assert_close(full, F.linear(x, ref, b), atol=1e-4, rtol=1e-4)


@native
@pytest.mark.parametrize("k", [16, 48, 130])
def test_low_precision_activations_are_rounded_as_torch_rounds_them(k):
    """Through an identity weight (exact in bf16 and int8) each output is one activation after the kernel's own
    rounding, bit for bit, in the vector loops and their scalar tails: bf16 compute gives torch's round-to-nearest-even
    bf16 (the dot instruction then reads subnormals as zero); int8 compute gives the row's symmetric quantisation
    q = round_half_even(x * (127 / amax)) times the weight (127, scale 1/127), the row scale amax / 127 and the weight
    scale, in that order."""
    torch.manual_seed(3)
    x = torch.randn(5, k) * 3
    x[0, :4] = torch.tensor([1e-40, -3e-39, 0.0, 65504.0])  # subnormals, zero, a large value
    x[1] = 0.0  # an all-zero row (scale 0)
    x[2] = (torch.arange(k) % 20 - 10) + 0.5  # halves: ties to even (amax 127: scale 1)
    x[2, 0] = 127.0
    eye = torch.eye(k)
    lin = PackedLinear(eye, None, "bf16")
    if lin.mode in (3, 5):
        ref = x.to(torch.bfloat16).float()
        ref[ref.abs() < torch.finfo(torch.float32).tiny] = 0.0  # vdpbf16ps / AMX read subnormals as zero
        assert torch.equal(lin(x), ref)
    lin = PackedLinear(eye, None, "int8")
    if lin.mode == 4:
        amax = x.abs().amax(1, keepdim=True)
        inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
        q = torch.round(x * inv).clamp(-127, 127)
        ref = q * 127 * (amax / 127) * lin.scale.view(1, -1)
        assert torch.equal(lin(x), ref)


@native
@pytest.mark.parametrize(
    "dtype, var, on, off", [("bf16", "BPD_BF16_COMPUTE", 3, 1), ("int8", "BPD_INT8_COMPUTE", 4, 2)]
)
def test_low_precision_compute_is_used_where_the_cpu_has_it_and_can_be_switched_off(monkeypatch, dtype, var, on, off):
    w = torch.randn(70, 33)
    available = {"bf16": bf16_compute, "int8": int8_compute}[dtype]
    if dtype == "bf16" and amx():
        on = 5  # bf16 compute on AMX tiles
    assert PackedLinear(w, None, dtype).mode == (on if available() else off)
    x = torch.randn(3, 33)
    low = PackedLinear(w, None, dtype)(x)
    monkeypatch.setenv(var, "0")
    assert not available()
    lin = PackedLinear(w, None, dtype)
    assert lin.mode == off  # weight-only kernels: activations stay fp32
    ref = {"bf16": w.to(torch.bfloat16).float(), "int8": None}[dtype]
    if ref is None:
        s = w.abs().amax(1, keepdim=True) / 127
        ref = torch.round(w / s).clamp(-127, 127) * s
    torch.testing.assert_close(lin(x), x @ ref.T, atol=1e-4, rtol=1e-4)
    assert (low - x @ w.T).abs().max() < 0.2  # the low-precision path is still the product


@native
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_packed_linear_thread_count_does_not_change_results(dtype):
    torch.manual_seed(1)
    lin = PackedLinear(torch.randn(4000, 64), None, dtype)
    x = torch.randn(3, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.fixture(params=["one", "two"])
def screen_passes(request):
    """The screen's passes: the build's own (AVX2: one int16 pass; else two int8 passes), then two int8 passes on
    every build (set_screen_two), so that both are tested on any CPU."""
    ext = native_kernels()
    ext.set_screen_two(request.param == "two")
    yield request.param
    ext.set_screen_two(False)


@native
def test_screened_argmax_is_the_fp32_argmax_whatever_the_ties(screen_passes):
    """Head 1's argmax through the int8 screen (an int8 pass with a proven error bound, the outputs that can win
    computed in fp32) is the fp32 projection's argmax: the first largest logit, ties and 1-ulp differences included,
    for ragged shapes, with and without a bias, for rows the screen cannot quantise (non-finite) and for flat logits
    (too many tokens can win: the full fp32 pass)."""
    ext = native_kernels()
    hits = 0
    for n, k, with_bias in [
        (4000, 128, True),
        (1000, 130, False),
        (77, 16, True),
        (300, 512, False),
        (5000, 24, True),
        (2000, 64, False),
    ]:
        torch.manual_seed(n + k)
        w = torch.randn(n, k) * 0.05
        if n == 2000:  # flat logits: too many candidates, full pass
            w = w[:1] + torch.randn(n, k) * 1e-4
        b = torch.randn(n) * 0.1 if with_bias else None
        w[7] = w[3]  # an exact tie: the first index wins
        w[11] = w[3]
        w[11, 0] = torch.nextafter(w[3, 0], torch.tensor(1.0))  # 1 ulp apart in one weight
        w[20] = w[3] * (1 + 2**-20)  # the same int8 copy, a slightly larger logit
        if b is not None:
            b[7] = b[11] = b[20] = b[3]
        full = PackedLinear(w, b, "fp32")
        scr = PackedLinear(w, b, "fp32", screen=True)
        assert scr.lin.screened() and not full.lin.screened()
        nw, nb = torch.rand(k) + 0.5, torch.randn(k) * 0.1
        x = torch.randn(3000, k) * 2
        x[:300] = w[3] * 30 + torch.randn(300, k) * 0.05  # rows aimed at the near-ties
        x[300] = float("inf")
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)  # rows split over threads, alone in one
            got = ext.norm_project_argmax(x, nw, nb, 1e-5, scr.lin)
            torch.set_num_threads(1)
            assert torch.equal(got, ext.norm_project_argmax(x, nw, nb, 1e-5, scr.lin))
        finally:
            torch.set_num_threads(threads)
        logits = full.lin(ext.layer_norm(x, nw, nb, 1e-5))
        assert torch.equal(got, ext.norm_project_argmax(x, nw, nb, 1e-5, full.lin))
        fin = torch.isfinite(logits).all(1)
        assert torch.equal(got[fin], logits[fin].argmax(-1)) and fin.sum() == len(x) - 1
        hits += int((got[:300] == 20).sum())
    assert hits > 0  # (the aimed rows did hit the near-tie)
    w[5, 3] = float("nan")  # no bound holds: not screened
    assert not PackedLinear(w, None, "fp32", screen=True).screened


@native
def test_screen_decides_rows_with_outlier_features_without_the_full_pass(screen_passes):
    """LLM hidden states have a few features far above the rest (max |x| near 20 rms): one int8 pass's activation
    error then lets hundreds of tokens through; the residual pass (or AVX2's int16 pass) keeps the candidates few, no
    row takes the full fp32 pass, and the argmax is the fp32 one."""
    ext = native_kernels()
    torch.manual_seed(0)
    n, k = 8192, 256
    w = torch.randn(n, k) * 0.05
    scr, full = PackedLinear(w, None, "fp32", screen=True), PackedLinear(w, None, "fp32")
    x = torch.randn(64, k)
    x[:, 5] *= 25.0  # outlier features, as in a real model's final states
    x[:, 77] *= -18.0
    nw, nb = torch.ones(k), torch.zeros(k)
    ext.screen_stats(True)
    got = ext.norm_project_argmax(x, nw, nb, 1e-5, scr.lin)
    rows, full_rows, cands = ext.screen_stats(True)
    assert torch.equal(got, ext.norm_project_argmax(x, nw, nb, 1e-5, full.lin))
    assert rows == len(x) and full_rows == 0
    assert cands / rows < n / 512, cands / rows  # (one pass: 43 a row here)


@native
def test_screened_projection_changes_no_token_and_no_step(monkeypatch):
    """fp32 decoding reads head 1 (and full-vocabulary fp32 proposals) through the int8 screen; BPD_SCREEN=0 turns
    it off. Greedy, exact and top-2 blockwise, chained heads, batch 1 and 6: the same tokens, calls and accepted
    blocks either way, encoder-decoder and decoder-only."""
    from tests.test_lm_engine import lm, prompts

    cases = [
        (random_model(4, 5, vocab=300), random_sources(6, 5)),
        (random_model(4, 6, vocab=50, chain=True), random_sources(6, 6)),
        (lm(3, vocab=40), prompts(6, 3, vocab=40)),
    ]
    for m, src in cases:
        runs = []
        for screen in ("1", "0"):
            monkeypatch.setenv("BPD_SCREEN", screen)
            mm = copy.deepcopy(m)
            assert default_weights(mm).get(mm).proj.lin.screened() == (screen == "1")
            got = []
            for rows in (src, src[:1]):
                got.append(greedy(mm, rows, max_len=20).tokens)
                for rule in (Exact(), TopK(2)):
                    r = blockwise(mm, rows, accept=rule, max_len=20)
                    got.append((r.tokens, r.calls, r.accepted_hist))
            runs.append(got)
        assert runs[0] == runs[1]
        assert runs[0][1][0] == runs[0][0]  # (exact blockwise is greedy)


def test_decode_weights_are_rebuilt_when_weights_change():
    m = random_model(4, seed=3)
    src = random_sources(4, seed=3)
    w0 = default_weights(m).get(m)
    assert default_weights(m).get(m) is w0  # cached while nothing changes
    other = random_model(4, seed=4)
    m.load_state_dict(other.state_dict())  # load_state_dict copies in place
    assert default_weights(m).get(m) is not w0
    assert greedy(m, src, max_len=12).tokens == greedy(other, src, max_len=12).tokens
    # an optimizer step (in-place update of one parameter)
    w1 = default_weights(m).get(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m.train()
    m(src, torch.ones(4, 3, dtype=torch.long)).sum().backward()
    opt.step()
    m.eval()
    assert default_weights(m).get(m) is not w1
    fresh = copy.deepcopy(m)  # a copy carries no packed weights: its own default ones are built anew
    assert default_weights(fresh).cached is None
    assert greedy(m, src, max_len=12).tokens == greedy(fresh, src, max_len=12).tokens
    # another precision is another set of packed weights
    pw_m = PackedWeights(DecodeOptions(dtype="bf16"))
    assert pw_m.get(m).options.dtype == "bf16"


@pytest.mark.parametrize("walk", ["native", "python"])
def test_weights_key_changes_with_every_kind_of_parameter_change(monkeypatch, walk):
    """The key the packed weights are cached under (read natively where the kernels are loaded, else in Python)
    changes with an in-place update, a new parameter object, a replaced submodule and a dtype change; it does not
    change while nothing does."""
    from bpd_train.engine import packed

    if walk == "python":
        monkeypatch.setattr(packed, "loaded_kernels", lambda: None)
    elif native_kernels() is None:
        pytest.skip("native decode kernels not built on this machine")
    m = random_model(4, seed=3)
    opts = DecodeOptions()
    key = packed.weights_key(m, opts)
    assert isinstance(key[1], bytes) == (walk == "native")
    assert packed.weights_key(m, opts) == key
    keys = [key]
    with torch.no_grad():
        m.decoder_layers[1].ffn.fc2.bias.add_(1.0)  # in place (optimizer step)
    keys.append(packed.weights_key(m, opts))
    fc1 = m.decoder_layers[0].ffn.fc1
    fc1.weight = torch.nn.Parameter(fc1.weight.detach().clone())  # a new parameter, same values
    keys.append(packed.weights_key(m, opts))
    m.decoder_layers[0].ffn.fc1 = copy.deepcopy(fc1)  # a replaced submodule
    keys.append(packed.weights_key(m, opts))
    m.to(torch.float64)
    keys.append(packed.weights_key(m, opts))
    assert len(set(keys)) == len(keys)
    assert packed.weights_key(m, DecodeOptions(dtype="bf16")) != keys[-1]


@native
def test_int8_on_amx_tiles_gives_the_bits_of_the_vnni_kernels():
    """int8 sums are exact integers: the AMX kernels (4 rows and more) and vpdpbusd give the same bits, so the engine
    picks by row count; bf16 on AMX is its own precision (mode 5), row-exact whatever the batch."""
    ext = native_kernels()
    if not ext.amx():
        pytest.skip("no AMX on this CPU")
    torch.manual_seed(0)
    for n, k in [(100, 130), (4000, 128), (70, 300)]:
        w, b = torch.randn(n, k), torch.randn(n)
        x = torch.randn(37, k)
        lin = PackedLinear(w, b, "int8")
        assert lin.mode == 4
        tiles = lin(x)
        ext.set_amx(False)
        try:
            vnni = lin(x)
        finally:
            ext.set_amx(True)
        assert torch.equal(tiles, vnni)
        lb = PackedLinear(w, b, "bf16")
        assert lb.mode == 5
        full = lb(x)
        assert all(torch.equal(lb(x[i : i + 1])[0], full[i]) for i in range(37))
        assert torch.equal(lb(x[3:30])[5], full[8])


@native
def test_native_kernels_run_on_the_threads_torch_is_given():
    """The extension is built with OpenMP: at::parallel_for is header code that is serial without it (then every
    "2 threads" run of our kernels used one). One parallel_for over 8 chunks uses 2 threads at 2, 1 at 1."""
    import os

    from bpd_train.engine.fastlinear import native_kernels

    ext = native_kernels()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ext.parallel_threads(8) == 1
        if (os.cpu_count() or 1) >= 2:
            torch.set_num_threads(2)
            assert ext.parallel_threads(8) == 2
    finally:
        torch.set_num_threads(before)


AVX2_CHECK = """
import torch
from bpd_train.decoding import blockwise, greedy
from bpd_train.engine.fastlinear import PackedLinear, engine_name
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights
from tests.test_decoding import EOS, random_model, random_sources
assert engine_name() == "native-avx2", engine_name()
import os, sys
torch.manual_seed(0)
w8, b8, x8 = torch.randn(300, 70), torch.randn(300), torch.randn(11, 70)
lin8 = PackedLinear(w8, b8, "int8")
assert lin8.mode == 4, lin8.mode                     # int8 x int8 on AVX2 too (vpmaddwd)
torch.save(lin8(x8), os.environ["AVX2_INT8_OUT"])
for dt in ("fp32", "bf16", "int8"):
    lin = PackedLinear(torch.randn(300, 70), torch.randn(300), dt)
    x = torch.randn(11, 70)
    full = lin(x)
    assert all(torch.equal(lin(x[i:i + 1])[0], full[i]) for i in range(11)), dt
    for k, seed, batch in [(4, 2, 1), (4, 3, 5)]:
        m = random_model(k, seed, eos_bias=1.5)
        pw_m = PackedWeights(DecodeOptions(dtype=dt))
        src = random_sources(batch, seed)
        g = greedy(m, src, max_len=(1.5, 4), weights=pw_m)
        assert blockwise(m, src, max_len=(1.5, 4), weights=pw_m).tokens == g.tokens, (dt, k, seed)
        assert blockwise(m, src, max_len=(1.5, 4), adaptive=True, weights=pw_m).tokens == g.tokens, (dt, k, seed)
from tests.test_engine import test_every_head_size_gives_a_token_the_same_bits_in_any_block_and_matches_torch as heads
for d in (16, 48, 64, 128, 256):                     # attention's unrolled and run-time head sizes
    heads(d, 2)
from tests.test_engine import test_screened_argmax_is_the_fp32_argmax_whatever_the_ties as screened
screened("own")                                       # the AVX2 packing of the exact rows
print("ok")
"""


@native
@pytest.mark.slow
def test_avx2_kernels_built_on_this_cpu_are_row_exact(tmp_path):
    """BPD_NATIVE_MARCH=haswell builds the AVX2 kernels (the AVX2-only CPUs' engine) on any x86 CPU: every row the
    same bits whatever the batch, and exact blockwise == greedy in each precision, with the batched native loop;
    attention at every head size as on this CPU's build; the screened argmax is the fp32 argmax; int8 compute gives
    the bits of this CPU's own build."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "avx2_int8.pt"
    env = {**os.environ, "BPD_NATIVE_MARCH": "haswell", "PYTHONPATH": str(root), "AVX2_INT8_OUT": str(out)}
    proc = subprocess.run(
        [sys.executable, "-c", AVX2_CHECK], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    # int8 compute: the AVX2 kernels' integer sums are this CPU's kernels' (VNNI / AMX where present), bit for bit
    torch.manual_seed(0)
    w8, b8, x8 = torch.randn(300, 70), torch.randn(300), torch.randn(11, 70)
    lin8 = PackedLinear(w8, b8, "int8")
    assert lin8.mode == 4
    assert torch.equal(torch.load(out, weights_only=True), lin8(x8))


@native
def test_native_encoder_matches_torch_and_each_row_alone():
    """Decoding encodes on the native kernels (pre-norm ReLU encoders; fp32 whatever the decode dtype): the
    encoder output and the cross-attention keys/values match the torch path to rounding, every source's rows are
    bit-identical alone or in a padded batch, and greedy decoding still equals exact blockwise decoding on them.
    Outside a decoder (training; validation, even in inference mode) the torch path runs; a post-norm encoder
    decodes through torch."""
    from bpd_train.decoding.common import decoding_mode
    from bpd_train.model import BPDConfig, BPDModel

    torch.manual_seed(0)
    m = BPDModel(
        BPDConfig(
            vocab_size=50,
            d_model=32,
            n_heads=4,
            n_encoder_layers=2,
            n_decoder_layers=2,
            d_ff=64,
            block_size=3,
            dropout=0.0,
            max_positions=64,
        )
    ).eval()
    src = random_sources(5, seed=3, vocab=50, max_src=17)
    assert default_weights(m).get(m).native_encoder is not None
    with torch.no_grad():  # the torch path (training / validation)
        ref = m.encode(src)
        ref_kv = torch.stack([layer.cross_attn.memory_kv(ref.out) for layer in m.decoder_layers])
    with torch.inference_mode():  # (Lightning validates in inference mode)
        assert torch.equal(m.encode(src).out, ref.out)
    with decoding_mode(m) as w:
        got = m.encode(src, w)
        kv = m.start_decoding(got, 8, weights=w).mem_kv
        keep = src != m.config.pad_id
        assert torch.allclose(got.out[keep], ref.out[keep], atol=1e-5)
        assert torch.allclose(kv.permute(2, 4, 0, 1, 3, 5)[keep], ref_kv.permute(2, 4, 0, 1, 3, 5)[keep], atol=1e-5)
        assert not torch.equal(got.out[keep], ref.out[keep])  # (it is the native path: rounding differs)
        for r in range(src.shape[0]):
            n = int(keep[r].sum())
            alone = m.encode(src[r : r + 1, :n], w).out[0]
            assert torch.equal(alone, got.out[r, :n])
    assert blockwise(m, src, max_len=12).tokens == greedy(m, src, max_len=12).tokens
    post = copy.deepcopy(m)
    for layer in post.encoder_layers:
        layer.pre_norm = False
    assert default_weights(post).get(post).native_encoder is None


@native
@pytest.mark.parametrize("d_model, n_heads", [(16, 2), (32, 2), (48, 2), (64, 2), (128, 2), (256, 2)])
def test_every_head_size_gives_a_token_the_same_bits_in_any_block_and_matches_torch(d_model, n_heads):
    """Attention has unrolled code for head sizes 16/32/64/128 and run-time loops for the others (here 8, 24):
    a token's decoder output is bit-identical fed alone or inside blocks of 2..5 tokens (blockwise verification),
    in every row of a padded batch, and its head-1 logits match the torch path's (teacher forcing) to rounding."""
    from bpd_train.decoding.common import decoding_mode

    torch.manual_seed(d_model)
    m = BPDModel(
        BPDConfig(
            vocab_size=40,
            d_model=d_model,
            n_heads=n_heads,
            n_encoder_layers=1,
            n_decoder_layers=2,
            d_ff=2 * d_model,
            block_size=2,
            dropout=0.0,
            max_positions=64,
        )
    ).eval()
    src = random_sources(5, seed=d_model, vocab=40, max_src=21)
    toks = torch.randint(3, 40, (5, 12))
    with decoding_mode(m) as w:
        mem = m.encode(src, w)
        one = m.start_decoding(mem, 16, weights=w)
        h_one = []
        for j in range(12):
            h_one.append(m.decode(one, toks[:, j : j + 1]))
            one.lengths += 1
        h_one = torch.cat(h_one, 1)
        blk = m.start_decoding(mem, 16, weights=w)
        h_blk = []
        for lo, hi in [(0, 2), (2, 7), (7, 10), (10, 12)]:
            h_blk.append(m.decode(blk, toks[:, lo:hi]))
            blk.lengths += hi - lo
        assert torch.equal(torch.cat(h_blk, 1), h_one)
        logits = w.head1(h_one)  # [R,12,V]
    tgt = torch.cat([torch.full((5, 1), m.config.bos_id), toks], 1)
    with torch.no_grad():  # the torch path
        ref = m(src, tgt[:, 1:])[:, :, 0]
    assert torch.allclose(logits, ref, atol=2e-4, rtol=1e-4)


@native
def test_step_weights_are_checked_once_per_decoding_call():
    """Inside one decoding call the step weights are checked against the parameters once (decoding_mode hands
    them to the encoder, start_decoding and the decoders); a parameter changed between calls still rebuilds them."""
    import bpd_train.engine.weights as packed
    from bpd_train.decoding.common import decoding_mode

    m = random_model(3, seed=1)
    src = random_sources(2, seed=1)
    greedy(m, src, max_len=8)
    calls = []
    real = packed.weights_key
    packed.weights_key = lambda *a: calls.append(1) or real(*a)
    try:
        with decoding_mode(m) as w:
            m.start_decoding(m.encode(src, w), 8, weights=w)
            assert default_weights(m).cached is w
        assert calls == [1]
        greedy(m, src, max_len=8)  # a new call checks again, once
        assert len(calls) == 2
        with torch.no_grad():
            m.embed.weight.mul_(-1.0)
        assert default_weights(m).get(m) is not w  # a new parameter state: new weights
        assert blockwise(m, src, max_len=8).tokens == greedy(m, src, max_len=8).tokens
    finally:
        packed.weights_key = real


@pytest.mark.parametrize(
    "options",
    [DecodeOptions(), DecodeOptions(proposal_dtype="int8"), DecodeOptions(dtype="int8", draft_vocab=(2, 3, 4, 5))],
)
def test_chained_heads_keep_blockwise_equal_to_greedy_and_propose_alike_everywhere(options):
    """Chained heads (config.head_chain): each head 2..k reads the previous head's token. Exact blockwise (native
    block loop at batch 1, batched loop, adaptive) is greedy; the native proposal pass gives the Python pass's
    tokens, and the decoders' head-1 token is what the chain starts from (None: computed, the same)."""
    accepted = 0.0
    for k, seed, batch in [(2, 1, 1), (4, 2, 5), (6, 3, 16), (8, 4, 1)]:
        m = random_model(k, seed, eos_bias=1.5, chain=True)
        pw = PackedWeights(options)
        src = random_sources(batch, seed)
        g = greedy(m, src, max_len=(1.5, 4), weights=pw)
        r = blockwise(m, src, accept=Exact(), max_len=(1.5, 4), weights=pw)
        assert r.tokens == g.tokens, f"k={k} seed={seed} {options}"
        assert blockwise(m, src, max_len=(1.5, 4), adaptive=True, weights=pw).tokens == g.tokens
        assert [blockwise(m, src[i : i + 1], max_len=(1.5, 4), weights=pw).tokens[0] for i in range(batch)] == g.tokens
        accepted = max(accepted, r.mean_accepted)
        w = pw.get(m)
        h = torch.randn(40, m.config.d_model)
        first = w.head1_argmax(h)
        props = w.propose(h, 1, k, first)
        assert props.shape == (40, k - 1) and torch.equal(w.propose(h, 1, k), props)
        assert (w.chain is not None) == (native_kernels() is not None)
        chain, w.chain = w.chain, None  # the Python pass
        try:
            assert torch.equal(w.propose(h, 1, k, first), props)
            if k > 2:  # a later head alone, started from the previous head's token
                assert torch.equal(w.propose(h, 2, k, props[:, 0]), props[:, 1:])
        finally:
            w.chain = chain
        if options == DecodeOptions():  # the model's own chain (torch) proposes the same tokens
            assert (m.heads_logits(h, 1, k).argmax(-1) == props).float().mean() > 0.95
        # another head-1 token changes what the chain proposes (it really reads it)
        assert not torch.equal(w.propose(h, 1, k, (first + 1) % m.config.vocab_size), props)
    assert accepted > 1.2


@native
def test_engine_bench_times_the_screened_argmax_against_the_full_one():
    # bench/engine.py --kernels: head 1's argmax, fp32 against the int8 screen, same ids checked before timing
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "engine.py"
    spec = importlib.util.spec_from_file_location("bpd_bench_engine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.bench_argmax("demo", 300, 40, 1, (1, 4), 2)
    assert {(r["kernel"], r["rows"]) for r in rows} == {
        (k, n) for k in ("argmax fp32", "argmax fp32, int8 screen") for n in (1, 4)
    }
    assert all(r["us"] > 0 and r["shape"] == "300x40" for r in rows)


@native
def test_engine_bench_times_fp32_from_4bit_codes_with_the_fp32_bits():
    # bench/engine.py --kernels times the Q4F kernels on gguf-style 4-bit blocks: they must be such blocks, and the
    # 1-8 row passes it times give the plain fp32 kernels' bits
    import importlib.util
    from pathlib import Path

    from bpd_train.engine.fastlinear import native_kernels

    path = Path(__file__).resolve().parent.parent / "bench" / "engine.py"
    spec = importlib.util.spec_from_file_location("bpd_bench_engine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.q4_linear(64, 40) is None  # not whole groups of 32
    q4 = mod.q4_linear(96, 128)
    assert q4 is not None
    ext = native_kernels()
    ref = ext.Lin(ext.pack(mod.q4_weight(96, 128), 0)[0], None, None, 96, 128, 0)
    for r in (1, 2, 3, 4, 5, 8):
        x = torch.randn(r, 128)
        assert torch.equal(q4.lin(x), ref(x))
