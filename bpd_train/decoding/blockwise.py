"""Blockwise parallel decoding (Stern et al. 2018), combined predict + verify.

After a prefill call on BOS, every step is ONE decoder call on [x0, x1..x(b-1)] per row: x0 is the last
accepted token (not yet in the cache), x1.. are the proposals of heads 2..b. At each of those positions
head 1 predicts the next token; proposal x(j+1) is accepted if it passes the acceptance rule against
head 1 at position j. With n proposals accepted the row gains n+1 tokens (the n proposals and head 1's
token at position n), and heads 1..b at position n give the next [x0, proposals]. The cache keeps the
slots of x0..xn; the slots of rejected proposals are rolled back by shortening the row's length.

Rows accept different numbers of tokens, so with more than one row the cache runs in per-row mode
(model/cache.py). Rows that finish (EOS or max_len) leave the batch.

Speed: the per-step bookkeeping (acceptance prefix, EOS, max_len, output) runs vectorised over rows in
numpy on the host: a handful of microseconds, where the same dozens of tiny tensor ops would cost more
than the decoder call itself at batch 1. The device only runs the decoder call, head 1's projection at
the block positions and the future heads at each row's last accepted position (two small transfers).
"""
from __future__ import annotations

import numpy as np
import torch

from bpd_train.decoding.acceptance import Exact, make_acceptance
from bpd_train.decoding.common import decoding_mode, prepare_source, row_limits, trim
from bpd_train.decoding.result import DecodeResult


def blockwise(model, src, block_size: int | None = None, accept=None, min_block: int = 1,
              max_len=(2.0, 10)) -> DecodeResult:
    """Decode with blocks of up to `block_size` tokens per decoder call (default: the model's k).

    accept: Exact() (default; output identical to greedy), TopK(n), Distance(eps), or their config
    names ("exact", "topk:N", "distance:EPS").
    min_block: accept at least min_block tokens per step even where verification fails (approximate).
    """
    cfg = model.config
    k = cfg.block_size
    kb = k if block_size is None else int(block_size)
    if kb < 1:
        raise ValueError(f"block_size must be >= 1, got {kb}")
    if kb > k:
        raise ValueError(f"block_size={kb} exceeds the model's number of heads k={k}")
    if not 1 <= int(min_block) <= kb:
        raise ValueError(f"min_block must be in 1..block_size={kb}, got {min_block}")
    rule = make_acceptance(accept if accept is not None else Exact())
    exact = isinstance(rule, Exact)
    eos = cfg.eos_id
    with decoding_mode(model):
        src = prepare_source(model, src)
        limits = np.asarray(row_limits(model, src, max_len), dtype=np.int64)
        b, dev = src.shape[0], src.device
        cap = max(int(limits.max()), 1)
        out = np.full((b, cap + kb), cfg.pad_id, dtype=np.int64)
        out_len = np.zeros(b, dtype=np.int64)
        orig = np.flatnonzero(limits > 0)                 # original row of each active row
        if orig.size == 0:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        if orig.size < b:
            src = src[torch.from_numpy(orig).to(dev)]
        limit = limits[orig]
        ar = np.arange(kb)
        hist = np.zeros(kb + 1, dtype=np.int64)

        # Prefill: BOS -> heads 1..b at position 0; head 1's token is accepted outright.
        state = model.start_decoding(model.encode(src), cap + kb)
        h = model.decode(state, torch.full((orig.size, 1), cfg.bos_id, dtype=torch.long, device=dev))
        x_dev = model.heads_logits(h[:, 0], 0, kb).argmax(-1)          # [R,b] next [x0, proposals]
        x = x_dev.cpu().numpy()
        out[orig, 0] = x[:, 0]
        length = np.ones(orig.size, dtype=np.int64)                    # cached tokens = tokens out (BOS + x0..)
        done = (x[:, 0] == eos) | (limit <= 1)
        calls = 0
        while True:
            if done.any():
                out_len[orig[done]] = length[done]
                keep = np.flatnonzero(~done)
                if keep.size == 0:
                    break
                idx = torch.from_numpy(keep).to(dev)
                state.lengths = length
                state.reorder(idx)
                x_dev, x, orig, limit, length = x_dev[idx], x[keep], orig[keep], limit[keep], length[keep]
            r = orig.size
            state.lengths = int(length[0]) if r == 1 else length  # one row: uniform mode, no scatter
            h = model.decode(state, x_dev)                              # [R,b,D]
            calls += 1
            logits = model.head_logits(h, 0)                            # [R,b,V]
            g_dev = logits.argmax(-1)                                   # head 1 at every block position
            if kb == 1:
                g = g_dev.cpu().numpy()
                n = np.zeros(r, dtype=np.int64)
            else:
                if exact:
                    g = g_dev.cpu().numpy()
                    ok = x[:, 1:] == g[:, :-1]
                else:
                    ok_dev = rule(x_dev[:, 1:], logits[:, :-1], g_dev[:, :-1])
                    both = torch.cat([g_dev, ok_dev.long()], 1).cpu().numpy()
                    g, ok = both[:, :kb], both[:, kb:].astype(bool)
                if min_block > 1:
                    ok[:, :min_block - 1] = True
                ok &= x[:, :-1] != eos                                  # nothing is accepted after an EOS
                n = np.cumprod(ok, axis=1).sum(1)                       # accepted proposals per row
            rows = np.arange(r)
            gn = g[rows, n]                                             # head 1 at the last accepted slot
            eos_in_block = x[rows, n] == eos                            # an accepted proposal was EOS
            c = np.minimum(n + 1 - eos_in_block, limit - length)        # tokens gained this step
            new = np.concatenate([x[:, 1:], gn[:, None]], axis=1)       # accepted proposals, then ...
            new[rows, n] = gn                                           # ... head 1's token; junk past c
            out[orig[:, None], length[:, None] + ar] = new              # is overwritten or cut off later
            length += c
            hist += np.bincount(c, minlength=kb + 1)
            done = eos_in_block | (gn == eos) | (length >= limit)
            if kb > 1 and not done.all():
                hn = h[:, int(n[0])] if r == 1 else h[torch.arange(r, device=dev), torch.from_numpy(n).to(dev)]
                fut = model.heads_logits(hn, 1, kb).argmax(-1).cpu().numpy()   # [R,b-1]
                x = np.concatenate([gn[:, None], fut], axis=1)
            else:
                x = gn[:, None]
            x_dev = torch.from_numpy(x).to(dev)
        tokens = trim(out.tolist(), out_len.tolist(), eos)
    steps = int(hist.sum())
    accepted = {int(s): int(c) for s, c in enumerate(hist) if c}
    mean = float((hist * np.arange(kb + 1)).sum() / steps) if steps else 1.0
    return DecodeResult(tokens=tokens, calls=calls, prefill_calls=1, mean_accepted=mean, accepted_hist=accepted)
