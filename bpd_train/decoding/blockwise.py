"""Blockwise parallel decoding (Stern et al. 2018), combined predict + verify.

    prefill   one decoder call on BOS; head 1 gives the first token x0, heads 2..b the first proposals.
    verify    ONE decoder call per step on [x0, x1..x(b-1)] per row (x0: the last accepted token, not yet
              cached; x1..: the proposals). At each of those positions head 1 predicts the next token.
    accept    proposal x(j+1) is accepted if it passes the acceptance rule against head 1 at position j;
              with n proposals accepted the row gains n+1 tokens (them and head 1's token at position n).
              The cache keeps x0..xn; rejected proposals' slots are rolled back by shortening the row.
    propose   heads 2..b at the last accepted position give the next proposals (over the draft vocabulary
              when the model's decode options set one: head 1 still verifies over the full vocabulary).

Rows accept different numbers of tokens, so with more than one row the cache runs in per-row mode
(model/cache.py); one row stays in the cheaper uniform mode. Rows that finish (EOS or max_len) leave the
batch. Every projection goes through the model's DecodeWeights, the same arithmetic greedy uses, so Exact
gives greedy's output token for token.

Proposals that won't be accepted still cost a decoder row and a head each step. `adaptive=True` feeds only
the prefix of proposals whose heads have been accepted often enough so far (per head, counted over this
call's steps), and drops the proposal pass entirely while no head pays for itself; the output is the same.

Per-step bookkeeping (acceptance prefix, EOS, max_len, output) runs vectorised in numpy on the host: a few
microseconds, where dozens of tiny tensor ops would cost more than the decoder call at batch 1.
"""
from __future__ import annotations

import numpy as np
import torch

from bpd_train.decoding.acceptance import Exact, make_acceptance
from bpd_train.decoding.common import decoding_mode, start_rows, start_tokens, trim
from bpd_train.decoding.result import DecodeResult

# Below this many multiply-adds per step (rows x b x (b-1) x proposal vocabulary x d_model), the proposal
# heads run at every block position inside the verify step (one pass, no second decoder round trip); above
# it they run in a second pass at the accepted position only. Measured in bench/decode.py.
FUSED_MACS = 1 << 21


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


class _Adaptive:
    """Which proposals to feed: proposal j (1-based) is fed while the heads 2..j+1 chain has been accepted
    often enough. Counts offered/accepted per proposal index over all steps and rows decoded with these
    weights (kept with the model's DecodeWeights, so short sentences decoded one call at a time still
    learn; halved every 4096 offers, so the counts follow the data); a proposal
    index is kept if its conditional acceptance rate is >= `threshold` (optimistic prior: 1 of 1, so every
    head is tried). While not even proposal 1 pays, the decoder runs plain greedy steps (no heads at all)
    and probes the heads once after every `interval` of them; the interval doubles after each probe that
    fails (8, 16, ... 64 steps) and starts again at 8 once a head pays."""

    def __init__(self, kb: int, threshold: float, probe: int = 8, max_interval: int = 64):
        self.offered = np.ones(kb, dtype=np.int64)
        self.accepted = np.ones(kb, dtype=np.int64)
        self.threshold = threshold
        self.probe, self.max_interval = probe, max_interval
        self.interval = probe

    def width(self) -> int:
        """Block width to feed next (1 = x0 only)."""
        rate = self.accepted[1:] / self.offered[1:]
        ok = np.cumprod(rate >= self.threshold)
        return 1 + int(ok.sum())

    def update(self, fed: int, n: np.ndarray) -> None:
        """fed block width, n [R] proposals accepted per row."""
        for j in range(1, fed):
            reached = n >= j - 1                     # proposal j was judged only if j-1 were accepted
            self.offered[j] += int(reached.sum())
            self.accepted[j] += int((n >= j).sum())
        if self.offered[1] > 4096:
            self.offered = np.maximum(self.offered // 2, 1)
            self.accepted = np.minimum(self.accepted // 2, self.offered)
        if fed > 1 and self.width() > 1:
            self.interval = self.probe

    def greedy_stretch(self) -> int:
        """Greedy steps to run before the next probe (and back off for the one after)."""
        n = self.interval
        self.interval = min(2 * self.interval, self.max_interval)
        return n


def blockwise(model, src, block_size: int | None = None, accept=None, min_block: int = 1,
              max_len=(2.0, 10), adaptive: bool | float = False) -> DecodeResult:
    """Decode with blocks of up to `block_size` tokens per decoder call (default: the model's k).

    accept: Exact() (default; output identical to greedy), TopK(n), Distance(eps), or their config
    names ("exact", "topk:N", "distance:EPS").
    min_block: accept at least min_block tokens per step even where verification fails (approximate).
    adaptive: False, True (threshold 0.5) or a threshold in (0, 1): feed only proposals whose heads are
    accepted at least that often (see the module docstring). Output unchanged.
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
    threshold = 0.5 if adaptive is True else float(adaptive or 0.0)
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"adaptive must be a bool or a threshold in (0, 1), got {adaptive!r}")
    if threshold and int(min_block) > 1:
        raise ValueError("adaptive feeding and min_block > 1 do not combine (min_block forces proposals in)")
    with decoding_mode(model):
        return _Blockwise(model, kb, rule, int(min_block), threshold).run(src, max_len)


class _Blockwise:
    def __init__(self, model, kb: int, rule, min_block: int, threshold: float):
        self.model, self.kb, self.rule, self.min_block = model, kb, rule, min_block
        self.exact = isinstance(rule, Exact)
        self.eos = model.config.eos_id
        self.threshold = threshold
        self.adapt = None

    def run(self, src, max_len) -> DecodeResult:
        model, kb, eos = self.model, self.kb, self.eos
        # out has kb spare columns: an accepted block may run past a row's limit before it is cut
        src, orig, limit, out, out_len, cap = start_rows(model, src, max_len, spare=kb)
        b = out.shape[0]
        if orig.size == 0:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        self.dev = src.device
        self.hist = np.zeros(kb + 1, dtype=np.int64)
        self.state = state = model.start_decoding(model.encode(src), cap + kb)
        self.w = state.weights
        if self.threshold:  # acceptance statistics live as long as these weights (see _Adaptive)
            stats = getattr(self.w, "stats", None)
            key = ("adaptive", kb, self.threshold)
            self.adapt = _Adaptive(kb, self.threshold) if stats is None else stats.setdefault(
                key, _Adaptive(kb, self.threshold))
        # a proposal vocabulary of N tokens: one-pass (fused) proposing while it is cheap
        vocab = len(self.w.draft_ids) if self.w.draft_ids is not None else self.w.vocab_size
        self.fused_unit = kb * max(kb - 1, 0) * vocab * model.config.d_model

        x = self.prefill(orig.size)                                     # [R,b] x0 + proposals
        out[orig, 0] = x[:, 0]
        length = np.ones(orig.size, dtype=np.int64)                    # cached tokens = tokens out (BOS + x0..)
        done = (x[:, 0] == eos) | (limit <= 1)
        self.calls = 0
        while True:
            if done.any():
                out_len[orig[done]] = length[done]
                keep = np.flatnonzero(~done)
                if keep.size == 0:
                    break
                state.lengths = length
                state.reorder(torch.from_numpy(keep).to(self.dev))
                x, orig, limit, length = x[keep], orig[keep], limit[keep], length[keep]
            r = orig.size
            state.lengths = int(length[0]) if r == 1 else length      # one row: uniform mode, no scatter
            fused = self.fused_unit and r * self.fused_unit <= FUSED_MACS and x.shape[1] > 1
            h, g, ok, top = self.verify(x, fused)
            n, gn, c, ended = _accept_rows(x, g, ok, self.min_block, eos, limit - length)
            if self.adapt is not None:
                self.adapt.update(x.shape[1], n)
            self.write(out, orig, length, x, n, gn)
            length += c
            self.hist += np.bincount(c, minlength=kb + 1)
            done = ended | (length >= limit)
            if done.all():
                continue
            if self.adapt is not None and self.adapt.width() == 1:
                x = gn[:, None]
                if not done.any():  # finished rows leave first (top of the loop); then the stretch
                    # no head pays: plain greedy steps (no heads), then one probe of every head
                    x, h1, length, done = self.greedy_steps(x, out, orig, limit, length, self.adapt.greedy_stretch())
                    if not done.any():
                        x = np.concatenate([x, self.w.propose(h1, 1, self.kb).cpu().numpy()], axis=1)
            else:
                x = self.propose(h, n, gn, top)
        tokens = trim(out.tolist(), out_len.tolist(), eos)
        steps = int(self.hist.sum())
        accepted = {int(s): int(c) for s, c in enumerate(self.hist) if c}
        mean = float((self.hist * np.arange(kb + 1)).sum() / steps) if steps else 1.0
        return DecodeResult(tokens=tokens, calls=self.calls, prefill_calls=1, mean_accepted=mean,
                            accepted_hist=accepted)

    def _width(self) -> int:
        if self.adapt is None or self.min_block > 1:
            return self.kb
        return min(self.kb, self.adapt.width())

    def greedy_steps(self, x, out, orig, limit, length, steps: int):
        """Up to `steps` one-token steps without heads (adaptive mode, while no head pays), stopping after
        the step in which a row ends. x [R,1] the last accepted tokens. Returns (x, head-1 hidden state of
        the last step [R,D], length, done)."""
        state, eos = self.state, self.eos
        r = x.shape[0]
        done = np.zeros(r, dtype=bool)
        for _ in range(steps):
            state.lengths = int(length[0]) if r == 1 else length
            h = self.model.decode(state, torch.from_numpy(x).to(self.dev))[:, 0]     # [R,D]
            self.calls += 1
            g = self.w.head1_argmax(h).cpu().numpy()
            out[orig, length] = g
            length += 1
            self.hist[1] += r
            x = g[:, None]
            done = (g == eos) | (length >= limit)
            if done.any():
                break
        return x, h, length, done

    def prefill(self, rows: int) -> np.ndarray:
        """BOS -> head 1's first token and the first proposals."""
        tok = start_tokens(self.model, self.state, rows, self.dev)     # [R,1] BOS, or an LM's last prompt tokens
        h = self.model.decode(self.state, tok)[:, 0]                    # [R,D]
        g = self.w.head1_argmax(h)
        b = self._width()
        if b == 1:
            return g.cpu().numpy()[:, None]
        return torch.cat([g[:, None], self.w.propose(h, 1, b)], dim=1).cpu().numpy()

    def verify(self, x: np.ndarray, fused: bool):
        """One decoder call on the fed tokens x [R,b]. Returns the hidden states, head 1's argmax g [R,b],
        the rule's verdicts ok [R,b-1] (None for Exact) and, fused, every head's proposal at every
        position [R,b,b-1] (else None)."""
        x_dev = torch.from_numpy(x).to(self.dev)
        h = self.model.decode(self.state, x_dev)                        # [R,b,D]
        self.calls += 1
        ok = None
        if self.exact or x.shape[1] == 1:
            g_dev = self.w.head1_argmax(h)                              # [R,b]
        else:
            l1 = self.w.head1(h)                                        # [R,b,V]
            g_dev = l1.argmax(-1)
            ok = self.rule(x_dev[:, 1:], l1[:, :-1], g_dev[:, :-1]).cpu().numpy()
        top = None
        if fused:
            top = self.w.propose(h, 1, self.kb)                         # [R,b,kb-1]
            g, top = g_dev.cpu().numpy(), top.cpu().numpy()
        else:
            g = g_dev.cpu().numpy()
        return h, g, ok, top

    def write(self, out, orig, length, x, n, gn) -> None:
        """Accepted proposals, then head 1's token, at each row's next output slots (junk past the tokens
        gained is overwritten later or cut off)."""
        r, b = x.shape
        new = np.concatenate([x[:, 1:], gn[:, None]], axis=1)
        new[np.arange(r), n] = gn
        out[orig[:, None], length[:, None] + np.arange(b)] = new

    def propose(self, h, n: np.ndarray, gn: np.ndarray, top) -> np.ndarray:
        """Next fed tokens [R,b']: head 1's token at the accepted slot, then heads 2..b' there."""
        b = self._width()
        if b == 1:
            return gn[:, None]
        r = gn.shape[0]
        if top is not None:                                             # computed in the verify step
            return np.concatenate([gn[:, None], top[np.arange(r), n, :b - 1]], axis=1)
        hn = h[:, int(n[0])] if r == 1 else h[torch.arange(r, device=self.dev), torch.from_numpy(n).to(self.dev)]
        fut = self.w.propose(hn, 1, b).cpu().numpy()                    # [R,b-1]
        return np.concatenate([gn[:, None], fut], axis=1)
