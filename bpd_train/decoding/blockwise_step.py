"""The reference step of blockwise parallel decoding (Stern et al. 2018) in Python and torch, one decoder call per
step: `BlockwiseStep.python_step` verifies the fed tokens (head 1 at every position), accepts each row's prefix
under the acceptance rule (`accept_rows`), writes the tokens gained and proposes the next block (heads 2..b at the
last accepted position, over the draft vocabulary where the decoder's options set one). Every projection goes
through the decoder's step weights (engine/step.py DecodeStep), the arithmetic greedy uses, so Exact gives
greedy's output token for token. decoding/blockwise.py runs the loop and, where they apply, the native loops and
adaptive feeding, which take the same steps (tested); a step they do not run comes here.
"""

from __future__ import annotations

from time import perf_counter

import numpy as np
import torch

from bpd_train.decoding.acceptance import Exact
from bpd_train.decoding.common import is_stop, start_tokens, stop_ids

# Below this many multiply-adds per step (rows x b x (b-1) x proposal vocabulary x d_model), the proposal
# heads run at every block position inside the verify step (one pass, no second decoder round trip); above
# it they run in a second pass at the accepted position only. Measured in bench/decode.py.
FUSED_MACS = 1 << 21


def accept_rows(x, g, ok, min_block, eos, room):
    """Vectorised acceptance for R rows. x [R,b] fed tokens (x0 + proposals), g [R,b] head 1's argmax at
    each position, ok [R,b-1] the rule's verdicts (None: exact match), eos the stop id(s). Returns accepted
    proposals n, head 1's token at the last accepted slot gn, tokens gained c (capped by room), ended-by-EOS flags."""
    r, kb = x.shape
    if kb == 1:
        n = np.zeros(r, dtype=np.int64)
    else:
        ok = x[:, 1:] == g[:, :-1] if ok is None else ok.astype(bool)
        if min_block > 1:
            ok[:, : min_block - 1] = True
        ok &= ~is_stop(x[:, :-1], eos)  # nothing is accepted after an EOS
        n = np.cumprod(ok, axis=1).sum(1)
    rows = np.arange(r)
    gn = g[rows, n]
    eos_in_block = is_stop(x[rows, n], eos)  # an accepted proposal was EOS
    c = np.minimum(n + 1 - eos_in_block, room)
    return n, gn, c, eos_in_block | is_stop(gn, eos)


class BlockwiseStep:
    """The state of one blockwise decoding call that its steps share (the model, its step weights `w`, the block
    size, the rule) and the reference step. `adapt` stays None here: the dispatch (decoding/blockwise.py) sets an
    adaptive controller and provides `stretch`, the greedy stretch a step hands over to where no head pays."""

    adapt = None

    def __init__(self, model, w, kb: int, rule, min_block: int):
        self.model, self.w, self.kb, self.rule, self.min_block = model, w, kb, rule, min_block
        self.exact = isinstance(rule, Exact)
        self.eos = stop_ids(model)

    def _width(self, rows: int) -> int:
        if self.adapt is None or self.min_block > 1:
            return self.kb
        return min(self.kb, self.adapt.width(rows))

    def prefill(self, rows: int) -> np.ndarray:
        """BOS -> head 1's first token and the first proposals."""
        tok = start_tokens(self.model, self.state, rows, self.dev)  # [R,1] BOS, or an LM's last prompt tokens
        h = self.model.decode(self.state, tok)[:, 0]  # [R,D]
        g = self.w.head1_argmax(h)
        b = self._width(rows)
        if b == 1:
            return g.cpu().numpy()[:, None]
        return torch.cat([g[:, None], self.w.propose(h, 1, b, g)], dim=1).cpu().numpy()

    def python_step(self, x, out, orig, limit, length):
        """One step through Python: verify the fed tokens, accept each row's prefix under the rule, write the
        tokens gained, then propose the next block (or, adaptive, start a greedy stretch where no head pays)."""
        r, kb = orig.size, self.kb
        self.state.lengths = int(length[0]) if r == 1 else length  # one row: uniform mode, no scatter
        t0 = perf_counter()
        # on an accelerator every host round trip costs more than proposing at every position: one transfer
        fused = x.shape[1] > 1 and (self.dev.type != "cpu" or self.fused_unit and r * self.fused_unit <= FUSED_MACS)
        h, g, ok, top = self.verify(x, fused)
        n, gn, c, ended = accept_rows(x, g, ok, self.min_block, self.eos, limit - length)
        if self.adapt is not None:
            self.adapt.update(x.shape[1], n)
        self.write(out, orig, length, x, n, gn)
        length += c
        self.hist += np.bincount(c, minlength=kb + 1)
        done = ended | (length >= limit)
        if done.all():
            return x, done
        if self.adapt is not None and self.adapt.width(r) == 1:
            x = gn[:, None]
            if not done.any():  # finished rows leave first (top of the loop); then the stretch
                x, done = self.stretch(x, out, orig, limit, length)
            return x, done
        fed = x.shape[1]
        x = self.propose(h, n, gn, top)
        if self.adapt is not None and fed > 1:  # what a step of this width cost, verify to proposals
            self.adapt.timed(fed, r, perf_counter() - t0)
        return x, done

    def verify(self, x: np.ndarray, fused: bool):
        """One decoder call on the fed tokens x [R,b]. Returns the hidden states, head 1's argmax g [R,b],
        the rule's verdicts ok [R,b-1] (None for Exact) and, fused, every head's proposal at every
        position [R,b,b-1] (else None)."""
        x_dev = torch.from_numpy(x).to(self.dev)
        h = self.model.decode(self.state, x_dev)  # [R,b,D]
        self.calls += 1
        ok = None
        if self.exact or x.shape[1] == 1:
            g_dev = self.w.head1_argmax(h)  # [R,b]
        else:
            l1 = self.w.head1(h)  # [R,b,V]
            g_dev = l1.argmax(-1)
            ok = self.rule(x_dev[:, 1:], l1[:, :-1], g_dev[:, :-1]).cpu().numpy()
        top = None
        if fused:
            top = self.w.propose(h, 1, self.kb, g_dev)  # [R,b,kb-1]
            both = torch.cat([g_dev[..., None], top], dim=-1).cpu().numpy()  # one device -> host copy per step
            g, top = both[..., 0], both[..., 1:]
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
        b = self._width(gn.shape[0])
        if b == 1:
            return gn[:, None]
        r = gn.shape[0]
        if top is not None:  # computed in the verify step
            return np.concatenate([gn[:, None], top[np.arange(r), n, : b - 1]], axis=1)
        hn = h[:, int(n[0])] if r == 1 else h[torch.arange(r, device=self.dev), torch.from_numpy(n).to(self.dev)]
        fut = self.w.propose(hn, 1, b, gn).cpu().numpy()  # [R,b-1]
        return np.concatenate([gn[:, None], fut], axis=1)
