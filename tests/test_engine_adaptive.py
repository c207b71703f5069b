"""Adaptive feeding on the native engine: calibration, probes, greedy stretches, buckets; the output stays greedy's."""

import pytest
import torch

from bpd_train.decoding import blockwise, greedy
from bpd_train.engine.fastlinear import native_kernels
from bpd_train.engine.weights import default_weights
from tests.test_decoding import EOS, random_model, random_sources

native = pytest.mark.skipif(native_kernels() is None, reason="native decode kernels not built on this machine")


def test_adaptive_feeding_keeps_the_output_and_stops_paying_for_useless_heads():
    m = random_model(6, seed=6, eos_bias=1.5)
    src = random_sources(16, seed=6)
    g = greedy(m, src, max_len=18)
    plain = blockwise(m, src, max_len=18)
    for threshold in (True, 0.2, 0.9):
        a = blockwise(m, src, max_len=18, adaptive=threshold)
        assert a.tokens == g.tokens == plain.tokens
    # heads that are never right (fc2 pushes every proposal elsewhere): adaptive falls back to one-token
    # steps with a probe every few steps, so it makes about as many calls as plain blockwise but feeds ~1 token
    bad = random_model(4, seed=7)
    with torch.no_grad():
        bad.heads.fc2.bias.fill_(0.0)
        bad.heads.fc2.weight.normal_(0, 5.0)
    src = random_sources(1, seed=8, max_src=9)
    g = greedy(bad, src, max_len=60)
    plain = blockwise(bad, src, max_len=60)
    for adaptive, key in ((0.5, ("adaptive", 4, 0.5)), (True, ("adaptive", 4, None))):
        a = blockwise(bad, src, max_len=60, adaptive=adaptive)
        assert a.tokens == plain.tokens == g.tokens
        offered = default_weights(bad).get(bad).stats[key].offered[1] - 1  # steps that fed proposal 1 (less the prior)
        assert plain.mean_accepted < 1.2  # the heads really are useless
        assert plain.calls > 20 and offered <= plain.calls // 4  # ... and adaptive mostly stops feeding them
    with pytest.raises(ValueError, match="adaptive"):
        blockwise(bad, src, adaptive=1.5)


def test_adaptive_on_a_model_without_heads_is_greedy():
    """A base model (k = 1) under adaptive feeding (decode.adaptive=true on every checkpoint of a run) decodes as
    greedy does instead of dividing by its zero proposal widths."""
    m = random_model(1, 4)
    src = random_sources(3, 4)
    for batch in (src[:1], src):
        assert blockwise(m, batch, max_len=(1.5, 4), adaptive=True).tokens == greedy(m, batch, max_len=(1.5, 4)).tokens


def test_adaptive_with_repeating_heads_in_a_batch_equals_greedy():
    # zeroed future heads repeat head 1's token: accepted only on repeats, so adaptive switches to greedy
    # stretches while other rows of the batch end (by EOS or max_len) in between (regression: a row that had
    # ended in the step before a stretch kept decoding)
    for seed in range(1, 6):
        m = random_model(4, seed=seed)
        with torch.no_grad():
            m.heads.fc2.weight.zero_()
            m.heads.fc2.bias.zero_()
        for batch in (5, 32):
            src = random_sources(batch, seed=8)
            g = greedy(m, src, max_len=(1.0, 4))
            assert blockwise(m, src, max_len=(1.0, 4), adaptive=True).tokens == g.tokens, f"seed={seed} b={batch}"


@native
@pytest.mark.parametrize("max_len", [10, 50])
def test_adaptive_calibration_times_every_width_mid_sentence_on_a_scratch_cache(max_len):
    """The one-row calibration runs each width where decoding mostly is (after CALIB_LEAD of the sentence's own
    greedy tokens, or its token limit where that is lower, fed head 1's token there and the heads' proposals, as a
    probe is), not from BOS; it prices every width and leaves the decoding itself unchanged."""
    import numpy as np

    from bpd_train.decoding.blockwise import CALIB_LEAD
    from bpd_train.decoding.common import prepare_source, start_tokens
    from bpd_train.engine.mt import DecodeWeights

    m = random_model(4, seed=5)
    src = random_sources(1, seed=5)
    want = greedy(m, src, max_len=max_len).tokens
    w = default_weights(m).get(m)
    seen = []
    real = DecodeWeights.block_steps

    def spy(self, model, state, x, room, max_steps, eos=None, width=None, **kw):
        seen.append((int(state.lengths), x.tolist(), eos))
        return real(self, model, state, x, room, max_steps, eos=eos, width=width, **kw)

    DecodeWeights.block_steps = spy
    try:
        assert blockwise(m, src, max_len=max_len, adaptive=True).tokens == want
    finally:
        DecodeWeights.block_steps = real
    lead = min(max_len, CALIB_LEAD)
    calib = [c for c in seen if c[2] == -1]  # the calibration's runs (no EOS: a fixed step count)
    assert calib and {c[0] for c in calib} == {lead}
    # what it feeds first: token number `lead` of a greedy run that does not stop at EOS
    with torch.inference_mode():
        _w = default_weights(m).get(m)
        st = m.start_decoding(m.encode(prepare_source(m, src), _w), lead + 4, weights=_w)
        toks, _ = w.greedy_steps(m, st, start_tokens(m, st, 1, st.self_kv.device)[:, 0], np.array([99]), lead, eos=-1)
    assert {c[1][0] for c in calib} == {int(toks[0, -1])}
    assert {len(c[1]) for c in calib} == {2, 3, 4}
    ad = next(iter(w.stats.values()))
    assert sorted(v for v, _ in ad.calib) == [1, 2, 3, 4] and ad.calib[(1, 1)] == 1.0


def _heads_that_never_pay(k: int = 4, seed: int = 3):
    """A random model whose future heads repeat head 1's token (their last layer zeroed): never accepted."""
    m = random_model(k, seed=seed)
    with torch.no_grad():
        m.heads.fc2.weight.zero_()
        m.heads.fc2.bias.zero_()
    return m


@native
def test_adaptive_settled_on_greedy_runs_greedy_itself():
    """One row whose controller has timed every width, found none that pays and has no probe due within the call:
    blockwise(adaptive=True) is greedy() itself (same tokens, calls and histogram; the blockwise loop's bookkeeping
    cost 2-4% at demo size), and the call still counts in the probe schedule. A probe due within the call, or a
    width that pays, takes the blockwise loop as before."""
    import importlib

    bw = importlib.import_module("bpd_train.decoding.blockwise")
    m = _heads_that_never_pay()
    src = random_sources(1, seed=4)
    blockwise(m, src, max_len=12, adaptive=True)  # calibrates
    ad = next(iter(default_weights(m).get(m).stats.values()))
    ad.offered, ad.accepted = [1, 100, 100, 100], [1, 1, 1, 1]
    ad._best.clear()
    assert ad.calibrated_rows == {1} and ad.width(1) == 1
    runs = []
    real = bw._Blockwise.run
    bw._Blockwise.run = lambda self, *a: runs.append(1) or real(self, *a)
    try:
        ad.probes(1).reset(8)  # a probe due after 8 steps: the blockwise loop
        blockwise(m, src, max_len=12, adaptive=True)
        assert runs == [1]
        ad.probes(1).interval = ad.max_interval  # none within 12 steps: greedy() itself
        before = ad.probes(1).failed_at_cap
        got, want = blockwise(m, src, max_len=12, adaptive=True), greedy(m, src, max_len=12)
        assert runs == [1]
        assert (got.tokens, got.calls, got.accepted_hist) == (want.tokens, want.calls, want.accepted_hist)
        assert ad.probes(1).failed_at_cap == before + 1  # the stretch it stands for, counted
        ad.offered, ad.accepted = [1, 100, 100, 100], [1, 100, 100, 100]  # heads that pay: the loop again
        ad.calib.update({(v, 1): 1.0 + 0.2 * (v - 1) for v in (2, 3, 4)})  # (priced as at base size, not timed:
        ad._best.clear()  # this tiny model's wide steps cost what the CPU gives)
        blockwise(m, src, max_len=12, adaptive=True)
        assert runs == [1, 1]
    finally:
        bw._Blockwise.run = real


@native
def test_adaptive_settled_on_greedy_counts_the_shortest_row_of_a_padded_batch():
    """In a padded batch the horizon (steps before a row must end) is the shortest row's: a probe due after it is
    no reason to leave greedy's loop, though it falls within the padded width's horizon (the first, torch-free
    bound); a probe due before it is."""
    import importlib

    bw = importlib.import_module("bpd_train.decoding.blockwise")
    m = _heads_that_never_pay()
    src = torch.tensor([[5, 6, EOS, 0, 0, 0, 0, 0, 0], [3, 4, 5, 6, 3, 4, 5, 6, EOS]])  # 3 and 9 tokens
    ml = (1.0, 2)  # horizons: 5 (shortest row), 11 (padded width)
    blockwise(m, src, max_len=ml, adaptive=True)  # calibrates for 2 rows
    ad = next(iter(default_weights(m).get(m).stats.values()))
    ad.offered, ad.accepted = [1, 100, 100, 100], [1, 1, 1, 1]
    ad._best.clear()
    assert ad.calibrated(ad.bucket(2)) is not None and ad.width(2) == 1
    runs = []
    real = bw._Blockwise.run
    bw._Blockwise.run = lambda self, *a: runs.append(1) or real(self, *a)
    try:
        ad.probes(2).interval = 8  # 5 <= 8 < 11: greedy() itself
        got, want = blockwise(m, src, max_len=ml, adaptive=True), greedy(m, src, max_len=ml)
        assert runs == [] and (got.tokens, got.calls) == (want.tokens, want.calls)
        assert ad.probes(2).interval == 16  # the stretch it stands for, counted
        ad.probes(2).interval = 4  # a probe before the shortest row ends: the loop
        got = blockwise(m, src, max_len=ml, adaptive=True)
        assert runs == [1] and got.tokens == want.tokens
    finally:
        bw._Blockwise.run = real


@pytest.mark.parametrize("adaptive", [True, 0.5])
def test_adaptive_blockwise_equals_greedy_on_random_models(adaptive):
    # the randomised blockwise == greedy cases in adaptive mode, batch 1 (native block loop, greedy stretches,
    # probes) and batches; statistics carry over between calls, so repeated calls feed other widths
    widths = set()
    for k, seed, batch in [(2, 1, 1), (4, 2, 5), (6, 3, 16), (8, 4, 1), (4, 5, 1), (4, 6, 3)]:
        m = random_model(k, seed, eos_bias=1.5)
        src = random_sources(batch, seed)
        g = greedy(m, src, max_len=(1.5, 4))
        for rep in range(3):
            r = blockwise(m, src, max_len=(1.5, 4), adaptive=adaptive)
            assert r.tokens == g.tokens, f"k={k} seed={seed} batch={batch} rep={rep}"
            widths |= set(r.accepted_hist)
        alone = [blockwise(m, src[i : i + 1], max_len=(1.5, 4), adaptive=adaptive).tokens[0] for i in range(batch)]
        assert alone == g.tokens
    assert len(widths) >= 3  # blocks of several sizes were accepted


def test_adaptive_probes_back_off_then_return_when_a_head_pays():
    """The probe schedule of the cost-aware controller: greedy stretches double from 8 to 64 steps while probes
    fail, grow to 512 after LONG_AFTER failed probes at 64 (a probe that does not pay costs its extra step time),
    and start again at 8 as soon as a probe shows a head that pays."""
    import numpy as np

    from bpd_train.decoding.adaptive import Adaptive

    a = Adaptive(4)
    for w in (1, 2, 3, 4):  # calibrated costs: 1, 1.5, 2, 2.5 greedy steps
        a.timed(w, 1, 1.0 + 0.5 * (w - 1), steps=8)
    a.offered, a.accepted = [1, 100, 100, 100], [1, 2, 2, 2]  # heads almost never accepted
    assert a.width(1) == 1
    stretches = [a.greedy_stretch() for _ in range(4 + Adaptive.LONG_AFTER + 5)]
    assert stretches[:4] == [8, 16, 32, 64]
    assert stretches[4 : 4 + Adaptive.LONG_AFTER] == [64] * Adaptive.LONG_AFTER
    assert stretches[4 + Adaptive.LONG_AFTER :] == [128, 256, 512, 512, 512]
    # a probe where every proposal is accepted: the width pays again and the next stretch is short
    for _ in range(400):
        a.update(4, np.array([3]), one_row=True)
    assert a.width(1) > 1
    assert a.greedy_stretch() == 8 and a.probes(1).failed_at_cap == 0
    # runs at the chosen width: short while the heads are barely judged, long once they are (per-call cost)
    assert Adaptive(4).run_length() == 8 and a.run_length() == 32


@native
def test_adaptive_batch_of_fewer_rows_borrows_a_larger_batchs_calibration():
    """A batch smaller than one already calibrated (the last batch of a file, rows that ended) is priced by the
    larger batch's calibration instead of paying a calibration of its own; one row is always calibrated itself."""
    from bpd_train.engine.mt import DecodeWeights

    m = _heads_that_never_pay()
    big, small = random_sources(8, seed=7), random_sources(3, seed=8)
    calls = []
    real_batch = DecodeWeights.batch_block_steps

    def spy(self, model, state, x, lengths, room, max_steps, width=None, eos=None, **kw):
        calls.append((x.shape[0], eos))
        return real_batch(self, model, state, x, lengths, room, max_steps, width=width, eos=eos, **kw)

    DecodeWeights.batch_block_steps = spy
    try:
        assert blockwise(m, big, max_len=12, adaptive=True).tokens == greedy(m, big, max_len=12).tokens
        ad = next(iter(default_weights(m).get(m).stats.values()))
        assert ad.calibrated_rows == {ad.bucket(8)} and any(e == -1 for _, e in calls)
        calls.clear()
        assert blockwise(m, small, max_len=12, adaptive=True).tokens == greedy(m, small, max_len=12).tokens
    finally:
        DecodeWeights.batch_block_steps = real_batch
    assert not any(e == -1 for _, e in calls)  # no calibration run for 3 rows
    assert ad.calibrated(ad.bucket(3)) == ad.bucket(8) and ad.calibrated(1) is None
    assert ad.cost(2, ad.bucket(3)) == ad.cost(2, ad.bucket(8))


def test_adaptive_calibrates_a_batch_as_a_batch_and_settles_on_greedy_per_bucket():
    """A batch is priced by its own calibration (every width timed over the batch's rows, on a scratch cache) and
    keeps its own probe schedule: a head that pays for one row does not make the batch probe again. Where no width
    pays for the batch and no probe is due before its first row must end, blockwise(adaptive=True) on the batch is
    greedy() itself (same tokens, calls, histogram); the output equals greedy's either way."""
    import importlib

    import numpy as np

    from bpd_train.engine.mt import DecodeWeights

    bw = importlib.import_module("bpd_train.decoding.blockwise")
    m = _heads_that_never_pay()
    src = random_sources(3, seed=6)
    want = greedy(m, src, max_len=12)
    seen = []
    real_batch = DecodeWeights.batch_block_steps

    def spy(self, model, state, x, lengths, room, max_steps, width=None, eos=None, **kw):
        seen.append((x.shape, eos))
        return real_batch(self, model, state, x, lengths, room, max_steps, width=width, eos=eos, **kw)

    DecodeWeights.batch_block_steps = spy
    try:
        assert blockwise(m, src, max_len=12, adaptive=True).tokens == want.tokens  # calibrates bucket 2
    finally:
        DecodeWeights.batch_block_steps = real_batch
    # widths timed over the 3 rows, in order, up to the first that would not pay even if every proposal were
    # accepted (the optimistic prior: E[w] = w); wider ones are priced as that one, per proposal
    timed = sorted({s[1] for s, e in seen if e == -1})
    top = timed[-1]
    assert {s[0] for s, e in seen if e == -1} == {3} and timed == list(range(2, top + 1))
    ad = next(iter(default_weights(m).get(m).stats.values()))
    b = ad.bucket(3)
    assert b in ad.calibrated_rows and sorted(v for v, c in ad.calib if c == b) == [1, 2, 3, 4]
    assert all(ad.calib[(v, b)] > 1.0 for v in (2, 3, 4))  # a wider step over 3 rows costs more than a greedy one
    if top < 4:
        assert ad.calib[(top, b)] * ad.BATCH_MARGIN > top
        assert all(ad.calib[(v, b)] == pytest.approx(ad.calib[(top, b)] * v / top) for v in range(top + 1, 5))
    ad.offered, ad.accepted = [1, 100, 100, 100], [1, 1, 1, 1]
    ad._best.clear()
    assert ad.width(3) == 1
    runs = []
    real = bw._Blockwise.run
    bw._Blockwise.run = lambda self, *a: runs.append(1) or real(self, *a)
    try:
        ad.probes(3).reset(8)  # a probe due within the call: the blockwise loop
        assert blockwise(m, src, max_len=12, adaptive=True).tokens == want.tokens
        assert runs == [1]
        ad.probes(3).interval = ad.max_interval  # none before the first row must end: greedy() itself
        before = ad.probes(3).failed_at_cap
        got = blockwise(m, src, max_len=12, adaptive=True)
        assert runs == [1]
        assert (got.tokens, got.calls, got.accepted_hist) == (want.tokens, want.calls, want.accepted_hist)
        assert ad.probes(3).failed_at_cap == before + 1
        # one row's heads paying resets that bucket's schedule only
        ad.offered, ad.accepted = [1, 100, 100, 100], [1, 100, 100, 100]
        ad.probes(1).interval = ad.max_interval
        ad.update(4, np.array([3]), one_row=True)
        assert ad.probes(1).interval == ad.probe and ad.probes(3).interval == ad.max_interval
    finally:
        bw._Blockwise.run = real


class _RowsFed:
    """Rows the decoder-only native loops were fed outside calibration (eos -1): one per live row and greedy step,
    w per live row and w-wide step. A count, not a timing: what a step costs grows with its rows."""

    def __init__(self, monkeypatch):
        from bpd_train.engine.lm import LMDecodeWeights as W

        self.rows = 0
        block, batch, steps, to_end = W.block_steps, W.batch_block_steps, W.greedy_steps, W.greedy_to_end

        def block_steps(w, model, state, x, room, max_steps, eos=None, width=None, **kw):
            got = block(w, model, state, x, room, max_steps, eos=eos, width=width, **kw)
            if got is not None and eos != -1:
                self.rows += got[1].shape[0] * (x.shape[0] if width is None else width)
            return got

        def batch_block_steps(w, model, state, x, lengths, room, max_steps, width=None, eos=None, **kw):
            got = batch(w, model, state, x, lengths, room, max_steps, width=width, eos=eos, **kw)
            if got is not None and eos != -1:
                row_steps = int(got[1].sum()) if kw.get("to_end") else got[1].shape[0] * got[1].shape[1]
                self.rows += row_steps * (x.shape[1] if width is None else width)
            return got

        def greedy_steps(w, model, state, tok, room, max_steps, eos=None):
            got = steps(w, model, state, tok, room, max_steps, eos=eos)
            if eos != -1:
                self.rows += got[0].size
            return got

        def greedy_to_end(w, model, state, tok, room, max_steps):
            got = to_end(w, model, state, tok, room, max_steps)
            if got is not None:
                self.rows += int(got[1].sum())
            return got

        for name, fn in [
            ("block_steps", block_steps),
            ("batch_block_steps", batch_block_steps),
            ("greedy_steps", greedy_steps),
            ("greedy_to_end", greedy_to_end),
        ]:
            monkeypatch.setattr(W, name, fn)

    def of(self, fn):
        self.rows = 0
        got = fn()
        return got, self.rows


@native
def test_adaptive_batches_with_prompt_lookup_fall_back_to_greedy_rows_where_nothing_pays(monkeypatch):
    """Prompt lookup used to turn adaptive feeding off, so a batch fed every row the full block each step
    (SmolLM2 int8, batch 8, k = 8, lookup 3: 0.72x greedy). A batch of 8 rows on a tiny decoder-only model whose
    random heads and context repeats are (nearly) never accepted: plain blockwise feeds ~k rows per token; adaptive
    feeding, after its first call (calibration and probes), feeds about as many rows as greedy, with greedy's output.
    Where the proposals pay, the batch still gets wide blocks; one row with lookup keeps the plain block loop (the
    narrow steps adapt there), as before."""
    from bpd_train.decoding.adaptive import Adaptive
    from bpd_train.engine.packed import DecodeOptions
    from bpd_train.engine.weights import PackedWeights
    from tests.test_lm_engine import lm, prompts

    k, batch = 8, 8
    m = lm(0, "medusa", k=k, vocab=256)
    with torch.no_grad():
        for p in m.head_parameters():
            p.normal_(0, 1.0)  # random heads: proposals (nearly) never accepted
    src = prompts(batch, 0, vocab=256, longest=12)
    fed = _RowsFed(monkeypatch)
    g, greedy_rows = fed.of(lambda: greedy(m, src, max_len=48, weights=PackedWeights(DecodeOptions())))
    pw = PackedWeights(DecodeOptions(lookup=3))
    plain, plain_rows = fed.of(lambda: blockwise(m, src, max_len=48, weights=pw))
    assert plain.tokens == g.tokens and plain.mean_accepted < 1.1  # neither lookup nor the heads pay
    assert plain_rows > (k - 1) * greedy_rows
    for rep in range(3):  # statistics and step costs carry over between calls (kept with the weights)
        a, rows = fed.of(lambda: blockwise(m, src, max_len=48, weights=pw, adaptive=True))
        assert a.tokens == g.tokens, rep
        if rep:
            assert rows <= 1.1 * greedy_rows, (rep, rows, greedy_rows, plain_rows)
            assert a.calls <= g.calls + 2
    # proposals that pay (acceptance counts of heads always right, steps priced as at base size): wide blocks again
    pw = PackedWeights(DecodeOptions(lookup=3))
    w = pw.get(m)
    ad = w.stats.setdefault(("adaptive", k, None), Adaptive(k))
    ad.offered, ad.accepted = [1] + [4000] * (k - 1), [1] + [4000] * (k - 1)
    b = ad.bucket(batch)
    ad.calib.update({(v, b): 1.0 + 0.1 * (v - 1) for v in range(1, k + 1)})
    ad.calibrated_rows.add(b)
    ad.calib_tried.add(b)
    a, rows = fed.of(lambda: blockwise(m, src, max_len=48, weights=pw, adaptive=True))
    assert a.tokens == g.tokens and rows > 2 * greedy_rows
    # one row with lookup: the plain block loop, adaptive or not (same calls, histogram and rows)
    one = src[:1]
    pw = PackedWeights(DecodeOptions(lookup=3))
    p1, p1_rows = fed.of(lambda: blockwise(m, one, max_len=48, weights=pw))
    a1, a1_rows = fed.of(lambda: blockwise(m, one, max_len=48, weights=pw, adaptive=True))
    assert (a1.tokens, a1.calls, a1.accepted_hist, a1_rows) == (p1.tokens, p1.calls, p1.accepted_hist, p1_rows)
    assert a1.tokens == [g.tokens[0]]


@native
def test_the_probes_lookup_proposes_what_the_native_loops_do(monkeypatch):
    """A probe after a greedy stretch proposes from the row's context in Python (blockwise.lookup): the same tokens
    the native batch loop's lookup puts first in its next fed block (the heads' proposals fill the rest)."""
    import numpy as np

    from bpd_train.decoding.adaptive import Adaptive
    from bpd_train.decoding.blockwise import lookup
    from bpd_train.engine.lm import LMDecodeWeights
    from bpd_train.engine.packed import DecodeOptions
    from bpd_train.engine.weights import PackedWeights
    from tests.test_lm_engine import lm, prompts

    assert lookup(np.array([5, 6, 7, 8, 5, 6]), 3, 4).tolist() == [7, 8, 5, 6]  # "5 6" repeats: what followed
    assert lookup(np.array([5, 6, 7, 8, 5, 6]), 3, 1).tolist() == [7]
    assert lookup(np.array([5, 6, 5, 9, 5]), 3, 2).tolist() == [9, 5]  # the latest earlier occurrence
    assert lookup(np.array([4, 5, 6]), 3, 2).size == 0 and lookup(np.array([4]), 3, 2).size == 0
    seen = []
    real = LMDecodeWeights.batch_block_steps

    def spy(self, model, state, x, lengths, room, max_steps, width=None, eos=None, context=None, **kw):
        got = real(self, model, state, x, lengths, room, max_steps, width=width, eos=eos, context=context, **kw)
        if context is not None and not kw.get("to_end"):
            seen.append(([np.asarray(c) for c in context], got))
        return got

    monkeypatch.setattr(LMDecodeWeights, "batch_block_steps", spy)
    m = lm(0, "medusa", k=4, vocab=12)
    src = prompts(6, 3, longest=12)
    pw = PackedWeights(DecodeOptions(lookup=3))
    ad = pw.get(m).stats.setdefault(("adaptive", 4, None), Adaptive(4))  # wide steps pay: the batch loop runs them
    ad.offered, ad.accepted = [1, 4000, 4000, 4000], [1, 4000, 4000, 4000]
    ad.calib.update({(v, ad.bucket(6)): 1.0 + 0.1 * (v - 1) for v in range(1, 5)})
    ad.calibrated_rows.add(ad.bucket(6))
    ad.calib_tried.add(ad.bucket(6))
    g = greedy(m, src, max_len=40, weights=PackedWeights(DecodeOptions()))
    assert blockwise(m, src, max_len=40, weights=pw, adaptive=True).tokens == g.tokens
    checked = 0
    for context, (toks, nc, nxt, _, ended) in seen:
        for r, c in enumerate(context):
            if ended[r]:
                continue
            after = np.concatenate([c, toks[r, : nc[r, :, 1].sum()]])
            want = lookup(after, 3, nxt.shape[1] - 1)
            assert nxt[r, 1 : 1 + want.size].tolist() == want.tolist()
            checked += want.size > 0
    assert checked > 5


@native
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_adaptive_batches_with_lookup_narrow_steps_and_trees_equal_greedy(dtype):
    """Adaptive feeding with prompt lookup in batches (rows leaving down to the last one, where narrow steps and
    candidate trees act): greedy's output token for token, over repeated calls (statistics carry over, so later
    calls feed other widths), for Medusa, chained and BPD heads."""
    from bpd_train.engine.packed import DecodeOptions
    from bpd_train.engine.weights import PackedWeights
    from tests.test_lm_engine import CONFIGS, lm, prompts

    for i, (heads, kv, bias, tie, extra) in enumerate(CONFIGS[:5]):
        m = lm(80 + i, heads, k=4, kv=kv, qkv_bias=bias, tie=tie, **extra)
        src = prompts(7, 90 + i, longest=12)
        g = greedy(m, src, max_len=40, weights=PackedWeights(DecodeOptions(dtype=dtype)))
        trees = [] if heads == "chain" else [dict(lookup=2, tree=((0,), (1,)))]  # (trees: not on chained heads)
        for opts in [dict(lookup=3), dict(lookup=3, narrow=2)] + trees:
            pw = PackedWeights(DecodeOptions(dtype=dtype, **opts))
            for adaptive in (True, True, 0.5):
                got = blockwise(m, src, max_len=40, weights=pw, adaptive=adaptive)
                assert got.tokens == g.tokens, (heads, opts, adaptive)
