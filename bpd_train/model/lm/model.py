"""Decoder-only Transformer (the Llama / Qwen2 architecture) with k BPD or Medusa heads.

Pre-norm RMSNorm layers, rotary positions (transformers' rotate-half layout), SwiGLU feed-forward,
grouped-query attention, tied or separate output embedding, optional q/k/v (Qwen2) and output biases. The
head interface is BPDModel's (heads_logits, head_logits, identity head 1, zero-initialised future heads,
head_parameters/backbone_parameters, start_decoding/decode/start_tokens),
so greedy, beam search and blockwise decoding run on it unchanged.

How prompts enter the decoders: `encode(prompts)` (right-padded with the pad sentinel, as the decoders'
prepare_source builds them) returns a `Prompt`: the prompts left-padded to the longest one, P tokens.
`start_decoding` prefills all but each prompt's last token into the KV cache as a fixed prefix of P-1 slots
(DecoderState.base) and `start_tokens(state)` hands the decoders each prompt's last token as their first
input, where an encoder-decoder model hands them BOS. A row with L prompt tokens has P-L pad slots in
front: a per-row key mask hides them and rotary positions count from the row's first real token, so every
row decodes as it would alone.

Decoding (engine/lm.py LMDecodeWeights, which the caller passes in: `start_decoding(prompt, capacity, weights=...)`;
the model keeps no decode state of its own) runs on the native CPU engine (bpd_train/engine) where it is
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
from bpd_train.model.common import HeadedModel
from bpd_train.model.heads import BPDHeads, ChainHeads, MedusaHeads
from bpd_train.model.lm.config import LMConfig


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
    inv = rope_frequencies(dh, theta, scaling, device)  # [Dh/2]
    f = torch.arange(n, dtype=torch.float, device=device)[:, None] * inv[None, :]  # [n,Dh/2]
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
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=p,
            is_causal=causal and mask is None,
            enable_gqa=self.n_kv != self.n_heads,
        )
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

    def step(self, x: Tensor, kv: Tensor, write, kv_len: int, mask: Tensor | None, cos: Tensor, sin: Tensor) -> Tensor:
        """Cached decoding: x [R,n,D] new tokens; kv [2,R,G,L,Dh] this layer's cache, where write(kv, new
        [2,R,G,n,Dh]) stores the new keys/values; attention reads slots [0, kv_len) under the additive mask."""
        q, k, v = self.attn.qkv_heads(self.norm1(x), cos, sin)
        write(kv, torch.stack([k, v]))
        x = x + self.attn.attend(q, kv[0, :, :, :kv_len], kv[1, :, :, :kv_len], mask, causal=False)
        return x + self.mlp(self.norm2(x))


@dataclass
class Prompt:
    """What `encode` gives the decoders: prompts left-padded to the longest."""

    ids: Tensor  # [B,P] token ids; the pad slots hold 0 (hidden by the mask)
    lpad: Tensor  # [B] pad slots in front of each row's first token

    @property
    def batch_size(self) -> int:
        return self.ids.shape[0]


class LMState(DecoderState):
    """DecoderState of a decoder-only model: `base` = P-1 prompt slots, and per row `lpad` pad slots among
    them that no query may see; rotary position of a slot = slot - lpad (the row's own token count)."""

    def __init__(self, self_kv: Tensor, lpad: Tensor, config: LMConfig):
        super().__init__(self_kv, None, None, max_positions=self_kv.shape[4])
        self.lpad = lpad  # [R]
        self.cos, self.sin = rope_tables(
            self.capacity, config.dh, config.rope_theta, self_kv.device, config.rope_scaling
        )
        self.first: Tensor | None = None  # [R,1] each prompt's last token
        self._pad_bias = self._key_pad_bias()

    def _key_pad_bias(self) -> Tensor | None:
        """[R,1,1,L] additive: -inf at each row's pad slots; None when no row is padded."""
        if not bool((self.lpad > 0).any()):
            return None
        slots = torch.arange(self.capacity, device=self.lpad.device)
        hide = slots[None, :] < self.lpad[:, None]
        return torch.zeros(hide.shape, dtype=self.self_kv.dtype, device=hide.device).masked_fill_(hide, float("-inf"))[
            :, None, None, :
        ]

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
        pos = pos.expand(self.rows, n) - self.lpad[:, None]  # [R,n]
        if self._pad_bias is not None:
            pad = self._pad_bias[..., :kv_len]
            mask = pad if mask is None else mask + pad
        return pos, write, kv_len, mask


class LMModel(HeadedModel):
    decoder_only = True  # the decode engine builds engine/lm.py LMDecodeWeights for it (engine/weights.py)

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
            if c.heads == "medusa":
                heads = MedusaHeads(c.d_model, c.block_size, c.medusa_layers, c.dropout)
            elif c.heads == "chain":
                heads = ChainHeads(c.d_model, c.block_size, c.head_hidden, c.dropout)
            else:
                heads = BPDHeads(c.d_model, c.block_size, c.head_hidden, c.identity_p1, c.dropout)
        self.register_module("heads", heads)

    @property
    def medusa_heads(self) -> bool:
        """Whether the heads are Medusa heads (what the decode engine's step weights are told)."""
        return isinstance(self._modules.get("heads"), MedusaHeads)

    def _init_backbone(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

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
    @property
    def chained(self) -> bool:
        """Heads 2..k read the token before their own (heads=chain): head_states / head_logits then take it."""
        return getattr(self._modules.get("heads"), "chained", False)

    def embed_prev(self, prev: Tensor) -> Tensor:
        """prev [...] token ids -> [...,D] what chained heads read of them: the model's token embedding."""
        return F.embedding(prev.clamp(min=0), self._modules["embed"]._parameters["weight"])

    def head_states(self, h: Tensor, lo: int = 0, hi: int | None = None, prev: Tensor | None = None) -> Tensor:
        """h [...,D] -> what the vocabulary projection reads for heads lo..hi-1 [...,hi-lo,D]: BPD and chained heads
        go through the final norm after their FFN, Medusa heads read the normed state. Chained heads also read
        prev [...], the token before head lo's target (hi = lo + 1; teacher-forced in training); None: the model's
        own chain, each head given the previous head's argmax."""
        k = self.config.block_size
        hi = k if hi is None else hi
        if not 0 <= lo < hi <= k:
            raise IndexError(f"heads {lo}..{hi - 1} out of range for block_size={k}")
        heads = self.heads
        if heads is None:
            return self.norm(h).unsqueeze(-2)
        if getattr(heads, "chained", False):
            out = []
            for i in range(lo, hi):
                if i == 0:
                    s = self.norm(h)
                else:
                    if prev is None:
                        prev = F.linear(
                            out[-1] if out else self.head_states(h, i - 1, i).squeeze(-2), self.output_weight()
                        ).argmax(-1)
                    s = self.norm(heads.state(h, i, self.embed_prev(prev)))
                out.append(s)
                prev = None
            return torch.stack(out, dim=-2)
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

    def head_logits(self, h: Tensor, i: int, prev: Tensor | None = None) -> Tensor:
        """h [...,D] -> logits [...,V] of head i (0 = the LM head: predicts the next token); prev: chained heads'
        token before head i's target (head_states)."""
        if not 0 <= i < self.config.block_size:
            raise IndexError(f"head {i} out of range for block_size={self.config.block_size}")
        return F.linear(self.head_states(h, i, i + 1, prev).squeeze(-2), self.output_weight())

    # ---- decoding ----
    def encode(self, prompts: Tensor, weights=None) -> Prompt:
        """prompts [B,S] right-padded with pad_id (what decoding/common.py prepare_source builds) -> Prompt,
        left-padded. Rows hold >= 1 token (prepare_source refuses empty ones). (weights: unused, as the
        encoder-decoder model's encode takes them; the prompts are read in start_decoding.)"""
        if prompts.dim() != 2:
            raise ValueError(f"prompts must be [B,S], got shape {tuple(prompts.shape)}")
        real = prompts != self.config.pad_id
        lens = real.sum(1)  # [B]
        p = int(lens.max())
        if p > self.config.max_positions:
            raise ValueError(f"prompt length {p} exceeds max_positions={self.config.max_positions}")
        lpad = p - lens
        ids = torch.zeros(prompts.shape[0], p, dtype=torch.long, device=prompts.device)
        dest = torch.arange(prompts.shape[1], device=prompts.device)[None, :] + lpad[:, None]  # [B,S]
        ids[real.nonzero(as_tuple=True)[0], dest[real]] = prompts[real]
        return Prompt(ids, lpad)

    def start_decoding(self, prompt: Prompt, capacity: int, expand: int = 1, *, weights) -> LMState:
        """A KV cache for prompt.batch_size*expand rows (row r belongs to prompt r // expand) holding the
        prompts (all but their last tokens) and up to `capacity` decoder tokens per row, decoded with `weights`
        (a decoder's step weights, engine/lm.py LMDecodeWeights)."""
        c = self.config
        ids, lpad = prompt.ids, prompt.lpad
        if expand > 1:
            ids, lpad = ids.repeat_interleave(expand, 0), lpad.repeat_interleave(expand, 0)
        r, p = ids.shape
        w = self.embed.weight
        dtype = getattr(weights, "kv_dtype", None) or w.dtype  # (the native engine's: half below fp32)
        kv = w.new_zeros(c.n_layers, 2, r, c.kv_heads, p - 1 + capacity, c.dh, dtype=dtype)
        state = LMState(kv, lpad, c)
        state.weights = weights
        state.first = ids[:, -1:].clone()
        if p > 1:
            self._prefill(state, ids[:, :-1])
            state.base = p - 1
        return state

    def _prefill(self, state: LMState, ids: Tensor) -> None:
        """Cache the prompt prefix ids [R,P-1] at slots 0..P-2. Pad queries attend to themselves only (finite
        junk that the key mask then hides), real ones causally to the row's real tokens."""
        r, t = ids.shape
        if getattr(state.weights, "native_layers", None) is not None:  # the native stack: LMDecodeWeights.prefill
            state.weights.prefill(state, ids)
            return
        slots = torch.arange(t, device=ids.device)
        key_ok = (slots[None, :] >= state.lpad[:, None])[:, None, :] | (slots[:, None] == slots[None, :])  # [R,t,t]
        allowed = key_ok & (slots[None, :] <= slots[:, None])
        mask = torch.zeros(allowed.shape, dtype=state.self_kv.dtype, device=ids.device).masked_fill_(
            ~allowed, float("-inf")
        )[:, None]  # [R,1,t,t]
        pos = (slots[None, :] - state.lpad[:, None]).clamp(min=0)

        def write(kv: Tensor, new: Tensor) -> None:
            kv[:, :, :, :t] = new

        self._run(state, ids, pos, write, t, mask)

    def _run(self, state: LMState, tokens: Tensor, pos: Tensor, write, kv_len: int, mask) -> Tensor:
        x = self.embed(tokens)
        cos, sin = state.cos[pos][:, None].to(x.dtype), state.sin[pos][:, None].to(x.dtype)  # [R,1,n,Dh]
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
            return w.ext.lm_decode_layers(
                tokens, net, state.self_kv, state.lpad, state.cos, state.sin, state.slots(tokens.shape[1])
            )
        pos, write, kv_len, mask = state.prepare(tokens.shape[1], kv_len)
        return self._run(state, tokens, pos, write, kv_len, mask)

    def start_tokens(self, state: LMState) -> Tensor:
        """[R,1] the decoders' first input: each prompt's last token."""
        return state.first
