"""Greedy decoding with the KV cache: the reference every other decoder is checked against."""

from __future__ import annotations

import torch

from bpd_train.decoding.common import (
    DEFAULT_MAX_LEN,
    decoding_mode,
    is_stop,
    keep_rows,
    start_rows,
    start_tokens,
    stop_ids,
    trim,
)
from bpd_train.decoding.result import DecodeResult
from bpd_train.engine.weights import PackedWeights


def greedy(model, src, max_len=DEFAULT_MAX_LEN, weights: PackedWeights | None = None) -> DecodeResult:
    """Head-1 argmax, one token per decoder call. Finished rows leave the batch (their cache rows are
    dropped), so results do not depend on batch mates and a batch costs what its longest row costs.
    weights: the decoder's packed-weight cache, with its DecodeOptions (None: the model's default, fp32)."""
    stop = stop_ids(model)
    with decoding_mode(model, weights) as w:
        src, orig, limit, out, out_len, cap = start_rows(model, src, max_len)
        b, dev = out.shape[0], src.device
        if orig.size == 0:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        state = model.start_decoding(model.encode(src, w), cap, weights=w)
        tok = start_tokens(model, state, orig.size, dev)[:, 0]  # [R] BOS, or an LM's last prompt tokens
        done = to_end(model, w, state, tok, orig, limit, cap, out, out_len, stop)
        if done is not None:
            return done
        calls = row_steps = step = 0
        while True:
            # steps until one row ends (one native call where the kernels are built: DecodeWeights.greedy_steps)
            got, _ = w.greedy_steps(model, state, tok, limit - step, cap - step)  # [R,s]
            s = got.shape[1]
            state.lengths += s
            out[orig, step : step + s] = got
            calls += s - (step == 0)  # the first step (BOS) is the prefill call
            row_steps += orig.size * (s - (step == 0))
            step += s
            nxt_np = got[:, -1]
            done = is_stop(nxt_np, stop) | (limit <= step)
            if done.any():
                out_len[orig[done]] = step
                keep = keep_rows(done)
                if keep.size == 0:
                    break
                idx = torch.from_numpy(keep).to(dev)
                state.reorder(idx)
                nxt_np, orig, limit = nxt_np[keep], orig[keep], limit[keep]
            tok = torch.from_numpy(nxt_np).to(dev)
        tokens = trim(out.tolist(), out_len.tolist(), stop)
    return DecodeResult(tokens=tokens, calls=calls, prefill_calls=1, mean_accepted=1.0, accepted_hist=_hist(row_steps))


def to_end(model, w, state, tok, orig, limit, cap, out, out_len, stop, sampler=None) -> DecodeResult | None:
    """The whole batch in one native call, finished rows leaving inside it (DecodeStep.greedy_to_end; sampled
    steps with `sampler`, engine/step.py native_sampler), or None where the native loop does not run it."""
    call = getattr(w, "greedy_to_end", None)
    kw = {} if sampler is None else {"sampler": sampler}
    got = None if call is None else call(model, state, tok, limit, cap, **kw)
    if got is None:
        return None
    toks, steps = got
    out[orig, : toks.shape[1]] = toks
    out_len[orig] = steps
    return DecodeResult(
        tokens=trim(out.tolist(), out_len.tolist(), stop),
        calls=toks.shape[1] - 1,
        prefill_calls=1,
        mean_accepted=1.0,
        accepted_hist=_hist(int((steps - 1).sum())),
    )


def _hist(row_steps: int) -> dict[int, int]:
    return {1: row_steps} if row_steps else {}
