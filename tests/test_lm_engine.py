"""Decoder-only models on the native CPU decode engine (engine/lm.py LMDecodeWeights, engine/csrc/lm.h): packed
linears in fp32 / bf16 / int8, the native layer stack (RMSNorm, rotary with per-row positions, GQA, SwiGLU, biases) with
row-exact attention, native greedy and exact blockwise loops (one row and a batch), draft vocabulary and proposal
precision, several stop ids. Exact blockwise must give greedy's output of the same precision, token for token, on random
models, random heads and random prompts of different lengths (left padding)."""

import itertools

import numpy as np
import pytest
import torch

from bpd_train.decode_settings import DecodeSettings
from bpd_train.decoding import Distance, TopK, beam_search, blockwise, greedy
from bpd_train.engine.fastlinear import native_kernels
from bpd_train.engine.lm import LMDecodeWeights
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights, default_weights
from bpd_train.model import LMConfig, LMModel

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native decode kernels not built on this machine")

DTYPES = ["fp32", "bf16", "int8"]
MODE = {0: "fp32", 1: "bf16", 3: "bf16", 5: "bf16", 2: "int8", 4: "int8"}  # fastlinear.PackedLinear.mode


def lm(seed=0, heads="bpd", k=4, vocab=12, n_heads=4, kv=2, qkv_bias=False, tie=True, std=0.4, **kw):
    """A small random LM. A small vocabulary and random (non-zero) heads: proposals are accepted now and then,
    so multi-token blocks are accepted and rejected ones rolled back."""
    torch.manual_seed(seed)
    c = LMConfig(
        vocab_size=vocab,
        d_model=32,
        n_layers=2,
        n_heads=n_heads,
        n_kv_heads=kv,
        d_ff=48,
        block_size=k,
        heads=heads,
        head_d_hidden=16,
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
            p.normal_(0, std if p.dim() >= 2 else 0.1)
        for layer in m.layers:  # norms near one, as trained models have
            layer.norm1.weight.add_(1.0)
            layer.norm2.weight.add_(1.0)
        m.norm.weight.add_(1.0)
    return m


def prompts(n, seed, vocab=12, longest=9):
    g = np.random.default_rng(seed)
    return [g.integers(3, vocab, size=int(g.integers(1, longest + 1))).tolist() for _ in range(n)]


def padded(rows):
    """Token lists -> [R, longest] right-padded with -1 (the encode input)."""
    out = torch.full((len(rows), max(map(len, rows))), -1, dtype=torch.long)
    for r, p in enumerate(rows):
        out[r, : len(p)] = torch.tensor(p)
    return out


CONFIGS = [  # (head type, GQA kv heads, qkv bias, tied output, extra config)
    ("bpd", 2, False, True, {}),
    ("bpd", 4, True, False, {}),  # MHA, q/k/v and o biases, separate lm_head
    ("medusa", 1, True, True, {}),  # multi-query attention
    ("medusa", 2, False, False, {"medusa_layers": 2}),
    ("chain", 2, False, True, {}),  # heads that read the token before their own
    ("bpd", 2, True, True, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("bpd", 2, False, False, {"head_dim": 16}),  # n_heads * head_dim != d_model
    (
        "bpd",
        4,
        False,
        True,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
]


def test_the_native_step_computes_the_torch_step():
    # prefill (left-padded prompts of different lengths), one token, then a block: the native stack's decoder output
    # against the full-sequence torch forward of each row alone (rounding only)
    for i, (heads, kv, bias, tie, extra) in enumerate(CONFIGS):
        m = lm(i, heads, kv=kv, qkv_bias=bias, tie=tie, **extra)
        rows = prompts(4, i)
        w = default_weights(m).get(m)
        assert isinstance(w, LMDecodeWeights) and w.native_layers is not None
        with torch.inference_mode():
            src = padded(rows)
            _w = default_weights(m).get(m)
            state = m.start_decoding(m.encode(src, _w), 8, weights=_w)
            h1 = m.decode(state, state.first)  # [4,1,D]
            state.lengths = 1
            nxt = torch.randint(3, 12, (4, 3))
            h2 = m.decode(state, nxt)  # [4,3,D]
            for r, p in enumerate(rows):
                full = m.features(torch.tensor([p + nxt[r].tolist()]))[0]  # [L+3,D]
                torch.testing.assert_close(h1[r, 0], full[len(p) - 1], atol=3e-4, rtol=1e-3)
                torch.testing.assert_close(h2[r], full[len(p) :], atol=3e-4, rtol=1e-3)
                logits = m.heads_logits(full[-1])
                torch.testing.assert_close(w.logits(full[-1], 0, m.config.block_size), logits, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_bit_identical_alone_or_inside_a_block(dtype):
    # row-exact linears and attention: feeding k tokens at once gives each the bits of feeding them one at a time,
    # whatever the batch mates (torch's SDPA does not promise that)
    m = lm(1, "bpd", kv=2, qkv_bias=True)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype))
    rows = prompts(3, 1)
    src = padded(rows)
    toks = torch.randint(3, 12, (3, 5))
    with torch.inference_mode():
        _w = pw_m.get(m)
        a = m.start_decoding(m.encode(src, _w), 8, weights=_w)
        block = m.decode(a, toks)  # [3,5,D]
        _w = pw_m.get(m)
        b = m.start_decoding(m.encode(src, _w), 8, weights=_w)
        for j in range(5):
            b.lengths = j
            assert torch.equal(m.decode(b, toks[:, j : j + 1])[:, 0], block[:, j])
        for r, p in enumerate(rows):  # and alone, no left padding
            _w = pw_m.get(m)
            c = m.start_decoding(m.encode(torch.tensor([p]), _w), 8, weights=_w)
            assert torch.equal(m.decode(c, toks[r : r + 1])[0], block[r])
        w = pw_m.get(m)
        assert torch.equal(w.head1_argmax(block), w.head1_argmax(block.reshape(15, -1)).view(3, 5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_blockwise_equals_greedy_of_the_same_precision(dtype):
    accepted = 0
    for i, (heads, kv, bias, tie, extra) in enumerate(CONFIGS):
        m = lm(10 + i, heads, kv=kv, qkv_bias=bias, tie=tie, **extra)
        pw_m = PackedWeights(DecodeOptions(dtype=dtype))
        for batch, seed in [(1, i), (5, 100 + i)]:
            src = prompts(batch, seed)
            g = greedy(m, src, max_len=24, weights=pw_m)
            for k in (2, 4):
                r = blockwise(m, src, block_size=k, max_len=24, weights=pw_m)
                assert r.tokens == g.tokens, f"config {i} dtype {dtype} batch {batch} k {k}"
                assert r.calls <= g.calls and max(r.accepted_hist, default=1) <= k
                accepted += max(r.accepted_hist, default=1) > 1
            alone = [greedy(m, [p], max_len=24, weights=pw_m).tokens[0] for p in src]
            assert alone == g.tokens  # rows decode as they would alone
    assert accepted >= 6  # multi-token blocks were accepted


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_loops_take_the_same_steps_as_the_one_step_loops(dtype, monkeypatch):
    # greedy_to_end / block_steps / batch_block_steps against the Python steps over the same native pieces (the
    # loops switched off): same tokens, same decoder calls, same accepted blocks (greedy's rows leave inside its call)
    for i, (heads, batch) in enumerate(
        [("bpd", 1), ("medusa", 1), ("bpd", 4), ("medusa", 6), ("chain", 1), ("chain", 5)]
    ):
        m = lm(20 + i, heads, qkv_bias=i % 2 == 0, tie=i < 2)
        pw_m = PackedWeights(DecodeOptions(dtype=dtype))
        src = prompts(batch, 20 + i)
        w = pw_m.get(m)
        assert w.native_loop is not None
        calls = {"block": 0, "batch": 0, "greedy": 0}
        cls = type(w)
        for name, attr in [("block", "block_steps"), ("batch", "batch_block_steps"), ("greedy", "greedy_to_end")]:
            real = getattr(cls, attr)
            monkeypatch.setattr(
                cls, attr, lambda *a, _r=real, _n=name, **kw: calls.__setitem__(_n, calls[_n] + 1) or _r(*a, **kw)
            )
        rule = (None, TopK(2), Distance(1))[i % 3]  # (None: Exact) every rule the loops know
        g, b = greedy(m, src, max_len=20, weights=pw_m), blockwise(m, src, max_len=20, accept=rule, weights=pw_m)
        assert calls["greedy"] and (calls["block"] if batch == 1 else calls["batch"])
        loop, w.native_loop = w.native_loop, None  # one step per call, through model.decode
        try:
            g1, b1 = greedy(m, src, max_len=20, weights=pw_m), blockwise(m, src, max_len=20, accept=rule, weights=pw_m)
        finally:
            w.native_loop = loop
        monkeypatch.undo()
        assert g.tokens == g1.tokens and b.tokens == b1.tokens, f"case {i}"
        assert rule is not None or b.tokens == g.tokens
        assert (g.calls, g.accepted_hist) == (g1.calls, g1.accepted_hist)
        assert (b.calls, b.accepted_hist) == (b1.calls, b1.accepted_hist)


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_chained_heads_propose_natively_what_the_torch_path_proposes(dtype):
    # csrc/lm.h lm_propose_chain against engine/lm.py's torch steps over the same packed linears (bit for bit), and
    # against LMModel's own chain (the model's argmax over the full vocabulary, fp32: the same ids); each head reads
    # the token before its own target, so a different first token changes what the heads propose
    m = lm(7, "chain", vocab=40, std=0.3)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype, draft_vocab=tuple(range(0, 40, 3)) if dtype == "int8" else None))
    w = pw_m.get(m)
    h = torch.randn(6, 32)
    first = torch.randint(3, 40, (6,))
    native = w.propose(h, 1, 4, first)
    assert native.shape == (6, 3) and torch.equal(native, w.propose_torch(h, 1, 4, first))
    own = w.propose(h, 1, 4)  # first computed: head 1's argmax
    assert torch.equal(own, w.propose(h, 1, 4, w.head1_argmax(h)))
    assert torch.equal(w.propose(h, 2, 4, own[:, 0]), own[:, 1:])  # the chain goes on from head 2's proposal
    other = w.propose(h, 1, 4, (first + 1) % 40)
    assert not torch.equal(native, other)
    if dtype == "fp32":
        with torch.no_grad():
            logits = torch.stack([m.head_logits(h, i) for i in range(1, 4)], dim=1)  # the model's own chain
        assert torch.equal(own, logits.argmax(-1))
        assert torch.equal(m.head_logits(h, 2, own[:, 0]), m.head_logits(h, 2))


def test_several_stop_ids_end_rows_in_the_native_loops(monkeypatch):
    m = lm(3, "bpd", vocab=12, eos_ids=[2, 3, 4])
    src = prompts(6, 3)
    w = default_weights(m).get(m)
    seen = []
    real = type(w).block_steps
    monkeypatch.setattr(type(w), "block_steps", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    g = greedy(m, src, max_len=30)
    assert any(len(t) < 30 for t in g.tokens)  # some rows ended on a stop id
    assert not any(t in (2, 3, 4) for row in g.tokens for t in row)  # the stop id is cut, none before it
    assert blockwise(m, src, max_len=30).tokens == g.tokens
    for p, want in zip(src, g.tokens):
        assert blockwise(m, [p], max_len=30).tokens[0] == want
    assert seen  # ... through the native block loop


@pytest.mark.parametrize("dtype", DTYPES)
def test_draft_vocabulary_and_proposal_precision_keep_the_output(dtype):
    for heads in ("bpd", "medusa", "chain"):
        m = lm(5, heads, vocab=40, std=0.3)
        pw_m = PackedWeights(DecodeOptions(dtype=dtype))
        src = prompts(4, 5, vocab=40)
        want = greedy(m, src, max_len=20, weights=pw_m).tokens
        for opts in [
            dict(draft_vocab=tuple(range(0, 40, 2))),
            dict(proposal_dtype="int8"),
            dict(draft_vocab=tuple(range(10)), proposal_dtype="bf16"),
        ]:
            pw_m = PackedWeights(DecodeOptions(dtype=dtype, **opts))
            w = pw_m.get(m)
            if "draft_vocab" in opts:
                ids = w.propose(torch.randn(3, 32), 1, 4)
                assert set(ids.flatten().tolist()) <= set(opts["draft_vocab"])
            assert MODE[w.proj.mode] == dtype  # head 1 verifies in `dtype`
            assert MODE[w.prop_proj.mode] == opts.get("proposal_dtype", dtype)
            assert blockwise(m, src, max_len=20, weights=pw_m).tokens == want
            assert [blockwise(m, [p], max_len=20, weights=pw_m).tokens[0] for p in src] == want
            assert greedy(m, src, max_len=20, weights=pw_m).tokens == want  # head 1 stays in `dtype`


def test_adaptive_beam_search_and_other_rules_run_on_the_native_weights():
    from bpd_train.decoding import TopK

    m = lm(6, "medusa")
    pw_m = PackedWeights(DecodeOptions(dtype="bf16"))
    src = prompts(4, 6)
    want = greedy(m, src, max_len=16, weights=pw_m).tokens
    assert blockwise(m, src, max_len=16, adaptive=True, weights=pw_m).tokens == want
    assert [blockwise(m, [p], max_len=16, adaptive=True, weights=pw_m).tokens[0] for p in src] == want
    assert blockwise(m, src, max_len=16, accept=TopK(1), weights=pw_m).tokens == want
    assert beam_search(m, src, beam_size=1, length_penalty=0.0, max_len=16, weights=pw_m).tokens == want
    assert len(beam_search(m, src, beam_size=3, max_len=16, weights=pw_m).tokens) == 4


def test_weights_are_repacked_after_a_parameter_changes():
    m = lm(7, "bpd")
    src = prompts(3, 7)
    w1 = default_weights(m).get(m)
    before = greedy(m, src, max_len=12).tokens
    with torch.no_grad():
        m.layers[0].mlp.down.weight.mul_(-1.0)
    w2 = default_weights(m).get(m)
    assert w2 is not w1
    after = greedy(m, src, max_len=12).tokens
    assert after == blockwise(m, src, max_len=12).tokens and after != before


def test_weights_packed_while_the_kernels_load_are_packed_once(monkeypatch):
    """A process's first decoder loads the native kernels while it packs its weights, and the cache key is read
    natively from then on: the weights must be cached under that key (under the key read before, every first
    decoding call packed them twice)."""
    from bpd_train.engine import packed
    from bpd_train.engine import weights as wmod

    loaded = []
    real_loaded, real_build = packed.loaded_kernels, wmod.build_step_weights
    monkeypatch.setattr(packed, "loaded_kernels", lambda: real_loaded() if loaded else None)

    def build(model, options):  # building is what loads the kernels
        loaded.append(1)
        return real_build(model, options)

    monkeypatch.setattr(wmod, "build_step_weights", build)
    m = lm(7, "medusa")
    pw = PackedWeights(DecodeOptions(dtype="int8"))
    w = pw.get(m)
    assert pw.get(m) is w and len(loaded) == 1
    with torch.no_grad():
        m.layers[0].mlp.down.weight.mul_(-1.0)
    assert pw.get(m) is not w and len(loaded) == 2  # a changed parameter still repacks


def test_the_kv_cache_is_half_precision_below_fp32_and_read_within_its_rounding(monkeypatch):
    """Below fp32 the native engine keeps K/V in float16 (half the bytes attention reads a token); fp32 keeps float32
    (and BPD_KV_HALF=0 any precision). The same tokens decoded over a half cache land as near fp32's outputs as over a
    float32 one; blockwise stays greedy's (the other tests run half caches)."""
    m = lm(9, "medusa")
    src = prompts(3, 9, longest=12)
    ids = padded(src)
    toks = torch.randint(3, 12, (3, 5), generator=torch.Generator().manual_seed(9))

    def run(dtype, half):
        monkeypatch.setenv("BPD_KV_HALF", "1" if half else "0")
        w = PackedWeights(DecodeOptions(dtype=dtype)).get(m)
        with torch.inference_mode():
            st = m.start_decoding(m.encode(ids, w), 8, weights=w)
            return st.self_kv.dtype, m.decode(st, toks)

    (d_half, h_half), (d_full, h_full), (d_32, h_32) = run("int8", True), run("int8", False), run("fp32", True)
    assert (d_half, d_full, d_32) == (torch.float16, torch.float32, torch.float32)
    assert not torch.equal(h_half, h_full)  # the half cache is what attention read
    # as near fp32's outputs as with a float32 cache: int8's own rounding of the activations is what parts them
    assert (h_half - h_32).norm() < 1.1 * (h_full - h_32).norm()


def test_the_native_prefix_does_not_depend_on_the_batch():
    # every combination of prompts: a row's tokens never depend on its batch mates or on their lengths
    m = lm(8, "bpd", qkv_bias=True)
    src = prompts(4, 8, longest=12)
    alone = [greedy(m, [p], max_len=16).tokens[0] for p in src]
    for pair in itertools.combinations(range(4), 2):
        got = greedy(m, [src[j] for j in pair], max_len=16).tokens
        assert got == [alone[j] for j in pair]
        assert blockwise(m, [src[j] for j in pair], max_len=16).tokens == got


@pytest.mark.parametrize("dtype", DTYPES)
def test_bpd_heads_with_their_own_head1_take_python_steps_over_the_native_pieces(dtype):
    m = lm(9, "bpd", identity_p1=False)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype))
    w = pw_m.get(m)
    assert w.native_layers is not None and w.native_loop is None  # native stack, Python loops
    src = prompts(4, 9)
    g = greedy(m, src, max_len=16, weights=pw_m)
    assert blockwise(m, src, max_len=16, weights=pw_m).tokens == g.tokens
    assert [blockwise(m, [p], max_len=16, weights=pw_m).tokens[0] for p in src] == g.tokens
    h = torch.randn(5, 32)
    assert torch.equal(w.head1_argmax(h), w.logits(h, 0, 1)[:, 0].argmax(-1))


def test_lazy_verification_takes_the_same_steps_whatever_the_group():
    for heads, batch in [("bpd", 1), ("medusa", 1), ("bpd", 5)]:
        m = lm(11, heads)
        src = prompts(batch, 11)
        w = default_weights(m).get(m)
        got = []
        for group in (1, 2, 3, 8):
            w.verify_group = w.batch_verify_group = group
            r = blockwise(m, src, max_len=20)
            got.append((r.tokens, r.calls, r.accepted_hist))
        assert all(g == got[0] for g in got) and got[0][0] == greedy(m, src, max_len=20).tokens


def test_the_torch_engine_still_decodes_decoder_only_models_in_fp32(tmp_path):
    # BPD_DECODE_ENGINE=torch (as on CUDA): LMModel's torch path, fp32 only, the decoders unchanged
    import os
    import subprocess
    import sys

    code = (
        "import torch, pytest\n"
        "from tests.test_lm_engine import lm, prompts\n"
        "from bpd_train.decoding import greedy, blockwise\n"
        "from bpd_train.engine.packed import DecodeOptions\n"
        "from bpd_train.engine.weights import PackedWeights, default_weights\n"
        "m = lm(12, 'medusa', qkv_bias=True)\n"
        "src = prompts(3, 12)\n"
        "assert default_weights(m).get(m).native_layers is None\n"
        "assert blockwise(m, src, max_len=12).tokens == greedy(m, src, max_len=12).tokens\n"
        "c = lm(13, 'chain', vocab=40, std=0.3)\n"  # chained heads on the torch path too
        "src2 = prompts(3, 13, vocab=40)\n"
        "assert default_weights(c).get(c).native_layers is None\n"
        "assert blockwise(c, src2, max_len=12).tokens == greedy(c, src2, max_len=12).tokens\n"
        "assert [blockwise(c, [p], max_len=12).tokens[0] for p in src2] == greedy(c, src2, max_len=12).tokens\n"
        "with pytest.raises(ValueError, match='fp32'):\n"
        "    greedy(m, src, max_len=4, weights=PackedWeights(DecodeOptions(dtype='int8')))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "BPD_DECODE_ENGINE": "torch"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_a_bit(dtype):
    m = lm(13, "bpd", kv=2, qkv_bias=True)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype))
    src = prompts(4, 13)
    ids = padded(src)
    toks = torch.randint(3, 12, (4, 6))
    before = torch.get_num_threads()
    got = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            with torch.inference_mode():
                _w = pw_m.get(m)
                st = m.start_decoding(m.encode(ids, _w), 8, weights=_w)
                got.append(
                    (
                        m.decode(st, toks),
                        greedy(m, src, max_len=16, weights=pw_m).tokens,
                        blockwise(m, src, max_len=16, weights=pw_m).tokens,
                    )
                )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0][0], got[1][0]) and got[0][1] == got[1][1] == got[0][2] == got[1][2]


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_prompt_lookup_keeps_greedy_output_and_accepts_what_the_context_repeats(dtype):
    """DecodeOptions.lookup: proposals copied from the row's prompt and answer so far where its last tokens occurred
    before (heads elsewhere). Exact blockwise stays greedy's token for token, alone and in a batch (rows leave the
    batch as they end, their contexts with them); on a small vocabulary a random LM's answers repeat themselves,
    so lookup proposals are accepted more often than the heads' (fewer calls overall). Proposals from zero heads
    are the fed token again: without lookup little is accepted."""
    calls = {"off": 0, "on": 0}
    for i, (heads, kv, bias, tie, extra) in enumerate(CONFIGS[:4]):
        m = lm(30 + i, heads, kv=kv, qkv_bias=bias, tie=tie, **extra)
        with torch.no_grad():
            for p in m.head_parameters():
                p.zero_()
        for batch, seed in [(1, i), (1, 50 + i), (6, 200 + i)]:
            src = prompts(batch, seed, longest=12)
            pw_m = PackedWeights(DecodeOptions(dtype=dtype))
            g = greedy(m, src, max_len=40, weights=pw_m)
            off = blockwise(m, src, max_len=40, adaptive=False, weights=pw_m)
            pw_m = PackedWeights(DecodeOptions(dtype=dtype, lookup=3))
            on = blockwise(m, src, max_len=40, weights=pw_m)
            assert on.tokens == g.tokens == off.tokens, f"config {i} batch {batch}"
            assert max(on.accepted_hist, default=1) <= m.config.block_size
            calls["off"] += off.calls
            calls["on"] += on.calls
    assert calls["on"] < 0.9 * calls["off"], calls  # lookup's proposals were accepted
    with pytest.raises(ValueError, match="lookup"):
        DecodeSettings(lookup=-1)  # checked once, by the settings (DecodeOptions is derived data)


def _repeats_two(c: list[int]) -> bool:
    """Whether the context's last two tokens occurred before in it (a lookup match of >= 2 tokens)."""
    return len(c) >= 3 and any(c[j : j + 2] == c[-2:] for j in range(len(c) - 2))


@pytest.mark.parametrize("narrow", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_narrow_steps_follow_the_lookup_rule_and_keep_greedy_output(dtype, narrow):
    """DecodeOptions.narrow with lookup (one row, native loop): a step whose context (prompt and tokens so far)
    does not repeat its last two tokens feeds `narrow` rows (the fed token and the heads' first proposals), one
    that does feeds the full block. Driven one step per native call, the next fed block's width is checked against
    that rule on the context the loop saw; whole decodes stay greedy's, alone and in a batch (where narrow does not
    act), for Medusa and chained heads and BPD heads (fewer heads asked of a path that computes them all).
    narrow 1: such a step feeds the fed token alone (a greedy step)."""
    widths = set()
    for i, (heads, kv, bias, tie, extra) in enumerate([CONFIGS[0], CONFIGS[2], CONFIGS[4]]):
        m = lm(60 + i, heads, k=4, kv=kv, qkv_bias=bias, tie=tie, **extra)
        src = prompts(5, 70 + i, longest=10)
        pw_m = PackedWeights(DecodeOptions(dtype=dtype))
        g = greedy(m, src, max_len=40, weights=pw_m)
        pw_m = PackedWeights(DecodeOptions(dtype=dtype, lookup=3, narrow=narrow))
        assert blockwise(m, src, max_len=40, weights=pw_m).tokens == g.tokens, f"{heads} batch"
        assert [blockwise(m, [p], max_len=40, weights=pw_m).tokens[0] for p in src] == g.tokens, f"{heads} one row"
        w = pw_m.get(m)
        if w.native_loop is None:  # heads with their own head 1 take the Python steps: no narrowing there
            continue
        assert w.narrows
        for p in src:
            with torch.inference_mode():
                _w = pw_m.get(m)
                state = m.start_decoding(m.encode(torch.tensor([p]), _w), 48, weights=_w)
                x, out = state.first[0].numpy(), []
                for _ in range(30):
                    state.lengths = len(out)
                    toks, nc, nxt, hn, ended = w.block_steps(
                        m, state, x, 40 - len(out), 1, width=4, context=[np.array(p + out)]
                    )
                    out += toks.tolist()
                    if ended:
                        break
                    want = 4 if _repeats_two(p + out) else narrow
                    assert len(nxt) == want, (heads, p, out, nxt)
                    widths.add(want)
                    x = nxt
            gt = g.tokens[src.index(p)]  # (greedy's tokens stop before the end id the loop returns)
            assert out[: len(gt)] == gt[: len(out)] and len(out) <= len(gt) + 1
    assert widths == {narrow, 4}  # both kinds of step occurred
    with pytest.raises(ValueError, match="narrow"):
        DecodeSettings(narrow=-1)
