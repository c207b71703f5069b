"""The cost-aware controller of `blockwise(..., adaptive=True)`: how many proposals to feed each step, from each
head's measured acceptance and the measured cost of a step of that width (decoding/blockwise.py runs the steps)."""

from __future__ import annotations

from collections import deque

import numpy as np


class Adaptive:
    """How many proposals to feed (the block width; 1 = x0 only, a plain greedy step).

    Acceptance: offered/accepted counts per proposal index j over all steps and rows decoded with these weights
    (kept with the model's DecodeWeights, so short sentences decoded one call at a time still learn; halved
    every 4096 offers, so the counts follow the data); a_j = accepted/offered is the rate at which proposal j
    is accepted once proposals 1..j-1 were (optimistic prior: 1 of 1, so every head is tried first).

    Width, cost-aware (threshold None): the width w maximising expected tokens per second, E[w] / cost(w), where
    E[w] = 1 + a_1 + a_1 a_2 + ... (w terms) and cost(w) is the measured time of a w-wide step (verify + the
    next proposals) relative to a greedy step, per bucket of row counts (a k-row step costs little more than a
    1-row one where weight reads dominate, several times more where arithmetic does: small cached models,
    large batches). Widths not yet measured use COST_PRIOR's shape, scaled to what was measured. A width > 1
    must beat greedy by MARGIN (timing noise; BATCH_MARGIN over several rows). Threshold mode (a float): feed
    proposal j while a_1..a_j all reach the threshold (the rule before costs were measured).

    While the width is 1 the decoder runs plain greedy steps (no heads at all, the greedy decoder's own
    native loop) and probes every head once after `interval` of them; the interval doubles after each probe
    that fails (8, 16, ... 64 steps) and starts again at 8 once a head pays. After LONG_AFTER probes in a row
    have failed at the 64-step cap, the cap is 8x that (512 steps): a probe of a width that does not pay costs
    its extra step time, a few % of greedy's speed once every 64 steps and a fraction of that once every 512.
    Each bucket of row counts keeps its own schedule (Probes): at batch 32 a wide
    step costs ~k greedy steps on a CPU without AMX, while the last row of the same batch may gain from it, and
    one schedule shared by both probed the batch every 8 steps whenever the last rows' wide steps paid."""

    COST_PRIOR = (0.5, 0.5)  # cost(w) ~ 1 + 0.5 (w - 1) + 0.5 (proposal pass) until measured: cautious between
    #                            the cheap wide steps of large models and the dear ones of small models
    REFRESH = 512  # steps at width > 1 after which greedy steps are timed again
    MARGIN = 1.15  # a width > 1 must promise 15% more tokens per second than greedy steps: with a
    #                           smaller margin, heads that barely pay (the demo's `frozen`) were fed 2-wide blocks in
    #                           some runs, where the calibration's noise priced them under greedy, and decoded slower
    BATCH_MARGIN = 1.15  # ... 15% over several rows too: rows ending (each a return to Python and a cache reorder)
    #                           and ragged lengths cost the batch loop what a calibration on aligned rows does not
    #                           see (the demo's `self` at 32 rows: 2-wide steps priced a little ahead of greedy left
    #                           the batch behind it)
    FLOOR = 0.05  # a w-wide step costs at least 1 + 0.05 w greedy steps
    LONG_AFTER = 8  # failed probes at the cap after which the cap grows 8x

    def __init__(self, kb: int, threshold: float | None = None, probe: int = 8, max_interval: int = 64):
        self.kb = kb
        self.offered = [1] * kb  # index j: proposal j (index 0 unused)
        self.accepted = [1] * kb
        self.threshold = threshold
        self.probe, self.max_interval = probe, max_interval
        self._probes_by: dict[int, Probes] = {}  # rows bucket -> its probe schedule
        self.seconds: dict[tuple[int, int], float] = {}  # (width, rows bucket) -> seconds per step
        self._times: dict[tuple[int, int], deque] = {}
        self._best: dict[int, int] = {}
        self.chunk, self.last_fed = 1, 0  # native block loop (one row): steps per call, last width
        self.wide_steps = 0  # steps at width > 1 since greedy steps were last timed
        self.calib_tried: set[int] = set()  # rows buckets _Blockwise.calibrate ran for (or gave up on)
        # (width, rows bucket) -> cost in greedy steps from that calibration: widths and greedy timed alike,
        # interleaved. Preferred to the decoders' own timings, which compare unlike steps: greedy stretches
        # right after the encoder (cold caches, dearer than a warm step) against rare wide steps, so
        # every width once looked cheaper than it was and regimes whose heads never pay fed 2-wide blocks
        self.calib: dict[tuple[int, int], float] = {}
        self.calibrated_rows: set[int] = set()
        self._probes = -1  # probes made after every width was timed

    @staticmethod
    def bucket(rows: int) -> int:
        return rows.bit_length()  # 1, 2-3, 4-7, ... rows

    def run_length(self) -> int:
        """Steps per native call at the chosen width (one row), before the width is decided again: 8 until the heads
        were judged 64 times (useless heads are dropped within a few steps), then 32 (at 8 a call, each call's Python and
        cold start made the demo's `self` decode slower than plain blockwise at the same width)."""
        return 32 if self.offered[1] > 64 else 8

    def probes(self, rows: int = 1) -> "Probes":
        """The probe schedule of this bucket of row counts."""
        b = self.bucket(rows)
        got = self._probes_by.get(b)
        if got is None:
            got = self._probes_by[b] = Probes(self.probe)
        return got

    def settled_on_greedy(self, horizon: int, rows: int = 1) -> bool:
        """Whether a call on `rows` rows would run greedy steps only until its first row ends (within `horizon`
        steps): every width was timed for this many rows, none pays, and the next probe is further away than
        `horizon`. blockwise() then runs greedy() itself: the stretch cost the same native calls plus a few % at
        batch 1 (the blockwise loop's bookkeeping, and a cache kb slots longer, whose layout moved greedy's own time
        either way), more at batch 32 (per-row cache writes where greedy's rows stay aligned).
        Rows that leave a batch do not bring the loop back: its last few rows are a small share of its time."""
        return (
            self.threshold is None
            and self.calibrated(self.bucket(rows)) is not None
            and self.width(rows) == 1
            and self.probes(rows).interval >= horizon
        )

    def width(self, rows: int = 1) -> int:
        """Block width to feed next for `rows` rows (1 = x0 only)."""
        b = self.bucket(rows)
        w = self._best.get(b)
        if w is None:
            w = self._best[b] = self._choose(b)
        return w

    def gains(self) -> list[float]:
        """[E[1], E[2], ...]: expected tokens of a w-wide step from the acceptance counts (threshold mode: only the
        widths whose heads all reach the threshold)."""
        rate, chain, gain = 1.0, 1.0, [1.0]
        for j in range(1, self.kb):
            # a head judged fewer than 8 times (its predecessors are rarely accepted) is assumed no better
            # than the one before it, rather than its optimistic prior
            rate = (
                self.accepted[j] / self.offered[j]
                if self.offered[j] >= 8 or j == 1
                else min(rate, self.accepted[j] / self.offered[j])
            )
            if self.threshold is not None and rate < self.threshold:
                break
            chain *= rate
            gain.append(gain[-1] + chain)  # gain[w-1] = E[w]
        return gain

    def calibrated(self, b: int) -> int | None:
        """The bucket whose calibration prices steps over rows of bucket b: b itself, or for several rows the nearest
        larger calibrated bucket (a batch's rows leave as they end, and a batch of 16 after batches of 32 would
        otherwise pay a calibration of its own, as long as a pass over the sentences at batch 32). A wide
        step over fewer rows costs at most as many greedy steps as over more rows, so the borrowed price is a
        cautious one."""
        if b in self.calibrated_rows:
            return b
        if b > 1:
            return min((c for c in self.calibrated_rows if c > b), default=None)
        return None

    def _choose(self, b: int) -> int:
        gain = self.gains()
        if self.threshold is not None:
            return len(gain)
        if self.calibrated(b) is None and (
            self.wide_steps > self.REFRESH or (1, b) not in self.seconds and self.wide_steps > self.REFRESH // 8
        ):
            return 1  # time greedy steps again (a stale or missing greedy cost could lock wider steps in)
        best, best_rate = 1, self.MARGIN if b == 1 else self.BATCH_MARGIN
        for w in range(2, len(gain) + 1):
            r = gain[w - 1] / self.cost(w, b)
            if r > best_rate:
                best, best_rate = w, r
        return best

    def _prior(self, w: int) -> float:
        return 1.0 + self.COST_PRIOR[0] * (w - 1) + self.COST_PRIOR[1] if w > 1 else 1.0

    def cost(self, w: int, b: int) -> float:
        """A w-wide step in greedy steps (measured, or the prior scaled to the nearest measured width), never
        under FLOOR: where a step is all overhead (tiny models) a timing would call extra rows free, and
        proposals almost never accepted would be fed for ever."""
        return max(self._cost(w, b), 1.0 + self.FLOOR * w)

    def _cost(self, w: int, b: int) -> float:
        c = self.calibrated(b)
        got = self.calib.get((w, c)) if c is not None else None
        if got is not None:
            # the calibration alone: the decoders' own timings compare unlike steps (a probe is one step after a
            # greedy stretch, the heads' weights cold; wide runs and greedy stretches sit at other positions)
            return got
        one = self.seconds.get((1, b))
        if one is None:
            return self._prior(w)
        got = self.seconds.get((w, b))
        if got is not None:
            return got / one
        near = [v for v in range(2, self.kb + 1) if (v, b) in self.seconds]
        if not near:
            return self._prior(w)
        v = min(near, key=lambda v: abs(v - w))
        return 1.0 + (self.seconds[(v, b)] / one - 1.0) * (self._prior(w) - 1.0) / (self._prior(v) - 1.0)

    def timed(self, width: int, rows: int, seconds: float, steps: int = 1) -> None:
        """Record `steps` steps of `width` over `rows` rows that took `seconds` in all. A width's cost is the
        least time per step over its last 16 records: other work on the machine only ever adds time, and a
        width that is no longer run keeps a cost that noise did not inflate (an average would keep a spike
        and, for greedy steps, lock the decoder into wider steps that only looked cheaper)."""
        key = (width, self.bucket(rows))
        if width == 1:
            self.wide_steps = 0
            if steps < 8 and key in self._times:
                # a short stretch (a row ended) charges the call's fixed cost to a few steps: greedy would
                # look dear and wider steps would be chosen on that (and stay: no stretch, no new timing)
                return
        else:
            self.wide_steps += steps
        got = self._times.get(key)
        if got is None:
            got = self._times[key] = deque(maxlen=16)
        got.append(seconds / steps)
        least = min(got)
        if self.seconds.get(key) != least:  # widths are re-chosen only when a cost changed
            self.seconds[key] = least
            self._best.clear()

    def update(self, fed: int, n: np.ndarray, one_row: bool = False) -> None:
        """fed block width, n [R] proposals accepted per row (one_row: one row's, per step)."""
        if fed > 1:
            if one_row or n.shape[0] == 1:
                for a in np.atleast_1d(n).tolist():  # proposal j was judged only if j-1 were accepted
                    for j in range(1, min(a + 2, fed)):
                        self.offered[j] += 1
                    for j in range(1, a + 1):
                        self.accepted[j] += 1
            else:
                at_least = np.bincount(n, minlength=fed)[::-1].cumsum()[::-1]  # [j]: rows with n >= j
                for j in range(1, fed):
                    self.offered[j] += int(at_least[j - 1])
                    self.accepted[j] += int(at_least[j])
            if self.offered[1] > 4096:
                self.offered = [max(o // 2, 1) for o in self.offered]
                self.accepted = [min(a // 2, o) for a, o in zip(self.accepted, self.offered)]
            self._best.clear()
            rows = 1 if one_row else n.shape[0]
            if self.width(rows) > 1:
                self.probes(rows).reset(self.probe)

    def greedy_stretch(self, rows: int = 1) -> int:
        """Greedy steps to run on `rows` rows before the next probe (and back off for the one after)."""
        return self.probes(rows).stretch(self.max_interval, self.LONG_AFTER)

    def probe_width(self, rows: int) -> int:
        """Width of the next probe: widths not yet timed first, then every width in turn. Probing only the full
        width left narrower ones priced by extrapolation from one noisy timing: on the demo's `both` a 2-wide
        step that would have paid was never tried, and adaptive mode ran greedy throughout."""
        if self.threshold is not None:
            return self.kb
        b = self.bucket(rows)
        for w in range(2, self.kb + 1):
            if (w, b) not in self.seconds:
                return w
        self._probes += 1
        return 2 + self._probes % (self.kb - 1)


class Probes:
    """One bucket's probe schedule: greedy steps before the next probe (`interval`), and how many stretches in a
    row ran with the interval at its cap (`failed_at_cap`)."""

    __slots__ = ("interval", "failed_at_cap")

    def __init__(self, first: int):
        self.interval, self.failed_at_cap = first, 0

    def reset(self, first: int) -> None:
        """A head pays: probe again soon."""
        self.interval, self.failed_at_cap = first, 0

    def stretch(self, cap: int, long_after: int) -> int:
        """The next stretch's length; the one after is twice as long, up to `cap` (8x `cap` after `long_after`
        stretches at it)."""
        n = self.interval
        if n >= cap:
            self.failed_at_cap += 1
        self.interval = min(2 * n, cap * (8 if self.failed_at_cap > long_after else 1))
        return n
