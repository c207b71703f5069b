"""Decoding state: encoder memory K/V for cross-attention (computed once) and a preallocated self-attention
KV cache.

Two modes, chosen by the type of `lengths`:
  * uniform (`int`): every row has the same number of cached tokens (greedy, beam search). New K/V are
    written with one slice copy and a single-token call needs no attention mask.
  * per-row (`LongTensor[R]`): rows hold different numbers of tokens (blockwise decoding, where rows
    accept blocks of different sizes). New K/V are scattered at each row's own slots, and a mask lets a
    query at slot p see slots <= p only. Slots past a row's length are stale (rejected proposals) and
    hidden by that mask, so rolling back is just setting `lengths` smaller; they are overwritten later.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Memory:
    out: Tensor                 # [B,S,D] encoder output (after the encoder's final norm)
    pad_mask: Tensor            # [B,S] bool, True at real source tokens
    attn_mask: Tensor | None    # [B,1,1,S] bool for SDPA, None when no row is padded

    @property
    def batch_size(self) -> int:
        return self.out.shape[0]


class DecoderState:
    """KV cache for R decoder rows. `self_kv` [layers,2,R,H,L,Dh]; `mem_kv` [layers,2,R,H,S,Dh]."""

    def __init__(self, self_kv: Tensor, mem_kv: Tensor, mem_mask: Tensor | None, max_positions: int):
        self.self_kv = self_kv
        self.mem_kv = mem_kv
        self.mem_mask = mem_mask
        self.max_positions = max_positions
        self.lengths: int | Tensor = 0
        self._slot_cache: dict[int, Tensor] = {}

    @property
    def rows(self) -> int:
        return self.self_kv.shape[2]

    @property
    def capacity(self) -> int:
        return self.self_kv.shape[4]

    def arange(self, n: int) -> Tensor:
        a = self._slot_cache.get(n)
        if a is None:
            a = self._slot_cache[n] = torch.arange(n, device=self.self_kv.device)
        return a

    def per_row(self) -> "DecoderState":
        """Switch to per-row lengths (idempotent)."""
        if isinstance(self.lengths, int):
            self.lengths = torch.full((self.rows,), self.lengths, dtype=torch.long, device=self.self_kv.device)
        return self

    def reorder(self, index: Tensor, uniform_len: int | None = None) -> None:
        """Keep rows `index` (any order, repeats allowed): beam reordering and dropping finished rows.
        Only the filled prefix of the self cache is copied in uniform mode."""
        if isinstance(self.lengths, int):
            t = self.lengths
            kv = self.self_kv.new_empty(self.self_kv.shape[:2] + (index.numel(),) + self.self_kv.shape[3:])
            if t:
                kv[:, :, :, :, :t] = self.self_kv[:, :, :, :, :t].index_select(2, index)
            self.self_kv = kv
        else:
            self.self_kv = self.self_kv.index_select(2, index)
            self.lengths = self.lengths.index_select(0, index)
        self.mem_kv = self.mem_kv.index_select(2, index)
        if self.mem_mask is not None:
            self.mem_mask = self.mem_mask.index_select(0, index)

    def prepare(self, n: int, kv_len: int | None = None):
        """Everything one decoder call on n new tokens per row needs, shared by all layers:
        (positions [R,n] or [n], writer, kv_len, self-attention mask or None).

        kv_len (per-row mode): an upper bound on max(lengths) + n known to the caller (saves a device sync)."""
        ar = self.arange(n)
        if isinstance(self.lengths, int):
            t = self.lengths
            if t + n > self.capacity:
                raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({t}+{n})")

            def write(kv: Tensor, new: Tensor) -> None:
                kv[:, :, :, t:t + n] = new

            mask = None
            if n > 1:  # causal within the new tokens; all cached tokens visible
                mask = self.arange(t + n)[None, :] <= (t + ar)[:, None]  # [n, t+n]
            return (t + ar).clamp_(max=self.max_positions - 1), write, t + n, mask
        slots = self.lengths[:, None] + ar  # [R,n]
        if kv_len is None:
            kv_len = int(self.lengths.max()) + n
        kv_len = min(kv_len, self.capacity)
        _, r, h, _, dh = self.self_kv.shape[1:]
        index = slots[None, :, None, :, None].expand(2, r, h, n, dh)

        def write(kv: Tensor, new: Tensor) -> None:
            kv.scatter_(3, index, new)

        mask = (self.arange(kv_len)[None, None, :] <= slots[:, :, None]).unsqueeze(1)  # [R,1,n,kv_len]
        return slots.clamp(max=self.max_positions - 1), write, kv_len, mask
