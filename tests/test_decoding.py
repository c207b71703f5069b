"""Decoders: blockwise == greedy, acceptance rules, beam search against a known table, batch independence,
bad inputs."""

import collections
import math

import numpy as np
import pytest
import torch
from torch import nn

import bpd_train.engine.weights as engine_weights
from bpd_train.decoding import Distance, Exact, TopK, beam_search, blockwise, greedy
from bpd_train.engine.mt import DecodeWeights
from bpd_train.model import BPDConfig, BPDModel

EOS = 2


def random_model(k, seed, vocab=7, std=0.08, eos_bias=0.5, scale=2.5, chain=False):
    """A random tiny model. Small head perturbations make heads 2..k often (not always) agree with head 1
    one step later, so multi-token blocks get accepted and rejected ones are rolled back. Scaling the
    decoder weights makes outputs less repetitive; the EOS bias makes rows end at different places.
    chain: chained heads (config.head_chain), their token maps and FFN outputs perturbed alike."""
    torch.manual_seed(seed)
    cfg = BPDConfig(
        vocab_size=vocab,
        d_model=16,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=2,
        d_ff=32,
        block_size=k,
        dropout=0.0,
        max_positions=64,
        head_chain=chain and k > 1,
    )
    m = BPDModel(cfg).eval()
    with torch.no_grad():
        if m.heads is not None and chain:
            m.heads.w2.normal_(0, std)
            m.heads.tok.normal_(0, 0.3)
        elif m.heads is not None:
            m.heads.fc2.weight.normal_(0, std)
        for name, p in m.named_parameters():
            if name.startswith("decoder_layers") and p.dim() == 2:
                p.mul_(scale)
        m.embed.weight[EOS] *= 1.0 + eos_bias
    return m


def random_sources(batch, seed, vocab=7, max_src=9):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_src + 1, (batch,), generator=g).tolist()
    src = torch.zeros(batch, max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        src[i, : n - 1] = torch.randint(3, vocab, (n - 1,), generator=g)
        src[i, n - 1] = EOS
    return src


def test_blockwise_exact_equals_greedy_with_real_multi_token_acceptance():
    sizes, partial = [], 0
    cases = eos_inside = 0
    for k in range(1, 9):
        for rep in range(3):
            seed = 10 * k + rep
            m = random_model(k, seed, eos_bias=1.5)
            b = [1, 5, 16][rep]
            src = random_sources(b, seed)
            max_len = (1.5, 4) if rep != 1 else 18
            g = greedy(m, src, max_len=max_len)
            r = blockwise(m, src, block_size=k, accept=Exact(), max_len=max_len)
            assert r.tokens == g.tokens, f"k={k} seed={seed}"
            assert r.calls <= g.calls and r.prefill_calls == 1
            assert sum(s * c for s, c in r.accepted_hist.items()) == pytest.approx(r.mean_accepted * r.row_steps)
            assert max(r.accepted_hist, default=1) <= k
            if k > 1:
                sizes.append(r.mean_accepted)
                # a block shorter than k that is not a row's last step means proposals were rolled back
                partial += sum(c for s, c in r.accepted_hist.items() if 1 <= s < k)
            else:
                assert r.mean_accepted == 1.0 and r.calls == g.calls
            limits = [max_len] * b if isinstance(max_len, int) else [int(1.5 * int((s != 0).sum()) + 4) for s in src]
            eos_inside += sum(0 < len(t) < n for t, n in zip(r.tokens, limits))
            cases += 1
    assert cases == 24
    assert eos_inside >= 5  # some rows ended by EOS after some tokens, not only by max_len
    assert sum(sizes) / len(sizes) > 1.2, sizes
    assert partial > 20


def test_blockwise_smaller_block_than_k_and_rows_of_different_lengths():
    m = random_model(6, seed=1)
    src = random_sources(12, seed=1)
    g = greedy(m, src, max_len=(2.0, 1))
    for b in (2, 3, 6):
        r = blockwise(m, src, block_size=b, max_len=(2.0, 1))
        assert r.tokens == g.tokens
        assert max(r.accepted_hist) <= b
    assert len({len(t) for t in g.tokens}) > 3  # rows really had different lengths


def test_topk1_equals_exact_and_relaxed_rules_accept_more():
    m = random_model(5, seed=7, std=0.3)
    src = random_sources(8, seed=7)
    exact = blockwise(m, src, accept=Exact(), max_len=20)
    assert blockwise(m, src, accept=TopK(1), max_len=20).tokens == exact.tokens
    assert blockwise(m, src, accept="topk:1", max_len=20).tokens == exact.tokens
    assert blockwise(m, src, accept=Distance(0), max_len=20).tokens == exact.tokens
    loose = blockwise(m, src, accept=TopK(3), max_len=20)
    assert loose.mean_accepted >= exact.mean_accepted
    assert blockwise(m, src, accept=Distance(1), max_len=20).mean_accepted >= exact.mean_accepted
    forced = blockwise(m, src, min_block=5, max_len=20)  # every step keeps a full block
    # only a row's last step (EOS or max_len) may keep fewer than 5
    assert sum(c for s, c in forced.accepted_hist.items() if s < 5) <= 8 and forced.accepted_hist[5] > 0


class OracleModel(nn.Module):
    """A fake BPD model with scripted heads: at decoder slot s (slot 0 = BOS) head i predicts token s+i of
    the row's script (EOS past its end), except at (slot, head) pairs listed in `wrong`. Lets tests
    check blockwise bookkeeping (acceptance, rollback, EOS inside a block, max_len) step by step."""

    def __init__(self, scripts, k, wrong=(), vocab=8):
        super().__init__()
        self.config = BPDConfig(vocab_size=vocab, d_model=8, n_heads=1, block_size=k, max_positions=64)
        self.scripts, self.wrong, self.k, self.v = scripts, set(wrong), k, vocab

    def encode(self, src, weights=None):
        return src[:, 0]  # the script id

    def start_decoding(self, memory, capacity, expand=1, weights=None):
        st = _OracleState(memory.repeat_interleave(expand), capacity)
        st.weights = _FakeWeights(self)
        return st

    def decode(self, state, tokens, kv_len=None):
        r, n = tokens.shape
        lens = [state.lengths] * r if isinstance(state.lengths, int) else state.lengths.tolist()
        out = torch.full((r, n, self.k, self.v), -10.0)
        for row in range(r):
            script = self.scripts[int(state.keys[row])]
            for j in range(n):
                slot = lens[row] + j
                state.fed[row, slot] = tokens[row, j]
                for i in range(self.k):
                    tok = script[slot + i] if slot + i < len(script) else EOS
                    if (slot, i) in self.wrong:
                        tok = 3 if tok != 3 else 4
                    out[row, j, i, tok] = 10.0
        return out.view(r, n, self.k * self.v)

    def head_logits(self, h, i):
        return h[..., i * self.v : (i + 1) * self.v]

    def heads_logits(self, h, lo=0, hi=None):
        hi = self.k if hi is None else hi
        return h[..., lo * self.v : hi * self.v].reshape(*h.shape[:-1], hi - lo, self.v)


@pytest.fixture(autouse=True)
def _fake_models_bring_their_step_weights(monkeypatch):
    """The decoders get a model's step weights from a packed-weight cache (engine/weights.py); the scripted models
    here have no layers to pack: their cache builds the fake step weights below."""
    real = engine_weights.build_step_weights

    def build(model, options):
        return _FakeWeights(model) if isinstance(model, (OracleModel, TableModel)) else real(model, options)

    monkeypatch.setattr(engine_weights, "build_step_weights", build)


class _FakeWeights:
    """The decode-step interface decoders use (engine/mt.py DecodeWeights) over a fake model's heads."""

    def __init__(self, model):
        self.m, self.draft_ids, self.vocab_size = model, None, model.config.vocab_size

    def head1(self, h):
        return self.m.head_logits(h, 0)

    def head1_argmax(self, h):
        return self.head1(h).argmax(-1)

    def propose(self, h, lo, hi, first=None):
        return self.m.heads_logits(h, lo, hi).argmax(-1)

    native_loop = None  # greedy stretches: DecodeWeights' one-step-at-a-time loop over this interface

    def greedy_steps(self, model, state, tok, room, max_steps):
        return DecodeWeights.greedy_steps(self, model, state, tok, room, max_steps)

    def block_steps(self, model, state, x, room, max_steps, width=None, rule=None):
        return None  # no native blockwise loop: the decoder runs its Python steps


class _OracleState:
    def __init__(self, keys, capacity):
        self.keys, self.lengths = keys, 0
        self.fed = torch.zeros(keys.shape[0], capacity, dtype=torch.long)  # what the decoder saw per slot

    def per_row(self):
        if isinstance(self.lengths, int):
            self.lengths = torch.full((self.keys.shape[0],), self.lengths, dtype=torch.long)
        return self

    def reorder(self, index):
        self.keys, self.fed = self.keys[index], self.fed[index]
        if not isinstance(self.lengths, int):
            self.lengths = self.lengths[index]


SCRIPT = [3, 4, 5, 6, 7, 3, 4, EOS]


def test_blockwise_bookkeeping_step_by_step():
    src = torch.tensor([[0, EOS]])
    # all heads right: prefill gives 3; step 1 accepts [4,5,6]+7; step 2 accepts [3,4,EOS] and ends on the EOS
    r = blockwise(OracleModel({0: SCRIPT}, k=4), src, max_len=50)
    assert r.tokens == [SCRIPT[:-1]] and r.calls == 2 and r.accepted_hist == {4: 1, 3: 1}
    # head 3 wrong at slot 4: step 2 keeps [3]+4 and rolls back the rest; step 3 ends on the EOS
    m = OracleModel({0: SCRIPT}, k=4, wrong={(4, 2)})
    st = {}
    orig = m.start_decoding
    m.start_decoding = lambda *a, **kw: st.setdefault("s", orig(*a, **kw))
    r = blockwise(m, src, max_len=50)
    assert r.tokens == [SCRIPT[:-1]] and r.calls == 3 and r.accepted_hist == {4: 1, 2: 1, 1: 1}
    assert st["s"].fed[0, :8].tolist() == [1] + SCRIPT[:7]  # slot 7 held a rejected proposal, then 4
    # max_len inside a block truncates it
    r = blockwise(OracleModel({0: SCRIPT}, k=4), src, max_len=3)
    assert r.tokens == [SCRIPT[:3]] and r.accepted_hist == {2: 1}
    # rows of different lengths and errors in one batch == each row alone == greedy
    scripts = {0: SCRIPT, 1: [5, EOS], 2: [6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5, EOS], 3: [EOS]}
    m = OracleModel(scripts, k=3, wrong={(1, 1), (3, 2), (6, 1)})
    src = torch.tensor([[i, EOS] for i in range(4)])
    together = blockwise(m, src, max_len=50)
    assert together.tokens == [s[:-1] for s in scripts.values()] == greedy(m, src, max_len=50).tokens
    alone = [blockwise(m, src[i : i + 1], max_len=50) for i in range(4)]
    assert together.tokens == [a.tokens[0] for a in alone]
    merged = sum((collections.Counter(a.accepted_hist) for a in alone), collections.Counter())
    assert together.accepted_hist == dict(merged)


class TableModel(nn.Module):
    """A fake model for the decoders: next-token probabilities come from a table keyed by the prefix of
    generated tokens (anything not in the table ends with EOS). Implements the decoding interface only."""

    def __init__(self, table, vocab=6):
        super().__init__()
        self.config = BPDConfig(vocab_size=vocab, d_model=vocab, n_heads=1, block_size=1, max_positions=32)
        self.table = table
        self.vocab = vocab

    def encode(self, src, weights=None):
        return src

    def start_decoding(self, memory, capacity, expand=1, weights=None):
        st = _TableState(memory.shape[0] * expand, capacity)
        st.weights = _FakeWeights(self)
        return st

    def decode(self, state, tokens, kv_len=None):
        n = tokens.shape[1]
        state.buf[:, state.lengths : state.lengths + n] = tokens
        out = torch.full((tokens.shape[0], n, self.vocab), -1e9)
        for r in range(tokens.shape[0]):
            for j in range(n):
                prefix = tuple(state.buf[r, 1 : state.lengths + j + 1].tolist())
                for tok, p in self.table.get(prefix, {EOS: 1.0}).items():
                    out[r, j, tok] = math.log(p)
        return out

    def head_logits(self, h, i):
        return h


class _TableState:
    def __init__(self, rows, capacity):
        self.buf = torch.zeros(rows, capacity, dtype=torch.long)
        self.lengths = 0

    def reorder(self, index):
        self.buf = self.buf.index_select(0, index)


# Greedy takes 3 (0.5) then 3 (0.4): p = 0.2; the best hypothesis is [4] (0.4 * 0.9 = 0.36).
TABLE = {
    (): {3: 0.5, 4: 0.4, 5: 0.05, EOS: 0.05},
    (3,): {3: 0.4, 4: 0.3, 5: 0.3},
    (4,): {EOS: 0.9, 5: 0.1},
    (3, 3): {EOS: 1.0},
    (3, 4): {EOS: 1.0},
    (3, 5): {EOS: 1.0},
    (4, 5): {5: 1.0},
    (4, 5, 5): {EOS: 1.0},
}


def test_beam_search_finds_the_known_best_hypothesis():
    model = TableModel(TABLE)
    src = torch.tensor([[3, EOS], [4, EOS]])
    assert greedy(model, src, max_len=10).tokens == [[3, 3], [3, 3]]
    for alpha in (0.0, 0.6):
        r = beam_search(model, src, beam_size=2, length_penalty=alpha, max_len=10)
        assert r.tokens == [[4], [4]]
        assert r.scores[0] == pytest.approx(math.log(0.36) / ((5 + 2) / 6) ** alpha, abs=1e-5)
    assert beam_search(model, src, beam_size=1, max_len=10).tokens == [[3, 3], [3, 3]]
    # max_len forces EOS: with room for one token only, [4] still wins; with none, the empty hypothesis
    assert beam_search(model, src, beam_size=3, max_len=1).tokens == [[4], [4]]
    r0 = beam_search(model, src, beam_size=3, max_len=0)
    assert r0.tokens == [[], []] and r0.scores[0] == pytest.approx(math.log(0.05))


def test_beam_size_one_equals_greedy_on_random_models():
    for seed in range(3):
        m = random_model(2, seed=100 + seed, eos_bias=0.5)
        src = random_sources(6, seed=seed)
        assert beam_search(m, src, beam_size=1, max_len=(1.0, 3)).tokens == greedy(m, src, max_len=(1.0, 3)).tokens


def test_results_do_not_depend_on_batch_composition_or_padding():
    m = random_model(4, seed=42, eos_bias=0.5)
    src = random_sources(7, seed=42)
    wide = torch.cat([src, torch.zeros(7, 5, dtype=torch.long)], 1)  # extra padding columns
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    for decode in (
        lambda s: greedy(m, s, max_len=(1.5, 3)),
        lambda s: blockwise(m, s, max_len=(1.5, 3)),
        lambda s: blockwise(m, s, block_size=3, accept=TopK(2), max_len=(1.5, 3)),
        lambda s: beam_search(m, s, beam_size=3, max_len=(1.5, 3)),
    ):
        together = decode(src).tokens
        alone = [decode(src[i : i + 1, : int((src[i] != 0).sum())]).tokens[0] for i in range(7)]
        assert together == alone
        assert decode(wide).tokens == together
        assert decode(src[perm]).tokens == [together[i] for i in perm.tolist()]
    # lists of id lists are accepted too
    assert (
        greedy(m, [r[r != 0].tolist() for r in src], max_len=(1.5, 3)).tokens == greedy(m, src, max_len=(1.5, 3)).tokens
    )


def test_bad_inputs_raise_value_errors():
    m = random_model(3, seed=0)
    src = random_sources(2, seed=0)
    with pytest.raises(ValueError, match="exceeds"):
        blockwise(m, src, block_size=4)
    with pytest.raises(ValueError, match="empty batch"):
        greedy(m, torch.zeros(0, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="empty batch"):
        blockwise(m, [])
    with pytest.raises(ValueError, match="max_positions"):
        beam_search(m, torch.full((1, 65), 4))
    with pytest.raises(ValueError, match="max_positions"):
        blockwise(m, torch.full((1, 65), 4))
    for rule in ("nucleus", object(), {"name": "topk", "bogus": 1}):
        with pytest.raises(ValueError, match="acceptance rule"):
            blockwise(m, src, accept=rule)
    with pytest.raises(ValueError):
        blockwise(m, src, min_block=4)
    with pytest.raises(ValueError):
        greedy(m, src, max_len="long")


def test_decoders_restore_training_mode_and_do_not_track_gradients():
    m = random_model(2, seed=1)
    m.train()
    src = random_sources(3, seed=1)
    with torch.enable_grad():
        blockwise(m, src, max_len=5)
    assert m.training
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decoders_on_cuda_match_cpu():
    m = random_model(4, seed=3)
    src = random_sources(9, seed=3)
    cpu = greedy(m, src, max_len=20).tokens
    mc = m.cuda()
    assert greedy(mc, src.cuda(), max_len=20).tokens == cpu
    assert blockwise(mc, src.cuda(), max_len=20).tokens == cpu
    assert (
        beam_search(mc, src, beam_size=2, max_len=20).tokens
        == beam_search(m.cpu(), src, beam_size=2, max_len=20).tokens
    )


@pytest.mark.parametrize("copy", ["native", "torch"])
@pytest.mark.parametrize("uniform", [True, False])
def test_cache_reorder_copies_only_moved_rows_and_every_row_follows_its_index(uniform, copy, monkeypatch):
    """DecoderState.reorder: after keeping rows `index` (keep_rows' order, a plain sorted subset, a permutation
    with repeats as beam search makes), row i holds row index[i]'s filled cache prefix, memory and length; with
    keep_rows' order only the rows that changed place are copied, in place."""
    from bpd_train.decoding.common import keep_rows
    from bpd_train.engine import fastlinear, packed
    from bpd_train.model.cache import DecoderState

    if copy == "torch":
        monkeypatch.setattr(packed, "loaded_kernels", lambda: None)
    elif fastlinear.native_kernels() is None:
        pytest.skip("native decode kernels not built on this machine")
    g = torch.Generator().manual_seed(0)
    rows, cap, S = 7, 9, 5
    done = np.array([0, 1, 0, 0, 1, 0, 1], dtype=bool)
    for index in (keep_rows(done), np.flatnonzero(~done), np.array([3, 3, 0, 6, 1, 2, 5])):
        self_kv = torch.randn(2, 2, rows, 3, cap, 4, generator=g)
        mem_kv = torch.randn(2, 2, rows, 3, S, 4, generator=g)
        mask = torch.zeros(rows, 1, 1, S).masked_fill_(torch.rand(rows, 1, 1, S, generator=g) < 0.3, float("-inf"))
        st = DecoderState(self_kv.clone(), mem_kv.clone(), mask.clone(), max_positions=64)
        lengths = np.array([5, 2, 6, 4, 3, 6, 1], dtype=np.int64)
        st.lengths = 6 if uniform else lengths.copy()
        before = st.self_kv.data_ptr()
        st.reorder(torch.from_numpy(index))
        t = 6
        assert st.self_kv.shape[2] == st.mem_kv.shape[2] == len(index) and st.self_kv.data_ptr() == before
        for i, r in enumerate(index):
            assert torch.equal(st.self_kv[:, :, i, :, :t], self_kv[:, :, r, :, :t])
            assert torch.equal(st.mem_kv[:, :, i], mem_kv[:, :, r]) and torch.equal(st.mem_mask[i], mask[r])
            if not uniform:
                assert st.lengths[i] == lengths[r]
    # keep_rows moves one row per finished row inside the new batch: rows 0, 2, 3 stay, row 5 takes row 1's place
    assert keep_rows(done).tolist() == [0, 5, 2, 3]
