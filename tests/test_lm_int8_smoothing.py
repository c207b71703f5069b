"""int8 decoding of decoder-only models with per-channel smoothing (engine/lm.py int8_smoothing): the folded weights
compute the model's own function, int8 hidden states land nearer fp32's where a few channels are large (as in
trained LLMs), and BPD_INT8_SMOOTH=0 turns it off. Exactness (blockwise = greedy of the same precision) is
tests/test_lm_engine.py's, run with smoothing on (the default)."""

import copy

import pytest
import torch
from test_lm_engine import lm, prompts

from bpd_train.decoding import blockwise, greedy
from bpd_train.engine.fastlinear import native_kernels
from bpd_train.engine.lm import int8_smoothing
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native decode kernels not built on this machine")


def outliers(m, gain=40.0):
    """A few large activation channels, as trained LLMs have (RMSNorm weights far above the rest)."""
    with torch.no_grad():
        for layer in m.layers:
            layer.norm1.weight[3] *= gain
            layer.norm2.weight[7] *= gain
    return m


@pytest.mark.parametrize("kw", [dict(kv=2), dict(kv=1, qkv_bias=True, mlp_bias=True), dict(kv=4, head_dim=16)])
def test_the_smoothed_weights_compute_the_same_function(kw):
    m = outliers(lm(3, "bpd", **kw))
    smooth = int8_smoothing(m)
    folded = copy.deepcopy(m)
    with torch.no_grad():
        for layer, w in zip(folded.layers, smooth):
            layer.norm1.weight.copy_(w["norm1"])
            layer.norm2.weight.copy_(w["norm2"])
            layer.attn.qkv.weight.copy_(w["qkv"])
            layer.attn.o.weight.copy_(w["o"])
            layer.mlp.gate_up.weight.copy_(w["gate_up"])
            layer.mlp.down.weight.copy_(w["down"])
            if w["qkv_b"] is not None:
                layer.attn.qkv.bias.copy_(w["qkv_b"])
            if w["gate_up_b"] is not None:
                layer.mlp.gate_up.bias.copy_(w["gate_up_b"])
        ids = torch.tensor([prompts(1, 3, longest=20)[0]])
        ref = m.features(ids)  # rounding only (values in the tens here): a wrong fold is off by O(1)
        torch.testing.assert_close(folded.features(ids), ref, atol=1e-4 * float(ref.abs().max()), rtol=2e-3)
    # the scales are not one: the large channels moved into the weights
    assert not torch.allclose(smooth[0]["norm1"], m.layers[0].norm1.weight)
    assert smooth[0]["norm1"][3] < m.layers[0].norm1.weight[3] / 2


def int8_error(m, rows) -> float:
    """Relative error of the int8 engine's decoder output at each prompt's last position against fp32 torch."""
    pw_m = PackedWeights(DecodeOptions(dtype="int8"))
    with torch.inference_mode():
        src = torch.full((len(rows), max(map(len, rows))), -1, dtype=torch.long)
        for r, p in enumerate(rows):
            src[r, : len(p)] = torch.tensor(p)
        _w = pw_m.get(m)
        state = m.start_decoding(m.encode(src, _w), 8, weights=_w)
        h = m.decode(state, state.first)[:, 0]
        ref = torch.stack([m.features(torch.tensor([p]))[0, -1] for p in rows])
    return float((h - ref).norm() / ref.norm())


def test_int8_lands_nearer_fp32_with_smoothing_and_stays_exact(monkeypatch):
    base = outliers(lm(5, "bpd", vocab=40, std=0.3))
    rows = prompts(6, 5, vocab=40, longest=12)
    monkeypatch.setenv("BPD_INT8_SMOOTH", "0")
    plain = int8_error(copy.deepcopy(base), rows)
    monkeypatch.setenv("BPD_INT8_SMOOTH", "1")
    m = copy.deepcopy(base)
    smoothed = int8_error(m, rows)
    assert smoothed < 0.7 * plain, (smoothed, plain)
    g = greedy(m, rows, max_len=12).tokens
    assert blockwise(m, rows, max_len=12).tokens == g
