"""The decoder-only LM on the shared decoders: per-row prompt lengths, cache vs full-sequence parity, head
initialisation, blockwise (every acceptance rule, both head types) against greedy, beam search."""

import pytest
import torch

from bpd_train.decoding import Distance, Exact, TopK, beam_search, blockwise, greedy
from bpd_train.engine.fastlinear import native_kernels
from bpd_train.engine.weights import PackedWeights
from bpd_train.model import LMConfig, LMModel, build_model, config_from_dict

PROMPTS = [[5, 6, 7, 8, 9, 3], [10, 11], [4], [7, 7, 1, 9]]


def _model(heads="bpd", k=4, vocab=12, seed=0, **kw):
    """Small vocabulary: random heads' proposals are accepted now and then, so rollback is exercised."""
    torch.manual_seed(seed)
    c = LMConfig(
        vocab_size=vocab,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        block_size=k,
        heads=heads,
        head_d_hidden=16,
        eos_id=2,
        max_positions=64,
        **kw,
    )
    m = LMModel(c).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.4)
    return m


def test_prompts_of_different_lengths_decode_as_alone():
    m = _model()
    batch = greedy(m, PROMPTS, max_len=20)
    assert len({len(t) for t in batch.tokens}) > 1 or all(len(t) == 20 for t in batch.tokens)
    for p, want in zip(PROMPTS, batch.tokens):
        assert greedy(m, [p], max_len=20).tokens[0] == want


def test_cached_decoding_equals_the_full_sequence():
    m = _model()
    out = greedy(m, PROMPTS, max_len=12).tokens
    for p, gen in zip(PROMPTS, out):
        with torch.no_grad():
            logits = m(torch.tensor([p + gen]))[0, :, 0]  # [T,V]
        assert logits[len(p) - 1 : len(p) - 1 + len(gen)].argmax(-1).tolist() == gen


@pytest.mark.parametrize("heads", ["bpd", "medusa"])
def test_fresh_heads_equal_head1_and_parameter_groups(heads):
    m = LMModel(LMConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, d_ff=24, block_size=3, heads=heads))
    h = torch.randn(2, 5, 16)
    with torch.no_grad():
        lg = m.heads_logits(h)  # [2,5,3,V]
        assert torch.allclose(lg[:, :, 1], lg[:, :, 0]) and torch.allclose(lg[:, :, 2], lg[:, :, 0])
        assert torch.equal(m.head_logits(h, 2), lg[:, :, 2])
    hp, bp = m.head_parameters(), m.backbone_parameters()
    assert hp and not {id(p) for p in hp} & {id(p) for p in bp}
    assert len(hp) + len(bp) == len(list(m.parameters()))


@pytest.mark.parametrize("heads", ["bpd", "medusa"])
def test_blockwise_exact_equals_greedy_with_random_heads(heads):
    m = _model(heads)
    want = greedy(m, PROMPTS, max_len=24).tokens
    r = blockwise(m, PROMPTS, accept=Exact(), max_len=24)
    assert r.tokens == want
    assert r.mean_accepted > 1.0  # blocks were accepted (and rolled back)
    assert blockwise(m, PROMPTS, accept=TopK(1), max_len=24).tokens == want
    assert blockwise(m, PROMPTS, accept=Distance(0.0), max_len=24).tokens == want
    assert blockwise(m, PROMPTS, adaptive=True, max_len=24).tokens == want
    for p, w in zip(PROMPTS, want):  # batch of one: the uniform cache mode
        assert blockwise(m, [p], max_len=24).tokens[0] == w
    # approximate rules run and respect max_len
    for kw in ({"accept": TopK(3)}, {"accept": Distance(2.0)}, {"min_block": 2}):
        out = blockwise(m, PROMPTS, max_len=24, **kw)
        assert all(len(t) <= 24 for t in out.tokens) and out.mean_accepted >= 1.0


def test_draft_vocabulary_keeps_exact_output():
    from bpd_train.engine.packed import DecodeOptions

    m = _model("medusa")
    want = greedy(m, PROMPTS, max_len=16).tokens
    pw_m = PackedWeights(DecodeOptions(draft_vocab=tuple(range(6))))
    assert blockwise(m, PROMPTS, max_len=16, weights=pw_m).tokens == want
    pw_m = PackedWeights(DecodeOptions(dtype="bf16"))
    if native_kernels() is None:  # the torch path decodes in fp32 only
        with pytest.raises(ValueError, match="fp32"):
            greedy(m, PROMPTS, max_len=4, weights=pw_m)
    else:  # the native engine: greedy of that precision
        assert (
            blockwise(m, PROMPTS, max_len=16, weights=pw_m).tokens
            == greedy(m, PROMPTS, max_len=16, weights=pw_m).tokens
        )


def test_beam_of_one_is_greedy_and_beams_run():
    m = _model(k=1)
    want = greedy(m, PROMPTS, max_len=10).tokens
    assert beam_search(m, PROMPTS, beam_size=1, length_penalty=0.0, max_len=10).tokens == want
    assert len(beam_search(m, PROMPTS, beam_size=3, max_len=10).tokens) == len(PROMPTS)


def test_config_round_trip_and_checks():
    m = _model("medusa", qkv_bias=True, tie_output=False)
    d = m.config.to_dict()
    assert d["arch"] == "lm" and config_from_dict(d) == m.config
    m2 = build_model(d)
    m2.load_state_dict(m.state_dict())
    assert greedy(m2, PROMPTS, max_len=8).tokens == greedy(m, PROMPTS, max_len=8).tokens
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        LMConfig(vocab_size=10, d_model=32, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="sentinel"):
        LMConfig(vocab_size=10, pad_id=0)
    with pytest.raises(ValueError, match="exceeds the model's max_positions"):
        greedy(m, [[3] * 65], max_len=2)


def test_training_step_after_inference():
    m = _model("medusa")
    with torch.inference_mode():
        m(torch.tensor([[3, 4, 5]]))
    m.train()
    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, -1, -1]])  # right-padded with the sentinel
    logits = m(tokens)  # [2,4,k,V]
    loss = logits[:, :, 1].logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for p in m.head_parameters())
    with torch.no_grad():  # padding after a row never changes its logits (causal)
        m.eval()
        assert torch.allclose(m(tokens)[1, :2], m(tokens[1:, :2])[0], atol=1e-5)


@pytest.mark.parametrize("heads", ["bpd", "medusa"])
def test_heads_trained_on_own_greedy_outputs_raise_acceptance(heads):
    """Self-distillation in miniature: a frozen LM's greedy continuations teach its heads (logits[:, t, i]
    predicts position t+1+i); blockwise then accepts blocks and still returns greedy's tokens."""
    m = _model(heads, k=3, vocab=16, seed=1)
    prompts = [[3 + i % 11, 4 + (i * 5) % 11, 5 + (i * 3) % 10] for i in range(12)]
    want = greedy(m, prompts, max_len=24).tokens
    before = blockwise(m, prompts, max_len=24)
    rows = [p + w for p, w in zip(prompts, want)]
    t = max(map(len, rows))
    seq = torch.full((len(rows), t), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        seq[i, : len(r)] = torch.tensor(r)
    with torch.no_grad():
        h = m.features(seq)  # frozen backbone: features once
    opt = torch.optim.Adam(m.head_parameters(), lr=3e-2)
    for _ in range(150):
        loss = 0
        for i in range(1, 3):
            logits = m.head_logits(h[:, : t - 1 - i], i)  # predicts position t+1+i
            target = seq[:, 1 + i :]
            loss = loss + torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-1
            )
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = blockwise(m, prompts, max_len=24)
    assert after.tokens == want
    assert after.mean_accepted > max(1.8, before.mean_accepted + 0.5), (before.mean_accepted, after.mean_accepted)


def test_sampling_rows_follow_their_seeds_and_the_softmax():
    from bpd_train.decoding.sampling import sample

    m = _model(k=1, vocab=12)
    assert sample(m, PROMPTS, max_len=10, temperature=0).tokens == greedy(m, PROMPTS, max_len=10).tokens
    a = sample(m, PROMPTS, max_len=10, temperature=1.0, row_seeds=[5, 6, 7, 8])
    assert sample(m, PROMPTS[2:3], max_len=10, row_seeds=[7]).tokens[0] == a.tokens[2]  # batch mates don't matter
    assert sample(m, PROMPTS, max_len=10, row_seeds=[9, 10, 11, 12]).tokens != a.tokens
    # the first token's empirical distribution is softmax(logits / T)
    n, temp = 600, 0.7
    first = sample(m, [PROMPTS[0]] * n, max_len=1, temperature=temp, seed=100).tokens
    counts = torch.bincount(torch.tensor([r[0] if r else m.config.eos_id for r in first]), minlength=12).float() / n
    with torch.no_grad():
        p = torch.softmax(m(torch.tensor([PROMPTS[0]]))[0, -1, 0] / temp, -1)
    assert (counts - p).abs().sum().item() / 2 < 0.08  # total variation


def test_sharded_training_decodes_a_gathered_copy_of_the_same_family(monkeypatch):
    """Under FSDP / ZeRO-3 the in-training blockwise evaluation decodes a plain copy of the gathered weights; that
    copy once was always an encoder-decoder BPDModel, so an LM head regime with strategy=fsdp stopped at its first
    validation (AttributeError on LMConfig)."""
    import contextlib

    from bpd_train.evaluation import callback

    m = _model()
    monkeypatch.setattr(callback, "_gather_context", lambda trainer, model: contextlib.nullcontext())
    copy = callback._decoding_model(None, m)
    assert isinstance(copy, LMModel) and copy is not m
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), m.state_dict().values()))
    prompts = [[3, 4, 5], [6, 7]]
    assert greedy(copy, prompts, max_len=6).tokens == greedy(m, prompts, max_len=6).tokens
