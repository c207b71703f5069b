"""Sampling in the native loops: plain (engine/csrc/sample.h through decoding/sampling.py's `sample`) and blockwise
(engine/csrc/sample_loop.h through decoding/speculative.py's `speculative_sample`). Whole short answers are
distributed as the model's exact sequence probabilities (the enumeration and decision rule of
tests/test_speculative.py: 20,000 answers, chi-square at 1e-3 and a total-variation bound), for both families, with
temperature, top-k and top-p, heads that are right, random and wrong (a one-token draft vocabulary: every draft the
same token), a draft vocabulary, and prompt lookup with and without narrow steps; the same test fails when the draws
ignore a setting; top_k = 1 gives greedy's tokens; a row's tokens depend on its seed only (alone, in a batch, in
another order), and seeds reproduce. The reference decoder's tests (test_speculative.py) show the same rule rejecting
a broken residual."""

from __future__ import annotations

import sys

import pytest
import torch
from test_decoding import random_sources
from test_speculative import CASES, DRAFT, MODELS, WRONG, N, _source, exact_distribution, fit, set_heads, tiny_lm

from bpd_train.decoding import greedy, sample, speculative_sample
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights

NATIVE_CASES = [CASES[0], CASES[2], CASES[3], ("lm", 3, 3, 0.7, 3, 0.9)]


def _through_native(owner, name: str, ran, decode, *args, **kw):
    """decode(*args, **kw), failing unless owner.<name> (the native path's entry) ran and `ran(its result, its
    keywords)` held"""
    real, used = getattr(owner, name), []

    def spy(*a, **k):
        r = real(*a, **k)
        used.append(ran(r, k))
        return r

    setattr(owner, name, spy)
    try:
        out = decode(*args, **kw)
    finally:
        setattr(owner, name, real)
    assert used == [True], "the native loop did not run"
    return out


def native_sample(*args, **kw):
    """sample() that fails unless the native loop drew the tokens"""
    mod = sys.modules["bpd_train.decoding.sampling"]
    return _through_native(
        mod, "to_end", lambda r, k: k.get("sampler") is not None and r is not None, sample, *args, **kw
    )


def native_blockwise(*args, **kw):
    """speculative_sample() that fails unless the native loop drew the tokens"""
    cls = sys.modules["bpd_train.decoding.speculative"]._Sampler
    return _through_native(cls, "native_run", lambda r, k: r is not None, speculative_sample, *args, **kw)


HEADS = {"right": None, "random": None, "wrong": (WRONG,), "draft vocabulary": DRAFT}


@pytest.mark.parametrize("family,k,m,t,top_k,top_p", CASES)
@pytest.mark.parametrize("heads", list(HEADS))
def test_native_blockwise_sampling_draws_whole_answers_from_the_models_distribution(
    family, k, m, t, top_k, top_p, heads, monkeypatch
):
    model = set_heads(MODELS[family](k), "random" if heads == "random" else "right", monkeypatch)
    src = _source(family, model)
    exact = exact_distribution(model, src, m, t, top_k, top_p)
    w = PackedWeights(DecodeOptions(draft_vocab=HEADS[heads])) if HEADS[heads] else None
    r = native_blockwise(
        model, src.repeat(N, 1), max_len=m, temperature=t, top_k=top_k, top_p=top_p, seed=11, weights=w
    )
    chi2, crit, tv, bound = fit(r.tokens, exact)
    print(
        f"NATIVE BLOCKWISE {family} k={k} T={t} top_k={top_k} top_p={top_p} heads={heads}: chi2={chi2:.1f} "
        f"(crit {crit:.1f}) TV={tv:.4f} k-hat={r.mean_accepted:.2f}"
    )
    assert chi2 < crit and tv < bound, (chi2, crit, tv, bound)
    if heads == "right" and top_k == 0:
        assert r.mean_accepted > 1.4  # drafts from heads equal to head 1 are mostly accepted
    if heads == "wrong":
        assert r.mean_accepted < 1.3  # one token drafted everywhere: mostly rejected


@pytest.mark.parametrize("narrow", [0, 1, 2])
def test_native_blockwise_sampling_with_prompt_lookup_keeps_the_distribution(narrow, monkeypatch):
    k, m, t = 3, 4, 1.0
    model = set_heads(tiny_lm(k, seed=4), "random", monkeypatch)
    src = torch.tensor([[1, 4, 6, 4, 6, 3]])  # repeats: lookup proposes from the first token on
    exact = exact_distribution(model, src, m, t)
    w = PackedWeights(DecodeOptions(lookup=2, narrow=narrow))
    r = native_blockwise(model, src.repeat(N, 1), max_len=m, temperature=t, seed=11, weights=w)
    chi2, crit, tv, bound = fit(r.tokens, exact)
    print(f"NATIVE LOOKUP narrow={narrow}: chi2={chi2:.1f} (crit {crit:.1f}) TV={tv:.4f} k-hat={r.mean_accepted:.2f}")
    assert chi2 < crit and tv < bound, (chi2, crit, tv, bound)
    plain = native_blockwise(model, src.repeat(N, 1), max_len=m, temperature=t, seed=11)
    assert r.mean_accepted != plain.mean_accepted  # lookup changed what was drafted


@pytest.mark.parametrize("family", ["mt", "lm"])
def test_native_blockwise_sampling_top_1_is_greedy_and_rows_do_not_depend_on_batch_mates(family, monkeypatch):
    model = set_heads(MODELS[family](3), "random", monkeypatch)
    if family == "mt":
        src = random_sources(6, seed=8, vocab=8)
        rows = [src[i : i + 1, : int((src[i] != 0).sum())] for i in range(6)]
        w = None
    else:
        src = torch.tensor([[1, 4, 6, 4, 6, 3], [1, 5, 3, 5, 3, 5], [1, 6, 6, 4, 4, 3]])
        rows = [src[i : i + 1] for i in range(3)]
        w = PackedWeights(DecodeOptions(lookup=2, narrow=2))
    g = greedy(model, src, max_len=12)
    for kb in (2, 3):  # fewer heads than the model's, and all of them
        top1 = native_blockwise(model, src, block_size=kb, max_len=12, temperature=0.7, top_k=1, seed=3, weights=w)
        assert top1.tokens == g.tokens, kb
    seeds = [40 + 3 * i for i in range(len(rows))]
    batch = native_blockwise(model, src, max_len=12, temperature=1.0, row_seeds=seeds, weights=w)
    assert len({len(t) for t in batch.tokens}) > 1  # rows finish at different steps
    for i, row in enumerate(rows):
        alone = native_blockwise(model, row, max_len=12, temperature=1.0, row_seeds=[seeds[i]], weights=w)
        assert alone.tokens[0] == batch.tokens[i], i
    flipped = native_blockwise(model, src.flip(0), max_len=12, temperature=1.0, row_seeds=seeds[::-1], weights=w)
    assert flipped.tokens[::-1] == batch.tokens
    again = native_blockwise(model, src, max_len=12, temperature=1.0, row_seeds=seeds, weights=w)
    assert again.tokens == batch.tokens


@pytest.mark.parametrize("family,k,m,t,top_k,top_p", NATIVE_CASES)
def test_native_sampling_draws_whole_answers_from_the_models_distribution(family, k, m, t, top_k, top_p):
    model = MODELS[family](k)
    src = _source(family, model)
    exact = exact_distribution(model, src, m, t, top_k, top_p)
    r = native_sample(model, src.repeat(N, 1), max_len=m, temperature=t, top_k=top_k, top_p=top_p, seed=11)
    chi2, crit, tv, bound = fit(r.tokens, exact)
    print(f"NATIVE {family} T={t} top_k={top_k} top_p={top_p}: chi2={chi2:.1f} (crit {crit:.1f}) TV={tv:.4f}")
    assert chi2 < crit and tv < bound, (chi2, crit, tv, bound)


@pytest.mark.parametrize(
    "drawn,held",
    [((1.0, 4, 0.8), (1.0, 0, 1.0)), ((1.0, 0, 1.0), (1.0, 0, 0.8)), ((1.0, 0, 1.0), (0.8, 0, 1.0))],
    ids=["masks-against-none", "no-top-p-against-top-p", "temperature"],
)
def test_the_same_test_fails_when_the_draws_ignore_a_setting(drawn, held):
    """Draws made with one setting, held to the distribution of another (what a native loop ignoring top_p, or
    applying top_k where none was asked, or the wrong temperature, would give): the test must reject them."""
    model = MODELS["mt"](3)
    src = _source("mt", model)
    exact = exact_distribution(model, src, 3, *held)
    t, top_k, top_p = drawn
    r = native_sample(model, src.repeat(N, 1), max_len=3, temperature=t, top_k=top_k, top_p=top_p, seed=11)
    chi2, crit, tv, bound = fit_any(r.tokens, exact)
    assert chi2 > crit, (chi2, crit, tv, bound)


def fit_any(samples, exact):
    """fit() where samples may hold answers `exact` gives probability 0 (a mask applied that should not be): those
    count as one cell of expected count 0.5"""
    known = [s for s in samples if tuple(s) in exact]
    if len(known) == len(samples):
        return fit(samples, exact)
    return float("inf"), 0.0, 1.0, 0.0


@pytest.mark.parametrize("family", ["mt", "lm"])
def test_native_sampling_rows_do_not_depend_on_batch_mates_and_seeds_reproduce(family):
    model = MODELS[family](3)
    if family == "mt":
        src = random_sources(8, seed=8, vocab=8)
        rows = [src[i : i + 1, : int((src[i] != 0).sum())] for i in range(8)]
    else:
        src = torch.tensor([[1, 4, 6, 3], [1, 5, 3, 3], [1, 6, 6, 4], [1, 3, 7, 5]])
        rows = [src[i : i + 1] for i in range(src.shape[0])]
    seeds = [40 + 3 * i for i in range(src.shape[0])]
    batch = native_sample(model, src, max_len=12, temperature=1.0, row_seeds=seeds)
    assert len({len(t) for t in batch.tokens}) > 1
    for i, row in enumerate(rows):
        assert native_sample(model, row, max_len=12, temperature=1.0, row_seeds=[seeds[i]]).tokens[0] == batch.tokens[i]
    flipped = native_sample(model, src.flip(0), max_len=12, temperature=1.0, row_seeds=seeds[::-1])
    assert flipped.tokens[::-1] == batch.tokens
    assert native_sample(model, src, max_len=12, temperature=1.0, row_seeds=seeds).tokens == batch.tokens
    other = native_sample(model, src, max_len=12, temperature=1.0, row_seeds=[s + 1 for s in seeds])
    assert other.tokens != batch.tokens
    assert sample(model, src, max_len=12, temperature=0).tokens == greedy(model, src, max_len=12).tokens


@pytest.mark.parametrize("heads", ["chain", "medusa"])
def test_native_blockwise_sampling_with_chained_and_medusa_heads_keeps_the_distribution(heads):
    """Heads that read the token before their own (drafting after the token drawn, as the reference decoder's
    draft_logits does) and Medusa blocks, random: the same enumerated test, and top_k=1 is greedy."""
    from bpd_train.model.lm.config import LMConfig
    from bpd_train.model.lm.model import LMModel

    torch.manual_seed(9)
    cfg = LMConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, d_ff=32, block_size=3, eos_id=2, heads=heads)
    model = LMModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("heads"):
                p.normal_(0.0, 0.5)  # (heads start as copies of head 1: make them propose otherwise)
            elif p.dim() == 2:
                p.mul_(3.0)
    src = torch.tensor([[1, 4, 6, 3]])
    exact = exact_distribution(model, src, 3, 1.0)
    r = native_blockwise(model, src.repeat(N, 1), max_len=3, temperature=1.0, seed=11)
    chi2, crit, tv, bound = fit(r.tokens, exact)
    print(f"NATIVE {heads}: chi2={chi2:.1f} (crit {crit:.1f}) TV={tv:.4f} k-hat={r.mean_accepted:.2f}")
    assert chi2 < crit and tv < bound, (chi2, crit, tv, bound)
    assert r.mean_accepted > 1.0
    many = torch.tensor([[1, 4, 6, 3], [1, 5, 3, 3], [1, 6, 6, 4]])
    top1 = native_blockwise(model, many, max_len=10, temperature=0.7, top_k=1, seed=3)
    assert top1.tokens == greedy(model, many, max_len=10).tokens


def bigram_lm_with_right_chained_head():
    """A decoder-only model whose next token depends on the last token alone (its layers add nothing: a bigram
    model) and a chained head 2 that is right under sampling: it reads the token before its target, e(prev), through
    tok = c I, w1 = [I; -I], w2 = [I, -I] (w2 relu(w1 x) = x), so its state 2h + c e(prev) normalises to about
    e(prev)'s, and its distribution is the model's after prev, whatever prev was drawn."""
    from bpd_train.model.lm.config import LMConfig
    from bpd_train.model.lm.model import LMModel

    torch.manual_seed(5)
    d = 16
    cfg = LMConfig(
        vocab_size=8,
        d_model=d,
        n_layers=1,
        n_heads=2,
        d_ff=32,
        block_size=2,
        eos_id=2,
        heads="chain",
        head_d_hidden=2 * d,
        tie_output=False,
    )
    model = LMModel(cfg).eval()
    eye = torch.eye(d)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.o.weight.zero_()
            layer.mlp.down.weight.zero_()
        model.embed.weight.copy_(torch.randn(8, d))
        model.embed.weight[:, 0] = 2.0  # one shared direction, which the output reads for EOS alone: long answers
        model.lm_head.weight.copy_(torch.randn(8, d) * 0.5)
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[2, 0] = -3.0
        hd = model.heads
        hd.tok[0].copy_(1e4 * eye)
        hd.w1[0].copy_(torch.cat([eye, -eye], 0))
        hd.b1.zero_()
        hd.w2[0].copy_(torch.cat([eye, -eye], 1))
        hd.b2.zero_()
    return model


@pytest.mark.parametrize("native", [True, False])
def test_chained_heads_under_sampling_read_the_token_drawn(native):
    """Under sampling the token before head 2's target is the one drawn at the last accepted place, often not head
    1's argmax: a chained head that reads it proposes from the model's own distribution there, so speculative
    verification keeps nearly every draft (reading head 1's argmax instead kept two in three)."""
    model = bigram_lm_with_right_chained_head()
    src = torch.tensor([[1, 4, 6, 3]]).repeat(64, 1)
    plain = sample(model, src, max_len=15, temperature=1.0, seed=3).tokens
    assert len({t[0] for t in plain}) > 4  # the drawn tokens vary: often not the argmax
    run = native_blockwise if native else speculative_sample  # 15 tokens: the first, then 7 blocks of 2
    r = run(model, src, max_len=15, temperature=1.0, seed=3, verify="speculative", native=native)
    steps, two = sum(r.accepted_hist.values()), r.accepted_hist.get(2, 0)
    assert two / steps > 0.97, r.accepted_hist


@pytest.mark.parametrize("family", ["mt", "lm"])
def test_native_sampling_at_extreme_temperatures(family):
    """A temperature far below any logit gap is greedy's argmax (no overflow to inf - inf), one far above it draws
    among all tokens; neither fails."""
    model = MODELS[family](3)
    src = random_sources(4, seed=8, vocab=8) if family == "mt" else torch.tensor([[1, 4, 6, 3], [1, 5, 3, 3]])
    g = greedy(model, src, max_len=10).tokens
    assert native_sample(model, src, max_len=10, temperature=1e-45, seed=1).tokens == g
    assert native_blockwise(model, src, max_len=10, temperature=1e-45, seed=1).tokens == g
    hot = native_blockwise(model, src.repeat(50, 1), max_len=4, temperature=1e6, seed=1).tokens
    assert len({t for row in hot for t in row}) >= 6  # nearly uniform over the 8 ids


@pytest.mark.parametrize("family", ["mt", "lm"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_match_verification_returns_plain_samplings_own_tokens(family, heads, monkeypatch):
    """verify="match" keeps a draft only where it is the token plain sampling picks at that place (each place's
    randomness keyed by the seed and the position): blockwise sampling then returns plain sampling's tokens, row for
    row, whatever the heads draft, the batch, lookup or narrow steps; speculative verification does not."""
    model = set_heads(MODELS[family](3), "random" if heads == "random" else "right", monkeypatch)
    if family == "mt":
        src = random_sources(8, seed=8, vocab=8)
        looks = [{}]
    else:
        src = torch.tensor([[1, 4, 6, 4, 6, 3], [1, 5, 3, 5, 3, 5], [1, 6, 6, 4, 4, 3], [1, 3, 7, 5, 7, 5]])
        looks = [{}, {"lookup": 2}, {"lookup": 2, "narrow": 1}, {"lookup": 2, "narrow": 2}]
    seeds = [70 + 5 * i for i in range(src.shape[0])]
    for how in [dict(temperature=1.0), dict(temperature=0.6, top_k=3), dict(temperature=1.3, top_p=0.8)]:
        plain = native_sample(model, src, max_len=12, row_seeds=seeds, **how).tokens
        assert len({len(t) for t in plain}) > 1  # rows end at different steps
        for look in looks:
            opts = {**look, "draft_vocab": HEADS[heads]} if HEADS[heads] else look
            w = PackedWeights(DecodeOptions(**opts)) if opts else None
            for kb in (2, 3):
                r = native_blockwise(model, src, block_size=kb, max_len=12, row_seeds=seeds, weights=w, **how)
                assert r.tokens == plain, (how, look, kb)
                if heads == "right" and "top_k" not in how and look.get("narrow") != 1:
                    assert r.mean_accepted > 1.0, (how, look, kb)  # drafts were kept: not plain steps
    spec = native_blockwise(model, src, max_len=12, row_seeds=seeds, temperature=1.0, verify="speculative")
    assert spec.tokens != native_sample(model, src, max_len=12, row_seeds=seeds, temperature=1.0).tokens


@pytest.mark.parametrize("dtype", ["int8", "bf16", "q4"])
def test_every_precision_samples_natively_and_match_keeps_its_tokens(dtype, monkeypatch):
    """Each decode precision samples in the native loops: top_k = 1 is that precision's greedy decoding, and match
    verification returns plain sampling's tokens in it (with and without lookup and narrow steps)."""
    model = set_heads(MODELS["lm"](3), "right", monkeypatch)
    src = torch.tensor([[1, 4, 6, 4, 6, 3], [1, 5, 3, 5, 3, 5], [1, 6, 6, 4, 4, 3], [1, 3, 7, 5, 7, 5]])
    seeds = [70 + 5 * i for i in range(src.shape[0])]

    def weights(**kw):
        return PackedWeights(DecodeOptions(dtype=dtype, **kw))

    greedy_ids = greedy(model, src, max_len=12, weights=weights()).tokens
    assert native_sample(model, src, max_len=12, row_seeds=seeds, top_k=1, weights=weights()).tokens == greedy_ids
    for look in ({}, {"lookup": 2, "narrow": 2}):
        plain = native_sample(model, src, max_len=12, row_seeds=seeds, temperature=0.8, weights=weights(**look))
        r = native_blockwise(
            model, src, block_size=3, max_len=12, row_seeds=seeds, temperature=0.8, weights=weights(**look)
        )
        assert r.tokens == plain.tokens and r.mean_accepted > 1.0, look


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 0.9), (1.0, 0, 0.9), (1.0, 0, 0.5), (0.7, 50, 0.95),
                                                       (1.3, 0, 1.0), (1.0, 3000, 0.99)])  # fmt: skip
def test_the_native_distribution_is_the_references_over_a_full_vocabulary(temperature, top_k, top_p):
    """Sampler::probs (which ranks for top-p only the ids that can be in the nucleus) against decoding/sampling.py's
    sampling_probs over a real vocabulary's size: the same kept ids, ties included (logits on a grid of quarters),
    and the same probabilities to float rounding, for peaked and flat rows."""
    from bpd_train.decoding.sampling import sampling_probs
    from bpd_train.engine.fastlinear import native_kernels

    g = torch.Generator().manual_seed(4)
    v = 49152
    rows = torch.cat([torch.randn(3, v, generator=g) * s for s in (4.0, 1.5, 0.3)])
    rows = (rows * 4).round() / 4  # ties among the likeliest ids
    ref = sampling_probs(rows, temperature, top_k, top_p)
    if top_p < 1.0:  # (no row's nucleus ends within rounding of top_p: the set is unambiguous)
        cum = ref.sort(dim=-1, descending=True).values.cumsum(-1)
        assert ((cum - top_p).abs() > 1e-9).all()
    got = native_kernels().sampling_probs(rows, temperature, top_k, top_p)
    assert torch.equal(got > 0, ref > 0)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-12)
    kept = (got > 0).sum(-1)
    assert int(kept.min()) >= 1 and (top_p == 1.0 or int(kept[:3].max()) < int(kept[6:].min()))  # peaked < flat
