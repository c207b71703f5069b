"""BPDConfig architecture options (for imported checkpoints): the cached decode path, the inference fast paths
and every decoder agree with the full-sequence forward, and the defaults are today's models."""

import json

import pytest
import torch

from bpd_train.decoding import Exact, beam_search, blockwise, greedy
from bpd_train.engine.weights import default_weights
from bpd_train.model import BPDConfig, BPDModel
from bpd_train.model.layers import sinusoidal_table

BASE = dict(
    vocab_size=12,
    d_model=16,
    n_heads=2,
    n_encoder_layers=2,
    n_decoder_layers=2,
    d_ff=32,
    dropout=0.0,
    max_positions=40,
    block_size=3,
)
OPTIONS = {
    # Marian-like: post-norm, no final norms, [sin|cos] positions, swish, logits bias, separate embeddings
    "marian": dict(
        pre_norm=False,
        final_norm=False,
        pos_layout="marian",
        activation="swish",
        logits_bias=True,
        share_embeddings=False,
        src_vocab_size=14,
        tie_output=False,
        scale_embedding=False,
        norm_eps=1e-5,
    ),
    # M2M100/NLLB-like: fairseq positions from pad_id + 1, a decoder-start prefix before the language BOS
    "m2m100": dict(pos_layout="fairseq", pos_offset=1, activation="gelu", decoder_prefix=(2,), bos_id=9, norm_eps=1e-5),
    # pre-norm ReLU layers run on the native step where it is built: with a prefix, a logits bias, a suppressed id
    "native-step": dict(pos_layout="marian", logits_bias=True, decoder_prefix=(2, 4), bos_id=9, suppress_ids=(5,)),
}


def make(name, seed=0, **kw):
    torch.manual_seed(seed)
    m = BPDModel(BPDConfig(**{**BASE, **OPTIONS[name], **kw})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # also the heads and the norms: nothing sits at its identity init
    return m


def batch(seed=0, src_vocab=12):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, src_vocab, (3, 7), generator=g)
    src[:, -1] = 2
    src[1, 4] = 2
    src[1, 5:] = 0
    tgt = torch.randint(3, 12, (3, 6), generator=g)
    return src, tgt


def test_defaults_are_todays_model():
    c = BPDConfig(vocab_size=8)
    old = {k: v for k, v in c.to_dict().items() if k in ("vocab_size", "d_model", "n_heads", "pad_id", "norm_eps")}
    assert BPDConfig.from_dict(old) == c  # configs written before these options load unchanged
    m = BPDModel(BPDConfig(**BASE))
    assert m.src_embed is None and m.lm_head is None and m.logits_bias is None
    assert set(m.state_dict()) == set(BPDModel(BPDConfig(**BASE)).state_dict())
    assert not any(k.startswith(("src_embed", "lm_head", "logits_bias")) for k in m.state_dict())


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_config_round_trips_through_json(name):
    c = make(name).config
    again = BPDConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and isinstance(again.decoder_prefix, tuple)


def test_sinusoid_layouts():
    inter = sinusoidal_table(5, 8)
    halves = sinusoidal_table(5, 8, "marian")
    # same frequencies, [sin|cos] halves instead of alternating
    torch.testing.assert_close(halves, inter[:, [0, 2, 4, 6, 1, 3, 5, 7]], atol=1e-6, rtol=0)
    fair = sinusoidal_table(6, 8, "fairseq", offset=2)
    assert torch.equal(fair[0], sinusoidal_table(8, 8, "fairseq")[2])
    with pytest.raises(ValueError, match="pos_layout"):
        BPDConfig(vocab_size=8, pos_layout="rotary")
    with pytest.raises(ValueError, match="activation"):
        BPDConfig(vocab_size=8, activation="tanh")


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_cached_decoding_matches_full_forward(name):
    m = make(name, seed=1)
    src, tgt = batch(1, m.config.source_vocab_size)
    with torch.enable_grad():
        ref = m(src, tgt)  # training (module) path
    with torch.inference_mode():
        torch.testing.assert_close(m(src, tgt), ref.detach(), atol=1e-5, rtol=0)  # functional fast path
        mem = m.encode(src)
        _w = default_weights(m).get(m)
        st = m.start_decoding(mem, capacity=tgt.shape[1], weights=_w)
        steps = []
        for t in range(tgt.shape[1]):
            steps.append(m.decode(st, tgt[:, t : t + 1]))
            st.lengths += 1
        h = torch.cat(steps, 1)
        torch.testing.assert_close(h, m.features(mem, tgt), atol=1e-5, rtol=0)
        want = ref.detach().clone()
        want[..., list(m.config.suppress_ids)] = float("-inf")  # the decoders' projection only
        torch.testing.assert_close(st.weights.logits(h, 0, 3), want, atol=1e-4, rtol=0)
        # per-row cache with rollback, after the prefix
        _w = default_weights(m).get(m)
        st = m.start_decoding(mem, capacity=12, weights=_w).per_row()
        m.decode(st, torch.full((3, 4), 5))
        st.lengths = torch.zeros(3, dtype=torch.long)
        m.decode(st, tgt[:, :3])
        st.lengths = torch.tensor([3, 1, 2])
        h = m.decode(st, torch.stack([tgt[0, 3:6], tgt[1, 1:4], tgt[2, 2:5]]))
        full = m.features(mem, tgt)
        torch.testing.assert_close(h[1], full[1, 1:4], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_decoders_agree(name):
    from bpd_train.engine.fastlinear import native_kernels

    m = make(name, seed=2)
    if native_kernels() is not None:  # the one-call native step only where it implements the layer
        assert (default_weights(m).get(m).native_layers is not None) == (name == "native-step")
    src, _ = batch(2, m.config.source_vocab_size)
    g = greedy(m, src, max_len=12)
    assert blockwise(m, src, accept=Exact(), max_len=12).tokens == g.tokens
    assert [blockwise(m, src[i : i + 1], max_len=12).tokens[0] for i in range(3)] == g.tokens
    # one beam without length penalty is greedy (also through the prefix and the beam bookkeeping)
    assert beam_search(m, src, beam_size=1, length_penalty=0.0, max_len=12).tokens == g.tokens


def test_suppressed_ids_are_never_generated_but_still_trained():
    m = make("marian", seed=3)
    src, tgt = batch(3, m.config.source_vocab_size)
    with torch.no_grad():
        m.logits_bias[7] = 50.0  # token 7 wins everywhere
    assert all(set(t) == {7} for t in greedy(m, src, max_len=5).tokens)
    m2 = make("marian", seed=3, suppress_ids=(7,))
    m2.load_state_dict(m.state_dict())
    for dec in (
        greedy(m2, src, max_len=5),
        blockwise(m2, src, max_len=5),
        beam_search(m2, src, beam_size=2, max_len=5),
    ):
        assert all(7 not in t for t in dec.tokens)
    torch.testing.assert_close(m2(src, tgt), m(src, tgt))  # forward (training) sees the full distribution


def test_training_reaches_the_new_parameters_but_not_the_logits_bias():
    m = make("marian", seed=4).train()
    src, tgt = batch(4, m.config.source_vocab_size)
    m(src, tgt).logsumexp(-1).sum().backward()
    assert m.src_embed.weight.grad is not None and m.lm_head.weight.grad is not None
    assert m.logits_bias.grad is None and not m.logits_bias.requires_grad  # a transformers buffer: never trained
    p = make("m2m100", seed=4).train()
    src, tgt = batch(4)
    p(src, tgt).logsumexp(-1).sum().backward()
    assert p.embed.weight.grad[2].abs().sum() > 0  # the decoder-start prefix token is part of every target
