"""Decoding state: encoder memory K/V for cross-attention (computed once) and a preallocated self-attention
KV cache.

Two modes, chosen by the type of `lengths` (the number of cached tokens, BOS included):
  * uniform (`int`): every row has the same length (greedy, beam search, blockwise at batch 1). New K/V
    are written with one slice copy; a single-token call needs no attention mask.
  * per-row (`numpy.ndarray` kept by the host, or a `LongTensor[R]` on the device): rows hold different
    numbers of tokens (blockwise decoding: rows accept blocks of different sizes). New K/V are scattered
    at each row's own slots and a mask lets a query at slot p see slots <= p only. Slots past a row's
    length are stale (rejected proposals) and hidden by that mask, so rolling back is just setting
    `lengths` smaller; they are overwritten later.

`base` slots before all of that hold a fixed decoder prefix (M2M100/NLLB's decoder-start token, cached by
BPDModel.start_decoding): `lengths` counts the tokens after it, so decoders never see the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def copy_rows(x: Tensor, dim: int, dst: np.ndarray, src: np.ndarray, limit_dim: int = -1, limit: int = -1) -> None:
    """x's rows dst[i] (along dim) = its rows src[i], in place, the first `limit` entries along limit_dim only where
    limit >= 0; no dst row is a src row. Torch ops, a handful per row: a state whose step weights copy rows
    natively (engine/mt.py and engine/lm.py `copy_rows`, one call) uses theirs."""
    for d, s in zip(dst.tolist(), src.tolist()):
        a, b = x.select(dim, d), x.select(dim, s)
        if limit >= 0:
            ld = limit_dim - (limit_dim > dim)
            a, b = a.narrow(ld, 0, limit), b.narrow(ld, 0, limit)
        a.copy_(b)


@dataclass
class Memory:
    out: Tensor  # [B,S,D] encoder output (after the encoder's final norm)
    pad_mask: Tensor  # [B,S] bool, True at real source tokens
    attn_mask: Tensor | None  # [B,1,1,S] bool for SDPA, None when no row is padded

    @property
    def batch_size(self) -> int:
        return self.out.shape[0]


class DecoderState:
    """KV cache for R decoder rows. `self_kv` [layers,2,R,H,L,Dh]; `mem_kv` [layers,2,R/G,H,S,Dh].

    Rows come in groups of `mem_group` (G: beam search's beams) that share one source, so cross-attention
    K/V and mask are stored once per group (decoder rows r*G..r*G+G-1 read memory row r): reordering beams
    within their sentences leaves them untouched, and only dropping sentences reindexes them."""

    def __init__(
        self, self_kv: Tensor, mem_kv: Tensor, mem_mask: Tensor | None, max_positions: int, mem_group: int = 1
    ):
        self.self_kv = self_kv
        self.mem_kv = mem_kv
        self.mem_mask = mem_mask
        self.mem_group = mem_group
        self.max_positions = max_positions
        self.lengths: int | np.ndarray | Tensor = 0
        self.base = 0  # slots holding the decoder prefix, before every row's tokens
        self._slot_positions: Tensor | None = None
        self._arange: dict[int, Tensor] = {}
        self._causal_mask: Tensor | None = None
        self.weights = None  # engine/mt.py DecodeWeights, set by BPDModel.start_decoding

    @property
    def _positions(self) -> Tensor:
        """The decoder position of every cache slot (slots past max_positions only ever hold tokens beyond max_len);
        built on first use: the native decode loops never ask."""
        if self._slot_positions is None:
            self._slot_positions = torch.arange(self.capacity, device=self.self_kv.device).clamp_(
                max=self.max_positions - 1
            )
        return self._slot_positions

    @property
    def rows(self) -> int:
        return self.self_kv.shape[2]

    @property
    def capacity(self) -> int:
        return self.self_kv.shape[4]

    def per_row(self) -> "DecoderState":
        """Switch to per-row lengths held as a device tensor (idempotent)."""
        if isinstance(self.lengths, int):
            # uniform mode leaves slots past `lengths` undefined after a reorder; per-row attention reads
            # (masked) slots past short rows, so they must hold finite numbers
            self.self_kv[:, :, :, :, self.base + self.lengths :].zero_()
            self.lengths = torch.full((self.rows,), self.lengths, dtype=torch.long, device=self.self_kv.device)
        elif isinstance(self.lengths, np.ndarray):
            self.lengths = torch.from_numpy(self.lengths).to(self.self_kv.device)
        return self

    def reorder(self, index: Tensor) -> None:
        """Keep rows `index` (any order, repeats allowed): beam reordering and dropping finished rows.
        Only the filled prefix of the self cache (up to the longest kept row) is copied, in place when the
        number of rows does not grow."""
        m = index.numel()
        if isinstance(self.lengths, int):
            t = self.base + self.lengths
        elif isinstance(self.lengths, np.ndarray):
            self.lengths = self.lengths[index.cpu().numpy()]
            t = self.base + int(self.lengths.max()) if m else 0
        else:
            self.lengths = self.lengths.index_select(0, index)
            t = self.base + int(self.lengths.max()) if m else 0
        if m <= self.rows and index.device.type == "cpu" and self._drop_rows(index.numpy(), t):
            return
        if m <= self.rows:
            # shrink in place: gather the filled prefix of the kept rows, write it into the first m rows
            # (slots past a row's length keep older finite values, hidden by the per-row mask)
            kv = self.self_kv[:, :, :m]
            if t:
                kv[:, :, :, :, :t] = self.self_kv[:, :, :, :, :t].index_select(2, index)
        else:
            kv = self.self_kv.new_zeros(self.self_kv.shape[:2] + (m,) + self.self_kv.shape[3:])
            if t:
                kv[:, :, :, :, :t] = self.self_kv[:, :, :, :, :t].index_select(2, index)
        self.self_kv = kv
        self._reorder_memory(index)

    def _drop_rows(self, idx: np.ndarray, t: int) -> bool:
        """reorder's common case, finished rows leaving (decoding/common.py keep_rows): rows that stay keep their
        place and every row that moves comes from past the new end, so no copy overwrites a row another one reads:
        only those rows are copied, in place (one row per finished row; at batch 32 gathering every row's cache
        was a sizeable share of greedy decoding's time). False where idx is not of that form."""
        m = idx.size
        dst = np.flatnonzero(idx != np.arange(m))
        src = idx[dst]
        if dst.size and src.min() < m:
            return False
        copy = getattr(self.weights, "copy_rows", None) or copy_rows  # native where the step weights have it
        if dst.size and t:
            copy(self.self_kv, 2, dst, src, 4, t)
        self.self_kv = self.self_kv[:, :, :m]
        if self.mem_kv is None or self.mem_group != 1:
            self._reorder_memory(torch.from_numpy(idx))
            return True
        if dst.size:
            copy(self.mem_kv, 2, dst, src)
            if self.mem_mask is not None:
                copy(self.mem_mask, 0, dst, src)
        self.mem_kv = self.mem_kv[:, :, :m]
        if self.mem_mask is not None:
            self.mem_mask = self.mem_mask[:m]
        return True

    def _reorder_memory(self, index: Tensor) -> None:
        g = self.mem_group
        if g == 1:
            mem_index = index
        else:
            groups = index.view(-1, g) if index.numel() % g == 0 else None
            sent = groups[:, 0] // g if groups is not None else None
            if sent is None or not bool((groups // g == sent[:, None]).all()):
                # rows no longer come in whole groups: give every row its own memory copy
                self.mem_kv = self.mem_kv.repeat_interleave(g, dim=2)
                if self.mem_mask is not None:
                    self.mem_mask = self.mem_mask.repeat_interleave(g, dim=0)
                self.mem_group = 1
                mem_index = index
            elif sent.numel() == self.mem_kv.shape[2] and bool(
                (sent == torch.arange(sent.numel(), device=sent.device)).all()
            ):
                return  # beams moved within their sentences only: memory rows unchanged
            else:
                mem_index = sent
        self.mem_kv = self.mem_kv.index_select(2, mem_index)
        if self.mem_mask is not None:
            self.mem_mask = self.mem_mask.index_select(0, mem_index)

    def _causal(self) -> Tensor:
        """[L,L] additive causal mask over cache slots, built once per state (uniform calls with n > 1)."""
        if self._causal_mask is None:
            slots = torch.arange(self.capacity, device=self.self_kv.device)
            self._causal_mask = torch.zeros(
                self.capacity, self.capacity, dtype=self.self_kv.dtype, device=self.self_kv.device
            ).masked_fill_(slots[None, :] > slots[:, None], float("-inf"))
        return self._causal_mask

    def _float_mask(self, allowed: np.ndarray) -> Tensor:
        m = np.where(allowed, np.float32(0), np.float32(-np.inf))
        return torch.from_numpy(m).to(device=self.self_kv.device, dtype=self.self_kv.dtype)

    def prepare(self, n: int, kv_len: int | None = None):
        """What one decoder call on n new tokens per row needs, shared by all layers:
        (positions: slice, [n] or [R,n] index into the position table, writer of the new K/V, number of slots
        attention reads, additive mask). The writer also says how it writes, for the native step: `write.t`
        (uniform: slots [t, t+n) of every row) or `write.index` (per-row: scatter index [2,R,H,n,Dh])."""
        lengths, base = self.lengths, self.base
        if isinstance(lengths, int):
            t = base + lengths
            if t + n > self.capacity:
                raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({t}+{n})")

            def write(kv: Tensor, new: Tensor) -> None:
                kv[:, :, :, t : t + n] = new

            write.t, write.index = t, None

            mask = None
            if n > 1:  # causal within the new tokens; everything cached before is visible
                mask = self._causal()[t : t + n, : t + n]  # [n,t+n]
            pos = slice(t, t + n) if t + n <= self.max_positions else self._positions[t : t + n]
            return pos, write, t + n, mask
        r, (_, _, _, h, _, dh) = self.rows, self.self_kv.shape
        if isinstance(lengths, np.ndarray):  # host-side bookkeeping: build slots and mask with numpy
            slots_np = lengths[:, None] + np.arange(base, base + n)  # [R,n]
            kv_len = int(slots_np.max()) + 1
            mask = self._float_mask(np.arange(kv_len)[None, None, :] <= slots_np[:, :, None])[:, None]
            slots = torch.from_numpy(slots_np).to(self.self_kv.device)
        else:
            slots = lengths[:, None] + (self._ar(n) if not base else self._ar(n) + base)
            if kv_len is None:
                kv_len = int(lengths.max()) + n
            kv_len += base
            allowed = (self._ar(kv_len)[None, None, :] <= slots[:, :, None]).unsqueeze(1)  # [R,1,n,kv_len]
            mask = torch.zeros(allowed.shape, dtype=self.self_kv.dtype, device=slots.device)
            mask.masked_fill_(~allowed, float("-inf"))
        if kv_len > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded (needs {kv_len})")
        index = slots[None, :, None, :, None].expand(2, r, h, n, dh)

        def write(kv: Tensor, new: Tensor) -> None:
            kv.scatter_(3, index, new)

        write.t, write.index = 0, index

        return self._positions[slots], write, kv_len, mask

    def _ar(self, n: int) -> Tensor:
        a = self._arange.get(n)
        if a is None:
            a = self._arange[n] = torch.arange(n, device=self.self_kv.device)
        return a
