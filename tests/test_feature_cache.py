"""The frozen backbone's hidden states cached per training row (training/feature_cache.py): a batch whose rows
were all seen is assembled from the cache with the states a fresh forward gives, whatever the batch's padding;
the regime module uses it only where the backbone is frozen, dropout-free and decoder-only, and the loss and the
heads' gradients are the recomputed ones."""

import torch

from bpd_train.model.lm.config import LMConfig
from bpd_train.model.lm.model import LMModel
from bpd_train.training.feature_cache import FeatureCache
from bpd_train.training.module import BPDLightningModule

PAD = -1


def _lm(k=3, dropout=0.0, heads="medusa") -> LMModel:
    torch.manual_seed(0)
    return LMModel(
        LMConfig(
            vocab_size=40,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=48,
            block_size=k,
            heads=heads,
            head_d_hidden=24,
            dropout=dropout,
        )
    ).eval()


def _draft_module(draft: int, heads: str = "medusa") -> BPDLightningModule:
    """A k = 4 regime module with the draft-vocabulary loss over the lowest `draft` ids and random heads."""
    m = BPDLightningModule(
        _lm(k=4, heads=heads).config.to_dict(),
        {"name": "t", "block_size": 4, "head_loss": "mean", "trainable": "heads", "init_from": "x"},
        {"optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-2}},
        {"draft_lowest_ids": draft, "recompute": False},
        seed=3,
    )
    with torch.no_grad():
        for p in m.model.head_parameters():
            p.normal_(0, 0.2)
    m.train()
    return m


def _prompted_batch(seed: int) -> dict:
    """Four rows whose prompts (of different lengths) have no targets."""
    rows = _rows([9, 14, 6, 12], seed=seed)
    tokens = _batch([r[:-1] for r in rows], width=16)
    targets = torch.full_like(tokens, PAD)
    for i, (r, prompt) in enumerate(zip(rows, (5, 2, 4, 8))):
        targets[i, prompt - 1 : len(r) - 1] = torch.tensor(r[prompt:])
    return {"tokens": tokens, "targets": targets, "prompts": [r[:1] for r in rows]}


def _same_loss_and_gradients(m, b: dict, draft: int, logits_of) -> torch.Tensor:
    """The module's draft-vocabulary loss on batch b and its heads' gradients equal the mean over heads 1-3 of the
    cross-entropy of logits_of(h, i) [B,T,V] over the lowest `draft` ids (targets outside ignored). Returns h."""
    import torch.nn.functional as F

    targets = b["targets"]
    loss, _ = m.compute_loss(b, [1, 2, 3], [1 / 3] * 3)
    loss.backward()
    got = [p.grad.clone() for p in m.model.head_parameters()]
    m.zero_grad()
    h = m.model.features(b["tokens"]).detach()
    want = 0.0
    for i in (1, 2, 3):
        t = torch.full_like(targets, PAD)
        t[:, :-i] = targets[:, i:]
        t[t >= draft] = PAD
        lg = logits_of(h, i)[..., :draft]
        want = want + F.cross_entropy(lg.reshape(-1, draft), t.reshape(-1), ignore_index=PAD) / 3
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-5
    assert all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(got, m.model.head_parameters()))
    m.zero_grad()
    return h


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 40, (n,), generator=g).tolist() for n in lengths]


def _batch(rows, width=None):
    t = width or max(map(len, rows))
    out = torch.full((len(rows), t), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def test_rows_come_back_from_the_cache_whatever_the_batch():
    model = _lm()
    rows = _rows([5, 9, 3, 7])
    cache = FeatureCache(PAD, 1 << 30)
    first = _batch(rows[:2])
    with torch.no_grad():
        h = cache.features(first, lambda: model.features(first))
    assert cache.misses == 1 and cache.hits == 0 and len(cache.rows) == 2
    # the same rows in another order and width (more padding): a hit, equal to a fresh forward where it is real
    again = _batch([rows[1], rows[0]], width=12)
    calls = []
    got = cache.features(again, lambda: calls.append(1))
    assert not calls and cache.hits == 1
    with torch.no_grad():
        fresh = model.features(again)
    for i, r in enumerate([rows[1], rows[0]]):
        assert torch.allclose(got[i, : len(r)], fresh[i, : len(r)], atol=1e-5)
        assert torch.equal(got[i, len(r) :], torch.zeros_like(got[i, len(r) :]))
    assert torch.equal(got[1, :5], h[0, :5])
    # one unseen row: the whole batch is computed (and the new row kept)
    mixed = _batch([rows[0], rows[2]])
    with torch.no_grad():
        cache.features(mixed, lambda: model.features(mixed))
    assert cache.misses == 2 and len(cache.rows) == 3
    # a different row of the same length is another key
    other = _batch([[(t + 1) % 40 for t in rows[2]]])
    with torch.no_grad():
        cache.features(other, lambda: model.features(other))
    assert cache.misses == 3 and len(cache.rows) == 4


def test_the_budget_caps_what_is_kept():
    model = _lm()
    rows = _rows([8, 8, 8])
    per_row = 8 * 32 * 4
    cache = FeatureCache(PAD, 2 * per_row)
    b = _batch(rows)
    with torch.no_grad():
        cache.features(b, lambda: model.features(b))
    assert len(cache.rows) == 2 and cache.bytes == 2 * per_row


def _module(dropout=0.0, gb=1.0, trainable="heads"):
    cfg = _lm(dropout=dropout).config.to_dict()
    reg = {
        "name": "t",
        "block_size": 3,
        "head_loss": "mean",
        "trainable": trainable,
        "init_from": "x",
        "feature_cache_gb": gb,
    }
    optim = {
        "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-2},
        "schedule": {"name": "constant", "warmup_steps": 0},
    }
    return BPDLightningModule(cfg, reg, optim, {}, seed=3)


def _lm_batch(rows):
    tokens = _batch([r[:-1] for r in rows])
    targets = torch.full_like(tokens, PAD)
    for i, r in enumerate(rows):
        targets[i, 1 : len(r) - 1] = torch.tensor(r[2:])  # a one-token prompt, then the response
    return {"tokens": tokens, "targets": targets, "prompts": [r[:1] for r in rows]}


def test_the_module_trains_the_same_from_the_cache():
    m = _module()
    assert m._feature_cache is not None
    with torch.no_grad():  # heads that do something, so the gradients compared below are not all zero
        for p in m.model.head_parameters():
            p.normal_(0, 0.2)
    m.train()
    rows = _rows([6, 9, 4], seed=1)
    grads = []
    for width in (None, 14):  # computed, then from the cache in a wider batch
        b = _lm_batch(rows)
        if width:
            pad = width - b["tokens"].shape[1]
            b = {
                "tokens": torch.nn.functional.pad(b["tokens"], (0, pad), value=PAD),
                "targets": torch.nn.functional.pad(b["targets"], (0, pad), value=PAD),
                "prompts": b["prompts"],
            }
        loss, _ = m.compute_loss(b, [1, 2], [0.5, 0.5])
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in m.model.head_parameters()]))
        m.zero_grad()
    assert m._feature_cache.hits == 1 and m._feature_cache.misses == 1
    assert abs(grads[0][0] - grads[1][0]) < 1e-5
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads[0][1], grads[1][1]))
    assert any(float(g.abs().sum()) > 0 for g in grads[0][1])


def test_no_cache_where_states_can_change():
    assert _module(dropout=0.1)._feature_cache is None  # dropout: the states differ per pass
    assert _module(gb=0)._feature_cache is None  # switched off
    assert _module(trainable="all")._feature_cache is None  # the backbone trains


def _k3_module(loss: dict) -> BPDLightningModule:
    """A k = 3 heads-only regime module with this loss config and random heads, in training mode."""
    m = BPDLightningModule(
        _lm().config.to_dict(),
        {"name": "t", "block_size": 3, "head_loss": "mean", "trainable": "heads", "init_from": "x"},
        {"optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-2}},
        loss,
        seed=3,
    )
    with torch.no_grad():
        for p in m.model.head_parameters():
            p.normal_(0, 0.2)
    m.train()
    return m


def _ahead_in_draft(targets: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """Head i's targets (the token i ahead), those outside the n lowest ids masked."""
    t = torch.full_like(targets, PAD)
    t[:, :-i] = targets[:, i:]
    t[t >= n] = PAD
    return t


def test_draft_vocabulary_loss_is_the_cross_entropy_over_the_lowest_ids():
    """loss.draft_lowest_ids = N: heads 2..k's loss is the CE of their logits over ids < N, targets >= N ignored."""
    import torch.nn.functional as F

    m = _k3_module({"draft_lowest_ids": 24, "recompute": False})
    b = _lm_batch(_rows([7, 10, 5], seed=2))
    loss, per_head = m.compute_loss(b, [1, 2], [0.5, 0.5])
    with torch.no_grad():
        h = m.model.features(b["tokens"])
        want = []
        for i in (1, 2):
            logits = m.model.heads_logits(h, i, i + 1).squeeze(-2)[..., :24]
            t = _ahead_in_draft(b["targets"], i, 24)
            want.append(F.cross_entropy(logits.reshape(-1, 24), t.reshape(-1), ignore_index=PAD))
    assert abs(loss.item() - 0.5 * (want[0] + want[1]).item()) < 1e-5
    assert (b["targets"] >= 24).any()  # some targets fall outside and are ignored
    import pytest

    for bad in ({"draft_lowest_ids": 0.5e9}, {"draft_lowest_ids": 24, "kd_weight": 0.5}):
        with pytest.raises(ValueError, match="draft_lowest_ids"):
            BPDLightningModule(
                _lm().config.to_dict(),
                {"name": "t", "block_size": 3, "trainable": "heads", "init_from": "x"},
                {},
                bad,
                seed=3,
            )
    with pytest.raises(ValueError, match="frozen"):
        BPDLightningModule(_lm().config.to_dict(), {"name": "t", "block_size": 3}, {}, {"draft_vocab": 24}, seed=3)


def test_draft_vocabulary_loss_skips_prompt_and_padding_positions_with_the_same_loss_and_gradients():
    """The draft-vocabulary loss runs the heads' projection only from each row's first useful position to its last
    target (compact_rows): the loss and the heads' gradients are those over the whole padded batch."""
    from bpd_train.training.module import compact_rows

    m = _draft_module(30)
    b = _prompted_batch(5)
    h = _same_loss_and_gradients(m, b, 30, lambda h, i: m.model.heads_logits(h, i, i + 1).squeeze(-2))
    targets = b["targets"]
    hc, tc = compact_rows(h, targets, 3, PAD)
    assert tc.shape[1] < targets.shape[1] and tc.ne(PAD).sum() == targets.ne(PAD).sum()
    assert compact_rows(h, torch.full_like(targets, PAD), 3, PAD)[1].ne(PAD).sum() == 0  # no target anywhere


def test_chained_heads_learn_over_the_draft_vocabulary_from_the_token_before_their_own():
    """Chained heads (heads=chain) with the draft-vocabulary loss: head i learns the target i+1 ahead among the lowest
    ids, given the token before it whatever that token's id (head 1's is the model's own next token, often outside
    the draft vocabulary): the loss and gradients of that teacher-forced cross-entropy, and training lowers it."""
    m = _draft_module(20, "chain")
    assert m.model.chained
    b = _prompted_batch(6)
    targets = b["targets"]
    assert ((targets >= 20) & (targets != PAD)).any() and ((targets < 20) & (targets != PAD)).any()

    def logits(h, i):  # given the data's token before the target, whatever its id
        prev = torch.full_like(targets, PAD)
        prev[:, : targets.size(1) - i + 1] = targets[:, i - 1 :]
        return m.model.head_logits(h, i, prev)

    _same_loss_and_gradients(m, b, 20, logits)
    opt = torch.optim.AdamW(m.model.head_parameters(), lr=3e-2)
    first = m.compute_loss(b, [1, 2, 3], [1 / 3] * 3)[0].item()
    for _ in range(60):
        opt.zero_grad()
        m.compute_loss(b, [1, 2, 3], [1 / 3] * 3)[0].backward()
        opt.step()
    assert m.compute_loss(b, [1, 2, 3], [1 / 3] * 3)[0].item() < 0.85 * first


def test_draft_vocabulary_with_self_kd_learns_head1s_distribution_over_the_same_ids():
    """draft_lowest_ids = N with self_kd_weight = μ (heads for sampling): head i at t scores (1-μ)·CE + μ·KL(head 1
    at t+i ‖ head i at t), both softmaxes over the ids < N, at the positions whose target is one of them."""
    import pytest
    import torch.nn.functional as F

    mu = 0.4
    m = _k3_module({"draft_lowest_ids": 24, "self_kd_weight": mu, "recompute": False})
    b = _prompted_batch(seed=4)  # prompts without targets: the rows are compacted before the loss
    loss, per_head = m.compute_loss(b, [1, 2], [0.5, 0.5])
    with torch.no_grad():
        h = m.model.features(b["tokens"])
        p1 = m.model.heads_logits(h, 0, 1).squeeze(-2)[..., :24]
        want = []
        for i in (1, 2):
            logits = m.model.heads_logits(h, i, i + 1).squeeze(-2)[..., :24]
            t = _ahead_in_draft(b["targets"], i, 24)
            keep = t.ne(PAD)
            keep[:, -i:] = False
            ce = F.cross_entropy(logits[keep], t[keep])
            s = torch.log_softmax(logits[keep], -1)
            q = torch.log_softmax(p1[:, i:][keep[:, :-i]], -1)  # head 1 at t + i
            kl = (q.exp() * (q - s)).sum(-1).mean()
            assert kl.item() > 1e-3  # random heads: a real term
            want.append((1 - mu) * ce + mu * kl)
    assert per_head[1].item() == pytest.approx(want[0].item(), rel=1e-5)
    assert per_head[2].item() == pytest.approx(want[1].item(), rel=1e-5)
    assert abs(loss.item() - 0.5 * (want[0] + want[1]).item()) < 1e-5
    loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m.model.head_parameters())
