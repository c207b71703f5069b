"""Blockwise parallel decoding (Stern et al. 2018), combined predict + verify.

    prefill   one decoder call on BOS; head 1 gives the first token x0, heads 2..b the first proposals.
    verify    ONE decoder call per step on [x0, x1..x(b-1)] per row (x0: the last accepted token, not yet
              cached; x1..: the proposals). At each of those positions head 1 predicts the next token.
    accept    proposal x(j+1) is accepted if it passes the acceptance rule against head 1 at position j;
              with n proposals accepted the row gains n+1 tokens (them and head 1's token at position n).
              The cache keeps x0..xn; rejected proposals' slots are rolled back by shortening the row.
    propose   heads 2..b at the last accepted position give the next proposals (over the draft vocabulary
              when the decoder's options set one: head 1 still verifies over the full vocabulary).

Two modules: decoding/blockwise_step.py holds the reference step in Python and torch (`BlockwiseStep.python_step`:
`verify`, `accept_rows`, `write`, `propose`); this one the entry point and the dispatch. `_Blockwise.run` is the
loop: `first_step` (the prefill), then `step` until every row has ended, finished rows leaving the batch in
between; `step` runs the first mode that applies: a greedy stretch (`stretch`, adaptive mode while no head pays),
the native loops (`block_native` for one row, `batch_native` for a batch), or the reference step.

Rows accept different numbers of tokens, so with more than one row the cache runs in per-row mode
(model/cache.py); rows that finish leave the batch. Every projection goes through the decoder's step weights
(engine/step.py DecodeStep, from its packed-weight cache: engine/weights.py PackedWeights), the arithmetic greedy
uses, so Exact gives greedy's output token for token. `adaptive=True` feeds only as many
proposals as pay (decoding/adaptive.py) and runs greedy stretches while none does; the output is the same. Where
the native kernels run the model, the Exact, TopK and Distance rules (without min_block) run whole runs of steps in
one C++ call (block_steps / batch_block_steps / greedy_steps); other cases take the reference step (both take the
same steps, tested). Per-step bookkeeping runs vectorised in numpy on the host.
"""

from __future__ import annotations

from time import perf_counter

import numpy as np
import torch

from bpd_train.decoding.acceptance import Exact, make_acceptance
from bpd_train.decoding.adaptive import Adaptive
from bpd_train.decoding.blockwise_step import BlockwiseStep
from bpd_train.decoding.common import (
    DEFAULT_MAX_LEN,
    decoding_mode,
    is_stop,
    keep_rows,
    parse_max_len,
    start_rows,
    start_tokens,
    trim,
)
from bpd_train.decoding.greedy import greedy
from bpd_train.decoding.result import DecodeResult
from bpd_train.engine.packed import tree_rows
from bpd_train.engine.weights import PackedWeights, default_weights

# Adaptive feeding times each step width after this many of the sentences' own greedy tokens: where a
# translation's steps mostly are (attention's share of a step grows with the position)
CALIB_LEAD = 32


def blockwise(
    model,
    src,
    block_size: int | None = None,
    accept=None,
    min_block: int = 1,
    max_len=DEFAULT_MAX_LEN,
    adaptive: bool | float = False,
    weights: PackedWeights | None = None,
) -> DecodeResult:
    """Decode with blocks of up to `block_size` tokens per decoder call (default: the model's k).

    accept: Exact() (default; output identical to greedy), TopK(n), Distance(eps), or their config
    names ("exact", "topk:N", "distance:EPS").
    min_block: accept at least min_block tokens per step even where verification fails (approximate).
    adaptive: False; True: feed the number of proposals that maximises expected tokens per second (measured
    acceptance per head, measured step costs; see Adaptive); or a threshold in (0, 1): feed only proposals
    whose heads are accepted at least that often. Output unchanged. With prompt lookup (DecodeOptions.lookup) it
    acts on calls of several rows (its counts then measure lookup's and the heads' proposals together); one row
    feeds the full block (or narrow steps).
    weights: the decoder's packed-weight cache, with its DecodeOptions (None: the model's default, fp32).
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
    if adaptive is None or isinstance(adaptive, bool) or float(adaptive) == 0.0:  # 0: off, as before
        threshold = None
        adaptive = bool(adaptive)
    else:
        threshold = float(adaptive)
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"adaptive must be a bool or a threshold in (0, 1), got {adaptive!r}")
    adaptive = adaptive is not None and adaptive is not False
    weights = weights if weights is not None else default_weights(model)
    if weights.options.lookup and _rows(src) == 1:
        # one row with prompt lookup: plain blockwise, as before (narrow steps and trees pick each step's width
        # there, and a k-row step costs little more than a greedy one). Several rows keep adaptive feeding: no
        # step narrows there, a k-row step over every row costs several greedy steps, and without it lookup's
        # batches ran at ~0.7x greedy where neither the context nor the heads paid
        adaptive, threshold = False, None
    if adaptive and int(min_block) > 1:
        raise ValueError("adaptive feeding and min_block > 1 do not combine (min_block forces proposals in)")
    if kb == 1:
        # a 1-wide block proposes nothing: greedy decoding, on greedy's own loop (the same tokens, calls and
        # histogram; the blockwise steps cost more per token there, and adaptive feeding had no width to probe)
        return greedy(model, src, max_len, weights)
    if adaptive and threshold is None and _settled_on_greedy(model, weights, kb, src, max_len):
        return greedy(model, src, max_len, weights)  # what the greedy stretch would have run, on greedy's own loop
    with decoding_mode(model, weights) as w:
        return _Blockwise(model, w, kb, rule, int(min_block), adaptive, threshold).run(src, max_len)


def _rows(src) -> int:
    """Rows of a call's source: a [R,S] (or [S]) tensor, or a list of token lists."""
    if isinstance(src, torch.Tensor):
        return src.shape[0] if src.dim() == 2 else 1
    return len(src)


def _settled_on_greedy(model, weights: PackedWeights, kb: int, src, max_len) -> bool:
    """Rows whose adaptive controller (kept with the decoder's current step weights) would run one greedy stretch
    and no probe before the first row must end (Adaptive.settled_on_greedy); the stretch is then counted in its
    probe schedule. The step weights are read from the decoder's cache unchecked: stale ones at worst send one call
    down greedy's loop, whose tokens are the same.
    The horizon (the steps before the shortest row must end) is first bounded from the padded width alone: torch
    ops on the source are dear here at batch 1, right after a decode (the interpreter's and torch's code out of
    the caches), and a controller settled on greedy probes far less often than any row's
    horizon, so the exact shortest row is counted only when the bound does not settle it."""
    stats = getattr(weights.cached, "stats", None)
    ad = stats.get(("adaptive", kb, None)) if stats else None
    tensor = isinstance(src, torch.Tensor)
    rows = _rows(src)
    if ad is None or rows == 0:
        return False
    m = parse_max_len(max_len)
    cfg = model.config

    def horizon(n: int) -> int:
        return min(m if isinstance(m, int) else int(m[0] * n + m[1]), cfg.max_positions)

    if tensor:
        settled = ad.settled_on_greedy(horizon(src.shape[-1]), rows)  # every row is at most this long
        if not settled and not isinstance(m, int):  # the shortest row's source tokens
            n = int((src != cfg.pad_id).sum(-1).min())
            settled = ad.settled_on_greedy(horizon(n), rows)
    else:
        settled = ad.settled_on_greedy(horizon(min(len(s) for s in src)), rows)
    if not settled:
        return False
    ad.greedy_stretch(rows)
    return True


def lookup(context: np.ndarray, n: int, want: int) -> np.ndarray:
    """Prompt lookup's proposals for one row, as the native loops make them (csrc/loops.h LoopModel::lookup): where
    the context's last n (else fewer, down to 1) tokens occurred before, up to `want` tokens that followed their
    latest earlier occurrence; none where nothing repeats."""
    return lookup_match(context, n, want)[0]


def lookup_match(context: np.ndarray, n: int, want: int) -> tuple[np.ndarray, int]:
    """`lookup`'s proposals and how many of the context's last tokens matched (0: none)."""
    c = np.asarray(context, dtype=np.int64)
    size = c.size
    for m in range(min(n, size - 1), 0, -1):
        earlier = np.lib.stride_tricks.sliding_window_view(c[: size - 1], m)  # [j]: c[j : j + m], j + m < size
        hits = np.flatnonzero((earlier == c[size - m :]).all(1))
        if hits.size:
            j = int(hits[-1]) + m
            return c[j : j + min(want, size - j)], m
    return c[:0], 0


class _Blockwise(BlockwiseStep):
    """One blockwise decoding call: the loop (`run`) and the dispatch of each step to the native loops, a greedy
    stretch (adaptive feeding) or the reference step (decoding/blockwise_step.py)."""

    def __init__(self, model, w, kb: int, rule, min_block: int, adaptive: bool, threshold: float | None):
        super().__init__(model, w, kb, rule, min_block)
        self.adaptive, self.threshold = adaptive, threshold
        self.adapt = None
        # whole runs of steps in one native call (DecodeWeights.block_steps / batch_block_steps) where it can:
        # a rule the native loops know (Exact, TopK, Distance) without a minimum block; the encoder-decoder loops
        # end rows on one EOS id, the decoder-only ones on several (see run)
        self.native_rule = getattr(rule, "native", None)
        self.native_block = self.native_rule is not None and min_block == 1

    def run(self, src, max_len) -> DecodeResult:
        model, kb, eos = self.model, self.kb, self.eos
        # out has kb spare columns: an accepted block may run past a row's limit before it is cut
        src, orig, limit, out, out_len, cap = start_rows(model, src, max_len, spare=kb)
        b = out.shape[0]
        if orig.size == 0:
            return DecodeResult(tokens=[[] for _ in range(b)], calls=0, prefill_calls=0, accepted_hist={})
        self.dev = src.device
        self.hist = np.zeros(kb + 1, dtype=np.int64)
        memory = model.encode(src, self.w)
        tree = getattr(self.w, "options", None)  # (a test's scripted step weights carry no options)
        tree = tree.tree if tree is not None else ()
        self.state = state = model.start_decoding(memory, cap + max(kb, tree_rows(tree)), weights=self.w)
        self.w = state.weights
        # prompt lookup (DecodeOptions.lookup, decoder-only native loops): each row's prompt, by row of `out`
        self.prompts = None
        if getattr(self.w, "lookup_context", False) and self.w.options.lookup:
            pad = model.config.pad_id
            self.prompts = {int(o): row[row != pad].cpu().numpy() for o, row in zip(orig, src)}
        if not isinstance(eos, int) and not getattr(self.w, "multi_stop", False):
            self.native_block = False
        if self.adaptive:  # acceptance statistics and step costs live as long as these weights (see Adaptive)
            stats = getattr(self.w, "stats", None)
            key = ("adaptive", kb, self.threshold)
            self.adapt = (
                Adaptive(kb, self.threshold) if stats is None else stats.setdefault(key, Adaptive(kb, self.threshold))
            )
            b = self.adapt.bucket(orig.size)
            if (
                self.native_block
                and self.threshold is None
                and b not in self.adapt.calib_tried
                and self.adapt.calibrated(b) is None
            ):
                self.calibrate(memory, limit)
        # a proposal vocabulary of N tokens: one-pass (fused) proposing while it is cheap
        vocab = len(self.w.draft_ids) if self.w.draft_ids is not None else self.w.vocab_size
        self.fused_unit = kb * max(kb - 1, 0) * vocab * model.config.d_model

        length = np.zeros(orig.size, dtype=np.int64)  # cached tokens = tokens out (BOS + x0..)
        self.calls = 0
        x, done = self.first_step(out, orig, limit, length)
        while True:
            if done.any():  # finished rows leave the batch
                out_len[orig[done]] = length[done]
                keep = keep_rows(done)
                if keep.size == 0:
                    break
                state.lengths = length
                state.reorder(torch.from_numpy(keep).to(self.dev))
                x, orig, limit, length = x[keep], orig[keep], limit[keep], length[keep]
            x, done = self.step(x, out, orig, limit, length)
        tokens = trim(out.tolist(), out_len.tolist(), eos)
        steps = int(self.hist.sum())
        accepted = {int(s): int(c) for s, c in enumerate(self.hist) if c}
        mean = float((self.hist * np.arange(kb + 1)).sum() / steps) if steps else 1.0
        return DecodeResult(
            tokens=tokens, calls=self.calls, prefill_calls=1, mean_accepted=mean, accepted_hist=accepted
        )

    # ---- the loop's steps: each takes the fed tokens x [R,b] of the rows still decoding (orig: their rows in
    # out, limit: their token limits, length: their cached tokens, advanced in place) and returns the next fed
    # tokens and which rows ended ----

    def first_step(self, out, orig, limit, length):
        """The prefill: a greedy stretch from BOS where adaptive mode finds no head that pays; for one row with
        Exact the first call of the native block loop; else one decoder call on BOS (head 1's token and the first
        proposals)."""
        model, state = self.model, self.state
        rows = orig.size
        if self.adapt is not None and self.adapt.width(rows) == 1:
            first = start_tokens(model, state, rows, self.dev).cpu().numpy()  # [R,1] BOS / prompts' last
            x, done = self.stretch(first, out, orig, limit, length)
            self.calls -= 1  # (its first step is the prefill)
            self.hist[1] -= rows
            return x, done
        if rows == 1 and self.native_block and getattr(self.w, "native_loop", None) is not None:
            # the prefill as the first step of the native block loop (BOS alone, then blocks of the width)
            first = start_tokens(model, state, 1, self.dev).cpu().numpy()  # [1,1]
            got = self.block_native(first, out, orig, limit, length, width=self._width(1))
            if got is not None:
                return got
        x = self.prefill(rows)  # [R,b] x0 + proposals
        out[orig, 0] = x[:, 0]
        length += 1
        return x, is_stop(x[:, 0], self.eos) | (limit <= 1)

    def step(self, x, out, orig, limit, length):
        """The next steps, in the first mode that applies: a greedy stretch (adaptive mode fed no proposal), the
        native loops (one row, or a batch; a rule they know), else one verify-accept-propose step in Python."""
        if x.shape[1] == 1 and self.adapt is not None:
            # no proposal fed (rows just left during a greedy stretch): go on with the stretch, not with a
            # one-token verify step through Python
            return self.stretch(x, out, orig, limit, length)
        if self.native_block and x.shape[1] > 1:
            got = (self.block_native if orig.size == 1 else self.batch_native)(x, out, orig, limit, length)
            if got is not None:
                return got
        return self.python_step(x, out, orig, limit, length)

    def block_native(self, x, out, orig, limit, length, width: int | None = None):
        """One row: blockwise steps as one native call, the same steps as the Python loop (verify,
        accept, propose) without its per-step overhead; adaptive mode re-decides the width after each run of
        steps (Adaptive.run_length; after every step while probing).
        width: the prefill (x = [[BOS]]): its step comes first in the same call, then blocks of this width.
        Returns (next fed tokens [1,b], done [1]), or None where the native kernels do not run this model."""
        t0 = perf_counter()  # (where no native time comes back, the timing covers this method's bookkeeping too)
        prefill = width is not None
        fed = x.shape[1] if width is None else width
        self.state.lengths = int(length[0])
        steps = int(limit[0])
        ad = self.adapt
        if ad is not None:  # a probe runs 1 step per call, the width the costs chose a run (Adaptive.run_length)
            ad.chunk = ad.run_length() if ad.width(1) == fed else 1
            ad.last_fed, steps = fed, ad.chunk + prefill
        narrows = getattr(self.w, "narrows", False)  # the loop picks each step's width (DecodeOptions.narrow)
        got = self.w.block_steps(
            self.model,
            self.state,
            x[0],
            int(limit[0] - length[0]),
            steps,
            rule=self.native_rule,
            **({"width": width} if prefill else {"width": self.kb} if narrows else {}),
            **self._context(out, orig, length),
        )
        if got is None:
            self.native_block = False
            return None
        toks, nc, nxt, hn, ended = got
        out[orig[0], length[0] : length[0] + toks.shape[0]] = toks
        length += toks.shape[0]
        self.calls += nc.shape[0] - prefill  # the prefill is not a verify call
        self.hist += np.bincount(nc[prefill:, 1], minlength=self.kb + 1)
        done = np.array([ended])
        if self.adapt is not None and nc.shape[0] > prefill:
            self.adapt.update(fed, nc[prefill:, 0], one_row=True)
            self.adapt.timed(fed, 1, self._seconds(t0), nc.shape[0])
        if ended:
            return x, done
        b = self._width(1)
        if b == 1:
            return self.stretch(nxt[None, :1], out, orig, limit, length)
        if b <= fed or narrows:
            return nxt[None, :b], done
        return np.concatenate([nxt[None, :1], self.w.propose(hn[None], 1, b, nxt[:1]).cpu().numpy()], axis=1), done

    def batch_native(self, x, out, orig, limit, length):
        """R > 1 rows: blockwise steps as one native call (DecodeWeights.batch_block_steps) until a row ends,
        at most 16 steps (adaptive too at the width the costs chose, 1 while probing): the Python loop's steps
        without its per-step overhead (numpy bookkeeping, tensor round trips). Returns (next fed tokens [R,b],
        done [R]), or None where the native kernels do not run this model."""
        t0 = perf_counter()
        r, fed = x.shape
        ad = self.adapt
        steps = 16
        if ad is not None:
            ad.chunk = 16 if ad.width(r) == fed else 1
            ad.last_fed, steps = fed, ad.chunk
        self.state.lengths = length
        native = getattr(self.w, "batch_block_steps", None)
        if ad is None and native is not None and self.state.mem_group == 1:
            # a fixed width: every row to its end in one call, finished rows leaving inside it (as greedy's)
            got = native(
                self.model,
                self.state,
                x,
                length,
                limit - length,
                int((limit - length).max()),
                rule=self.native_rule,
                to_end=True,
                **self._context(out, orig, length),
            )
            if got is not None:
                toks, hist, s, cnt = got
                self._write(out, orig, length, toks, cnt)
                self.calls += s
                self.hist[: hist.size] += hist
                return x[:, :1], np.ones(r, dtype=bool)
        got = (
            native(
                self.model,
                self.state,
                x,
                length,
                limit - length,
                steps,
                rule=self.native_rule,
                **self._context(out, orig, length),
            )
            if native is not None
            else None
        )
        if got is None:
            self.native_block = False
            return None
        toks, nc, nxt, hn, ended = got
        self._write(out, orig, length, toks, nc[:, :, 1].sum(1))
        s = nc.shape[1]
        self.calls += s
        self.hist += np.bincount(nc[:, :, 1].ravel(), minlength=self.kb + 1)
        done = ended | (length >= limit)
        if ad is not None and s:
            for j in range(s):
                ad.update(fed, nc[:, j, 0])
            ad.timed(fed, r, self._seconds(t0), s)
        if done.all():
            return nxt, done
        b = self._width(r)
        if b == 1:
            if done.any():  # finished rows leave first (top of the loop); then the stretch
                return nxt[:, :1], done
            return self.stretch(nxt[:, :1], out, orig, limit, length)
        if b <= fed:
            return nxt[:, :b], done
        return np.concatenate([nxt[:, :1], self.w.propose(hn, 1, b, nxt[:, 0]).cpu().numpy()], axis=1), done

    def _context(self, out, orig, length) -> dict:
        """The native loops' `context` argument for prompt lookup: each row's prompt and tokens so far."""
        if self.prompts is None:
            return {}
        return {"context": [np.concatenate([self.prompts[int(o)], out[o, :n]]) for o, n in zip(orig, length)]}

    @staticmethod
    def _write(out, orig, length, toks, cnt) -> None:
        """Rows' gained tokens toks [R,T] (the first cnt[r] of row r) into out after each row's length; length
        advances."""
        cols = np.arange(toks.shape[1])
        keep = cols[None, :] < cnt[:, None]
        out[np.broadcast_to(orig[:, None], keep.shape)[keep], (length[:, None] + cols[None, :])[keep]] = toks[keep]
        length += cnt

    def calibrate(self, memory, limit: np.ndarray, steps: int = 8) -> None:
        """Time every step width once per set of weights and bucket of row counts: `steps` steps of each in the
        native loops on a scratch cache for these rows, best of 5 rounds (2 where a round takes over 5 ms),
        interleaved. Probes alone priced widths badly: a probe is one step after a greedy stretch (cold caches, the
        call around it), timed dearer than a step in a run of steps, and one such timing kept a width out for good (the
        demo's `both` never left greedy steps). A batch is timed as a batch: on a CPU without AMX tiles a k-wide
        step over 32 rows costs about k greedy steps (arithmetic), over one row far less (weight reads).
        Every width starts where decoding mostly is: after CALIB_LEAD of the sentences' own greedy tokens (fewer
        where a token limit is lower), fed head 1's token and the heads' own proposals there, as a probe is. Timed
        from BOS with rejected proposals, a wide step's attention ran over a near-empty cache and its verification
        stopped at the first position, so wide steps looked cheaper than in decoding; timed at half of the first
        sentence's limit, the price depended on that sentence (the demo's `finetune`: a 4-wide step with the draft
        vocabulary priced far dearer from a long first sentence than from a short one)."""
        ad, w, model, kb = self.adapt, self.w, self.model, self.kb
        rows = int(limit.shape[0])
        b = ad.bucket(rows)
        ad.calib_tried.add(b)
        if getattr(w, "native_loop", None) is None or getattr(w, "heads", None) is None:
            return
        lead = max(min(int(limit.min()), CALIB_LEAD), 0)
        st = model.start_decoding(memory, lead + steps * kb + kb + 1, weights=w)
        tok = start_tokens(model, st, rows, self.dev)  # [R,1] BOS / the prompts' last tokens
        room = np.full(rows, 10**6)
        h = None
        if lead:
            st.lengths = 0
            got, h = w.greedy_steps(model, st, tok[:, 0], room, lead, eos=-1)
            if w.last_seconds is None:
                return
            tok = torch.from_numpy(got[:, -1:]).to(self.dev)
        x0 = tok.cpu().numpy()  # [R,1]
        fed = {
            v: np.concatenate([x0, w.propose(h, 1, v, x0[:, 0]).cpu().numpy()], axis=1)
            if h is not None
            else np.repeat(x0, v, axis=1)
            for v in range(2, kb + 1)
        }  # [R,v]
        best: dict[int, float] = {}
        gain, top = ad.gains(), kb
        for rep in range(5):
            if rep >= 2 and sum(best.values()) * steps > 0.005:
                break  # 5 rounds where a round takes < 5 ms (small models, noisy timings), else 2
            for width in range(1, top + 1):
                st.lengths = lead
                if width == 1:
                    w.greedy_steps(model, st, tok[:, 0], room, steps, eos=-1)
                elif rows == 1:
                    if w.block_steps(model, st, fed[width][0], 10**6, steps, eos=-1) is None:
                        return
                else:
                    lengths = np.full(rows, lead, dtype=np.int64)
                    st.lengths = lengths
                    if w.batch_block_steps(model, st, fed[width], lengths, room, steps, eos=-1) is None:
                        return
                t = w.last_seconds
                if t is None:
                    return
                best[width] = min(best.get(width, t), t)
                if rows > 1 and width > 1 and gain[min(width, len(gain)) - 1] * best[1] < ad.BATCH_MARGIN * best[width]:
                    # over several rows a step's cost grows about linearly with its width and the expected tokens
                    # less than linearly: once a width does not pay, no wider one will, and timing them was most
                    # of the calibration (k = 4 at batch 32: widths 3 and 4 are 7 of the 10 greedy-step units)
                    top = width
                    break
        for width, t in best.items():  # (the decoders' own timings of each width are kept apart: see _cost)
            ad.calib[(width, b)] = t / best[1]
        for width in range(top + 1, kb + 1):  # not timed: priced as the last width timed, per proposal
            ad.calib[(width, b)] = ad.calib[(top, b)] * width / top
        ad.calibrated_rows.add(b)
        ad._best.clear()

    def _seconds(self, t0: float) -> float:
        """What the steps just run cost: the native loop's own time where it ran (a probe runs one step per call,
        and the Python call around it, charged to that one step, made every wider step look dearer than it
        is at demo size: adaptive mode then never left greedy), else the time since t0."""
        got = getattr(self.w, "last_seconds", None)
        return got if got is not None else perf_counter() - t0

    def stretch(self, x, out, orig, limit, length):
        """No head pays: plain greedy steps (no heads), then one probe (Adaptive.probe_width) where no row ended.
        x [R,1] the next tokens to feed. Returns (the next fed tokens [R,1 or b], done); length advances."""
        x, h1, length, done = self.greedy_steps(x, out, orig, limit, length, self.adapt.greedy_stretch(x.shape[0]))
        if not done.any():
            w = self.adapt.probe_width(x.shape[0])
            prop = self.w.propose(h1, 1, w, x[:, 0]).cpu().numpy()
            if self.prompts is not None:  # prompt lookup: the probe feeds what the native loops would
                for r, c in enumerate(self._context(out, orig, length)["context"]):
                    got = lookup(c, self.w.options.lookup, w - 1)
                    prop[r, : got.size] = got
            x = np.concatenate([x, prop], axis=1)
        return x, done

    def greedy_steps(self, x, out, orig, limit, length, steps: int):
        """Up to `steps` one-token steps without heads (adaptive mode, while no head pays), stopping after
        the step in which a row ends: the greedy decoder's own loop (DecodeWeights.greedy_steps, one native
        call), so a stretch costs what greedy decoding costs. x [R,1] the last accepted tokens. Returns (x,
        the decoder output of the last step [R,D], length, done)."""
        r = x.shape[0]
        self.state.lengths = int(length[0]) if r == 1 else length
        t0 = perf_counter()
        got, h = self.w.greedy_steps(
            self.model, self.state, torch.from_numpy(x[:, 0]).to(self.dev), limit - length, steps
        )  # [R,s]
        s = got.shape[1]
        out[orig[:, None], length[:, None] + np.arange(s)] = got
        length += s
        self.calls += s
        self.hist[1] += r * s
        self.adapt.timed(1, r, self._seconds(t0), s)
        x = got[:, -1:]
        return x, h, length, is_stop(x[:, 0], self.eos) | (length >= limit)
