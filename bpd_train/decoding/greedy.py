"""Greedy decoding with the KV cache: the reference every other decoder is checked against."""
from __future__ import annotations

import numpy as np
import torch

from bpd_train.decoding.common import decoding_mode, start_rows, start_tokens, trim
from bpd_train.decoding.result import DecodeResult


def greedy(model, src, max_len=(2.0, 10)) -> DecodeResult:
    """Head-1 argmax, one token per decoder call. Finished rows leave the batch (their cache rows are
    dropped), so results do not depend on batch mates and a batch costs what its longest row costs."""
    cfg = model.config
    with decoding_mode(model):
        src, orig, limit, out, out_len, cap = start_rows(model, src, max_len)
        b, dev = out.shape[0], src.device
        if orig.size == 0:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        state = model.start_decoding(model.encode(src), cap)
        tok = start_tokens(model, state, orig.size, dev)        # [R,1] BOS, or an LM's last prompt tokens
        calls = row_steps = 0
        for step in range(cap):
            h = model.decode(state, tok)                        # [R,1,D]
            state.lengths += 1
            if step:
                calls += 1
                row_steps += orig.size
            nxt = state.weights.head1_argmax(h[:, 0])           # [R]
            nxt_np = nxt.cpu().numpy()
            out[orig, step] = nxt_np
            done = (nxt_np == cfg.eos_id) | (limit <= step + 1)
            if done.any():
                out_len[orig[done]] = step + 1
                keep = np.flatnonzero(~done)
                if keep.size == 0:
                    break
                idx = torch.from_numpy(keep).to(dev)
                state.reorder(idx)
                nxt, orig, limit = nxt[idx], orig[keep], limit[keep]
            tok = nxt[:, None]
        tokens = trim(out.tolist(), out_len.tolist(), cfg.eos_id)
    return DecodeResult(tokens=tokens, calls=calls, prefill_calls=1, mean_accepted=1.0,
                        accepted_hist={1: row_steps} if row_steps else {})
