"""Ancestral sampling with the KV cache (self-distillation with temperature).

Each row draws from its own generator, seeded by `row_seeds` (default: seed + row index), with the Gumbel-max
trick (argmax of logits/T + Gumbel noise = a draw from softmax(logits/T)): a row's tokens depend on its seed,
never on its batch mates or on which rows finished first, so sharded, resumable corpora reproduce exactly.
temperature 0 is greedy decoding.
"""

from __future__ import annotations

from typing import Sequence

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
from bpd_train.decoding.greedy import greedy
from bpd_train.decoding.result import DecodeResult


def sample(
    model, src, max_len=DEFAULT_MAX_LEN, temperature: float = 1.0, seed: int = 0, row_seeds: Sequence[int] | None = None
) -> DecodeResult:
    """One token per decoder call drawn from head 1's softmax(logits / temperature)."""
    t = float(temperature)
    if not t >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if t == 0.0:
        return greedy(model, src, max_len=max_len)
    stop = stop_ids(model)
    with decoding_mode(model):
        src, orig, limit, out, out_len, cap = start_rows(model, src, max_len)
        b, dev = out.shape[0], src.device
        seeds = [seed + i for i in range(b)] if row_seeds is None else [int(s) for s in row_seeds]
        if len(seeds) != b:
            raise ValueError(f"row_seeds has {len(seeds)} seeds for {b} rows")
        if orig.size == 0:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        gens = {int(r): torch.Generator(device=dev).manual_seed(seeds[r]) for r in orig}
        state = model.start_decoding(model.encode(src), cap)
        tok = start_tokens(model, state, orig.size, dev)
        calls = row_steps = 0
        for step in range(cap):
            h = model.decode(state, tok)  # [R,1,D]
            state.lengths += 1
            if step:
                calls += 1
                row_steps += orig.size
            logits = state.weights.head1(h[:, 0]).float() / t  # [R,V]
            u = torch.stack([torch.rand(logits.shape[-1], generator=gens[int(r)], device=dev) for r in orig])
            nxt = (logits - torch.log(-torch.log(u.clamp_(min=1e-20)))).argmax(-1)  # Gumbel-max
            nxt_np = nxt.cpu().numpy()
            out[orig, step] = nxt_np
            done = is_stop(nxt_np, stop) | (limit <= step + 1)
            if done.any():
                out_len[orig[done]] = step + 1
                keep = keep_rows(done)
                if keep.size == 0:
                    break
                idx = torch.from_numpy(keep).to(dev)
                state.reorder(idx)
                nxt, orig, limit = nxt[idx], orig[keep], limit[keep]
            tok = nxt[:, None]
        tokens = trim(out.tolist(), out_len.tolist(), stop)
    return DecodeResult(
        tokens=tokens,
        calls=calls,
        prefill_calls=1,
        mean_accepted=1.0,
        accepted_hist={1: row_steps} if row_steps else {},
    )
