"""Quality and speed metrics: sacrebleu BLEU/chrF with signatures, k̂, agreement, fair wall-clock timing."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch


def one_line(text: str) -> str:
    """Hypothesis/reference files hold one sentence per line: no line breaks inside, no surrounding spaces
    (the sacrebleu CLI strips them too), so the files score exactly like the in-memory lists."""
    return " ".join(str(text).splitlines()).strip()


def corpus_scores(hyps: Sequence[str], refs: Sequence[str]) -> dict:
    """BLEU and chrF on detokenized text (sacrebleu defaults: 13a tokenization, mixed case) + their signatures."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    hyps = [one_line(h) for h in hyps]
    refs = [one_line(r) for r in refs]
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(hyps, [refs])
    c = chrf.corpus_score(hyps, [refs])
    return {"bleu": float(b.score), "chrf": float(c.score), "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()), "bleu_detail": str(b)}


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """% of sentences whose token sequences are identical."""
    if len(a) != len(b):
        raise ValueError(f"cannot compare {len(a)} with {len(b)} outputs")
    if not a:
        return 100.0
    return 100.0 * sum(list(x) == list(y) for x, y in zip(a, b)) / len(a)


@dataclass
class DecodeStats:
    """Accumulates DecodeResults over batches. k̂ counts per-row accepted blocks (from accepted_hist when the
    decoder reports it, else tokens/calls), decoder calls exclude the encoder and the prefill call."""

    calls: int = 0
    prefill_calls: int = 0
    hist: Counter = field(default_factory=Counter)
    generated: float = 0.0
    sentences: int = 0
    tokens: int = 0

    def add(self, r) -> None:
        calls = int(getattr(r, "calls", 0) or 0)
        self.calls += calls
        self.prefill_calls += int(getattr(r, "prefill_calls", 0) or 0)
        hist = getattr(r, "accepted_hist", None) or {}
        self.hist.update({int(k): int(v) for k, v in hist.items()})
        self.generated += float(getattr(r, "mean_accepted", 0.0) or 0.0) * calls
        self.sentences += len(r.tokens)
        self.tokens += sum(len(t) for t in r.tokens)

    @property
    def mean_accepted(self) -> float:
        if self.hist:
            n = sum(self.hist.values())
            return sum(k * v for k, v in self.hist.items()) / n if n else 0.0
        return self.generated / self.calls if self.calls else 0.0

    def to_dict(self) -> dict:
        return {"calls": self.calls, "prefill_calls": self.prefill_calls, "mean_accepted": self.mean_accepted,
                "accepted_hist": {str(k): v for k, v in sorted(self.hist.items())}, "sentences": self.sentences,
                "tokens": self.tokens}


def synchronize(device: torch.device | str | None) -> None:
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(dev)


@dataclass
class Timed:
    seconds: float = 0.0       # all timed passes
    results: list = field(default_factory=list)   # the first timed pass's, in batch order
    passes: int = 0


def time_interleaved(fns: dict[str, Callable], batches: Sequence, device=None, warmup: int = 1,
                     on_batch: Callable[[], None] | None = None, min_seconds: float = 0.0,
                     max_passes: int = 20) -> dict[str, Timed]:
    """Run every fn on every batch, alternating which goes first per batch (so drift, caches and clock boosts hit
    all of them alike), after `warmup` untimed batches each. Returns per-fn total seconds and per-batch results
    (the results of the first timed pass, in batch order). min_seconds: more timed passes over all the batches
    until every fn has run that long in all (at most max_passes): a pass over 80 sentences at batch 32 takes
    ~0.15 s at demo size, where one pass's ratio moved by 20% between runs."""
    names = list(fns)
    batches = list(batches)
    with torch.inference_mode():
        for batch in batches[:max(0, warmup)]:
            for n in names:
                fns[n](batch)
        synchronize(device)
        out = {n: Timed() for n in names}
        i = 0
        while True:
            for j, batch in enumerate(batches):
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
            if not batches or out[names[0]].passes >= max_passes or \
                    min(t.seconds for t in out.values()) >= min_seconds:
                break
    return out


def pad_batch(seqs: Iterable[Sequence[int]], pad_id: int, device=None) -> torch.Tensor:
    seqs = [list(s) for s in seqs]
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), max(width, 1)), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device) if device is not None else out
