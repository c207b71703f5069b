"""Quality and speed metrics: sacrebleu BLEU/chrF with signatures, k̂, agreement, fair wall-clock timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from bpd_train.decoding.result import DecodeStats  # noqa: F401 - re-exported: evaluation's callers import it here
from bpd_train.decoding.text import pad_batch  # noqa: F401 - re-exported
from bpd_train.scoring import corpus_scores, one_line  # noqa: F401 - re-exported: the one scorer


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """% of sentences whose token sequences are identical."""
    if len(a) != len(b):
        raise ValueError(f"cannot compare {len(a)} with {len(b)} outputs")
    if not a:
        return 100.0
    return 100.0 * sum(list(x) == list(y) for x, y in zip(a, b)) / len(a)


def synchronize(device: torch.device | str | None) -> None:
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(dev)


@dataclass
class Timed:
    seconds: float = 0.0  # all timed passes
    results: list = field(default_factory=list)  # the first timed pass's, in batch order
    passes: int = 0


def time_interleaved(
    fns: dict[str, Callable],
    batches: Sequence,
    device=None,
    warmup: int = 1,
    on_batch: Callable[[], None] | None = None,
    min_seconds: float = 0.0,
    max_passes: int = 20,
) -> dict[str, Timed]:
    """Run every fn on every batch, alternating which goes first per batch (so drift, caches and clock boosts hit
    all of them alike), after `warmup` untimed batches each. Returns per-fn total seconds and per-batch results
    (the results of the first timed pass, in batch order). min_seconds: more timed passes over all the batches
    until every fn has run that long in all (at most max_passes): one short pass is too noisy to compare by
    (docs/experiments.md, *Timing noise*)."""
    names = list(fns)
    batches = list(batches)
    with torch.inference_mode():
        for batch in batches[: max(0, warmup)]:
            for n in names:
                fns[n](batch)
        synchronize(device)
        out = {n: Timed() for n in names}
        i = 0
        while True:
            for batch in batches:
                order = names if i % 2 == 0 else names[::-1]
                i += 1
                for n in order:
                    synchronize(device)
                    t0 = time.perf_counter()
                    r = fns[n](batch)
                    synchronize(device)
                    out[n].seconds += time.perf_counter() - t0
                    if out[n].passes == 0:
                        out[n].results.append(r)
                if on_batch is not None and out[names[0]].passes == 0:
                    on_batch()
            for n in names:
                out[n].passes += 1
            if not batches or out[names[0]].passes >= max_passes or min(t.seconds for t in out.values()) >= min_seconds:
                break
    return out
