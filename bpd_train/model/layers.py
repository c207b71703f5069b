"""Transformer building blocks (pre-norm). Each block has a full-sequence path (training) and a cached
single-call path (decoding) that must give the same numbers; the cache itself lives in cache.py."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """[P, D] fixed positions (Vaswani et al.): no parameters, so any max_positions loads any checkpoint."""
    pos = torch.arange(n_positions, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(n_positions, d_model)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div[: d_model // 2])
    return pe


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    b, t, d = x.shape  # [B,T,D] -> [B,H,T,Dh]
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    b, h, t, dh = x.shape  # [B,H,T,Dh] -> [B,T,D]
    return x.transpose(1, 2).reshape(b, t, h * dh)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(F.relu(self.fc1(x))))


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.attn_dropout = dropout

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        q, k, v = (split_heads(t, self.n_heads) for t in self.qkv(x).chunk(3, dim=-1))
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal and mask is None)
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
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.dropout(self.attn(self.norm1(x), mask=mask))
        return x + self.dropout(self.ffn(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.self_attn = SelfAttention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.cross_attn = CrossAttention(d_model, n_heads, dropout)
        self.norm3 = nn.LayerNorm(d_model, eps=eps)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mem_kv: Tensor, mem_mask: Tensor | None) -> Tensor:
        x = x + self.dropout(self.self_attn(self.norm1(x), causal=True))
        x = x + self.dropout(self.cross_attn(self.norm2(x), mem_kv, mem_mask))
        return x + self.dropout(self.ffn(self.norm3(x)))

    def step(self, x: Tensor, self_kv: Tensor, write, kv_len: int, self_mask: Tensor | None,
             mem_kv: Tensor, mem_mask: Tensor | None) -> Tensor:
        """Cached decoding (eval only): x [R,n,D] new tokens; self_kv [2,R,H,L,Dh] this layer's cache, where
        write(kv, new [2,R,H,n,Dh]) stores the new keys/values; attention reads slots [0, kv_len) under the
        additive self_mask. Same math as forward(); written with functional calls because per-call
        overhead, not arithmetic, dominates small-batch decoding."""
        r, n, d = x.shape
        sa, ca, ffn = self.self_attn, self.cross_attn, self.ffn
        h = sa.n_heads
        y = F.layer_norm(x, (d,), self.norm1.weight, self.norm1.bias, self.norm1.eps)
        qkv = F.linear(y, sa.qkv.weight, sa.qkv.bias).view(r, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
        write(self_kv, qkv[1:])
        y = F.scaled_dot_product_attention(qkv[0], self_kv[0, :, :, :kv_len], self_kv[1, :, :, :kv_len],
                                           attn_mask=self_mask)
        x = x + F.linear(y.transpose(1, 2).reshape(r, n, d), sa.out.weight, sa.out.bias)
        y = F.layer_norm(x, (d,), self.norm2.weight, self.norm2.bias, self.norm2.eps)
        q = F.linear(y, ca.q.weight, ca.q.bias).view(r, n, h, d // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, mem_kv[0], mem_kv[1], attn_mask=mem_mask)
        x = x + F.linear(y.transpose(1, 2).reshape(r, n, d), ca.out.weight, ca.out.bias)
        y = F.layer_norm(x, (d,), self.norm3.weight, self.norm3.bias, self.norm3.eps)
        y = F.linear(F.relu(F.linear(y, ffn.fc1.weight, ffn.fc1.bias)), ffn.fc2.weight, ffn.fc2.bias)
        return x + y
