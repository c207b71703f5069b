"""Encoder-decoder Transformer (pre-norm, tied embeddings) with k BPD heads.

Shapes: B batch, S source length, T target length, D d_model, V vocab, k heads, R decoder rows while
decoding (batch x beam), n new tokens per decoder call.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bpd_train.model.cache import DecoderState, Memory
from bpd_train.model.config import BPDConfig
from bpd_train.model.heads import BPDHeads, HeadWeights
from bpd_train.model.layers import DecoderLayer, EncoderLayer, StepWeights, decode_step, linear_t, sinusoidal_table


class DecodeWeights(NamedTuple):
    """Every weight a decoder call and the heads read, Linear weights as [in,out] (layers.linear_t)."""
    layers: list[StepWeights]
    proj: Tensor                   # tied vocabulary projection [D,V]
    heads: HeadWeights | None
    norm: tuple                    # final norm: (normalized_shape, weight, bias, eps)


# model -> (registration count, parameters, their (version, data_ptr), (DecodeWeights for several rows,
# DecodeWeights for one row)). Kept off the module
# so that state_dict, deepcopy and pickling never see the copies; entries go with their model.
_DECODE_WEIGHTS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
# Counts parameter (re)registrations anywhere (e.g. load_state_dict(assign=True)), so that a cached entry
# never outlives a replaced Parameter object without walking the module tree on every decoding run.
_REGISTRATIONS = [0]


def _count_registration(module, name, param):
    _REGISTRATIONS[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_count_registration)


class BPDModel(nn.Module):
    def __init__(self, config: BPDConfig):
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)  # also the output projection (tied)
        self.embed_scale = math.sqrt(c.d_model)
        self.register_buffer("pe", sinusoidal_table(c.max_positions, c.d_model), persistent=False)
        self.dropout = nn.Dropout(c.dropout)
        self.encoder_layers = nn.ModuleList(
            [EncoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout, c.norm_eps) for _ in range(c.n_encoder_layers)])
        self.encoder_norm = nn.LayerNorm(c.d_model, eps=c.norm_eps)
        self.decoder_layers = nn.ModuleList(
            [DecoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout, c.norm_eps) for _ in range(c.n_decoder_layers)])
        self.decoder_norm = nn.LayerNorm(c.d_model, eps=c.norm_eps)  # the "final norm" every head goes through
        self._init_backbone()
        # k = 1 is a plain Transformer: no head parameters at all.
        self.heads = (BPDHeads(c.d_model, c.block_size, c.head_hidden, c.identity_p1, c.dropout)
                      if c.block_size > 1 else None)

    def _init_backbone(self) -> None:
        nn.init.normal_(self.embed.weight, std=self.config.d_model ** -0.5)
        for layer in [*self.encoder_layers, *self.decoder_layers]:
            for m in layer.modules():
                if isinstance(m, nn.Linear):
                    nn.init.xavier_uniform_(m.weight)
                    nn.init.zeros_(m.bias)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- parameter groups (regimes freeze by these) ----
    def head_parameters(self) -> list[nn.Parameter]:
        return list(self.heads.parameters()) if self.heads is not None else []

    def backbone_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("heads.")]

    # ---- encoder ----
    def _embed(self, tokens: Tensor, positions) -> Tensor:
        x = self.embed(tokens) * self.embed_scale + self.pe[positions]
        return self.dropout(x) if self.training else x

    def encode(self, src: Tensor) -> Memory:
        """src [B,S] ids + eos, right-padded with pad_id -> Memory (encoder output + padding masks)."""
        if src.dim() != 2:
            raise ValueError(f"src must be [B,S], got shape {tuple(src.shape)}")
        s = src.shape[1]
        if s > self.config.max_positions:
            raise ValueError(f"source length {s} exceeds max_positions={self.config.max_positions}")
        pad_mask = src != self.config.pad_id                      # [B,S]
        attn_mask = pad_mask[:, None, None, :]                    # [B,1,1,S]
        x = self._embed(src, slice(0, s))
        layer_mask = attn_mask
        if not torch.is_grad_enabled():  # decoding: same math, cheaper attention
            if bool(pad_mask.all()):
                layer_mask = None  # nothing padded (always so at batch 1)
            else:  # additive float mask once, rather than SDPA converting the bool mask in every layer
                layer_mask = torch.zeros(attn_mask.shape, dtype=x.dtype, device=x.device).masked_fill_(
                    ~attn_mask, float("-inf"))
        for layer in self.encoder_layers:
            x = layer(x, layer_mask)
        return Memory(self.encoder_norm(x), pad_mask, attn_mask)

    # ---- decoder, full sequence (training) ----
    def features(self, memory: Memory, tgt_in: Tensor) -> Tensor:
        """tgt_in [B,T] (BOS-prefixed) -> h [B,T,D]: decoder stack output before the final norm."""
        t = tgt_in.shape[1]
        if t > self.config.max_positions:
            raise ValueError(f"target length {t} exceeds max_positions={self.config.max_positions}")
        x = self._embed(tgt_in, slice(0, t))
        for layer in self.decoder_layers:
            x = layer(x, layer.cross_attn.memory_kv(memory.out), memory.attn_mask)
        return x

    def _project(self, s: Tensor) -> Tensor:
        """Final norm + tied vocabulary projection. (Dict reads instead of module attribute lookups: this
        runs once or twice per decoding step. The tied weight is used outside Embedding.forward, so
        DeepSpeed ZeRO-3 needs it registered as an external parameter of the model.)"""
        norm = self._modules["decoder_norm"]
        if not torch.is_grad_enabled():  # decoding: skip the module-call machinery
            p = norm._parameters
            s = torch.layer_norm(s, norm.normalized_shape, p["weight"], p["bias"], norm.eps)
        else:
            s = norm(s)
        return F.linear(s, self._modules["embed"]._parameters["weight"])

    @staticmethod
    def _decoding_weights(state: DecoderState, h: Tensor) -> DecodeWeights:
        return state.decode_weights if h.numel() > h.shape[-1] else state.decode_weights_1  # several rows?

    @staticmethod
    def _project_decoding(s: Tensor, w: DecodeWeights) -> Tensor:
        shape, nw, nb, eps = w.norm
        return linear_t(torch.layer_norm(s, shape, nw, nb, eps), w.proj)

    def head_logits(self, h: Tensor, i: int, state: DecoderState | None = None) -> Tensor:
        """h [...,D] -> logits [...,V] of head i (0 = p1, predicts the next token; i predicts i+1 ahead).
        state: while decoding, the DecoderState whose decode weights to use (same numbers, faster)."""
        if not 0 <= i < self.config.block_size:
            raise IndexError(f"head {i} out of range for block_size={self.config.block_size}")
        heads = self._modules.get("heads")
        if state is not None:
            w = self._decoding_weights(state, h)
            s = h if i == 0 and (heads is None or heads.identity_p1) else heads.states(h, i, i + 1, w.heads)[..., 0, :]
            return self._project_decoding(s, w)
        if i == 0 and (heads is None or heads.identity_p1):
            return self._project(h)
        return self._project(heads.state(h, i))

    def heads_logits(self, h: Tensor, lo: int = 0, hi: int | None = None,
                     state: DecoderState | None = None) -> Tensor:
        """h [...,D] -> logits of heads lo..hi-1 [...,hi-lo,V] (one FFN and one projection for all).
        state: while decoding, the DecoderState whose decode weights to use (same numbers, faster)."""
        k = self.config.block_size
        hi = k if hi is None else hi
        if not 0 <= lo < hi <= k:
            raise IndexError(f"heads {lo}..{hi - 1} out of range for block_size={k}")
        heads = self._modules.get("heads")
        w = self._decoding_weights(state, h) if state is not None else None
        project = self._project if w is None else (lambda x: self._project_decoding(x, w))
        hw = w.heads if w is not None else None
        if heads is None:
            return project(h).unsqueeze(-2)
        if lo == 0 and heads.identity_p1:
            s = h.unsqueeze(-2) if hi == 1 else torch.cat([h.unsqueeze(-2), heads.states(h, 1, hi, hw)], dim=-2)
        else:
            s = heads.states(h, lo, hi, hw)
        return project(s)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src [B,S], tgt_in [B,T] -> [B,T,k,V]; logits[:, t, i] predicts target position t+1+i."""
        return self.heads_logits(self.features(self.encode(src), tgt_in))

    # ---- decoder, incremental (decoding) ----
    def start_decoding(self, memory: Memory, capacity: int, expand: int = 1) -> DecoderState:
        """A KV cache for memory.batch_size*expand rows (row r belongs to source r // expand), holding up to
        `capacity` decoder tokens per row. Cross-attention K/V are computed here, once."""
        out = memory.out
        b, s, d = out.shape
        kvs = []
        for layer in self.decoder_layers:
            ca = layer._modules["cross_attn"]
            kv = ca._modules["kv"]._parameters
            kvs.append(F.linear(out, kv["weight"], kv["bias"]).view(b, s, 2, ca.n_heads, d // ca.n_heads))
        mem_kv = torch.stack(kvs).permute(0, 3, 1, 4, 2, 5)                     # [layers,2,B,H,S,Dh]
        mask = memory.attn_mask
        if mask is not None and bool(memory.pad_mask.all()):
            mask = None  # nothing padded: the cheaper unmasked attention gives the same result
        if mask is not None:  # additive float mask: SDPA would convert a bool mask on every call
            mask = torch.zeros(mask.shape, dtype=mem_kv.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        # expand > 1 (beams): memory stays one row per source, shared by that source's `expand` rows
        n_layers, _, b, h, _, dh = mem_kv.shape
        self_kv = mem_kv.new_zeros(n_layers, 2, b * expand, h, capacity, dh)
        state = DecoderState(self_kv, mem_kv.contiguous(), mask, self.config.max_positions, mem_group=expand)
        state.decode_weights, state.decode_weights_1 = self.decode_weights()
        state.weights, state.weights_1 = state.decode_weights.layers, state.decode_weights_1.layers
        return state

    def decode_weights(self) -> tuple[DecodeWeights, DecodeWeights]:
        """The weights decoding reads, Linear weights as [in,out] (layers.linear_t): for calls on several
        rows, and for calls on one row. On a CPU the first are contiguous copies, because MKL's few-row
        matmul is faster on them (the demo's 128 x 4000 vocabulary projection at 4 rows: 81 vs 120 us, at
        16 rows 111 vs 158 us, 2 threads), cached until any parameter changes (optimizer steps and
        load_state_dict bump version counters or replace parameters), at the cost of one copy of the
        decoder's and the embedding's weights in memory. One-row calls (greedy at batch 1) and every call
        off the CPU use transposed views, which is what F.linear multiplies by: inside greedy's loop on 2
        threads the copies made batch-1 greedy ~9% slower, although they win in isolation."""
        hit = _DECODE_WEIGHTS.get(self)
        if hit is not None and hit[0] == _REGISTRATIONS[0] and hit[2] == [(p._version, p.data_ptr()) for p in hit[1]]:
            return hit[3]
        epoch, params = _REGISTRATIONS[0], list(self.parameters())
        norm = self._modules["decoder_norm"]
        norm = (norm.normalized_shape, norm._parameters["weight"], norm._parameters["bias"], norm.eps)
        heads = self._modules.get("heads")
        emb = self._modules["embed"]._parameters["weight"]

        def build(t) -> DecodeWeights:
            return DecodeWeights(layers=[layer.step_weights(t) for layer in self.decoder_layers], proj=t(emb),
                                 heads=heads.decode_weights(t) if heads is not None else None, norm=norm)

        one = build(lambda w: w.detach().t())
        many = build(lambda w: w.detach().t().contiguous()) if params[0].device.type == "cpu" else one
        pair = (many, one)
        _DECODE_WEIGHTS[self] = (epoch, params, [(p._version, p.data_ptr()) for p in params], pair)
        return pair

    def decode(self, state: DecoderState, tokens: Tensor, kv_len: int | None = None) -> Tensor:
        """tokens [R,n] -> h [R,n,D]. Writes their K/V at each row's slots lengths..lengths+n-1; the caller
        advances (or rolls back) `state.lengths` afterwards."""
        pos, write, kv_len, mask = state.prepare(tokens.shape[1], kv_len)
        x = F.embedding(tokens, self.embed.weight) * self.embed_scale + self.pe[pos]
        self_kv, mem_kv, mem_mask = state.self_kv, state.mem_kv, state.mem_mask
        g = state.mem_group
        for i, w in enumerate(state.weights if tokens.numel() > 1 else state.weights_1):
            x = decode_step(w, x, self_kv[i], write, kv_len, mask, mem_kv[i], mem_mask, g)
        return x
