"""Blockwise sampling: the heads draft, head 1 verifies, and the output is distributed exactly as sampling from the
model (speculative sampling: Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).

    p      head 1's distribution at a position, softmax(logits / T) within top_k / top_p (sampling.sampling_probs):
           the model's sampling distribution, what plain `sample` draws from.
    q_i    head i's (i = 2..b) distribution over the draft vocabulary the greedy path proposes from (the decode
           options' draft_vocab; the full vocabulary where none is set), adjusted by the same function and settings
           within it, 0 elsewhere (any q keeps the output's distribution; a q closer to p accepts more).
    step   one decoder call on [x0, d1..d(b-1)] per row (x0: the last token, not yet cached; d_i ~ q_(i+1) drafted
           at the previous step's last accepted position). Draft d_i is accepted with probability
           min(1, p(d_i) / q(d_i)), p at the position before it given the accepted prefix; at the first rejection
           the row's next token is drawn from the normalised residual max(0, p - q) there; after a fully accepted
           block from p at the last position (the bonus token). Nothing is accepted after a stop id.
    draft  heads 2..b at the last accepted position give the next drafts, each drawn from its q; with prompt lookup
           (DecodeOptions.lookup, decoder-only models) the tokens that followed the context's latest earlier
           occurrence of its last n tokens take the first places instead (blockwise.lookup, as greedy's loops make
           them), each with q a point mass on it: accepted with probability p(d), the residual p without d. With
           narrow steps (DecodeOptions.narrow = w) a row whose context repeats fewer than 2 tokens drafts only w - 1
           tokens, from its heads: its later places in the call are never accepted and its bonus token is drawn
           after its w - 1 drafts. Lookup's drafts and a row's width are functions of its accepted prefix alone, so
           the output keeps its distribution, and a row's width does not depend on its batch mates.

Every token is then distributed as p given the tokens before it, so whole answers are distributed as plain
ancestral sampling's -- not the same tokens as a plain sampled run with the same seed: the two consume their random
numbers differently. Temperature 0 is greedy, on the exact blockwise path (greedy's tokens).

Each row draws from its own torch.Generator, seeded by `row_seeds` (default seed + row index), a fixed number of
uniforms per step (2b - 1: b - 1 acceptance tests, one residual or bonus draw, b - 1 drafts), so a row's tokens
depend on its seed and its own steps only, never on its batch mates or on which rows finished first.

Where the native loops run the model, the whole batch is one call (engine/csrc/sample_loop.h: the same algorithm,
each row drawing from its own splitmix64 stream, so the same distribution but not this loop's tokens for a seed).
There `verify="match"` (the default) verifies otherwise: plain sampling's token at each output position is an
exponential race keyed by (seed, position, id) (engine/csrc/sample.h, Sampler::choose), the heads draft with the same
race over their q (a Gumbel coupling: the draft is the model's choice wherever q and p agree), and a draft is kept
only where it is that choice: blockwise sampling then returns plain native sampling's tokens for the same seeds,
whatever was drafted, fed or batched; `verify="speculative"` is the algorithm above. `native=False`, CUDA and
models the native loops do not run take this reference PyTorch decoder (speculative whatever `verify` says): every
step through `model.decode`, head 1's full-vocabulary logits (`head1`) and the heads' draft-vocabulary logits
(`draft_logits`, in the proposal precision). Candidate trees (DecodeOptions.tree) run in the native loop's calls of
one row only (a step's tokens drawn node by node from p, the path following the child holding each: sample_loop.h),
adaptive feeding nowhere here.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from bpd_train.decoding.blockwise import blockwise, lookup_match
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
from bpd_train.decoding.sampling import check_sampling, sample, sampling_probs
from bpd_train.engine.packed import tree_rows
from bpd_train.engine.step import native_sampler
from bpd_train.engine.weights import PackedWeights

# head 1's positions per call in verification: most steps accept fewer drafts than this (narrow steps verify one)
CHUNK = 4


def residual(p: Tensor, q: Tensor) -> Tensor:
    """What a row draws from at its first rejected draft: max(0, p - q) (unnormalised; `draw` normalises). After a
    fully accepted block q is 0 there: p itself, the bonus token's distribution."""
    return (p - q).clamp_(min=0.0)


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draws: probs [..., V] (non-negative, unnormalised), u [...] uniforms in [0, 1) -> ids [...].
    A token of probability 0 is never drawn."""
    v = probs.shape[-1]
    cdf = probs.reshape(-1, v).cumsum(-1)
    at = (u.reshape(-1, 1).to(cdf.dtype) * cdf[:, -1:]).contiguous()
    return torch.searchsorted(cdf, at, right=True).clamp_(max=v - 1).reshape(u.shape)


def uniforms(gens: list[torch.Generator], n: int) -> Tensor:
    """[R, n] float64 uniforms, row r's from its own generator gens[r]."""
    return torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in gens])


def speculative_sample(
    model,
    src,
    block_size: int | None = None,
    max_len=DEFAULT_MAX_LEN,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    row_seeds: Sequence[int] | None = None,
    weights: PackedWeights | None = None,
    native: bool = True,
    verify: str = "match",
) -> DecodeResult:
    """Sample from the model (softmax(logits / temperature) within top_k / top_p) with blocks of up to
    `block_size` tokens per decoder call (default: the model's k); the output is distributed exactly as `sample`'s.
    temperature 0: exact blockwise decoding (greedy's tokens). A model without heads (or block_size 1): `sample`.
    native: one native call for the whole batch where the engine runs the model (its own random streams: the same
    distribution, not the same tokens as this reference loop); False: this Python loop.
    verify: "match" (native loops: plain native sampling's tokens for the same seeds; the reference loop verifies
    speculatively) or "speculative" (min(1, p/q) and the residual)."""
    t = check_sampling(temperature, top_k, top_p)
    if verify not in ("match", "speculative"):
        raise ValueError(f"verify must be match or speculative, got {verify!r}")
    k = int(model.config.block_size)
    kb = k if block_size is None else int(block_size)
    if not 1 <= kb <= k:
        raise ValueError(f"block_size must be in 1..{k} (the model's heads), got {block_size}")
    if t == 0.0:
        return blockwise(model, src, block_size=kb, max_len=max_len, weights=weights)
    if kb == 1:
        return sample(
            model,
            src,
            max_len,
            t,
            seed=seed,
            row_seeds=row_seeds,
            top_k=top_k,
            top_p=top_p,
            weights=weights,
            native=native,
        )
    with decoding_mode(model, weights) as w:
        sampler = _Sampler(model, w, kb, t, int(top_k), float(top_p), native, verify)
        return sampler.run(src, max_len, seed, row_seeds)


class _Sampler:
    def __init__(self, model, w, kb, temperature, top_k, top_p, native: bool = True, verify: str = "match"):
        self.model, self.w, self.kb = model, w, kb
        self.t, self.top_k, self.top_p = temperature, top_k, top_p
        self.eos = stop_ids(model)
        self.ids = w.draft_ids  # the heads' columns -> vocabulary ids (None: the full vocabulary)
        # prompt lookup's n (0: off): decoder-only models, whose input rows are the prompts
        self.look = int(w.options.lookup) if getattr(w, "lookup_context", False) and w.options.lookup else 0
        self.narrow = min(int(w.options.narrow), kb) if self.look and w.options.narrow else 0
        self.prompts: dict[int, np.ndarray] = {}
        self.native, self.match = native, verify == "match"

    def probs(self, logits: Tensor) -> Tensor:
        return sampling_probs(logits, self.t, self.top_k, self.top_p)

    def drafts(self, h: Tensor, u: Tensor, x0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Heads 2..b at h [R,D]: their distributions q [R,b-1,Vd] over the draft vocabulary, each draft's column
        in q [R,b-1] and its id d [R,b-1], one uniform each (u [R,b-1]). Chained heads read x0 [R], the token
        drawn at h (not head 1's argmax: under sampling the next token is often another)."""
        q = self.probs(self.w.draft_logits(h, 1, self.kb, x0))
        col = draw(q, u)
        return q, col, col if self.ids is None else self.ids[col]

    def looked_up(self, d: Tensor, out: np.ndarray, orig: np.ndarray, length: np.ndarray):
        """Prompt lookup's tokens over the heads' drafts d [R,b-1] (each row's context: its prompt and tokens so
        far) -> the drafts, where lookup put them [R,b-1] (bool: q there is a point mass on the draft) and each
        row's width [R] (1 + the drafts it has verified: narrow where the context repeats fewer than 2 tokens)."""
        mask = torch.zeros(d.shape, dtype=torch.bool)
        width = np.full(d.shape[0], self.kb, dtype=np.int64)
        if not self.look:
            return d, mask, width
        d = d.clone()
        for a, (o, n) in enumerate(zip(orig, length)):
            got, matched = lookup_match(np.concatenate([self.prompts[int(o)], out[o, :n]]), self.look, d.shape[1])
            if self.narrow and matched < 2:
                width[a] = self.narrow  # the heads' first drafts only, as greedy's narrow steps
            elif got.size:
                d[a, : got.size] = torch.from_numpy(got).to(d)
                mask[a, : got.size] = True
        return d, mask.to(d.device), width

    def verify(self, h: Tensor, d: Tensor, qd: Tensor, x: Tensor, u: Tensor, live: Tensor) -> tuple[Tensor, Tensor]:
        """The step's states h [R,b,D] -> p [R,J,V] at positions 0..J-1 and the accepted drafts n [R] (n < J).
        Draft j+1 (d [R,b-1], q(d) = qd [R,b-1]) is judged by p at position j: accepted with probability
        min(1, p/q) (u [R,b-1]), never after a stop id (x [R,b]) nor past a row's width (live [R,b-1]). Head 1's
        logits and p come CHUNK positions a call while some row still accepts: one call for most steps, and the
        positions after every row's first rejection are mostly never computed (the step weights compute a row's
        logits alike alone or among others)."""
        r, b = d.shape[0], d.shape[1] + 1
        ok = ~is_stop(x[:, :-1], self.eos) & live  # nothing is accepted after a stop id or past the row's width
        going = torch.ones(r, dtype=torch.bool, device=d.device)
        n = torch.zeros(r, dtype=torch.long, device=d.device)
        ps = []
        for lo in range(0, b, CHUNK):
            hi = min(lo + CHUNK, b)
            ps.append(self.probs(self.w.head1(h[:, lo:hi])))  # [R,hi-lo,V]
            for j in range(lo, min(hi, b - 1)):
                pd = ps[-1][:, j - lo].gather(-1, d[:, j, None])[:, 0]
                going &= ok[:, j] & (u[:, j] * qd[:, j] < pd)
                n += going
            if hi >= b or not bool(going.any()):
                break
        return torch.cat(ps, dim=1), n

    def full(self, q: Tensor) -> Tensor:
        """q [R,Vd] over the draft vocabulary -> [R,V] over the full one (0 off the draft vocabulary)."""
        if self.ids is None:
            return q
        return q.new_zeros(q.shape[0], self.w.vocab_size).index_copy_(1, self.ids, q)

    def run(self, src, max_len, seed: int, row_seeds) -> DecodeResult:
        model, kb, eos = self.model, self.kb, self.eos
        src, orig, limit, out, out_len, cap = start_rows(model, src, max_len, spare=kb)
        b = out.shape[0]
        seeds = [seed + i for i in range(b)] if row_seeds is None else [int(s) for s in row_seeds]
        if len(seeds) != b:
            raise ValueError(f"row_seeds has {len(seeds)} seeds for {b} rows")
        if orig.size == 0:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        dev = src.device
        if self.look:
            pad = model.config.pad_id
            self.prompts = {int(o): row[row != pad].cpu().numpy() for o, row in zip(orig, src)}
        opts = getattr(self.w, "options", None)  # a candidate tree's step may feed more rows than a block
        tree = opts.tree if opts is not None and self.native else ()
        state = model.start_decoding(model.encode(src, self.w), cap + max(kb, tree_rows(tree)), weights=self.w)
        if self.native:
            tok = start_tokens(model, state, orig.size, dev)
            got = self.native_run(state, tok, orig, limit, cap, [seeds[int(r)] for r in orig], out, out_len)
            if got is not None:
                return got
        gens = [torch.Generator().manual_seed(seeds[int(r)]) for r in orig]
        hist = np.zeros(kb + 1, dtype=np.int64)
        calls = 0

        # prefill: head 1's first token and the first drafts, from BOS (or each prompt's last token)
        h = model.decode(state, start_tokens(model, state, orig.size, dev))[:, 0]  # [R,D]
        u = uniforms(gens, kb)
        x0 = draw(self.probs(self.w.head1(h)), u[:, 0].to(dev))  # [R]
        q, col, d = self.drafts(h, u[:, 1:].to(dev), x0)
        out[orig, 0] = x0.cpu().numpy()
        length = np.ones(orig.size, dtype=np.int64)  # cached tokens = tokens out (BOS + x0..)
        d, looked, width = self.looked_up(d, out, orig, length)
        done = is_stop(out[orig, 0], eos) | (limit <= 1)
        while True:
            if done.any():  # finished rows leave the batch
                out_len[orig[done]] = length[done]
                keep = keep_rows(done)
                if keep.size == 0:
                    break
                state.lengths = length
                idx = torch.from_numpy(keep).to(dev)
                state.reorder(idx)
                x0, q, col, d, looked, width = x0[idx], q[idx], col[idx], d[idx], looked[idx], width[keep]
                orig, limit, length = orig[keep], limit[keep], length[keep]
                gens = [gens[i] for i in keep]
            r = orig.size
            rows = torch.arange(r, device=dev)
            b = int(width.max())  # this call's width: its widest row's
            wr = torch.from_numpy(width).to(dev)
            live = torch.arange(kb - 1, device=dev)[None, :] < (wr[:, None] - 1)  # [R,kb-1]: drafts each row verifies
            x = torch.cat([x0[:, None], d[:, : b - 1]], dim=1)  # [R,b]
            state.lengths = int(length[0]) if r == 1 else length
            h = model.decode(state, x)  # [R,b,D]
            calls += 1
            u = uniforms(gens, 2 * kb - 1).to(dev)
            qd = torch.where(looked, 1.0, q.gather(-1, col[..., None])[..., 0])  # q(d): 1 for a lookup draft
            p, n = self.verify(h, d[:, : b - 1], qd[:, : b - 1], x, u[:, : b - 1], live[:, : b - 1])
            q_end = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # q = 0 past the last draft: the bonus is p
            q_n = self.full(q_end[rows, n])  # [R,V]: q where each row's first rejection (or the bonus) falls
            q_n[n == wr - 1] = 0.0  # all of a row's drafts accepted: its bonus token, from p
            point = (n < wr - 1) & looked[rows, n.clamp(max=kb - 2)]  # ... a lookup draft there: q a point mass
            if bool(point.any()):
                q_n[point] = torch.nn.functional.one_hot(d[rows, n.clamp(max=kb - 2)][point], q_n.shape[-1]).to(q_n)
            nxt = draw(residual(p[rows, n], q_n), u[:, kb - 1])  # [R]
            new = torch.cat([d[:, : b - 1], nxt[:, None]], dim=1)
            new[rows, n] = nxt
            x_np, n_np, new_np = x.cpu().numpy(), n.cpu().numpy(), new.cpu().numpy()
            eos_in_block = is_stop(x_np[np.arange(r), n_np], eos)  # the last accepted draft was a stop id
            c = np.minimum(n_np + 1 - eos_in_block, limit - length)
            out[orig[:, None], length[:, None] + np.arange(b)] = new_np
            length += c
            hist += np.bincount(c, minlength=kb + 1)
            done = eos_in_block | is_stop(new_np[np.arange(r), n_np], eos) | (length >= limit)
            x0 = nxt
            q, col, d = self.drafts(h[rows, n], u[:, kb:], nxt)
            d, looked, width = self.looked_up(d, out, orig, length)
        return self.result(out, out_len, hist, calls)

    def native_run(self, state, tok, orig, limit, cap, seeds, out, out_len) -> DecodeResult | None:
        """The whole batch in one native call (engine/csrc/sample_loop.h: this algorithm, each row drawing from its
        own splitmix64 stream), or None where the native loops do not run the model."""
        if getattr(state, "mem_group", 1) != 1:
            return None
        r, kb = orig.size, self.kb
        lengths = np.zeros(r, dtype=np.int64) + np.asarray(state.lengths, dtype=np.int64)
        context = [self.prompts[int(o)] for o in orig] if self.look else None
        kw = {"context": context} if context is not None else {}
        got = self.w.batch_block_steps(
            self.model,
            state,
            tok.cpu().numpy(),
            lengths,
            np.ascontiguousarray(limit, dtype=np.int64),
            int(cap),
            width=kb,
            sampler=native_sampler(self.t, self.top_k, self.top_p, seeds, self.match),
            **kw,
        )
        if got is None:
            return None
        toks, hist, steps, counts = got
        width = min(toks.shape[1], out.shape[1])
        out[orig, :width] = toks[:, :width]
        out_len[orig] = counts
        hist = hist.copy()
        hist[1] -= r  # the first step (the prefill) gives each row its first token
        return self.result(out, out_len, hist, int(steps) - 1)

    def result(self, out, out_len, hist, calls: int) -> DecodeResult:
        kb, eos = self.kb, self.eos
        tokens = trim(out.tolist(), out_len.tolist(), eos)
        steps = int(hist.sum())
        mean = float((hist * np.arange(kb + 1)).sum() / steps) if steps else 1.0
        return DecodeResult(
            tokens=tokens,
            calls=calls,
            prefill_calls=1,
            mean_accepted=mean,
            accepted_hist={int(s): int(c) for s, c in enumerate(hist) if c},
        )
