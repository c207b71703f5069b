"""Greedy decoding with the KV cache: the reference every other decoder is checked against."""
from __future__ import annotations

import torch

from bpd_train.decoding.common import decoding_mode, prepare_source, row_limits, trim
from bpd_train.decoding.result import DecodeResult


def greedy(model, src, max_len=(2.0, 10)) -> DecodeResult:
    """Head-1 argmax one token per decoder call. Finished rows leave the batch (their cache rows are
    dropped), so a batch costs what its longest row costs and results do not depend on batch mates."""
    cfg = model.config
    with decoding_mode(model):
        src = prepare_source(model, src)
        limits = row_limits(model, src, max_len)
        b, dev = src.shape[0], src.device
        cap = max(max(limits), 1)
        out = torch.full((b, cap), cfg.pad_id, dtype=torch.long, device=dev)
        out_len = [0] * b
        active = [i for i in range(b) if limits[i] > 0]
        if not active:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        if len(active) < b:
            src = src[active]
        orig = torch.tensor(active, device=dev)
        orig_host = list(active)
        limit = torch.tensor([limits[i] for i in active], device=dev)
        state = model.start_decoding(model.encode(src), cap)
        tok = torch.full((len(active), 1), cfg.bos_id, dtype=torch.long, device=dev)
        calls = row_steps = 0
        for step in range(cap):
            h = model.decode(state, tok)                       # [R,1,D]
            state.lengths += 1
            if step:
                calls += 1
                row_steps += len(orig_host)
            nxt = model.head_logits(h[:, 0], 0).argmax(-1)     # [R]
            out[orig, step] = nxt
            done = (nxt == cfg.eos_id) | (limit <= step + 1)
            if bool(done.any()):
                done_l = done.tolist()
                keep = [j for j, d in enumerate(done_l) if not d]
                for j, d in enumerate(done_l):
                    if d:
                        out_len[orig_host[j]] = step + 1
                if not keep:
                    break
                idx = torch.tensor(keep, device=dev)
                state.reorder(idx)
                orig, limit, nxt = orig[idx], limit[idx], nxt[idx]
                orig_host = [orig_host[j] for j in keep]
            tok = nxt[:, None]
        tokens = trim(out.tolist(), out_len, cfg.eos_id)
    hist = {1: row_steps} if row_steps else {}
    return DecodeResult(tokens=tokens, calls=calls, prefill_calls=1, mean_accepted=1.0, accepted_hist=hist)
