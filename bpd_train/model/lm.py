"""Decoder-only Transformer (the Llama / Qwen2 architecture) with k BPD or Medusa heads.

Pre-norm RMSNorm layers, rotary positions (transformers' rotate-half layout), SwiGLU feed-forward,
grouped-query attention, tied or separate output embedding, optional q/k/v (Qwen2) and output biases. The
head interface is BPDModel's (heads_logits, head_logits, identity head 1, zero-initialised future heads,
head_parameters/backbone_parameters, decode_weights/decode_options, start_decoding/decode/start_tokens),
so greedy, beam search and blockwise decoding run on it unchanged.

How prompts enter the decoders: `encode(prompts)` (right-padded with the pad sentinel, as the decoders'
prepare_source builds them) returns a `Prompt`: the prompts left-padded to the longest one, P tokens.
`start_decoding` prefills all but each prompt's last token into the KV cache as a fixed prefix of P-1 slots
(DecoderState.base) and `start_tokens(state)` hands the decoders each prompt's last token as their first
input, where an encoder-decoder model hands them BOS. A row with L prompt tokens has P-L pad slots in
front: a per-row key mask hides them and rotary positions count from the row's first real token, so every
row decodes as it would alone.

Decoding (LMDecodeWeights) runs on the native CPU engine of model/fastlinear.py and csrc/linear.cpp where it is
built: packed linears in fp32 / bf16 / int8, the layer stack in one C++ call with row-exact attention, native greedy
and exact blockwise loops (one row and a batch), draft vocabulary and proposal precision, as the encoder-decoder
model's DecodeWeights (docs/engine.md). Elsewhere (CUDA, BPD_DECODE_ENGINE=torch) it runs plain torch (F.linear,
SDPA) in fp32.

Shapes: B batch, T tokens, D d_model, H query heads, G key/value heads (H % G == 0), Dh head size, V vocab,
R decoder rows while decoding, n new tokens per decoder call, P longest prompt, L cache slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bpd_train.model.cache import DecoderState
from bpd_train.model.heads import BPDHeads, MedusaHeads
from bpd_train.model.lm_config import LMConfig
from bpd_train.model.fastlinear import PackedLinear
from bpd_train.model.packed import DecodeOptions, weights_key


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()  # as transformers: statistics in fp32 whatever the activations' dtype
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_frequencies(dh: int, theta: float, scaling: dict | None = None, device=None) -> Tensor:
    """[Dh/2] inverse frequencies, rescaled as transformers' "linear" / "llama3" rope types do."""
    inv = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.float, device=device) / dh))
    if scaling is None:
        return inv
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    old = scaling["original_max_position_embeddings"]
    lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, blended, scaled)


def rope_tables(n: int, dh: int, theta: float, device=None, scaling: dict | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [n, Dh] for positions 0..n-1, frequencies repeated over both halves (rotate-half layout)."""
    inv = rope_frequencies(dh, theta, scaling, device)                                       # [Dh/2]
    f = torch.arange(n, dtype=torch.float, device=device)[:, None] * inv[None, :]            # [n,Dh/2]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B,h,T,Dh]; cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.dh = c.n_heads, c.kv_heads, c.dh
        self.qkv = nn.Linear(c.d_model, (c.n_heads + 2 * c.kv_heads) * c.dh, bias=c.qkv_bias)  # q, k, v stacked
        self.o = nn.Linear(c.n_heads * c.dh, c.d_model, bias=c.o_bias)
        self.p = c.dropout

    def qkv_heads(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B,T,D] -> rotated q [B,H,T,Dh], rotated k [B,G,T,Dh], v [B,G,T,Dh]."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * self.dh, self.n_kv * self.dh, self.n_kv * self.dh], dim=-1)
        q = q.view(b, t, self.n_heads, self.dh).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.dh).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.dh).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """q [B,H,T,Dh], k/v [B,G,S,Dh] -> [B,T,H*Dh] after the output projection."""
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal and mask is None,
                                           enable_gqa=self.n_kv != self.n_heads)
        b, _, t, _ = y.shape
        return self.o(y.transpose(1, 2).reshape(b, t, self.n_heads * self.dh))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.attend(*self.qkv_heads(x, cos, sin), mask=None, causal=True)


class SwiGLU(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.gate_up = nn.Linear(c.d_model, 2 * c.d_ff, bias=c.mlp_bias)  # gate, up stacked
        self.down = nn.Linear(c.d_ff, c.d_model, bias=c.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.norm1 = RMSNorm(c.d_model, c.norm_eps)
        self.attn = Attention(c)
        self.norm2 = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = SwiGLU(c)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Full causal sequence (training, forward): x [B,T,D]."""
        x = x + self.drop(self.attn(self.norm1(x), cos, sin))
        return x + self.drop(self.mlp(self.norm2(x)))

    def step(self, x: Tensor, kv: Tensor, write, kv_len: int, mask: Tensor | None, cos: Tensor,
             sin: Tensor) -> Tensor:
        """Cached decoding: x [R,n,D] new tokens; kv [2,R,G,L,Dh] this layer's cache, where write(kv, new
        [2,R,G,n,Dh]) stores the new keys/values; attention reads slots [0, kv_len) under the additive mask."""
        q, k, v = self.attn.qkv_heads(self.norm1(x), cos, sin)
        write(kv, torch.stack([k, v]))
        x = x + self.attn.attend(q, kv[0, :, :, :kv_len], kv[1, :, :, :kv_len], mask, causal=False)
        return x + self.mlp(self.norm2(x))


@dataclass
class Prompt:
    """What `encode` gives the decoders: prompts left-padded to the longest."""
    ids: Tensor    # [B,P] token ids; the pad slots hold 0 (hidden by the mask)
    lpad: Tensor   # [B] pad slots in front of each row's first token

    @property
    def batch_size(self) -> int:
        return self.ids.shape[0]


class LMState(DecoderState):
    """DecoderState of a decoder-only model: `base` = P-1 prompt slots, and per row `lpad` pad slots among
    them that no query may see; rotary position of a slot = slot - lpad (the row's own token count)."""

    def __init__(self, self_kv: Tensor, lpad: Tensor, config: LMConfig):
        super().__init__(self_kv, None, None, max_positions=self_kv.shape[4])
        self.lpad = lpad                                                        # [R]
        self.cos, self.sin = rope_tables(self.capacity, config.dh, config.rope_theta, self_kv.device,
                                         config.rope_scaling)
        self.first: Tensor | None = None                                        # [R,1] each prompt's last token
        self._pad_bias = self._key_pad_bias()

    def _key_pad_bias(self) -> Tensor | None:
        """[R,1,1,L] additive: -inf at each row's pad slots; None when no row is padded."""
        if not bool((self.lpad > 0).any()):
            return None
        slots = torch.arange(self.capacity, device=self.lpad.device)
        hide = slots[None, :] < self.lpad[:, None]
        return torch.zeros(hide.shape, dtype=self.self_kv.dtype, device=hide.device).masked_fill_(
            hide, float("-inf"))[:, None, None, :]

    def _reorder_memory(self, index: Tensor) -> None:  # DecoderState.reorder's hook: per-row prompt data
        self.lpad = self.lpad.index_select(0, index)
        if self._pad_bias is not None:
            self._pad_bias = self._pad_bias.index_select(0, index)

    def slots(self, n: int) -> Tensor:
        """[R,n] the cache slots n new tokens per row go to (the native step: positions and masks follow)."""
        lengths, base = self.lengths, self.base
        if isinstance(lengths, int):
            t = base + lengths
            if t + n > self.capacity:
                raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({t}+{n})")
            return torch.arange(t, t + n).expand(self.rows, n)
        ln = lengths if isinstance(lengths, Tensor) else torch.from_numpy(np.asarray(lengths))
        return ln.to(torch.long)[:, None] + (base + torch.arange(n))[None, :]

    def prepare(self, n: int, kv_len: int | None = None):
        """DecoderState.prepare with per-row positions [R,n] and the pad slots hidden."""
        pos, write, kv_len, mask = super().prepare(n, kv_len)
        if isinstance(pos, slice):
            pos = torch.arange(pos.start, pos.stop, device=self.lpad.device)
        pos = pos.expand(self.rows, n) - self.lpad[:, None]                     # [R,n]
        if self._pad_bias is not None:
            pad = self._pad_bias[..., :kv_len]
            mask = pad if mask is None else mask + pad
        return pos, write, kv_len, mask


def _stops(eos) -> Tensor:
    """The stop id(s) as the native loops take them: int64 [n]."""
    return torch.as_tensor(np.atleast_1d(np.asarray(eos, dtype=np.int64)))


class LMDecodeWeights:
    """What decoders call per step (the DecodeWeights interface of model/packed.py) for a decoder-only model:
    head1, head1_argmax, propose, logits, final_norm, greedy_steps, block_steps, batch_block_steps, vocab_size,
    draft_ids, stats.

    Where the native kernels run (CPU, fp32 weights; model/fastlinear.py) every linear of the step is a
    `PackedLinear` in `options.dtype` (fp32 / bf16 / int8: q/k/v with their biases, o, gate/up, down, the
    vocabulary projection, the heads' FFN or Medusa blocks; heads 2..k in `proposal_dtype` and over the draft
    vocabulary where set, head 1 always over the full vocabulary in `dtype`), and the layer stack is one native
    call (csrc/linear.cpp lm_decode_layers: RMSNorm, rotary, GQA attention one query at a time over the row's cache
    slots, SwiGLU), so a row's decoder output is bit-identical alone or in a block: exact blockwise decoding
    returns greedy's output of the same precision. Greedy and exact blockwise (one row and a batch) then run as
    native loops (lm_greedy_steps / lm_block_steps / lm_batch_block_steps; any of the model's stop ids ends a row).
    Elsewhere (CUDA, BPD_DECODE_ENGINE=torch, no compiler) the step is LMModel's torch path in fp32."""

    def __init__(self, model: "LMModel", options: DecodeOptions):
        from bpd_train.model.fastlinear import native_kernels

        self.model, self.options = model, options
        c = model.config
        dt = options.dtype
        emb = model.output_weight()
        ext = native_kernels() if emb.device.type == "cpu" and emb.dtype == torch.float32 else None
        if ext is None and dt != "fp32":
            raise ValueError(f"decoder-only models decode in fp32 where the native CPU kernels do not run "
                             f"(decode dtype {dt!r} asked; engine: torch)")
        self.vocab_size = c.vocab_size
        self.k, self.d = c.block_size, c.d_model
        self.stats: dict = {}
        self.last_seconds: float | None = None
        heads = model._modules.get("heads")
        self.heads = heads
        self.medusa = isinstance(heads, MedusaHeads)
        self.identity_p1 = heads is None or heads.identity_p1
        self.pdt = (options.proposal_dtype or dt) if self.identity_p1 else dt
        self.proj = PackedLinear(emb, None, dt)
        self.draft_ids: Tensor | None = None
        self.draft_proj: PackedLinear | None = None
        if options.draft_vocab is not None:
            ids = torch.tensor(options.draft_vocab, dtype=torch.long, device=emb.device)
            if int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
                raise ValueError(f"draft_vocab holds ids outside the vocabulary (size {self.vocab_size})")
            self.draft_ids = ids
            self.draft_proj = PackedLinear(emb.detach().index_select(0, ids), None, self.pdt)
        self.prop_proj = self.draft_proj or (self.proj if self.pdt == dt or heads is None
                                             else PackedLinear(emb, None, self.pdt))
        self._props: dict[tuple[int, int], tuple] = {}
        self.verify_group = 8 if emb.numel() * 4 > (16 << 20) else 2   # as DecodeWeights.verify_group
        self.ext = ext
        self.native_layers = self.native_loop = None
        self.lin: list = []
        if ext is not None:
            layers = []
            for layer in model.layers:
                a, m = layer._modules["attn"], layer._modules["mlp"]
                lins = [_plin(a.qkv, dt), _plin(a.o, dt), _plin(m.gate_up, dt), _plin(m.down, dt)]
                self.lin.append(lins)
                n1, n2 = layer._modules["norm1"], layer._modules["norm2"]
                layers.append(ext.LMLayer(a.n_heads, a.n_kv, a.dh, n1.eps, n1._parameters["weight"].detach(),
                                          lins[0].lin, lins[1].lin, n2._parameters["weight"].detach(), lins[2].lin,
                                          lins[3].lin))
            norm = model._modules["norm"]
            self.native_layers = ext.LMNet(layers, model._modules["embed"]._parameters["weight"].detach(),
                                           norm._parameters["weight"].detach(), norm.eps, self.proj.lin)
            # the native loops: head 1 is the LM head itself (identity_p1; BPD heads with their own head 1 take
            # the Python steps over the same native pieces)
            self.native_loop = self.native_layers if self.identity_p1 else None

    # ---- the pieces of a step ----
    def final_norm(self, h: Tensor) -> Tensor:
        norm = self.model._modules["norm"]
        if self.native_layers is not None and h.dtype == torch.float32:
            return self.ext.rms_norm(h, norm._parameters["weight"].detach(), norm.eps)   # the native loops' norm
        return norm(h)

    def _head_lins(self, lo: int, hi: int):
        """Packed linears of heads lo..hi-1 (lo >= 1, or lo = 0 for BPD heads without identity head 1) and the
        LMProp the native proposal path takes (None on the torch path)."""
        key = (lo, hi)
        got = self._props.get(key)
        if got is None:
            hd, dt, d = self.heads, self.pdt, self.d
            if self.medusa:
                w, b = hd._parameters["weight"].detach(), hd._parameters["bias"].detach()
                lins = [PackedLinear(w[i - 1, j], b[i - 1, j], dt) for i in range(lo, hi) for j in range(hd.n_layers)]
                kind, nl = 1, hd.n_layers
            else:
                fc1, fc2 = hd.fc1._parameters, hd.fc2._parameters
                s0, s1 = hd.slot(lo), hd.slot(hi)
                lins = [PackedLinear(fc1["weight"], fc1["bias"], dt),
                        PackedLinear(fc2["weight"][s0 * d:s1 * d], fc2["bias"][s0 * d:s1 * d], dt)]
                kind, nl = 0, 0
            prop = None
            if self.ext is not None and all(p.lin is not None for p in lins) and self.prop_proj.lin is not None:
                prop = self.ext.LMProp(kind, hi - lo, nl, [p.lin for p in lins], self.prop_proj.lin, self.draft_ids)
            got = self._props[key] = (lins, prop)
        return got

    def states(self, h: Tensor, lo: int, hi: int) -> Tensor:
        """h [...,D] -> what the vocabulary projection reads for heads lo..hi-1 [...,hi-lo,D] (model.head_states on
        the packed linears)."""
        parts = []
        if lo == 0 and self.identity_p1:
            parts.append(self.final_norm(h).unsqueeze(-2))
            lo = 1
        if lo < hi:
            lins, _ = self._head_lins(lo, hi)
            if self.medusa:
                n, nl = self.final_norm(h), self.heads.n_layers
                for i in range(hi - lo):
                    x = n
                    for j in range(nl):
                        x = x + F.silu(lins[i * nl + j](x))
                    parts.append(x.unsqueeze(-2))
            else:
                out = lins[1](torch.relu(lins[0](h)))
                parts.append(self.final_norm(h.unsqueeze(-2) + out.view(*h.shape[:-1], hi - lo, self.d)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def logits(self, h: Tensor, lo: int = 0, hi: int = 1) -> Tensor:
        """Full-vocabulary logits of heads lo..hi-1: h [...,D] -> [...,hi-lo,V]."""
        return self.proj(self.states(h, lo, hi))

    def head1(self, h: Tensor) -> Tensor:
        """Head 1's (the LM's) logits: h [...,D] -> [...,V]."""
        if self.identity_p1:
            return self.proj(self.final_norm(h))
        return self.logits(h, 0, 1).squeeze(-2)

    def head1_argmax(self, h: Tensor) -> Tensor:
        """Head 1's next token [...] (one native call where the kernels run: the loops' own arithmetic)."""
        if self.native_layers is not None and self.identity_p1:
            return self.ext.lm_head1_argmax(h, self.native_layers)
        return self.head1(h).argmax(-1)

    def propose(self, h: Tensor, lo: int, hi: int) -> Tensor:
        """Argmax ids of heads lo..hi-1 (lo >= 1) [...,hi-lo], over the draft vocabulary when one is set."""
        if self.native_layers is not None and lo >= 1:
            _, prop = self._head_lins(lo, hi)
            if prop is not None:
                return self.ext.lm_propose(h, self.native_layers, prop)
        s = self.states(h, lo, hi)
        if self.draft_proj is None:
            return self.prop_proj(s).argmax(-1)
        return self.draft_ids[self.draft_proj(s).argmax(-1)]

    # ---- loops ----
    def greedy_steps(self, model, state, tok: Tensor, room, max_steps: int, eos=None):
        """DecodeWeights.greedy_steps (same contract); a row ends on any of the model's stop ids (decoding/common.py
        stop_ids: LMConfig.eos_ids where a checkpoint lists several). One native call where the kernels run."""
        from bpd_train.decoding.common import is_stop, stop_ids

        eos = stop_ids(model) if eos is None else eos
        net = self.native_loop
        if net is not None and max_steps > 0:
            lengths = state.lengths
            if isinstance(lengths, int):
                t, per_row = state.base + lengths, None
            else:
                t = state.base
                per_row = lengths if isinstance(lengths, Tensor) else torch.from_numpy(np.asarray(lengths))
            toks, h, self.last_seconds = self.ext.lm_greedy_steps(
                tok, net, state.self_kv, state.lpad, state.cos, state.sin, t, per_row, _stops(eos),
                torch.from_numpy(np.ascontiguousarray(room, dtype=np.int64)), int(max_steps))
            return toks.numpy(), h
        self.last_seconds = None
        lengths = state.lengths
        steps, h = [], None
        x = tok[:, None]
        for s in range(max_steps):
            state.lengths = lengths + s
            h = model.decode(state, x)[:, 0]
            nxt = self.head1_argmax(h)
            g = nxt.cpu().numpy()
            steps.append(g)
            x = nxt[:, None]
            if (is_stop(g, eos) | (room <= s + 1)).any():
                break
        state.lengths = lengths
        return (np.stack(steps, axis=1) if steps else np.zeros((tok.shape[0], 0), dtype=np.int64)), h

    def _block_prop(self, w: int, max_steps: int):
        if self.native_loop is None or self.heads is None or w < 2 or max_steps < 1:
            return None
        return self._head_lins(1, w)[1]

    def block_steps(self, model, state, x: np.ndarray, room: int, max_steps: int, eos=None, width: int | None = None):
        """DecodeWeights.block_steps (same contract) for one row: exact blockwise steps as one native call, or None
        where the native kernels do not run this model."""
        from bpd_train.decoding.common import stop_ids

        w = x.shape[0] if width is None else int(width)
        prop = self._block_prop(w, max_steps)
        if prop is None:
            return None
        toks, nc, nxt, hn, ended, self.last_seconds = self.ext.lm_block_steps(
            torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)), self.native_loop, prop, state.self_kv,
            state.lpad, state.cos, state.sin, state.base + state.lengths,
            _stops(stop_ids(model) if eos is None else eos), int(room), int(max_steps), self.verify_group, w)
        return toks.numpy(), nc.numpy(), nxt.numpy(), hn, bool(ended)

    def batch_block_steps(self, model, state, x: np.ndarray, lengths: np.ndarray, room: np.ndarray, max_steps: int,
                          width: int | None = None, eos=None):
        """DecodeWeights.batch_block_steps (same contract) for R rows in per-row cache mode, or None where the
        native kernels do not run this model."""
        from bpd_train.decoding.common import stop_ids

        w = x.shape[1] if width is None else int(width)
        prop = self._block_prop(w, max_steps)
        if prop is None:
            return None
        toks, nc, nxt, hn, ended, self.last_seconds = self.ext.lm_batch_block_steps(
            torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)), self.native_loop, prop, state.self_kv,
            state.lpad, state.cos, state.sin, state.base,
            torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64)),
            _stops(stop_ids(model) if eos is None else eos),
            torch.from_numpy(np.ascontiguousarray(room, dtype=np.int64)), int(max_steps), self.verify_group, w)
        return toks.numpy(), nc.numpy(), nxt.numpy(), hn, ended.numpy().astype(bool)

    # the native loops end rows on any of several stop ids (decoding/blockwise.py asks)
    multi_stop = True


def _plin(mod: nn.Linear, dtype: str) -> PackedLinear:
    p = mod._parameters
    return PackedLinear(p["weight"], p["bias"], dtype)


class LMModel(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.register_module("lm_head", None if c.tie_output else nn.Linear(c.d_model, c.vocab_size, bias=False))
        self.drop = nn.Dropout(c.dropout)
        self._init_backbone()
        # k = 1 is a plain LM: no head parameters. Future heads start at zero: each equals head 1.
        heads = None
        if c.block_size > 1:
            heads = (MedusaHeads(c.d_model, c.block_size, c.medusa_layers, c.dropout) if c.heads == "medusa"
                     else BPDHeads(c.d_model, c.block_size, c.head_hidden, c.identity_p1, c.dropout))
        self.register_module("heads", heads)
        self.decode_options = DecodeOptions()
        self._decode_cache: tuple | None = None

    def _init_backbone(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- parameter groups (regimes freeze by these) ----
    def head_parameters(self) -> list[nn.Parameter]:
        return list(self.heads.parameters()) if self.heads is not None else []

    def backbone_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("heads.")]

    # ---- full sequence (training, scoring) ----
    def features(self, tokens: Tensor) -> Tensor:
        """tokens [B,T] (right padding with pad_id allowed: causal attention never looks ahead) -> h [B,T,D],
        the layer stack's output before the final norm."""
        t = tokens.shape[1]
        if t > self.config.max_positions:
            raise ValueError(f"sequence length {t} exceeds max_positions={self.config.max_positions}")
        # computed per call (T x Dh/2, negligible): a cached table built under inference_mode could not be
        # saved for backward by a later training step
        c = self.config
        cos, sin = rope_tables(t, c.dh, c.rope_theta, tokens.device, c.rope_scaling)
        x = self.drop(self.embed(tokens.clamp(min=0)))
        # the tables are built in fp32 (exact angles); the activations may be bf16 (DeepSpeed casts the weights)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [B,T] -> [B,T,k,V]; logits[:, t, i] predicts position t+1+i."""
        return self.heads_logits(self.features(tokens))

    # ---- heads ----
    def output_weight(self) -> Tensor:
        """[V,D] vocabulary projection: the token embedding (tied) or the separate lm_head."""
        head = self._modules["lm_head"]
        return (head if head is not None else self._modules["embed"])._parameters["weight"]

    def head_states(self, h: Tensor, lo: int = 0, hi: int | None = None) -> Tensor:
        """h [...,D] -> what the vocabulary projection reads for heads lo..hi-1 [...,hi-lo,D]: BPD heads go
        through the final norm after their FFN, Medusa heads read the normed state."""
        k = self.config.block_size
        hi = k if hi is None else hi
        if not 0 <= lo < hi <= k:
            raise IndexError(f"heads {lo}..{hi - 1} out of range for block_size={k}")
        heads = self.heads
        if heads is None:
            return self.norm(h).unsqueeze(-2)
        if isinstance(heads, MedusaHeads):
            n = self.norm(h)
            if lo == 0:
                return n.unsqueeze(-2) if hi == 1 else torch.cat([n.unsqueeze(-2), heads.states(n, 1, hi)], dim=-2)
            return heads.states(n, lo, hi)
        if lo == 0 and heads.identity_p1:
            s = h.unsqueeze(-2) if hi == 1 else torch.cat([h.unsqueeze(-2), heads.states(h, 1, hi)], dim=-2)
        else:
            s = heads.states(h, lo, hi)
        return self.norm(s)

    def heads_logits(self, h: Tensor, lo: int = 0, hi: int | None = None) -> Tensor:
        """h [...,D] -> logits of heads lo..hi-1 [...,hi-lo,V]."""
        return F.linear(self.head_states(h, lo, hi), self.output_weight())

    def head_logits(self, h: Tensor, i: int) -> Tensor:
        """h [...,D] -> logits [...,V] of head i (0 = the LM head: predicts the next token)."""
        if not 0 <= i < self.config.block_size:
            raise IndexError(f"head {i} out of range for block_size={self.config.block_size}")
        return self.heads_logits(h, i, i + 1).squeeze(-2)

    # ---- decoding ----
    def encode(self, prompts: Tensor) -> Prompt:
        """prompts [B,S] right-padded with pad_id (what decoding/common.py prepare_source builds) -> Prompt,
        left-padded. Rows hold >= 1 token (prepare_source refuses empty ones)."""
        if prompts.dim() != 2:
            raise ValueError(f"prompts must be [B,S], got shape {tuple(prompts.shape)}")
        real = prompts != self.config.pad_id
        lens = real.sum(1)                                                       # [B]
        p = int(lens.max())
        if p > self.config.max_positions:
            raise ValueError(f"prompt length {p} exceeds max_positions={self.config.max_positions}")
        lpad = p - lens
        ids = torch.zeros(prompts.shape[0], p, dtype=torch.long, device=prompts.device)
        dest = torch.arange(prompts.shape[1], device=prompts.device)[None, :] + lpad[:, None]   # [B,S]
        ids[real.nonzero(as_tuple=True)[0], dest[real]] = prompts[real]
        return Prompt(ids, lpad)

    def start_decoding(self, prompt: Prompt, capacity: int, expand: int = 1) -> LMState:
        """A KV cache for prompt.batch_size*expand rows (row r belongs to prompt r // expand) holding the
        prompts (all but their last tokens) and up to `capacity` decoder tokens per row."""
        c = self.config
        ids, lpad = prompt.ids, prompt.lpad
        if expand > 1:
            ids, lpad = ids.repeat_interleave(expand, 0), lpad.repeat_interleave(expand, 0)
        r, p = ids.shape
        w = self.embed.weight
        kv = w.new_zeros(c.n_layers, 2, r, c.kv_heads, p - 1 + capacity, c.dh)
        state = LMState(kv, lpad, c)
        state.weights = self.decode_weights()
        state.first = ids[:, -1:].clone()
        if p > 1:
            self._prefill(state, ids[:, :-1])
            state.base = p - 1
        return state

    def _prefill(self, state: LMState, ids: Tensor) -> None:
        """Cache the prompt prefix ids [R,P-1] at slots 0..P-2. Pad queries attend to themselves only (finite
        junk that the key mask then hides), real ones causally to the row's real tokens."""
        r, t = ids.shape
        net = getattr(state.weights, "native_layers", None)
        if net is not None:   # the native stack (LMDecodeWeights): every row's prefix as it would be alone
            state.weights.ext.lm_decode_layers(ids, net, state.self_kv, state.lpad, state.cos, state.sin,
                                               torch.arange(t).expand(r, t))
            return
        slots = torch.arange(t, device=ids.device)
        key_ok = (slots[None, :] >= state.lpad[:, None])[:, None, :] | (slots[:, None] == slots[None, :])  # [R,t,t]
        allowed = key_ok & (slots[None, :] <= slots[:, None])
        mask = torch.zeros(allowed.shape, dtype=state.self_kv.dtype, device=ids.device).masked_fill_(
            ~allowed, float("-inf"))[:, None]                                  # [R,1,t,t]
        pos = (slots[None, :] - state.lpad[:, None]).clamp(min=0)

        def write(kv: Tensor, new: Tensor) -> None:
            kv[:, :, :, :t] = new

        self._run(state, ids, pos, write, t, mask)

    def _run(self, state: LMState, tokens: Tensor, pos: Tensor, write, kv_len: int, mask) -> Tensor:
        x = self.embed(tokens)
        cos, sin = state.cos[pos][:, None].to(x.dtype), state.sin[pos][:, None].to(x.dtype)   # [R,1,n,Dh]
        for i, layer in enumerate(self.layers):
            x = layer.step(x, state.self_kv[i], write, kv_len, mask, cos, sin)
        return x

    def decode(self, state: LMState, tokens: Tensor, kv_len: int | None = None) -> Tensor:
        """tokens [R,n] -> h [R,n,D]. Writes their K/V at each row's slots base+lengths..; the caller
        advances (or rolls back) `state.lengths` afterwards. On the native path (LMDecodeWeights.native_layers)
        one C++ call, row-exact; else torch (SDPA)."""
        w = state.weights
        net = getattr(w, "native_layers", None)
        if net is not None:
            return w.ext.lm_decode_layers(tokens, net, state.self_kv, state.lpad, state.cos, state.sin,
                                          state.slots(tokens.shape[1]))
        pos, write, kv_len, mask = state.prepare(tokens.shape[1], kv_len)
        return self._run(state, tokens, pos, write, kv_len, mask)

    def start_tokens(self, state: LMState) -> Tensor:
        """[R,1] the decoders' first input: each prompt's last token."""
        return state.first

    def __getstate__(self):
        state = dict(super().__getstate__())
        state["_decode_cache"] = None
        return state

    def decode_weights(self) -> LMDecodeWeights:
        key = weights_key(self, self.decode_options)
        cached = self._decode_cache
        if cached is None or cached[0] != key:
            cached = self._decode_cache = (key, LMDecodeWeights(self, self.decode_options))
        return cached[1]
