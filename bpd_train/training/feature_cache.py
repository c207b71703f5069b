"""The frozen backbone's hidden states, computed once per training row and reused in later epochs.

With a frozen backbone (regimes frozen / distill) and no dropout, a row's hidden states never change during
training, so recomputing the whole backbone for every batch of every epoch only repeats work: this cache keeps
each row's states (keyed by the row's tokens) in memory, up to a budget, and assembles a batch from them when every
row of it is known. Only the heads' forward and backward run then.
"""

from __future__ import annotations

import hashlib
from typing import Callable

from torch import Tensor


class FeatureCache:
    """Row tokens (trailing padding stripped) -> hidden states [len, D], up to `max_bytes` in all."""

    def __init__(self, pad_id: int, max_bytes: int):
        self.pad_id, self.max_bytes = int(pad_id), int(max_bytes)
        self.rows: dict[bytes, Tensor] = {}
        self.bytes = 0
        self.hits = self.misses = 0

    def _keys(self, tokens: Tensor) -> list[tuple[bytes, int]]:
        """(key, real length) per row of tokens [B,T] right-padded with pad_id."""
        real = (tokens != self.pad_id).int()
        # the real length is up to the last non-pad token (a pad id inside a row, if any, is kept in the key)
        lens = (real.flip(1).cumsum(1) > 0).sum(1).tolist()
        rows = tokens.cpu().numpy()
        return [
            (hashlib.blake2b(rows[i, :n].tobytes(), digest_size=16).digest() + n.to_bytes(4, "little"), n)
            for i, n in enumerate(lens)
        ]

    def features(self, tokens: Tensor, compute: Callable[[], Tensor]) -> Tensor:
        """tokens [B,T] -> h [B,T,D]: from the cache when every row is in it, else `compute()` (and its rows kept
        while the budget lasts). Positions past a row's real length are zeros from the cache: the losses ignore
        them (their targets are padding)."""
        keys = self._keys(tokens)
        if keys and all(k in self.rows for k, _ in keys):
            self.hits += 1
            first = self.rows[keys[0][0]]
            out = first.new_zeros(tokens.shape[0], tokens.shape[1], first.shape[-1])
            for i, (k, n) in enumerate(keys):
                out[i, :n] = self.rows[k]
            return out.to(tokens.device)
        self.misses += 1
        h = compute()
        for i, (k, n) in enumerate(keys):
            if k in self.rows:
                continue
            row = h[i, :n].detach().to("cpu", copy=True)
            size = row.numel() * row.element_size()
            if self.bytes + size > self.max_bytes:
                break
            self.rows[k] = row
            self.bytes += size
        return h
