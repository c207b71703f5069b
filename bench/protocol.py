"""One timing protocol for every engine the real-model bench compares, ours and its peers alike.

measure() takes engines (name -> a function that decodes one unit of work: one request at batch 1, or one batch of
requests) and the units, then
  1. warms every engine up with one full untimed pass over every unit (interleaved as the timed passes are),
  2. times `reps` >= 3 passes; within a pass the engines take turns unit by unit, the first engine rotating from
     unit to unit, so no engine always runs first or after the same neighbour, and a slow minute of the machine
     falls on every engine alike,
and keeps every (rep, unit) time. Engines on an asynchronous device (CUDA) pass `sync`: it is called before and
after every timed call, so the clock reads finished work only. Summaries are medians with their spread: tokens/s
per pass (median over reps, min-max beside it), and speedups as the median over units of each unit's rate ratio
(its median over reps), with the quartiles and min-max. Nothing here picks a best rep.

Prompt caches are the engines' business and the bench states its policy: each engine instance keeps its own (our
prefix cache, llama.cpp's prompt cache), so with passes in the same order every engine sees every prompt after the
same previous prompt.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

MIN_REPS = 3


@dataclass
class Run:
    """What one engine returned for one unit: the generated ids of each request in it, its decoder calls after
    the prefill (0 where the engine does not say, e.g. llama.cpp), and where it says, its row steps by the tokens
    each added (tokens -> steps: the decoder's accepted_hist)."""

    tokens: list[list[int]]
    calls: int = 0
    accepted: dict[int, int] | None = None


Engine = Callable[[Any], Run]


@dataclass
class Timing:
    """One engine's timed passes: seconds[rep][unit]; its outputs per unit (from the first timed pass); whether
    every pass (warm-up included) gave the same outputs."""

    name: str
    seconds: list[list[float]] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    stable: bool = True

    @property
    def tokens(self) -> list[list[int]]:
        """Every request's ids, in unit order."""
        return [t for r in self.runs for t in r.tokens]

    def unit_tokens(self, unit: int) -> int:
        return sum(len(t) for t in self.runs[unit].tokens)

    @property
    def n_tokens(self) -> int:
        return sum(self.unit_tokens(i) for i in range(len(self.runs)))

    @property
    def calls(self) -> int:
        return sum(r.calls for r in self.runs)


def measure(
    engines: dict[str, Engine],
    units: Sequence[Any],
    reps: int = MIN_REPS,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[str], None] | None = None,
    sync: Callable[[], None] | None = None,
) -> dict[str, Timing]:
    """Time every engine over the same units under the protocol above; returns name -> Timing."""
    if reps < MIN_REPS:
        raise ValueError(f"reps={reps}: the protocol times at least {MIN_REPS} passes (a median needs them)")
    if not engines or not units:
        raise ValueError("measure() needs at least one engine and one unit")
    names = list(engines)
    done = sync if sync is not None else (lambda: None)
    out = {n: Timing(n) for n in names}
    first: dict[str, list[Run]] = {n: [] for n in names}

    def order(pass_no: int, unit: int) -> list[str]:
        s = (pass_no * len(units) + unit) % len(names)
        return names[s:] + names[:s]

    for i, u in enumerate(units):  # the warm-up pass: untimed, interleaved like the rest
        for n in order(0, i):
            first[n].append(engines[n](u))
    for rep in range(reps):
        for n in names:
            out[n].seconds.append([0.0] * len(units))
        for i, u in enumerate(units):
            for n in order(rep + 1, i):
                done()  # no work queued before this call lands in its time
                t0 = clock()
                r = engines[n](u)
                done()  # the clock reads the call's work finished, not merely queued
                out[n].seconds[rep][i] = clock() - t0
                if rep == 0:
                    out[n].runs.append(r)
                if r.tokens != first[n][i].tokens:
                    out[n].stable = False
        if progress is not None:
            progress(f"pass {rep + 1}/{reps}")
    return out


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median with quartiles and min-max (the quartiles by the inclusive method; one value: all equal)."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": xs[0], "max": xs[-1]}


def tok_s(t: Timing) -> dict[str, float]:
    """Tokens/s of each pass (all units), median over passes with the spread."""
    return spread([t.n_tokens / sum(rep) for rep in t.seconds])


def unit_rates(t: Timing) -> list[float]:
    """Each unit's tokens/s from its median time over passes."""
    return [t.unit_tokens(i) / statistics.median(rep[i] for rep in t.seconds) for i in range(len(t.runs))]


def speedup(base: Timing, t: Timing) -> dict[str, float]:
    """t's speed over base's: the median over units of each unit's rate ratio (rates, not times, so engines whose
    answers differ in length compare fairly), with the spread over units; units where either side generated
    nothing are left out."""
    pairs = [(a, b) for a, b in zip(unit_rates(base), unit_rates(t)) if a > 0 and b > 0]
    if not pairs:
        raise ValueError(f"{base.name} / {t.name}: no unit generated any token")
    return spread([b / a for a, b in pairs])


def pass_speedup(base: Timing, t: Timing) -> dict[str, float]:
    """t's speed over base's for whole passes (tokens/s of a pass over the other's in the same pass)."""
    return spread([(t.n_tokens / sum(b)) / (base.n_tokens / sum(a)) for a, b in zip(base.seconds, t.seconds)])


def step_cost(greedy: Timing, t: Timing) -> dict[str, float]:
    """What one of t's decoder calls costs in greedy calls, per pass: (t's seconds / its calls) over (greedy's
    seconds / its calls), median over passes with the spread."""
    return spread([(sum(b) / t.calls) / (sum(a) / greedy.calls) for a, b in zip(greedy.seconds, t.seconds)])


def k_hat(t: Timing) -> float | None:
    """Tokens per decoder call after the prefill (None where the engine reports no calls)."""
    return t.n_tokens / t.calls if t.calls else None


def mean_accepted(t: Timing) -> float | None:
    """Tokens a row step added, on average over every row step of every unit (None where a unit's engine did not
    say): at batch 1 the mean accepted block, at any batch size per row rather than per batched call as k-hat."""
    if not t.runs or any(r.accepted is None for r in t.runs):
        return None
    steps = sum(c for r in t.runs for c in r.accepted.values())
    return sum(n * c for r in t.runs for n, c in r.accepted.items()) / steps if steps else None


def matches(a: Timing | list[list[int]], b: Timing | list[list[int]]) -> tuple[int, int]:
    """(requests whose ids agree, requests): every request's ids compared whole."""
    ta = a.tokens if isinstance(a, Timing) else a
    tb = b.tokens if isinstance(b, Timing) else b
    if len(ta) != len(tb):
        raise ValueError(f"{len(ta)} against {len(tb)} requests")
    return sum(x == y for x, y in zip(ta, tb)), len(ta)
