"""Transformer building blocks (pre-norm, or post-norm for imported Marian models). Each block has a full-sequence
path (training) and a cached single-call path (decoding) that must give the same numbers; the cache itself lives in
cache.py."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


def sinusoidal_table(n_positions: int, d_model: int, layout: str = "interleaved", offset: int = 0) -> Tensor:
    """[P, D] fixed positions: no parameters, so any max_positions loads any checkpoint. Row p is position
    p + offset of the layout's table (M2M100's positions start at pad_id + 1).
      interleaved  Vaswani et al., sin/cos alternating (this project's own models)
      marian       Marian/transformers MarianMTModel: [sin | cos] halves, 10000^(2i/D), built in float64
      fairseq      fairseq/M2M100 (tensor2tensor): [sin | cos] halves, 10000^(i/(D/2 - 1)), float32"""
    if layout == "interleaved" and offset == 0:
        pos = torch.arange(n_positions, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(n_positions, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div[: d_model // 2])
        return pe
    if d_model % 2:
        raise ValueError(f"pos_layout {layout!r} needs an even d_model, got {d_model}")
    n = n_positions + offset
    half = d_model // 2
    if layout == "marian":  # the same arithmetic as transformers' create_weight, so the rows match bit for bit
        ang = np.arange(n, dtype=np.float64)[:, None] / np.power(10000, 2 * np.arange(half) / d_model)[None, :]
        pe = torch.cat([torch.from_numpy(np.sin(ang)).float(), torch.from_numpy(np.cos(ang)).float()], dim=1)
    elif layout == "fairseq":
        freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
        ang = torch.arange(n, dtype=torch.int64).float().unsqueeze(1) * freq.unsqueeze(0)
        pe = torch.cat([torch.sin(ang), torch.cos(ang)], dim=1)
    else:
        raise ValueError(f"unknown pos_layout {layout!r}")
    return pe[offset:].contiguous()


ACTIVATIONS = {"relu": torch.relu, "gelu": F.gelu, "swish": F.silu}


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    b, t, d = x.shape  # [B,T,D] -> [B,H,T,Dh]
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    b, h, t, dh = x.shape  # [B,H,T,Dh] -> [B,T,D]
    return x.transpose(1, 2).reshape(b, t, h * dh)


# Training paths call submodules as modules (so wrappers that hook module calls, e.g. DeepSpeed ZeRO-3,
# see every call). Inference paths (no autograd) call F.* with the weights read once: at decoding sizes
# the module-call machinery costs more than the arithmetic.


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str = "relu"):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.p = dropout
        self.act = ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        y = self.act(self.fc1(x))
        if self.training and self.p:
            y = F.dropout(y, self.p, True)
        return self.fc2(y)


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.attn_dropout = dropout

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            qkv[0], qkv[1], qkv[2], attn_mask=mask, dropout_p=p, is_causal=causal and mask is None
        )
        return self.out(merge_heads(y))


class CrossAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.attn_dropout = dropout

    def memory_kv(self, memory: Tensor) -> Tensor:
        """[B,S,D] -> [2,B,H,S,Dh]: computed once per source and reused by every decoder call."""
        b, s, d = memory.shape
        return self.kv(memory).view(b, s, 2, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)

    def forward(self, x: Tensor, kv: Tensor, mask: Tensor | None) -> Tensor:
        q = split_heads(self.q(x), self.n_heads)
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, dropout_p=p)
        return self.out(merge_heads(y))


class EncoderLayer(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float,
        eps: float,
        pre_norm: bool = True,
        activation: str = "relu",
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.ffn = FeedForward(d_model, d_ff, dropout, activation)
        self.p = dropout
        self.pre_norm = pre_norm

    def _drop(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, True) if self.training and self.p else x

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        if not self.training and not torch.is_grad_enabled():  # inference: same math, fewer lookups
            return self._forward_inference(x, mask)
        if not self.pre_norm:
            x = self.norm1(x + self._drop(self.attn(x, mask=mask)))
            return self.norm2(x + self._drop(self.ffn(x)))
        x = x + self._drop(self.attn(self.norm1(x), mask=mask))
        return x + self._drop(self.ffn(self.norm2(x)))

    def _forward_inference(self, x: Tensor, mask: Tensor | None) -> Tensor:
        m = self._modules
        n1, n2 = m["norm1"]._parameters, m["norm2"]._parameters
        at, ffn = m["attn"]._modules, m["ffn"]._modules
        qkv, out, fc1, fc2 = (mod._parameters for mod in (at["qkv"], at["out"], ffn["fc1"], ffn["fc2"]))
        b, t, d = x.shape
        h = m["attn"].n_heads
        shape, eps = m["norm1"].normalized_shape, m["norm1"].eps
        if not self.pre_norm:
            y = F.linear(x, qkv["weight"], qkv["bias"]).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(y[0], y[1], y[2], attn_mask=mask)
            x = x + F.linear(y.transpose(1, 2).reshape(b, t, d), out["weight"], out["bias"])
            x = torch.layer_norm(x, shape, n1["weight"], n1["bias"], eps)
            y = F.linear(m["ffn"].act(F.linear(x, fc1["weight"], fc1["bias"])), fc2["weight"], fc2["bias"])
            return torch.layer_norm(x + y, shape, n2["weight"], n2["bias"], eps)
        y = torch.layer_norm(x, shape, n1["weight"], n1["bias"], eps)
        y = F.linear(y, qkv["weight"], qkv["bias"]).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(y[0], y[1], y[2], attn_mask=mask)
        x = x + F.linear(y.transpose(1, 2).reshape(b, t, d), out["weight"], out["bias"])
        y = torch.layer_norm(x, shape, n2["weight"], n2["bias"], eps)
        return x + F.linear(m["ffn"].act(F.linear(y, fc1["weight"], fc1["bias"])), fc2["weight"], fc2["bias"])


class DecoderLayer(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float,
        eps: float,
        pre_norm: bool = True,
        activation: str = "relu",
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.self_attn = SelfAttention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.cross_attn = CrossAttention(d_model, n_heads, dropout)
        self.norm3 = nn.LayerNorm(d_model, eps=eps)
        self.ffn = FeedForward(d_model, d_ff, dropout, activation)
        self.p = dropout
        self.pre_norm = pre_norm

    def _drop(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, True) if self.training and self.p else x

    def forward(self, x: Tensor, memory: Tensor, mem_mask: Tensor | None) -> Tensor:
        """x [B,T,D] decoder input, memory [B,S,D] encoder output. The memory's K/V are computed here, inside this
        layer's call, so that wrappers that gather a layer's parameters for its forward (FSDP auto-wrap per
        layer, ZeRO-3) see every use of them."""
        mem_kv = self.cross_attn.memory_kv(memory)
        if not self.pre_norm:
            x = self.norm1(x + self._drop(self.self_attn(x, causal=True)))
            x = self.norm2(x + self._drop(self.cross_attn(x, mem_kv, mem_mask)))
            return self.norm3(x + self._drop(self.ffn(x)))
        x = x + self._drop(self.self_attn(self.norm1(x), causal=True))
        x = x + self._drop(self.cross_attn(self.norm2(x), mem_kv, mem_mask))
        return x + self._drop(self.ffn(self.norm3(x)))


def decode_step(
    w,
    x: Tensor,
    self_kv: Tensor,
    write,
    kv_len: int,
    self_mask: Tensor | None,
    mem_kv: Tensor,
    mem_mask: Tensor | None,
    mem_group: int = 1,
) -> Tensor:
    """DecoderLayer.forward for cached decoding (eval only). x [R,n,D] new tokens; self_kv [2,R,H,L,Dh]
    this layer's cache, where write(kv, new [2,R,H,n,Dh]) stores the new keys/values; attention reads
    slots [0, kv_len) under the additive self_mask. mem_kv [2,R/G,H,S,Dh] is shared by groups of G =
    mem_group consecutive rows (beams): their queries attend to it as one longer query block, so it is
    never copied per row. Plain torch calls: per-call overhead, not arithmetic,
    dominates small-batch decoding. w: engine/mt.py StepWeights (its linears are PackedLinear)."""
    if not w.pre_norm:
        return _decode_step_post_norm(w, x, self_kv, write, kv_len, self_mask, mem_kv, mem_mask, mem_group)
    r, n, d = x.shape
    h = w.n_heads
    y = torch.layer_norm(x, w.shape, w.n1_w, w.n1_b, w.eps)
    qkv = w.qkv(y).view(r, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
    write(self_kv, qkv[1:])
    y = F.scaled_dot_product_attention(
        qkv[0], self_kv[0, :, :, :kv_len], self_kv[1, :, :, :kv_len], attn_mask=self_mask
    )
    x = x + w.so(y.transpose(1, 2).reshape(r, n, d))
    y = torch.layer_norm(x, w.shape, w.n2_w, w.n2_b, w.eps)
    g = mem_group
    q = w.q(y).view(r // g, g * n, h, d // h).transpose(1, 2)  # [R/G,H,G*n,Dh]
    y = F.scaled_dot_product_attention(q, mem_kv[0], mem_kv[1], attn_mask=mem_mask)
    x = x + w.co(y.transpose(1, 2).reshape(r, n, d))
    y = torch.layer_norm(x, w.shape, w.n3_w, w.n3_b, w.eps)
    return x + w.f2(w.act(w.f1(y)))


def _decode_step_post_norm(
    w,
    x: Tensor,
    self_kv: Tensor,
    write,
    kv_len: int,
    self_mask: Tensor | None,
    mem_kv: Tensor,
    mem_mask: Tensor | None,
    mem_group: int,
) -> Tensor:
    """decode_step of a post-norm DecoderLayer (Marian): each sublayer's norm follows its residual sum."""
    r, n, d = x.shape
    h = w.n_heads
    qkv = w.qkv(x).view(r, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
    write(self_kv, qkv[1:])
    y = F.scaled_dot_product_attention(
        qkv[0], self_kv[0, :, :, :kv_len], self_kv[1, :, :, :kv_len], attn_mask=self_mask
    )
    x = torch.layer_norm(x + w.so(y.transpose(1, 2).reshape(r, n, d)), w.shape, w.n1_w, w.n1_b, w.eps)
    g = mem_group
    q = w.q(x).view(r // g, g * n, h, d // h).transpose(1, 2)  # [R/G,H,G*n,Dh]
    y = F.scaled_dot_product_attention(q, mem_kv[0], mem_kv[1], attn_mask=mem_mask)
    x = torch.layer_norm(x + w.co(y.transpose(1, 2).reshape(r, n, d)), w.shape, w.n2_w, w.n2_b, w.eps)
    return torch.layer_norm(x + w.f2(w.act(w.f1(x))), w.shape, w.n3_w, w.n3_b, w.eps)
