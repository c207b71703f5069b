"""Ancestral sampling with the KV cache (self-distillation with temperature; plain sampling for serving).

Each row draws from its own random stream, seeded by `row_seeds` (default: seed + row index): where the native
loop runs the model (engine/csrc/sample.h), the whole batch is one call choosing each token by an exponential race
whose numbers are hashed from the row's seed, the token's place and each id (what blockwise sampling's match
verification reproduces); elsewhere a torch.Generator per row with the Gumbel-max trick (argmax of logits/T + Gumbel
noise = a draw from softmax(logits/T)). Either way a row's tokens depend on its seed, never on its batch mates or
on which rows finished first, so sharded, resumable corpora reproduce exactly (on the same engine).
temperature 0 is greedy decoding. `top_k` / `top_p` restrict the draw to the most likely tokens (`keep_mask`, the
one mask blockwise sampling applies too: decoding/speculative.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

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
from bpd_train.decoding.greedy import greedy, to_end
from bpd_train.decoding.result import DecodeResult
from bpd_train.engine.step import native_sampler
from bpd_train.engine.weights import PackedWeights


def check_sampling(temperature: float, top_k: int = 0, top_p: float = 1.0) -> float:
    """The temperature as a float, or a ValueError naming a bad temperature, top_k or top_p."""
    t = float(temperature)
    if not t >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if int(top_k) < 0:
        raise ValueError(f"top_k must be >= 0 (0: all tokens), got {top_k!r}")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return t


def keep_mask(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor | None:
    """Which tokens a draw may pick [..., V] (bool), from temperature-scaled logits [..., V]: the top_k highest
    logits (ties with the k-th kept; 0: all), then the smallest set of the most likely of those whose probabilities
    sum to at least top_p (1: all; the most likely token always stays). None where nothing is masked."""
    top_k, top_p = int(top_k), float(top_p)
    v = logits.shape[-1]
    keep = None
    if 0 < top_k < v:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        keep = logits >= kth
    if top_p < 1.0:
        x = logits if keep is None else logits.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(x.double(), dim=-1)
        nucleus = _nucleus(probs.reshape(-1, v), top_p).reshape(probs.shape)
        keep = nucleus if keep is None else keep & nucleus
    return keep


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """probs [N,V] -> [N,V] bool: the tokens ranked (by probability, ties by id) before the probability ranked
    above them reaches top_p. Only the first m ranks are sorted (torch.topk), m growing until every row's nucleus
    ends within them: the same set as a stable sort of the whole row, without sorting the whole vocabulary."""
    v = probs.shape[-1]
    m = min(v, 64)
    while True:
        top = probs.topk(m, dim=-1, sorted=True).values  # [N,m] descending
        before = top.cumsum(-1) - top  # probability of the tokens ranked above
        if m == v or bool((before[:, -1] >= top_p).all()):
            break
        m = min(v, m * 8)
    size = (before < top_p).sum(-1, keepdim=True)  # the nucleus: the first `size` ranks (size >= 1)
    last = top.gather(-1, size - 1)  # its smallest probability
    above, tied = probs > last, probs == last
    # tokens tied at `last` rank by id (a stable sort's order): the nucleus holds the first of them
    return above | (tied & (tied.cumsum(-1) <= size - above.sum(-1, keepdim=True)))


def sampling_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The distribution a draw is made from, float64 [..., V]: softmax(logits / temperature) restricted to
    keep_mask and renormalised. Blockwise sampling computes head 1's p and the heads' q with it alike."""
    x = logits.double() / float(temperature)
    keep = keep_mask(x, top_k, top_p)
    if keep is not None:
        x = x.masked_fill(~keep, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(
    model,
    src,
    max_len=DEFAULT_MAX_LEN,
    temperature: float = 1.0,
    seed: int = 0,
    row_seeds: Sequence[int] | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    weights: PackedWeights | None = None,
    native: bool = True,
) -> DecodeResult:
    """One token per decoder call drawn from head 1's softmax(logits / temperature), among the top_k / top_p
    tokens where set (keep_mask). native: the whole batch in one native call where the engine runs it (its own
    random streams, seeded alike: the same distribution, not the same tokens as the Python loop's Gumbel draws);
    False: the Python loop."""
    t = check_sampling(temperature, top_k, top_p)
    if t == 0.0:
        return greedy(model, src, max_len=max_len, weights=weights)
    stop = stop_ids(model)
    with decoding_mode(model, weights) as w:
        src, orig, limit, out, out_len, cap = start_rows(model, src, max_len)
        b, dev = out.shape[0], src.device
        seeds = [seed + i for i in range(b)] if row_seeds is None else [int(s) for s in row_seeds]
        if len(seeds) != b:
            raise ValueError(f"row_seeds has {len(seeds)} seeds for {b} rows")
        if orig.size == 0:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        state = model.start_decoding(model.encode(src, w), cap, weights=w)
        tok = start_tokens(model, state, orig.size, dev)
        if native:
            smp = native_sampler(t, top_k, top_p, [seeds[r] for r in orig])
            done = to_end(model, w, state, tok[:, 0], orig, limit, cap, out, out_len, stop, sampler=smp)
            if done is not None:
                return done
        gens = {int(r): torch.Generator(device=dev).manual_seed(seeds[r]) for r in orig}
        calls = row_steps = 0
        for step in range(cap):
            h = model.decode(state, tok)  # [R,1,D]
            state.lengths += 1
            if step:
                calls += 1
                row_steps += orig.size
            l1 = state.weights.head1(h[:, 0])
            logits = l1.float() / t  # [R,V]
            keep = keep_mask(l1.double() / t, top_k, top_p) if top_k or top_p < 1.0 else None  # as sampling_probs
            if keep is not None:
                logits = logits.masked_fill(~keep, float("-inf"))
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
