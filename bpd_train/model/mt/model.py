"""Encoder-decoder Transformer (pre-norm, tied embeddings) with k BPD heads.

The BPDConfig architecture options (post-norm, no final norms, other sinusoid layouts, separate
embeddings, a logits bias, a decoder prefix) exist so that imported Marian / M2M100 / NLLB checkpoints
(bpd_train/sources/convert/hf/mt.py) compute what transformers computes; the defaults are this project's own models.

Shapes: B batch, S source length, T target length, D d_model, V vocab, k heads, R decoder rows while
decoding (batch x beam), n new tokens per decoder call.

Decoding reads the decode engine's step weights for this model (engine/mt.py DecodeWeights), which the caller
passes in (`encode(src, weights)`, `start_decoding(memory, capacity, weights=...)`): the model keeps no decode
state of its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bpd_train.model.cache import DecoderState, Memory
from bpd_train.model.common import HeadedModel
from bpd_train.model.heads import BPDHeads, ChainHeads
from bpd_train.model.layers import DecoderLayer, EncoderLayer, decode_step, sinusoidal_table
from bpd_train.model.mt.config import BPDConfig


class BPDModel(HeadedModel):
    def __init__(self, config: BPDConfig):
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)  # target tokens; also the output projection (tied)
        # only where the checkpoint has them: a separate encoder embedding, an untied output projection
        # (registered even when absent, so that state_dict names and _modules lookups are stable)
        self.register_module("src_embed", None if c.share_embeddings else nn.Embedding(c.source_vocab_size, c.d_model))
        self.register_module("lm_head", None if c.tie_output else nn.Linear(c.d_model, c.vocab_size, bias=False))
        # Marian's final_logits_bias: a parameter (so the decode-weight cache sees it change) that no regime trains
        self.register_parameter(
            "logits_bias", nn.Parameter(torch.zeros(c.vocab_size), requires_grad=False) if c.logits_bias else None
        )
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
        self.register_buffer(
            "pe", sinusoidal_table(c.max_positions, c.d_model, c.pos_layout, c.pos_offset), persistent=False
        )
        self.dropout = nn.Dropout(c.dropout)
        arch = dict(pre_norm=c.pre_norm, activation=c.activation)
        self.encoder_layers = nn.ModuleList(
            [
                EncoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout, c.norm_eps, **arch)
                for _ in range(c.n_encoder_layers)
            ]
        )
        self.register_module("encoder_norm", nn.LayerNorm(c.d_model, eps=c.norm_eps) if c.final_norm else None)
        self.decoder_layers = nn.ModuleList(
            [
                DecoderLayer(c.d_model, c.decoder_heads, c.decoder_ff, c.dropout, c.norm_eps, **arch)
                for _ in range(c.n_decoder_layers)
            ]
        )
        # the "final norm" every head goes through (None: heads go straight to the projection)
        self.register_module("decoder_norm", nn.LayerNorm(c.d_model, eps=c.norm_eps) if c.final_norm else None)
        self._init_backbone()
        # k = 1 is a plain Transformer: no head parameters at all.
        if c.block_size == 1:
            self.heads = None
        elif c.head_chain:
            self.heads = ChainHeads(c.d_model, c.block_size, c.head_hidden, c.dropout)
        else:
            self.heads = BPDHeads(c.d_model, c.block_size, c.head_hidden, c.identity_p1, c.dropout)

    def _init_backbone(self) -> None:
        nn.init.normal_(self.embed.weight, std=self.config.d_model**-0.5)
        for extra in (self.src_embed, self.lm_head):
            if extra is not None:
                nn.init.normal_(extra.weight, std=self.config.d_model**-0.5)
        for layer in [*self.encoder_layers, *self.decoder_layers]:
            for m in layer.modules():
                if isinstance(m, nn.Linear):
                    nn.init.xavier_uniform_(m.weight)
                    nn.init.zeros_(m.bias)

    # ---- encoder ----
    def _embed(self, tokens: Tensor, positions, source: bool = False) -> Tensor:
        table = self.src_embed if source and self.src_embed is not None else self.embed
        x = table(tokens) * self.embed_scale
        x = x + self.pe[positions].to(x.dtype)  # pe stays fp32 where DeepSpeed casts only the parameters
        return self.dropout(x) if self.training else x

    def encode(self, src: Tensor, weights=None) -> Memory:
        """src [B,S] ids + eos, right-padded with pad_id -> Memory (encoder output + padding masks). weights: a
        decoder's step weights (engine/step.py DecodeStep), whose native encoder runs it where it can."""
        if src.dim() != 2:
            raise ValueError(f"src must be [B,S], got shape {tuple(src.shape)}")
        s = src.shape[1]
        if s > self.config.max_positions:
            raise ValueError(f"source length {s} exceeds max_positions={self.config.max_positions}")
        pad_mask = src != self.config.pad_id  # [B,S]
        w = _native(weights, src.device, self._modules["embed"]._parameters["weight"].dtype)
        if w is not None:  # decoding on the CPU: embedding and the whole stack in one native call (engine/mt.py)
            out, padded = w.encode_ids(self, src)
            return Memory(out, pad_mask, pad_mask[:, None, None, :] if padded else None)
        attn_mask = pad_mask[:, None, None, :]  # [B,1,1,S]
        x = self._embed(src, slice(0, s), source=True)
        layer_mask = attn_mask
        if not torch.is_grad_enabled():  # decoding: same math, cheaper attention
            if bool(pad_mask.all()):
                layer_mask = None  # nothing padded (always so at batch 1)
            else:  # additive float mask once, rather than SDPA converting the bool mask in every layer
                layer_mask = torch.zeros(attn_mask.shape, dtype=x.dtype, device=x.device).masked_fill_(
                    ~attn_mask, float("-inf")
                )
        for layer in self.encoder_layers:
            x = layer(x, layer_mask)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return Memory(x, pad_mask, attn_mask)

    # ---- decoder, full sequence (training) ----
    def features(self, memory: Memory, tgt_in: Tensor) -> Tensor:
        """tgt_in [B,T] (BOS-prefixed) -> h [B,T,D]: decoder stack output before the final norm."""
        prefix = self.config.decoder_prefix
        if prefix:  # the decoder-start tokens before BOS (M2M100/NLLB); their outputs predict nothing
            tgt_in = torch.cat([tgt_in.new_tensor(prefix).expand(tgt_in.shape[0], -1), tgt_in], dim=1)
        t = tgt_in.shape[1]
        if t > self.config.max_positions:
            raise ValueError(f"target length {t} exceeds max_positions={self.config.max_positions}")
        x = self._embed(tgt_in, slice(0, t))
        for layer in self.decoder_layers:
            x = layer(x, memory.out, memory.attn_mask)
        return x[:, len(prefix) :] if prefix else x

    def decode_logits_bias(self) -> Tensor | None:
        """[V] bias the decoders add to the projection: logits_bias, and -inf at config.suppress_ids (what
        transformers' generate does with bad_words_ids). Training and forward() never suppress."""
        c = self.config
        bias = self.logits_bias
        if not c.suppress_ids:
            return bias.detach() if bias is not None else None
        out = bias.detach().clone() if bias is not None else self.output_weight().new_zeros(c.vocab_size)
        out[list(c.suppress_ids)] = float("-inf")
        return out

    def _project(self, s: Tensor) -> Tensor:
        """Final norm + tied vocabulary projection. (Dict reads instead of module attribute lookups: this
        runs once or twice per decoding step. The tied weight is used outside Embedding.forward, so
        DeepSpeed ZeRO-3 needs it registered as an external parameter of the model.)"""
        norm = self._modules["decoder_norm"]
        if norm is None:
            pass
        elif not torch.is_grad_enabled():  # decoding: skip the module-call machinery
            p = norm._parameters
            s = torch.layer_norm(s, norm.normalized_shape, p["weight"], p["bias"], norm.eps)
        else:
            s = norm(s)
        return F.linear(s, self.output_weight(), self._parameters["logits_bias"])

    @property
    def chained(self) -> bool:
        """Heads 2..k read the token before their own (config.head_chain): head_logits then takes it."""
        return getattr(self._modules.get("heads"), "chained", False)

    def embed_prev(self, prev: Tensor) -> Tensor:
        """prev [...] token ids -> [...,D] what chained heads read of them: the decoder's (scaled) token embedding."""
        return F.embedding(prev, self._modules["embed"]._parameters["weight"]) * self.embed_scale

    def head_logits(self, h: Tensor, i: int, prev: Tensor | None = None) -> Tensor:
        """h [...,D] -> logits [...,V] of head i (0 = p1, predicts the next token; i predicts i+1 ahead).
        Chained heads (i >= 1) also read prev [...], the token before head i's target (teacher-forced in training);
        None: the model's own chain, head i-1's argmax (head 1's for head 2)."""
        if not 0 <= i < self.config.block_size:
            raise IndexError(f"head {i} out of range for block_size={self.config.block_size}")
        heads = self._modules.get("heads")
        if i == 0 and (heads is None or heads.identity_p1):
            return self._project(h)
        if getattr(heads, "chained", False):
            if prev is None:
                prev = self.head_logits(h, i - 1).argmax(-1)
            return self._project(heads.state(h, i, self.embed_prev(prev)))
        return self._project(heads.state(h, i))

    def heads_logits(self, h: Tensor, lo: int = 0, hi: int | None = None) -> Tensor:
        """h [...,D] -> logits of heads lo..hi-1 [...,hi-lo,V] (one FFN and one projection for all; chained heads
        one after another, each given the previous head's argmax)."""
        k = self.config.block_size
        hi = k if hi is None else hi
        if not 0 <= lo < hi <= k:
            raise IndexError(f"heads {lo}..{hi - 1} out of range for block_size={k}")
        heads = self._modules.get("heads")
        if heads is None:
            return self._project(h).unsqueeze(-2)
        if getattr(heads, "chained", False):
            out, prev = [], None
            for i in range(lo, hi):
                out.append(self.head_logits(h, i, prev))
                prev = out[-1].argmax(-1)
            return torch.stack(out, dim=-2)
        if lo == 0 and heads.identity_p1:
            s = h.unsqueeze(-2) if hi == 1 else torch.cat([h.unsqueeze(-2), heads.states(h, 1, hi)], dim=-2)
        else:
            s = heads.states(h, lo, hi)
        return self._project(s)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src [B,S], tgt_in [B,T] -> [B,T,k,V]; logits[:, t, i] predicts target position t+1+i."""
        return self.heads_logits(self.features(self.encode(src), tgt_in))

    # ---- decoder, incremental (decoding) ----
    def start_decoding(self, memory: Memory, capacity: int, expand: int = 1, *, weights) -> DecoderState:
        """A KV cache for memory.batch_size*expand rows (row r belongs to source r // expand), holding up to
        `capacity` decoder tokens per row, decoded with `weights` (a decoder's step weights, engine/step.py
        DecodeStep). Cross-attention K/V are computed here, once."""
        out = memory.out
        b, s, d = out.shape
        w = _native(weights, out.device, out.dtype)
        if w is not None:
            mem_kv = w.memory_kv(out)  # [layers,2,B,H,S,Dh]
        else:
            kvs = []
            for layer in self.decoder_layers:
                ca = layer._modules["cross_attn"]
                kv = ca._modules["kv"]._parameters
                kvs.append(F.linear(out, kv["weight"], kv["bias"]).view(b, s, 2, ca.n_heads, d // ca.n_heads))
            mem_kv = torch.stack(kvs).permute(0, 3, 1, 4, 2, 5)  # [layers,2,B,H,S,Dh]
        mask = memory.attn_mask
        if mask is not None and bool(memory.pad_mask.all()):
            mask = None  # nothing padded: the cheaper unmasked attention gives the same result
        if mask is not None:  # additive float mask: SDPA would convert a bool mask on every call
            mask = torch.zeros(mask.shape, dtype=mem_kv.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        # expand > 1 (beams): memory stays one row per source, shared by that source's `expand` rows
        n_layers, _, b, h, _, dh = mem_kv.shape
        prefix = self.config.decoder_prefix
        self_kv = mem_kv.new_zeros(n_layers, 2, b * expand, h, capacity + len(prefix), dh)
        state = DecoderState(self_kv, mem_kv.contiguous(), mask, self.config.max_positions, mem_group=expand)
        state.weights = weights
        if prefix:  # cache the decoder-start tokens once; decoders then count from BOS as usual
            self.decode(state, torch.tensor(prefix, device=out.device).expand(b * expand, -1))
            state.base = len(prefix)
        return state

    def decode(self, state: DecoderState, tokens: Tensor, kv_len: int | None = None) -> Tensor:
        """tokens [R,n] -> h [R,n,D]. Writes their K/V at each row's slots lengths..lengths+n-1; the caller
        advances (or rolls back) `state.lengths` afterwards."""
        pos, write, kv_len, mask = state.prepare(tokens.shape[1], kv_len)
        x = F.embedding(tokens, self._modules["embed"]._parameters["weight"]) * self.embed_scale
        x = x + self.pe[pos].to(x.dtype)
        self_kv, mem_kv, mem_mask = state.self_kv, state.mem_kv, state.mem_mask
        g = state.mem_group
        native = state.weights.native_layers
        if native is not None:  # the same steps in one C++ call (engine/csrc/encdec.h decode_layers)
            return state.weights.ext.decode_layers(
                x, native, self_kv, mem_kv, mask, mem_mask, write.index, write.t, kv_len, g
            )
        for i, w in enumerate(state.weights.layers):
            x = decode_step(w, x, self_kv[i], write, kv_len, mask, mem_kv[i], mem_mask, g)
        return x


def _native(weights, device: torch.device, dtype: torch.dtype):
    """`weights` where they run this model on the native kernels (in inference mode, fp32 on the CPU, an encoder
    they implement), else None: training, validation (whose sharded strategies gather each layer's weights only
    around its own forward) and other devices keep the torch path."""
    if (
        weights is None
        or not torch.is_inference_mode_enabled()
        or device.type != "cpu"
        or dtype != torch.float32
        or getattr(weights, "native_encoder", None) is None
    ):
        return None
    return weights
