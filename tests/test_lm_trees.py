"""Candidate trees on the decoder-only native loop (DecodeOptions.tree): a step whose context does not repeat two
tokens feeds the fed token and a tree of the heads' ranked proposals; every node attends to the context and its
own ancestors, so exact blockwise decoding stays greedy's token for token, and a node off the top-1 chain, once
accepted, has its K/V moved to the chain's slots."""

import re

import numpy as np
import pytest
import torch

from bpd_train.decoding import blockwise, greedy
from bpd_train.decoding.settings import DecodeError, DecodeSettings, decode_options
from bpd_train.engine.packed import DecodeOptions, parse_tree, tree_rows
from bpd_train.engine.weights import PackedWeights
from tests.test_decoding import random_model
from tests.test_lm_engine import CONFIGS, lm, prompts

# siblings, a node under a second choice (two K/V moves when accepted), a top-1 chain three heads deep
TREE = "0,0,0;1;2;1,0;1,1"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_trees_keep_greedy_output_and_accept_nodes_off_the_top_chain(dtype):
    """Whole decodes with a tree, with and without lookup, alone and in a batch (where trees do not act), equal
    greedy's; on a 12-token vocabulary the heads' second and third choices are right often enough that a tree
    step gains more tokens than a step feeding the top-1 chain alone (fewer calls over the same tokens)."""
    calls = {"chain": 0, "tree": 0}
    for i, (heads, kv, bias, tie, extra) in enumerate([CONFIGS[0], CONFIGS[2], CONFIGS[3], CONFIGS[5]]):
        m = lm(80 + i, heads, k=4, kv=kv, qkv_bias=bias, tie=tie, **extra)
        src = prompts(6, 90 + i, longest=10)
        pw_m = PackedWeights(DecodeOptions(dtype=dtype))
        g = greedy(m, src, max_len=40, weights=pw_m)
        for lookup in (0, 3):
            pw_m = PackedWeights(DecodeOptions(dtype=dtype, lookup=lookup))
            chain = [blockwise(m, [p], max_len=40, adaptive=False, weights=pw_m) for p in src]
            pw_m = PackedWeights(DecodeOptions(dtype=dtype, lookup=lookup, tree=parse_tree(TREE)))
            assert pw_m.get(m).narrows
            tree = [blockwise(m, [p], max_len=40, weights=pw_m) for p in src]
            assert [r.tokens[0] for r in tree] == g.tokens == [r.tokens[0] for r in chain], (heads, lookup)
            assert blockwise(m, src, max_len=40, weights=pw_m).tokens == g.tokens, (heads, lookup, "batch")
            assert all(max(r.accepted_hist, default=1) <= 4 for r in tree)
            calls["chain"] += sum(r.calls for r in chain)
            calls["tree"] += sum(r.calls for r in tree)
    assert calls["tree"] < 0.95 * calls["chain"], calls


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_tree_step_gives_the_chains_bits_and_hands_back_its_top_chain(dtype):
    """Driven one native step per call: the decoder output at the last accepted node is bit for bit that of the
    same tokens decoded as a chain from scratch (the kept scores sit in a chain's lanes; the accepted path's K/V
    moved to the chain's slots), whichever node was accepted; the next fed block is the tree's top-1 chain."""
    m = lm(95, "medusa", k=4, kv=1, qkv_bias=True, tie=True)
    src = prompts(12, 96, longest=40)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype))
    g = greedy(m, src, max_len=30, weights=pw_m)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype, tree=parse_tree("0,0;1,0;2")))
    w = pw_m.get(m)
    gained = []
    for p, gt in zip(src, g.tokens):
        with torch.inference_mode():
            _w = pw_m.get(m)
            state = m.start_decoding(m.encode(torch.tensor([p]), _w), 30 + tree_rows(w.options.tree), weights=_w)
            x, out = state.first[0].numpy(), []
            for _ in range(30):
                state.lengths = len(out)
                toks, nc, nxt, hn, ended = w.block_steps(m, state, x, 30 - len(out), 1, width=4, context=None)
                out += toks.tolist()
                gained.append(int(nc[0, 0]))
                if nc[0, 1] == nc[0, 0] + 1:  # (a step cut short by room or a stop hands back fewer tokens)
                    _w = pw_m.get(m)
                    ref = m.start_decoding(m.encode(torch.tensor([p]), _w), 40, weights=_w)
                    fed = torch.tensor([[int(state.first[0, 0])] + out[:-1]])
                    assert torch.equal(m.decode(ref, fed)[0, -1], hn), (p, out)
                if ended or len(out) >= 30:
                    break
                assert len(nxt) == 3  # the root and the top-1 chain (0, 0): two heads deep
                x = nxt
        assert out[: len(gt)] == gt[: len(out)]
    assert max(gained) >= 1


def test_tree_options_are_checked_with_one_clear_message():
    assert parse_tree("0 1;1,0") == ((0,), (1,), (1, 0))
    assert parse_tree([[1], [0, 2]]) == ((0, 2), (1,))
    assert parse_tree(None) == parse_tree("none") == parse_tree("") == ()
    assert parse_tree("0") == ((0,),)  # head 2's first choice: narrow steps, plus the lookup's branch
    assert tree_rows(parse_tree("0;1;1,0")) == 5 and tree_rows(()) == 0
    many = ";".join(map(str, range(70)))
    for bad, what in [
        ("a", "rank paths"),
        (0, "rank paths"),
        ("0;-1", "rank >= 0"),
        ([[]], "rank >= 0"),
        (many, "at most"),
    ]:
        with pytest.raises(ValueError, match=what):
            parse_tree(bad)
        with pytest.raises(DecodeError, match=f"^tree={re.escape(repr(bad))}: expected .*{what}"):  # checked once
            DecodeSettings(tree=bad)
    assert decode_options(DecodeSettings(tree="0;1", lookup=3), None, 2, "cpu").tree == ((0,), (1,))
    m = lm(97, "medusa", k=3)
    pw = PackedWeights(DecodeOptions(tree=parse_tree("0,0,0")))  # three heads deep, two heads here
    with pytest.raises(ValueError, match="block size of at least 4"):
        blockwise(m, prompts(1, 98), max_len=8, weights=pw)
    np.testing.assert_equal(len(parse_tree("0;0;1")), 2)  # repeats count once
    c = lm(99, "chain", k=3)  # chained heads propose one token per head: no ranks to branch on
    pw_c = PackedWeights(DecodeOptions(tree=parse_tree("0;1")))
    with pytest.raises(ValueError, match="chained heads"):
        pw_c.get(c)
    mt = random_model(3, 0)
    pw_mt = PackedWeights(DecodeOptions(tree=parse_tree("0;1")))
    with pytest.raises(ValueError, match="decoder-only"):
        pw_mt.get(mt)
