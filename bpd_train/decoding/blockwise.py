"""Blockwise parallel decoding (Stern et al. 2018), combined predict + verify.

After a prefill call on BOS, every step is ONE decoder call per row on [x0, x1..x(b-1)]: x0 is the last
token already accepted (not yet in the cache), x1.. are proposals from heads 2..b. At each of those
positions head 1 predicts the next token; proposal x(j+1) is accepted if it passes the acceptance rule
against head 1 at position j. With n proposals accepted the row gains n+1 tokens (the n proposals and
head 1's token at position n), and heads 1..b at position n give the next [x0, proposals]. The cache
keeps the slots of x0..xn; slots of rejected proposals are rolled back by shortening the row's length.

Rows accept different numbers of tokens, so the cache runs in per-row mode (see model/cache.py); rows
that finish (EOS or max_len) leave the batch. All bookkeeping is tensor ops on the model's device; one
host sync per step decides whether rows finished and how far attention must read.
"""
from __future__ import annotations

import torch

from bpd_train.decoding.acceptance import Exact, make_acceptance
from bpd_train.decoding.common import decoding_mode, prepare_source, row_limits, trim
from bpd_train.decoding.result import DecodeResult


def blockwise(model, src, block_size: int | None = None, accept=None, min_block: int = 1,
              max_len=(2.0, 10)) -> DecodeResult:
    """Decode with blocks of up to `block_size` tokens per decoder call (default: the model's k).

    accept: Exact() (default; output identical to greedy), TopK(n), Distance(eps), or their config names.
    min_block: accept at least min_block tokens per step even if verification fails (approximate).
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
    eos = cfg.eos_id
    with decoding_mode(model):
        src = prepare_source(model, src)
        limits = row_limits(model, src, max_len)
        b, dev = src.shape[0], src.device
        cap = max(max(limits), 1)
        out = torch.full((b, cap + kb), cfg.pad_id, dtype=torch.long, device=dev)
        out_len = [0] * b
        active = [i for i in range(b) if limits[i] > 0]
        if not active:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        if len(active) < b:
            src = src[active]
        r = len(active)
        orig = torch.tensor(active, device=dev)
        orig_host = list(active)
        limit = torch.tensor([limits[i] for i in active], device=dev)
        ar = torch.arange(kb, device=dev)

        # Prefill: BOS -> heads 1..b at position 0; head 1's token is accepted outright.
        state = model.start_decoding(model.encode(src), cap + kb)
        h = model.decode(state, torch.full((r, 1), cfg.bos_id, dtype=torch.long, device=dev))[:, 0]
        state.lengths = 1
        state.per_row()
        x = model.heads_logits(h, 0, kb).argmax(-1)                       # [R,b]
        out[orig, 0] = x[:, 0]
        n_out = torch.ones(r, dtype=torch.long, device=dev)
        done = (x[:, 0] == eos) | (limit <= 1)
        accepted = []
        calls = 0
        kv_max = 1  # max cached length over active rows (host side)
        while True:
            if bool(done.any()):
                done_l = done.tolist()
                n_out_l = n_out.tolist()
                keep = [j for j, d in enumerate(done_l) if not d]
                for j, d in enumerate(done_l):
                    if d:
                        out_len[orig_host[j]] = n_out_l[j]
                if not keep:
                    break
                idx = torch.tensor(keep, device=dev)
                state.reorder(idx)
                orig, limit, x, n_out = orig[idx], limit[idx], x[idx], n_out[idx]
                orig_host = [orig_host[j] for j in keep]
            h = model.decode(state, x, kv_max + kb)                         # [R,b,D]
            calls += 1
            logits = model.head_logits(h, 0)                                # [R,b,V]
            g = logits.argmax(-1)                                           # [R,b]
            if kb > 1:
                ok = rule(x[:, 1:], logits[:, :-1], g[:, :-1])              # [R,b-1]
                if min_block > 1:
                    ok[:, :min_block - 1] = True
                n = ok.cumprod(-1).sum(-1)                                  # accepted proposals [R]
            else:
                n = torch.zeros_like(n_out)
            gn = g.gather(1, n[:, None])                                    # head 1 at the last accepted slot
            new = torch.where(ar < n[:, None], x.roll(-1, 1), gn)           # [R,b] tokens gained, c = n+1 valid
            c = n + 1
            is_eos = (new == eos) & (ar < c[:, None])
            has_eos = is_eos.any(-1)
            c = torch.where(has_eos, is_eos.int().argmax(-1) + 1, c)
            c = torch.minimum(c, limit - n_out)
            out[orig[:, None], n_out[:, None] + ar] = new
            n_out = n_out + c
            state.lengths = state.lengths + c
            accepted.append(c)
            done = (new.gather(1, (c - 1)[:, None])[:, 0] == eos) | (n_out >= limit)  # EOS accepted or full
            if kb > 1:
                hn = h.gather(1, n[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]  # [R,D] last accepted slot
                x = torch.cat([gn, model.heads_logits(hn, 1, kb).argmax(-1)], 1)       # next [x0, proposals]
            else:
                x = gn
            kv_max = int(state.lengths.max())
        tokens = trim(out.tolist(), out_len, eos)
    sizes = torch.cat(accepted) if accepted else torch.zeros(0, dtype=torch.long)
    counts = torch.bincount(sizes.cpu(), minlength=kb + 1).tolist() if accepted else []
    hist = {s: c for s, c in enumerate(counts) if c}
    steps = sum(hist.values())
    mean = sum(s * c for s, c in hist.items()) / steps if steps else 1.0
    return DecodeResult(tokens=tokens, calls=calls, prefill_calls=1, mean_accepted=mean, accepted_hist=hist)
