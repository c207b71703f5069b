"""The native decode loops (greedy, blockwise one row and batched) against the one-step loops: the same tokens and steps in
every precision, group size and transfer; exact blockwise equals greedy with every proposal option."""

import pytest
import torch

from bpd_train.decoding import Distance, Exact, TopK, beam_search, blockwise, greedy
from bpd_train.engine.fastlinear import PackedLinear, native_kernels
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights, default_weights
from tests.test_decoding import random_model, random_sources

native = pytest.mark.skipif(native_kernels() is None, reason="native decode kernels not built on this machine")


@pytest.mark.parametrize(
    "options",
    [
        DecodeOptions(dtype="bf16"),
        DecodeOptions(dtype="int8"),
        DecodeOptions(draft_vocab=(2, 3, 4)),
        DecodeOptions(dtype="int8", draft_vocab=(2, 3, 4, 5)),
        DecodeOptions(proposal_dtype="int8"),
        DecodeOptions(proposal_dtype="bf16"),
        DecodeOptions(draft_vocab=(2, 3, 4, 5), proposal_dtype="int8"),
    ],
)
def test_exact_blockwise_equals_greedy_of_the_same_precision_and_draft_vocabulary(options):
    accepted = 0.0
    for k, seed, batch in [(2, 1, 1), (4, 2, 5), (6, 3, 16), (8, 4, 1)]:
        m = random_model(k, seed, eos_bias=1.5)
        pw = PackedWeights(options)
        src = random_sources(batch, seed)
        g = greedy(m, src, max_len=(1.5, 4), weights=pw)
        r = blockwise(m, src, accept=Exact(), max_len=(1.5, 4), weights=pw)
        assert r.tokens == g.tokens, f"k={k} seed={seed} {options}"
        accepted = max(accepted, r.mean_accepted)
    assert accepted > 1.2  # the heads' proposals were really accepted


def test_low_precision_proposals_change_only_the_proposals():
    """proposal_dtype: heads 2..k and their projection in int8, head 1 (the output) in fp32 -- greedy's fp32
    tokens, with proposals that are the int8 path's (they differ from fp32 proposals somewhere)."""
    m = random_model(4, seed=7, eos_bias=1.5)
    src = random_sources(8, seed=7)
    g = greedy(m, src, max_len=(1.5, 4)).tokens
    h = torch.randn(64, m.config.d_model)
    w32 = default_weights(m).get(m)
    fp32_states, fp32_props = w32.states(h, 1, 4), w32.propose(h, 1, 4)
    pw_m = PackedWeights(DecodeOptions(proposal_dtype="int8"))
    w = pw_m.get(m)
    assert w.proj.mode == w32.proj.mode and w.prop_proj is not w.proj and w.prop_proj.mode != w.proj.mode
    int8_states = w.states(h, 1, 4)
    assert not torch.equal(int8_states, fp32_states) and torch.allclose(int8_states, fp32_states, atol=0.05)
    assert (w.propose(h, 1, 4) == fp32_props).float().mean() > 0.8
    r = blockwise(m, src, max_len=(1.5, 4), weights=pw_m)
    assert r.tokens == g and r.mean_accepted > 1.0
    assert greedy(m, src, max_len=(1.5, 4), weights=pw_m).tokens == g  # greedy never reads the proposal path


def test_draft_vocabulary_restricts_proposals_but_not_the_output():
    m = random_model(4, seed=5, eos_bias=1.5)
    src = random_sources(8, seed=5)
    full = blockwise(m, src, max_len=(1.5, 4))
    pw = PackedWeights(DecodeOptions(draft_vocab=(2,)))  # heads may only propose EOS
    w = pw.get(m)
    props = w.propose(torch.randn(5, m.config.d_model), 1, 4)
    assert props.unique().tolist() == [2]
    only_eos = blockwise(m, src, max_len=(1.5, 4), weights=pw)
    assert only_eos.tokens == full.tokens == greedy(m, src, max_len=(1.5, 4)).tokens
    assert only_eos.mean_accepted <= full.mean_accepted


@native
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_greedy_runs_a_batch_to_its_end_in_one_native_call(dtype, monkeypatch):
    """Greedy's native loop drops finished rows itself (the last row's cache moved into each freed place) and returns
    once every row has ended: the same tokens, calls and row steps as the loop that returned to Python at every row's
    end and reordered the cache there, on a padded batch whose rows end at different steps (EOS and max_len)."""
    from bpd_train.engine.mt import DecodeWeights

    m = random_model(4, seed=42, eos_bias=0.5)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype))
    src = torch.cat([random_sources(9, seed=11), torch.zeros(9, 3, dtype=torch.long)], 1)
    calls = []
    real = DecodeWeights.greedy_to_end
    monkeypatch.setattr(DecodeWeights, "greedy_to_end", lambda self, *a: calls.append(1) or real(self, *a))
    got = greedy(m, src, max_len=(1.5, 3), weights=pw_m)
    assert calls == [1]
    lens = [len(t) for t in got.tokens]
    assert len(set(lens)) > 2  # rows ended at several steps
    monkeypatch.setattr(DecodeWeights, "greedy_to_end", lambda self, *a: None)
    want = greedy(m, src, max_len=(1.5, 3), weights=pw_m)  # a native call per row end, cache reorders between
    assert (got.tokens, got.calls, got.accepted_hist) == (want.tokens, want.calls, want.accepted_hist)


def test_beam_search_runs_on_the_engine_in_every_precision():
    m = random_model(1, seed=9)
    src = random_sources(3, seed=9)
    ref = beam_search(m, src, beam_size=1, max_len=10).tokens
    assert ref == greedy(m, src, max_len=10).tokens
    pw_m = PackedWeights(DecodeOptions(dtype="int8"))
    assert (
        beam_search(m, src, beam_size=1, max_len=10, weights=pw_m).tokens
        == greedy(m, src, max_len=10, weights=pw_m).tokens
    )


def test_bad_options_are_refused():
    from bpd_train.decode_settings import DecodeError, DecodeSettings

    with pytest.raises(DecodeError, match="fp32, bf16, int8"):  # checked once, by the settings
        DecodeSettings(dtype="fp16")
    m = random_model(2, seed=1)
    pw = PackedWeights(DecodeOptions(dtype="fp16"))  # derived data given by hand: the packing still refuses it
    with pytest.raises(ValueError, match="fp32, bf16, int8"):
        pw.get(m)
    pw_m = PackedWeights(DecodeOptions(draft_vocab=(1, 99)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pw_m.get(m)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_native_loops_take_the_same_steps_as_the_one_step_loops(dtype):
    # greedy's and blockwise's native loops (DecodeWeights.greedy_steps / block_steps / batch_block_steps) against
    # the same decoders with the loops switched off: same tokens, same decoder calls, same accepted blocks (in every
    # precision: bf16 / int8 compute kernels must be as row-exact as fp32's), for every rule the loops know
    loose = 0
    for k, seed, batch in [(1, 1, 1), (4, 2, 4), (4, 3, 1), (8, 4, 1), (2, 5, 9)]:
        m = random_model(k, seed, eos_bias=1.5)
        pw_m = PackedWeights(DecodeOptions(dtype=dtype))
        src = random_sources(batch, seed)
        w = pw_m.get(m)
        rules = (Exact(), TopK(2), Distance(1))
        g, b = (
            greedy(m, src, max_len=(1.5, 4), weights=pw_m),
            [blockwise(m, src, accept=a, max_len=(1.5, 4), weights=pw_m) for a in rules],
        )
        assert (w.native_loop is not None) == (native_kernels() is not None)
        loop, w.native_loop = w.native_loop, None  # one step per call, through model.decode
        try:
            g1 = greedy(m, src, max_len=(1.5, 4), weights=pw_m)
            b1 = [blockwise(m, src, accept=a, max_len=(1.5, 4), weights=pw_m) for a in rules]
        finally:
            w.native_loop = loop
        assert g.tokens == g1.tokens == b[0].tokens == b1[0].tokens, f"k={k} seed={seed}"
        assert (g.calls, g.accepted_hist) == (g1.calls, g1.accepted_hist)
        for a, r, r1 in zip(rules, b, b1):
            assert (r.tokens, r.calls, r.accepted_hist) == (r1.tokens, r1.calls, r1.accepted_hist), f"{a} k={k}"
        loose += sum(r.tokens != g.tokens for r in b[1:])
    assert loose > 0  # (the loose rules did change some output)


@native
def test_lazy_verification_takes_the_same_steps_whatever_the_group():
    # block_steps computes head 1 a few positions at a time and stops at the first rejected proposal: how many
    # per pass must change the cost only, never the tokens or the accepted blocks
    for k, seed in [(4, 3), (8, 4)]:
        m = random_model(k, seed)
        src = random_sources(6, seed)
        w = default_weights(m).get(m)
        got = []
        for group in (1, 2, 3, 8):
            w.verify_group = group
            rs = [blockwise(m, src[i : i + 1], max_len=(2.0, 12)) for i in range(6)]  # one row: the native loop
            got.append([(r.tokens, r.calls, r.accepted_hist) for r in rs])
        assert all(g == got[0] for g in got), f"k={k} seed={seed}"
        assert [t for r in got[0] for t in r[0]] == greedy(m, src, max_len=(2.0, 12)).tokens
        assert max(b for r in got[0] for b in r[2]) > 1  # some proposals were accepted
        ext = w.ext
        ext.profile(True, True)
        for i in range(6):
            blockwise(m, src[i : i + 1], max_len=(2.0, 12))
        phases, steps = ext.profile(False, True)
        assert steps > 0 and phases[1] > 0 and phases[4] > 0  # decoder linears, head 1 were timed


def test_verification_groups_follow_the_projection_size_against_this_cpus_l2(monkeypatch):
    # one row: a projection outside L2 is read again by every lazy pass (all positions in one pass), one inside
    # costs its arithmetic (pairs); several rows: pairs unless the projection is memory-sized
    from bpd_train.engine import fastlinear
    from bpd_train.engine.packed import verify_groups

    assert fastlinear.l2_bytes() >= 64 << 10  # read from this machine (or the 1 MiB default)
    demo = torch.randn(4000, 128)  # the demo's output projection: 2 MB in fp32
    for l2, fp32, int8 in [(1280 << 10, 8, 2), (4 << 20, 2, 2), (256 << 10, 8, 8)]:
        monkeypatch.setattr(fastlinear, "_L2", l2)
        assert 4000 * 128 * 4 <= PackedLinear(demo).nbytes <= 4096 * 128 * 4  # (packed in blocks of 64 rows)
        assert verify_groups(PackedLinear(demo)) == (fp32, 2), l2
        assert verify_groups(PackedLinear(demo, dtype="int8"))[0] == int8, l2
        monkeypatch.delenv("BPD_SCREEN", raising=False)
        if native_kernels() is not None:  # screened: a pass reads the int8 copy
            assert verify_groups(PackedLinear(demo, screen=True))[0] == int8, l2
    assert verify_groups(PackedLinear(torch.randn(8200, 512)))[1] == 8  # 16.8 MB in fp32


@native
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_batched_native_loop_takes_the_same_steps_whatever_the_group(dtype, monkeypatch):
    # several rows: batch_block_steps verifies lazily across rows (only rows still accepting are projected
    # further) and stops after the step in which a row ends; tokens, calls and accepted blocks must not depend on
    # the group, and must be those of the one-step Python loop and of greedy decoding
    for k, seed in [(4, 3), (8, 4)]:
        m = random_model(k, seed, eos_bias=1.0)
        pw_m = PackedWeights(DecodeOptions(dtype=dtype))
        src = random_sources(7, seed)
        w = pw_m.get(m)
        calls = []
        real = type(w).batch_block_steps
        monkeypatch.setattr(type(w), "batch_block_steps", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        got = []
        for group in (1, 2, 3, 8):
            w.batch_verify_group = group
            r = blockwise(m, src, max_len=(2.0, 12), weights=pw_m)
            got.append((r.tokens, r.calls, r.accepted_hist))
        assert calls, "the batched native loop did not run"
        assert all(g == got[0] for g in got), f"k={k} seed={seed}"
        assert got[0][0] == greedy(m, src, max_len=(2.0, 12), weights=pw_m).tokens
        assert max(got[0][2]) > 1  # some proposals were accepted
        monkeypatch.setattr(type(w), "batch_block_steps", lambda *a, **kw: None)  # the one-step Python loop
        r = blockwise(m, src, max_len=(2.0, 12), weights=pw_m)
        assert (r.tokens, r.calls, r.accepted_hist) == got[0]
        monkeypatch.setattr(type(w), "batch_block_steps", real)


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_fused_proposals_in_one_transfer_take_the_same_steps(dtype, monkeypatch):
    """The Python step proposes at every block position inside the verify step ("fused": small models, and always on
    an accelerator, where the host round trip per step costs more) and copies head 1's tokens and the proposals to
    the host together; unfused, it proposes at the accepted position after the host decided it. Same steps."""
    import importlib

    bw = importlib.import_module("bpd_train.decoding.blockwise_step")  # the reference step
    from bpd_train.engine.mt import DecodeWeights

    monkeypatch.setattr(DecodeWeights, "batch_block_steps", lambda *a, **kw: None)  # the Python step loop
    m = random_model(4, 7, eos_bias=1.0)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype))
    src = random_sources(6, 7)
    got = []
    for macs in (0, 1 << 40):
        monkeypatch.setattr(bw, "FUSED_MACS", macs)
        r = blockwise(m, src, max_len=(2.0, 12), weights=pw_m)
        got.append((r.tokens, r.calls, r.accepted_hist))
    assert got[0] == got[1]
    assert got[0][0] == greedy(m, src, max_len=(2.0, 12), weights=pw_m).tokens and max(got[0][2]) > 1


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_chained_native_loops_take_the_same_steps_as_the_one_step_loops(dtype):
    for k, seed, batch in [(4, 2, 4), (4, 3, 1), (8, 4, 1), (2, 5, 9)]:
        m = random_model(k, seed, eos_bias=1.5, chain=True)
        pw_m = PackedWeights(DecodeOptions(dtype=dtype))
        src = random_sources(batch, seed)
        w = pw_m.get(m)
        b = blockwise(m, src, max_len=(1.5, 4), weights=pw_m)
        loop, w.native_loop = w.native_loop, None  # one step per call, through model.decode
        try:
            b1 = blockwise(m, src, max_len=(1.5, 4), weights=pw_m)
        finally:
            w.native_loop = loop
        assert b.tokens == b1.tokens == greedy(m, src, max_len=(1.5, 4), weights=pw_m).tokens, f"k={k} seed={seed}"
        assert (b.calls, b.accepted_hist) == (b1.calls, b1.accepted_hist)
