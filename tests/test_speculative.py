"""Blockwise sampling (decoding/speculative.py) is lossless in distribution: on tiny models with a vocabulary of 8,
the whole short answers it samples are distributed as the model's exact sequence probabilities, computed by
enumeration from head 1's adjusted distributions (temperature, top-k, top-p), with heads that are right (copies of
head 1), wrong (they point at one fixed token) and random, drafting over the whole vocabulary or a draft vocabulary;
a deliberately broken residual (drawing from p at a rejection instead of max(0, p - q)) fails the same test. Also:
temperature 0 is greedy, seeds reproduce, a row's tokens do not depend on its batch mates, p and q are masked alike,
and top-p's nucleus is the one a stable sort of the whole vocabulary gives.

The decision rule, fixed before any run: N = 20,000 answers per case (one source repeated, row i seeded seed + i);
answers whose expected count is below 5 are pooled into one cell; the sampler passes where Pearson's chi-square
statistic stays below the chi-square quantile at significance ALPHA = 1e-3 (Wilson-Hilferty) and the total variation
distance stays below TV_FACTOR = 2 times the distance expected from sampling noise alone (about ten standard
deviations above it). The broken residual must exceed both. Everything is seeded: the verdicts are deterministic."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_decoding import random_model, random_sources

from bpd_train.decoding import blockwise, greedy, sample
from bpd_train.decoding import speculative as spec
from bpd_train.decoding import speculative_sample as _speculative_sample
from bpd_train.decoding.common import decoding_mode, start_tokens
from bpd_train.decoding.sampling import keep_mask, sampling_probs
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights, default_weights
from bpd_train.model.lm.config import LMConfig
from bpd_train.model.lm.model import LMModel

N = 20_000
ALPHA = 1e-3
TV_FACTOR = 2.0
Z = {1e-3: 3.090232306167813}
WRONG = 5  # the token "wrong" heads point at


def speculative_sample(*args, native: bool = False, **kw):
    """The reference PyTorch decoder (the tests here patch its Python pieces); tests/test_native_sampling.py holds
    the native loop to the same tests."""
    return _speculative_sample(*args, native=native, **kw)


DRAFT = (2, 3, 5, 6)  # a draft vocabulary: half the ids, the stop id (2) and WRONG among them


def tiny_lm(k: int, seed: int, vocab: int = 8) -> LMModel:
    torch.manual_seed(seed)
    m = LMModel(LMConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, d_ff=32, block_size=k, eos_id=2))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2 and not name.startswith("heads"):
                p.mul_(3.0)
    return m.eval()


def set_heads(model, kind: str, monkeypatch, seed: int = 0):
    """Heads 2..k: right (each equals head 1 at the same position: their FFN outputs zero), wrong (each puts all
    its mass on the token WRONG: their logits replaced, as a final norm bounds what weights alone can do) or random
    (wide random FFN weights)."""
    fc2 = model.heads.fc2
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fc2.weight.zero_()
        fc2.bias.zero_()
        if kind == "random":
            fc2.weight.copy_(torch.randn(fc2.weight.shape, generator=g) * 1.5)
    if kind == "wrong":
        cls = type(default_weights(model).get(model))
        real = cls.logits

        def pointing(self, h, lo=0, hi=1, first=None):
            out = real(self, h, lo, hi, first)
            if lo >= 1:  # heads 2..k (head 1 never comes through here with lo >= 1)
                out = torch.full_like(out, -40.0)
                out[..., WRONG] = 40.0
            return out

        real_draft = cls.draft_logits

        def pointing_draft(self, h, lo, hi, first=None):  # with a draft vocabulary: WRONG's column
            out = torch.full_like(real_draft(self, h, lo, hi, first), -40.0)
            out[..., WRONG if self.draft_ids is None else self.draft_ids.tolist().index(WRONG)] = 40.0
            return out

        monkeypatch.setattr(cls, "logits", pointing)
        monkeypatch.setattr(cls, "draft_logits", pointing_draft)
    return model


def exact_distribution(model, src_row, m: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> dict:
    """P(answer) for every answer of at most m tokens (as the decoders return it: cut at, and without, EOS), from
    head 1's adjusted distribution after every prefix (the decoders' own decode step, one call per prefix)."""
    eos = int(model.config.eos_id)
    v = model.config.vocab_size
    out: dict[tuple, float] = {}
    live = {(): 1.0}
    with decoding_mode(model):
        for _ in range(m):
            prefixes = list(live)
            src = src_row.repeat(len(prefixes), 1)
            _w = default_weights(model).get(model)
            state = model.start_decoding(model.encode(src, _w), m + 1, weights=_w)
            fed = torch.cat([start_tokens(model, state, len(prefixes), src.device), torch.tensor(prefixes).long()], 1)
            h = model.decode(state, fed)[:, -1]
            p = sampling_probs(state.weights.head1(h), temperature, top_k, top_p).numpy()
            nxt = {}
            for prefix, row in zip(prefixes, p):
                for t in range(v):
                    q = live[prefix] * row[t]
                    if q == 0.0:
                        continue
                    if t == eos:
                        out[prefix] = out.get(prefix, 0.0) + q
                    else:
                        nxt[prefix + (t,)] = q
            live = nxt
    for prefix, q in live.items():
        out[prefix] = out.get(prefix, 0.0) + q
    return out


def fit(samples: list[list[int]], exact: dict) -> tuple[float, float, float, float]:
    """(chi-square statistic, its critical value at ALPHA, total variation, the TV bound) of `samples` against
    `exact`."""
    n = len(samples)
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    assert set(counts) <= set(exact), "an answer the model gives probability 0"
    keys = sorted(exact, key=lambda a: -exact[a])
    e = np.array([exact[a] * n for a in keys])
    o = np.array([counts.get(a, 0) for a in keys], dtype=float)
    big = e >= 5
    e_cells = np.append(e[big], e[~big].sum())
    o_cells = np.append(o[big], o[~big].sum())
    if e_cells[-1] < 5:  # fold a small rest into the smallest cell
        e_cells[-2] += e_cells[-1]
        o_cells[-2] += o_cells[-1]
        e_cells, o_cells = e_cells[:-1], o_cells[:-1]
    chi2 = float(((o_cells - e_cells) ** 2 / e_cells).sum())
    df = len(e_cells) - 1
    crit = df * (1 - 2 / (9 * df) + Z[ALPHA] * math.sqrt(2 / (9 * df))) ** 3
    p = np.array([exact[a] for a in keys])
    tv = 0.5 * float(np.abs(o / n - p).sum()) + 0.5 * (1.0 - p.sum())
    noise = 0.5 * float(np.sqrt(2 * p * (1 - p) / (math.pi * n)).sum())  # E|p_hat - p| summed, halved
    return chi2, crit, tv, TV_FACTOR * noise


MODELS = {
    "mt": lambda k: random_model(k, seed=3, vocab=8),
    "lm": lambda k: tiny_lm(k, seed=4),
}


def _source(family: str, model):
    if family == "mt":
        return random_sources(1, seed=5, vocab=8)
    return torch.tensor([[1, 4, 6, 3]])


CASES = [
    # family, k, answer tokens, temperature, top_k, top_p
    ("mt", 2, 3, 1.0, 0, 1.0),
    ("mt", 3, 4, 0.8, 0, 1.0),
    ("lm", 3, 3, 1.0, 0, 1.0),
    ("mt", 3, 3, 1.0, 4, 0.8),
]


@pytest.mark.parametrize("family,k,m,t,top_k,top_p", CASES)
@pytest.mark.parametrize("heads", ["right", "wrong", "random"])
def test_blockwise_sampling_draws_whole_answers_from_the_models_distribution(
    family, k, m, t, top_k, top_p, heads, monkeypatch
):
    model = set_heads(MODELS[family](k), heads, monkeypatch)
    src = _source(family, model)
    exact = exact_distribution(model, src, m, t, top_k, top_p)
    assert abs(sum(exact.values()) - 1.0) < 1e-9
    r = speculative_sample(model, src.repeat(N, 1), max_len=m, temperature=t, top_k=top_k, top_p=top_p, seed=11)
    chi2, crit, tv, bound = fit(r.tokens, exact)
    print(
        f"{family} k={k} m={m} T={t} top_k={top_k} top_p={top_p} heads={heads}: chi2={chi2:.1f} (crit {crit:.1f}) "
        f"TV={tv:.4f} (bound {bound:.4f}) k-hat={r.mean_accepted:.2f} cells={len(exact)}"
    )
    assert chi2 < crit and tv < bound, (chi2, crit, tv, bound)


@pytest.mark.parametrize("family,k,m,t,top_k,top_p", [CASES[0], CASES[2], CASES[3]])
@pytest.mark.parametrize("heads", ["right", "wrong", "random"])
def test_a_broken_residual_fails_the_same_test(family, k, m, t, top_k, top_p, heads, monkeypatch):
    """At a rejection, drawing from p (what a residual that forgot to subtract q does) over-weights the drafted
    tokens: the same decision rule must reject it."""
    model = set_heads(MODELS[family](k), heads, monkeypatch)
    src = _source(family, model)
    exact = exact_distribution(model, src, m, t, top_k, top_p)
    monkeypatch.setattr(spec, "residual", lambda p, q: p)
    r = speculative_sample(model, src.repeat(N, 1), max_len=m, temperature=t, top_k=top_k, top_p=top_p, seed=11)
    chi2, crit, tv, bound = fit(r.tokens, exact)
    print(
        f"BROKEN {family} k={k} m={m} T={t} top_k={top_k} top_p={top_p} heads={heads}: chi2={chi2:.1f} "
        f"(crit {crit:.1f}) TV={tv:.4f} (bound {bound:.4f})"
    )
    assert not (chi2 < crit and tv < bound) and chi2 > crit, (chi2, crit, tv, bound)


@pytest.mark.parametrize("family,k,m,t,top_k,top_p", [CASES[2], CASES[3]])
@pytest.mark.parametrize("heads", ["right", "wrong", "random"])
def test_heads_drafting_within_a_draft_vocabulary_keep_the_models_distribution(
    family, k, m, t, top_k, top_p, heads, monkeypatch
):
    """With a draft vocabulary (the greedy path's), q is over those ids only and 0 elsewhere; p stays over the whole
    vocabulary, so answers with ids outside it still come, from rejections and bonus tokens."""
    model = set_heads(MODELS[family](k), heads, monkeypatch)
    src = _source(family, model)
    exact = exact_distribution(model, src, m, t, top_k, top_p)
    w = PackedWeights(DecodeOptions(draft_vocab=DRAFT))
    r = speculative_sample(
        model, src.repeat(N, 1), max_len=m, temperature=t, top_k=top_k, top_p=top_p, seed=11, weights=w
    )
    chi2, crit, tv, bound = fit(r.tokens, exact)
    print(f"DRAFT {family} k={k} T={t} top_k={top_k} top_p={top_p} heads={heads}: chi2={chi2:.1f} (crit {crit:.1f})")
    assert chi2 < crit and tv < bound, (chi2, crit, tv, bound)
    assert any(set(a) - set(DRAFT) for a in r.tokens)  # ids outside the draft vocabulary are sampled too
    monkeypatch.setattr(spec, "residual", lambda p, q: p)  # the broken residual fails here as well
    r = speculative_sample(
        model, src.repeat(N, 1), max_len=m, temperature=t, top_k=top_k, top_p=top_p, seed=11, weights=w
    )
    chi2, crit, tv, bound = fit(r.tokens, exact)
    assert chi2 > crit, (chi2, crit, tv, bound)


def test_plain_sampling_passes_the_same_test():
    """The reference the blockwise sampler is held to: plain ancestral sampling (decoding/sampling.py, one token per
    decoder call, Gumbel-max: the Python loop; tests/test_native_sampling.py holds the native loop to the same test)
    against the same enumeration, top-k and top-p included."""
    for family, k, m, t, top_k, top_p in (CASES[0], CASES[3]):
        model = MODELS[family](k)
        src = _source(family, model)
        exact = exact_distribution(model, src, m, t, top_k, top_p)
        r = sample(model, src.repeat(N, 1), max_len=m, temperature=t, top_k=top_k, top_p=top_p, seed=11, native=False)
        chi2, crit, tv, bound = fit(r.tokens, exact)
        print(f"PLAIN {family} T={t} top_k={top_k} top_p={top_p}: chi2={chi2:.1f} (crit {crit:.1f}) TV={tv:.4f}")
        assert chi2 < crit and tv < bound, (chi2, crit, tv, bound)


def test_the_heads_really_are_right_wrong_and_random(monkeypatch):
    model = random_model(3, seed=3, vocab=8)
    src = random_sources(1, seed=5, vocab=8)
    got = {}
    for kind in ("right", "wrong", "random"):
        set_heads(model, kind, monkeypatch)
        with decoding_mode(model):
            _w = default_weights(model).get(model)
            state = model.start_decoding(model.encode(src, _w), 4, weights=_w)
            h = model.decode(state, start_tokens(model, state, 1, src.device))[:, 0]
            w = state.weights
            got[kind] = (sampling_probs(w.head1(h), 1.0)[0], sampling_probs(w.logits(h, 1, 3), 1.0)[0])
    p, q = got["right"]
    assert torch.allclose(q, p.expand_as(q), atol=1e-6)  # each head is head 1 at the same position
    p, q = got["wrong"]
    assert (q[:, WRONG] > 0.999).all() and 0.01 < p[WRONG] < 0.5
    p, q = got["random"]
    assert (q - p).abs().sum(-1).min() > 0.2


def test_keep_mask_top_k_keeps_ties_and_top_p_the_smallest_nucleus():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]])
    assert keep_mask(logits, 2).tolist() == [[True, True, True, False, False]]  # the k-th value's ties stay
    assert keep_mask(logits) is None and keep_mask(logits, 0, 1.0) is None and keep_mask(logits, 5) is None
    probs = torch.softmax(logits.double(), -1)[0]  # .464 .171 .171 .063 .023
    assert keep_mask(logits, 0, float(probs[0]) - 1e-9).tolist() == [[True, False, False, False, False]]
    assert keep_mask(logits, 0, 0.01).tolist() == [[True, False, False, False, False]]  # the top token always
    assert keep_mask(logits, 0, float(probs[0] + 0.5 * probs[1])).tolist() == [[True, True, False, False, False]]
    assert keep_mask(logits, 1, 0.99).tolist() == [[True, False, False, False, False]]  # top_p after top_k
    p = sampling_probs(logits, 1.0, 2, 0.9)
    assert p[0, 3:].sum() == 0 and abs(float(p.sum()) - 1) < 1e-12


def test_the_nucleus_is_a_stable_sort_of_the_whole_vocabulary_cut_at_top_p():
    """top_p's mask sorts only the first ranks (growing them until every row's nucleus ends there): it keeps the
    tokens a stable sort of the whole row keeps, ties at the cut taken by id, on peaked and flat rows alike."""

    def by_sorting(logits, top_p):
        probs = torch.softmax(logits.double(), dim=-1)
        sp, order = probs.sort(dim=-1, descending=True, stable=True)
        return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, sp.cumsum(-1) - sp < top_p)

    g = torch.Generator().manual_seed(0)
    v = 3000
    rows = [torch.randn(v, generator=g) * s for s in (0.1, 1.0, 3.0, 10.0)]  # flat to peaked
    rows.append(torch.randint(0, 4, (v,), generator=g).float())  # many ties at every cut
    rows.append(torch.zeros(v))  # all tied
    logits = torch.stack(rows)
    for top_p in (0.05, 0.5, 0.9, 0.99, 1 - 1e-9):
        want = by_sorting(logits, top_p)
        assert torch.equal(keep_mask(logits, 0, top_p), want), top_p
        assert torch.equal(keep_mask(logits[None], 0, top_p)[0], want)  # any leading shape
    sizes = by_sorting(logits, 0.9).sum(-1)
    assert sizes.min() < 64 < 512 < sizes.max()  # (rows whose nucleus needs more ranks than the first try)


@pytest.mark.parametrize("family", ["mt", "lm"])
def test_top_1_masks_p_and_q_alike_so_sampling_is_exact_blockwise(family, monkeypatch):
    """top_k=1: p is head 1's argmax and each q its head's argmax -- exact blockwise decoding, the same tokens and
    the same accepted blocks (with an unmasked q the drafts would differ and so would the blocks)."""
    model = MODELS[family](3)
    set_heads(model, "random", monkeypatch, seed=2)
    src = random_sources(6, seed=6, vocab=8) if family == "mt" else torch.tensor([[1, 4, 6, 3], [1, 5, 3, 3]])
    g = greedy(model, src, max_len=12)
    b = blockwise(model, src, max_len=12)
    s = speculative_sample(model, src, max_len=12, temperature=0.7, top_k=1, seed=3)
    assert s.tokens == g.tokens == b.tokens
    assert s.accepted_hist == b.accepted_hist and s.calls == b.calls
    # with a draft vocabulary each q is its head's argmax among those ids: blockwise's proposals there (right
    # heads, and a draft vocabulary without greedy's most frequent id, so that it changes which proposals hold)
    set_heads(model, "right", monkeypatch)
    b = blockwise(model, src, max_len=12)
    common = np.bincount([t for row in g.tokens for t in row]).argmax()
    opts = DecodeOptions(draft_vocab=tuple(i for i in range(8) if i != common))
    bd = blockwise(model, src, max_len=12, weights=PackedWeights(opts))
    sd = speculative_sample(model, src, max_len=12, temperature=0.7, top_k=1, seed=3, weights=PackedWeights(opts))
    assert sd.tokens == bd.tokens == g.tokens
    assert sd.accepted_hist == bd.accepted_hist and sd.calls == bd.calls
    assert bd.accepted_hist != b.accepted_hist


@pytest.mark.parametrize("family", ["mt", "lm"])
def test_temperature_0_is_greedy_and_seeds_reproduce(family):
    model = MODELS[family](3)
    src = random_sources(5, seed=7, vocab=8) if family == "mt" else torch.tensor([[1, 4, 6, 3], [1, 5, 3, 3]])
    assert speculative_sample(model, src, max_len=10, temperature=0).tokens == greedy(model, src, max_len=10).tokens
    a = speculative_sample(model, src, max_len=10, temperature=1.0, seed=5)
    assert speculative_sample(model, src, max_len=10, temperature=1.0, seed=5).tokens == a.tokens
    others = [speculative_sample(model, src, max_len=10, temperature=1.0, seed=s).tokens for s in (6, 7)]
    assert any(o != a.tokens for o in others)


def test_a_rows_tokens_do_not_depend_on_its_batch_mates():
    """Each row samples from its own generator (row_seeds): alone, or among other sources of other lengths (padding,
    rows finishing at different steps), a row gives the same tokens."""
    model = random_model(3, seed=8, vocab=8)
    src = random_sources(8, seed=8, vocab=8)
    seeds = [40 + 3 * i for i in range(8)]
    batch = speculative_sample(model, src, max_len=12, temperature=1.0, row_seeds=seeds)
    assert len({len(t) for t in batch.tokens}) > 2
    for i in range(8):
        row = src[i : i + 1, : int((src[i] != 0).sum())]
        alone = speculative_sample(model, row, max_len=12, temperature=1.0, row_seeds=[seeds[i]])
        assert alone.tokens[0] == batch.tokens[i], i
    flipped = speculative_sample(model, src.flip(0), max_len=12, temperature=1.0, row_seeds=seeds[::-1])
    assert flipped.tokens[::-1] == batch.tokens


@pytest.mark.parametrize("narrow", [0, 1, 2])
@pytest.mark.parametrize("heads", ["right", "wrong", "random"])
def test_prompt_lookup_drafts_keep_the_models_distribution(heads, narrow, monkeypatch):
    """With prompt lookup (a decoder-only model, DecodeOptions.lookup) the tokens after the context's earlier
    occurrence of its last tokens take the first draft places, q a point mass on each: accepted with probability
    p(d), the residual p without d. The answers keep the model's distribution; a residual that forgets to take
    the lookup draft out fails (point-mass q makes that the commonest rejection here). With narrow steps a row whose
    context repeats fewer than 2 tokens verifies one head draft only: the same test."""
    k, m, t = 3, 4, 1.0
    model = set_heads(tiny_lm(k, seed=4), heads, monkeypatch)
    src = torch.tensor([[1, 4, 6, 4, 6, 3]])  # repeats: lookup proposes from the first token on
    exact = exact_distribution(model, src, m, t)
    fired = []
    real = spec.lookup_match

    def counting(context, n, want):
        got, matched = real(context, n, want)
        fired.append(got.size if matched >= 2 or not narrow else 0)
        return got, matched

    monkeypatch.setattr(spec, "lookup_match", counting)
    w = PackedWeights(DecodeOptions(lookup=2, narrow=narrow))
    r = speculative_sample(model, src.repeat(N, 1), max_len=m, temperature=t, seed=11, weights=w)
    chi2, crit, tv, bound = fit(r.tokens, exact)
    print(f"LOOKUP narrow={narrow} heads={heads}: chi2={chi2:.1f} (crit {crit:.1f}) TV={tv:.4f} (bound {bound:.4f})")
    assert chi2 < crit and tv < bound, (chi2, crit, tv, bound)
    assert np.count_nonzero(fired) > (N // 2 if not narrow else N // 10)  # lookup proposed in many rows' steps
    if narrow:
        assert 0 < fired.count(0) < len(fired)  # and rows narrowed in others
    plain = speculative_sample(model, src.repeat(N, 1), max_len=m, temperature=t, seed=11)
    assert r.mean_accepted != plain.mean_accepted  # lookup changed what was drafted
    monkeypatch.setattr(spec, "residual", lambda p, q: p)
    r = speculative_sample(model, src.repeat(N, 1), max_len=m, temperature=t, seed=11, weights=w)
    chi2, crit, tv, bound = fit(r.tokens, exact)
    assert chi2 > crit, (chi2, crit, tv, bound)


@pytest.mark.parametrize("narrow", [0, 2])
def test_prompt_lookup_sampling_rows_do_not_depend_on_batch_mates_and_top_1_is_greedy_with_lookup(narrow):
    model = tiny_lm(3, seed=4)
    src = torch.tensor([[1, 4, 6, 4, 6, 3], [1, 5, 3, 5, 3, 5], [1, 6, 6, 4, 4, 3]])
    w = PackedWeights(DecodeOptions(lookup=2, narrow=narrow))
    seeds = [7, 9, 12]
    batch = speculative_sample(model, src, max_len=12, temperature=1.0, row_seeds=seeds, weights=w)
    assert len({len(t) for t in batch.tokens}) > 1  # rows finish at different steps
    for i in range(3):
        alone = speculative_sample(model, src[i : i + 1], max_len=12, temperature=1.0, row_seeds=[seeds[i]], weights=w)
        assert alone.tokens[0] == batch.tokens[i], i
    # top_k=1: every lookup draft the model would not pick is rejected (p = 0 there): greedy's tokens
    g = greedy(model, src, max_len=12)
    s = speculative_sample(model, src, max_len=12, temperature=0.7, top_k=1, seed=3, weights=w)
    assert s.tokens == g.tokens
