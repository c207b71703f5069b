"""Candidate trees under sampling (DecodeOptions.tree with temperature > 0, a call of one row, engine/csrc/
sample_loop.h): from the root down each reached node's token is drawn from the model's sampling distribution there
and the path follows the child holding it. With match verification that draw is plain sampling's own choice at the
place, so the answers are plain sampling's token for token (in fp32, bf16 and int8, with and without lookup, for
several model configurations) -- which also checks that the accepted path's K/V moved where a chain's would be: with
the moves switched off every one of these comparisons fails. With speculative verification the whole short answers
of many one-row calls are distributed as the model's exact sequence probabilities (tests/test_speculative.py's
enumeration and decision rule)."""

import numpy as np
import pytest
import torch
from test_native_sampling import native_blockwise, native_sample
from test_speculative import exact_distribution, fit, set_heads, tiny_lm

from bpd_train.decoding import greedy, speculative_sample
from bpd_train.engine.packed import DecodeOptions, parse_tree
from bpd_train.engine.weights import PackedWeights
from tests.test_lm_engine import CONFIGS, lm, prompts

# siblings, a node under a second choice (two K/V moves when accepted), a top-1 chain three heads deep
TREE = "0,0,0;1;2;1,0;1,1"
N_TREE = 8_000  # one-row calls (trees act in a call of one row): ~0.8 ms each


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_match_with_candidate_trees_returns_plain_samplings_tokens(dtype):
    """Each prompt alone with a tree gives plain sampling's tokens for its seed, as the chain does, in fewer calls
    (nodes off the top-1 chain are accepted), with head 1 computed at every node in one pass or node by node; a batch
    with the same options (trees do not act there) too."""
    calls = {"chain": 0, "tree": 0}
    for i, (heads, kv, bias, tie, extra) in enumerate([CONFIGS[0], CONFIGS[2], CONFIGS[5]]):
        m = lm(80 + i, heads, k=4, kv=kv, qkv_bias=bias, tie=tie, **extra)
        src = prompts(5, 90 + i, longest=10)
        seeds = [7 + 3 * j for j in range(len(src))]
        for how in [dict(temperature=1.0), dict(temperature=0.6, top_k=3), dict(temperature=1.3, top_p=0.8)]:
            pw = PackedWeights(DecodeOptions(dtype=dtype))
            plain = native_sample(m, src, max_len=40, row_seeds=seeds, weights=pw, **how).tokens
            for lookup in (0, 3):
                chain_w = PackedWeights(DecodeOptions(dtype=dtype, lookup=lookup))
                tree_w = PackedWeights(DecodeOptions(dtype=dtype, lookup=lookup, tree=parse_tree(TREE)))
                for j, p in enumerate(src):
                    chain = native_blockwise(m, [p], max_len=40, row_seeds=[seeds[j]], weights=chain_w, **how)
                    tree_w.get(m).batch_verify_group = 64 if j % 2 else 1  # head 1 at all nodes at once, or as reached
                    tree = native_blockwise(m, [p], max_len=40, row_seeds=[seeds[j]], weights=tree_w, **how)
                    assert tree.tokens[0] == plain[j] == chain.tokens[0], (heads, how, lookup, j)
                    assert max(tree.accepted_hist) <= 4
                    calls["chain"] += chain.calls
                    calls["tree"] += tree.calls
                batch = native_blockwise(m, src, max_len=40, row_seeds=seeds, weights=tree_w, **how)
                assert batch.tokens == plain, (heads, how, lookup, "batch")
    assert calls["tree"] < 0.95 * calls["chain"], calls


def test_a_tree_at_temperature_0_is_greedy():
    heads, kv, bias, tie, extra = CONFIGS[0]
    m = lm(81, heads, k=4, kv=kv, qkv_bias=bias, tie=tie, **extra)
    src = prompts(4, 91, longest=10)
    w = PackedWeights(DecodeOptions(lookup=3, tree=parse_tree(TREE)))
    g = greedy(m, src, max_len=30).tokens
    assert [speculative_sample(m, [p], max_len=30, temperature=0, weights=w).tokens[0] for p in src] == g


@pytest.mark.parametrize(
    "heads,lookup,t,top_p", [("random", 2, 1.0, 1.0), ("right", 0, 0.7, 0.8)], ids=["random+lookup", "right+top_p"]
)
def test_speculative_trees_keep_the_distribution(heads, lookup, t, top_p, monkeypatch):
    """N_TREE one-row calls with a tree and speculative verification: their whole answers against the exact
    sequence distribution (chi-square at 1e-3 and the TV bound). With lookup, steps after a repeat of two tokens
    are chains verified with min(1, p/q) and the residual, the others trees."""
    m_len = 4
    model = set_heads(tiny_lm(3, seed=4), heads, monkeypatch)
    src = torch.tensor([[1, 4, 6, 4, 6, 3]]) if lookup else torch.tensor([[1, 4, 6, 3]])
    exact = exact_distribution(model, src, m_len, t, 0, top_p)
    w = PackedWeights(DecodeOptions(lookup=lookup, tree=parse_tree("0,0;1;2")))
    chain_w = PackedWeights(DecodeOptions(lookup=lookup))
    kw = dict(max_len=m_len, temperature=t, top_p=top_p, verify="speculative")
    native_blockwise(model, src, seed=0, weights=w, **kw)  # (the native loop runs these calls)
    runs = [speculative_sample(model, src, seed=s, weights=w, **kw) for s in range(N_TREE)]
    tokens = [r.tokens[0] for r in runs]
    chi2, crit, tv, bound = fit(tokens, exact)
    mean = float(np.mean([r.mean_accepted for r in runs]))
    chained = [speculative_sample(model, src, seed=s, weights=chain_w, **kw) for s in range(200)]
    print(
        f"TREES {heads} lookup={lookup}: chi2={chi2:.1f} (crit {crit:.1f}) TV={tv:.4f} (bound {bound:.4f}) k-hat={mean:.2f}"
    )
    assert chi2 < crit and tv < bound, (chi2, crit, tv, bound)
    assert [r.tokens[0] for r in chained] != tokens[:200]  # the trees drew otherwise than the chain
    if heads == "right":
        assert mean > float(np.mean([r.mean_accepted for r in chained]))  # second choices were accepted too
