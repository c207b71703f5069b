"""The prompt prefix cache of decoder-only decoding (engine/lm.py LMDecodeWeights.prefill): the tokens a prompt shares
with the last prefilled one (a chat's system turn) are copied from that prompt's K/V instead of computed. The copy
must hold the bits a full prefill writes, for every row of a left-padded batch, in every precision: the cache
parity litgpt checks for its KV cache, here between a prefill with and without the shared part."""

import pytest
import torch
from test_lm_engine import DTYPES, lm

from bpd_train.decoding import blockwise, greedy
from bpd_train.engine.fastlinear import native_kernels
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights, default_weights

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native decode kernels not built on this machine")

SYSTEM = [5, 7, 3, 9, 4, 4, 8, 6, 10, 3, 5]  # the shared turn every request starts with


class Counting:
    """The extension with lm_decode_layers counting the tokens it is fed."""

    def __init__(self, ext):
        self.ext, self.fed = ext, []

    def lm_decode_layers(self, ids, *rest):
        self.fed.append(tuple(ids.shape))
        return self.ext.lm_decode_layers(ids, *rest)

    def __getattr__(self, name):
        return getattr(self.ext, name)


def prefilled(m, rows: list[list[int]], weights=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V cache after start_decoding (the prompts but their last tokens) and each row's left padding."""
    src = torch.full((len(rows), max(map(len, rows))), m.config.pad_id, dtype=torch.long)
    for r, p in enumerate(rows):
        src[r, : len(p)] = torch.tensor(p)
    with torch.inference_mode():
        _w = (weights or default_weights(m)).get(m)
        state = m.start_decoding(m.encode(src, _w), 4, weights=_w)
    return state.self_kv.clone(), state.lpad.clone()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shared_prefix_is_copied_with_the_bits_a_full_prefill_writes(dtype, monkeypatch):
    m = lm(1, "medusa", vocab=12, kv=2)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype))
    batches = [
        [SYSTEM + [6, 6, 7]],  # fills the cache
        [SYSTEM + [9, 3]],  # shares the system turn
        [SYSTEM + [9, 3]],  # the same prompt again: nothing left to compute but its last token
        [SYSTEM[:4]],  # a prefix of the cached prompt
        [SYSTEM + [8], SYSTEM[:7] + [4, 4, 4, 4, 4, 4, 4], SYSTEM + [3, 3, 3, 3]],  # rows of other lengths (pads)
        [SYSTEM + [8, 5]],  # shares the padded first row's prompt
        [[11, 10] + SYSTEM],  # nothing in common
        [SYSTEM + [6]],
    ]
    w = pw_m.get(m)
    counting = Counting(w.ext)
    monkeypatch.setattr(w, "ext", counting)
    cached = [prefilled(m, rows, pw_m) for rows in batches]
    monkeypatch.setenv("BPD_PREFIX_CACHE", "0")
    full = [prefilled(m, rows, pw_m) for rows in batches]
    for (kv, lpad), (ref, ref_lpad), rows in zip(cached, full, batches):
        assert torch.equal(lpad, ref_lpad)
        for r in range(len(rows)):  # the real slots of every row (pad slots hold junk no query reads)
            p = int(lpad[r])
            torch.testing.assert_close(
                kv[:, :, r, :, p : len(rows[r]) - 1], ref[:, :, r, :, p : len(rows[r]) - 1], rtol=0, atol=0
            )
    # the tokens computed ([rows, tokens] per call): with the cache, only what the rows do not share with the last
    # prompt (the same prompt again and a prefix of it: no call); without it, every prompt but its last token
    with_cache = [(1, 13), (1, 1), (3, 11), (1, 1), (1, 12), (1, 11)]
    assert counting.fed == with_cache + [(1, 13), (1, 12), (1, 12), (1, 3), (3, 14), (1, 12), (1, 12), (1, 11)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decoding_with_the_prefix_cache_gives_the_tokens_of_a_fresh_model(dtype, monkeypatch):
    requests = [SYSTEM + [6, 6, 7], SYSTEM + [9, 3], SYSTEM + [9, 3, 8, 8], [4] + SYSTEM, SYSTEM + [10]]
    m = lm(2, "medusa", vocab=12, kv=2, k=4)
    pw_m = PackedWeights(DecodeOptions(dtype=dtype))
    got = [greedy(m, [p], max_len=12, weights=pw_m).tokens[0] for p in requests]
    block = [blockwise(m, [p], block_size=4, max_len=12, weights=pw_m).tokens[0] for p in requests]
    batch = greedy(m, requests[1:4], max_len=12, weights=pw_m).tokens
    monkeypatch.setenv("BPD_PREFIX_CACHE", "0")
    ref = lm(2, "medusa", vocab=12, kv=2, k=4)
    pw_ref = PackedWeights(DecodeOptions(dtype=dtype))
    want = [greedy(ref, [p], max_len=12, weights=pw_ref).tokens[0] for p in requests]
    assert got == want and block == want and batch == want[1:4]
    assert pw_m.get(m)._prefix is not None and pw_ref.get(ref)._prefix is None


def test_a_prompt_longer_than_the_cache_keeps_its_head(monkeypatch):
    import bpd_train.engine.lm as engine_lm

    m = lm(3, "medusa", vocab=12, kv=2)
    pw_m = PackedWeights(DecodeOptions(dtype="fp32"))
    w = pw_m.get(m)
    per_token = m.config.n_layers * 2 * m.config.kv_heads * m.config.dh * 4  # fp32 K/V of one token, every layer
    monkeypatch.setattr(engine_lm, "PREFIX_CACHE_BYTES", 5 * per_token + 7)
    counting = Counting(w.ext)
    monkeypatch.setattr(w, "ext", counting)
    first, second = SYSTEM + [6, 6], SYSTEM + [9, 9]
    prefilled(m, [first], pw_m)
    assert w._prefix[0].tolist() == SYSTEM[:5] and w._prefix[1].shape[3] == 5
    kv, _ = prefilled(m, [second], pw_m)
    assert counting.fed == [(1, 12), (1, len(second) - 1 - 5)]  # the second prompt: 5 tokens copied
    monkeypatch.setenv("BPD_PREFIX_CACHE", "0")
    ref, _ = prefilled(m, [second], pw_m)
    torch.testing.assert_close(kv[:, :, :, :, : len(second) - 1], ref[:, :, :, :, : len(second) - 1], rtol=0, atol=0)
