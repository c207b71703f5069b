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
from bpd_train.decoding.common import decoding_mode, start_rows, trim
from bpd_train.decoding.result import DecodeResult


# Below this many multiply-adds per step (rows x b x b x vocab x d_model), blockwise projects every head
# at every block position at once instead of running the future heads in a second pass: at these sizes
# the saved calls and transfer cost more than the arithmetic.
FUSED_MACS = 1 << 22


def _accept_rows(x, g, ok, min_block, eos, room):
    """Vectorised acceptance for R rows. x [R,b] fed tokens (x0 + proposals), g [R,b] head 1's argmax at
    each position, ok [R,b-1] the rule's verdicts (None: exact match). Returns accepted proposals n,
    head 1's token at the last accepted slot gn, tokens gained c (capped by room), ended-by-EOS flags."""
    r, kb = x.shape
    if kb == 1:
        n = np.zeros(r, dtype=np.int64)
    else:
        ok = x[:, 1:] == g[:, :-1] if ok is None else ok.astype(bool)
        if min_block > 1:
            ok[:, :min_block - 1] = True
        ok &= x[:, :-1] != eos                                          # nothing is accepted after an EOS
        n = np.cumprod(ok, axis=1).sum(1)
    rows = np.arange(r)
    gn = g[rows, n]
    eos_in_block = x[rows, n] == eos                                    # an accepted proposal was EOS
    c = np.minimum(n + 1 - eos_in_block, room)
    return n, gn, c, eos_in_block | (gn == eos)


def _accept_one(x, g, ok, min_block, eos, room):
    """_accept_rows for a single row on Python lists (cheaper than a dozen numpy calls at batch 1)."""
    kb = len(x)
    n = 0
    while n < kb - 1 and x[n] != eos and (n < min_block - 1 or (x[n + 1] == g[n] if ok is None else ok[0, n])):
        n += 1
    gn = g[n]
    eos_in_block = x[n] == eos
    c = min(n + 1 - eos_in_block, room)
    return n, gn, c, eos_in_block or gn == eos or c >= room


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
        # out has kb spare columns: an accepted block may run past a row's limit before it is cut
        src, orig, limit, out, out_len, cap = start_rows(model, src, max_len, spare=kb)
        b, dev = out.shape[0], src.device
        if orig.size == 0:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
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
        vd = cfg.vocab_size * cfg.d_model
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
            # Small enough: project every head at every block position in one go, so the next proposals
            # (all heads at the last accepted position) need no second pass. Else head 1 now, heads 2..b
            # later at the accepted position only.
            fused = kb > 1 and r * kb * kb * vd <= FUSED_MACS
            if fused:
                logits = model.heads_logits(h, 0, kb)                   # [R,b,b,V]
                top_dev = logits.argmax(-1)                             # [R,b,b]
                l1, g_dev = logits[:, :, 0], top_dev[:, :, 0]
            else:
                l1 = model.head_logits(h, 0)                            # [R,b,V]
                top_dev = g_dev = l1.argmax(-1)                         # [R,b]
            ok = None
            if not exact and kb > 1:
                ok = rule(x_dev[:, 1:], l1[:, :-1], g_dev[:, :-1]).cpu().numpy()
            top = top_dev.cpu().numpy()
            g = top[:, :, 0] if fused else top                          # head 1 at every block position
            if r == 1:
                n1, gn1, c1, done1 = _accept_one(x[0].tolist(), g[0].tolist(), ok, min_block, eos,
                                                 int(limit[0] - length[0]))
                out[orig[0], length[0]:length[0] + c1] = x[0, 1:n1 + 1].tolist()[:c1] + [gn1][:c1 - n1]
                length += c1
                hist[c1] += 1
                done = np.array([done1])
                n, gn = np.array([n1]), np.array([gn1])
            else:
                n, gn, c, done = _accept_rows(x, g, ok, min_block, eos, limit - length)
                new = np.concatenate([x[:, 1:], gn[:, None]], axis=1)  # accepted proposals, then ...
                new[np.arange(r), n] = gn                               # ... head 1's token; junk past c
                out[orig[:, None], length[:, None] + ar] = new          # is overwritten or cut off later
                length += c
                hist += np.bincount(c, minlength=kb + 1)
                done |= length >= limit
            if done.all():
                continue
            if fused:
                x = top[np.arange(r), n]                                # heads 1..b at the accepted slot
            elif kb > 1:
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
