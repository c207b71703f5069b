"""Model: shapes, BPD head initialisation and identity_p1, parameter groups, KV-cache parity, padding."""

import pytest
import torch

from bpd_train.engine.weights import default_weights
from bpd_train.model import BPDConfig, BPDModel


def tiny(k=4, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=8,
        d_model=16,
        n_heads=2,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=32,
        block_size=k,
        dropout=0.0,
        max_positions=40,
    )
    cfg.update(kw)
    return BPDModel(BPDConfig(**cfg)).eval()


def perturb_heads(model, std=0.3):
    if model.heads is not None:
        with torch.no_grad():
            model.heads.fc2.weight.normal_(0, std)
            model.heads.fc2.bias.normal_(0, std)
    return model


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, 8, (3, 7), generator=g)
    src[:, -1] = 2
    src[1, 4] = 2
    src[1, 5:] = 0  # right padding
    tgt = torch.randint(3, 8, (3, 6), generator=g)
    tgt[:, 0] = 1
    return src, tgt


def test_forward_shape_and_head_semantics():
    m = perturb_heads(tiny(k=4))
    src, tgt = batch()
    out = m(src, tgt)
    assert out.shape == (3, 6, 4, 8)
    h = m.features(m.encode(src), tgt)
    assert h.shape == (3, 6, 16)
    for i in range(4):
        torch.testing.assert_close(m.head_logits(h, i), out[:, :, i], atol=1e-6, rtol=0)
    torch.testing.assert_close(m.heads_logits(h, 1, 3), out[:, :, 1:3], atol=1e-6, rtol=0)


def test_heads_start_equal_to_head_one():
    m = tiny(k=5)
    src, tgt = batch()
    out = m(src, tgt)
    for i in range(1, 5):
        assert torch.equal(out[:, :, i], out[:, :, 0])
    # ... and training the heads moves them away from head 1 (the zero init is not a dead end)
    opt = torch.optim.SGD(m.head_parameters(), lr=0.5)
    m(src, tgt)[:, :, 1:].logsumexp(-1).mean().backward()
    opt.step()
    assert not torch.equal(m(src, tgt)[:, :, 1], m(src, tgt)[:, :, 0])


def test_identity_p1_head_one_is_the_base_model():
    base = tiny(k=1, seed=3)
    m = perturb_heads(tiny(k=6, seed=3))
    m.load_state_dict(base.state_dict(), strict=False)  # backbone only
    src, tgt = batch()
    assert torch.equal(m(src, tgt)[:, :, 0], base(src, tgt)[:, :, 0])
    # without identity_p1, head 1 goes through the new layer (paper's original setup)
    p = perturb_heads(tiny(k=6, seed=3, identity_p1=False))
    p.load_state_dict(base.state_dict(), strict=False)
    assert not torch.allclose(p(src, tgt)[:, :, 0], base(src, tgt)[:, :, 0])


def test_parameter_groups():
    m = tiny(k=4)
    back, heads = m.backbone_parameters(), m.head_parameters()
    ids_b, ids_h = {id(p) for p in back}, {id(p) for p in heads}
    assert ids_b.isdisjoint(ids_h)
    assert ids_b | ids_h == {id(p) for p in m.parameters()}
    assert ids_h and id(m.embed.weight) in ids_b
    # head FFN: hidden k*head_hidden, output (k-1)*d_model with identity_p1
    assert m.heads.fc1.out_features == 4 * 32 and m.heads.fc2.out_features == 3 * 16
    plain = tiny(k=1)
    assert plain.head_parameters() == []
    assert len(plain.backbone_parameters()) == len(list(plain.parameters()))
    assert plain(*batch()).shape == (3, 6, 1, 8)


def test_incremental_decoding_matches_full_forward():
    m = perturb_heads(tiny(k=3, seed=1))
    src, tgt = batch(1)
    mem = m.encode(src)
    full = m.features(mem, tgt)
    # uniform cache: one token per call
    _w = default_weights(m).get(m)
    st = m.start_decoding(mem, capacity=tgt.shape[1], weights=_w)
    steps = []
    for t in range(tgt.shape[1]):
        steps.append(m.decode(st, tgt[:, t : t + 1]))
        st.lengths += 1
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)
    # uniform cache, several tokens per call
    _w = default_weights(m).get(m)
    st = m.start_decoding(mem, capacity=tgt.shape[1], weights=_w)
    a = m.decode(st, tgt[:, :2])
    st.lengths += 2
    b = m.decode(st, tgt[:, 2:])
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=0)
    # per-row cache with rollback: rows keep different lengths, junk written past them is discarded
    _w = default_weights(m).get(m)
    st = m.start_decoding(mem, capacity=12, weights=_w).per_row()
    m.decode(st, torch.full((3, 4), 5))  # junk in slots 0..3
    st.lengths = torch.zeros(3, dtype=torch.long)  # roll everything back
    m.decode(st, tgt[:, :3])
    st.lengths = torch.tensor([3, 1, 2])  # rows keep 3, 1 and 2 tokens
    h = m.decode(st, torch.stack([tgt[0, 3:6], tgt[1, 1:4], tgt[2, 2:5]]))
    torch.testing.assert_close(h[0], full[0, 3:6], atol=1e-5, rtol=0)
    torch.testing.assert_close(h[1], full[1, 1:4], atol=1e-5, rtol=0)
    torch.testing.assert_close(h[2], full[2, 2:5], atol=1e-5, rtol=0)
    torch.testing.assert_close(m.heads_logits(h[0]), m(src, tgt)[0, 3:6], atol=1e-5, rtol=0)


def test_inference_fast_paths_match_training_paths():
    m = perturb_heads(tiny(k=3, seed=4))
    src, tgt = batch(4)
    with torch.enable_grad():
        mem = m.encode(src)  # module path (autograd on)
        ref = m(src, tgt)
    with torch.inference_mode():
        fast = m.encode(src)  # functional inference path
        torch.testing.assert_close(fast.out, mem.out.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(m(src, tgt), ref.detach(), atol=1e-6, rtol=0)


def test_source_padding_does_not_change_outputs():
    m = perturb_heads(tiny(k=2, seed=2))
    src, tgt = batch(2)
    alone = m(src[1:2, :5], tgt[1:2])  # row 1 without its padding
    padded = m(torch.cat([src, torch.zeros(3, 4, dtype=torch.long)], 1), tgt)[1:2]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


def test_too_long_inputs_are_rejected():
    m = tiny(k=2, max_positions=8)
    with pytest.raises(ValueError, match="max_positions"):
        m.encode(torch.full((1, 9), 4))
    with pytest.raises(ValueError, match="max_positions"):
        m.features(m.encode(torch.full((1, 3), 4)), torch.full((1, 9), 4))
    with pytest.raises(IndexError):
        m.head_logits(torch.zeros(1, 16), 2)


def test_dropout_is_active_in_training_only():
    m = tiny(k=2, dropout=0.5)
    src, tgt = batch()
    m.train()
    assert not torch.equal(m(src, tgt), m(src, tgt))
    m.eval()
    assert torch.equal(m(src, tgt), m(src, tgt))
