"""What every decoder returns."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # one per source row, without BOS/EOS, cut at the first EOS
    calls: int  # batched decoder invocations after the prefill call
    prefill_calls: int = 1  # decoder invocations before the first proposal/verify step
    mean_accepted: float = 1.0  # k̂: tokens produced by the post-prefill calls / row-steps (= mean of accepted_hist)
    accepted_hist: dict[int, int] = field(default_factory=dict)  # tokens accepted in one row-step -> count
    scores: list[float] | None = None  # beam search: length-normalised log-probability of each returned hypothesis

    @property
    def row_steps(self) -> int:
        """Decoder calls summed over rows (each row counts the calls it took part in)."""
        return sum(self.accepted_hist.values())

    @staticmethod
    def merge(results: "list[DecodeResult]") -> "DecodeResult":
        """Concatenate results of several batches; k̂ is re-derived from the merged histogram."""
        hist: dict[int, int] = {}
        for r in results:
            for size, count in r.accepted_hist.items():
                hist[size] = hist.get(size, 0) + count
        steps = sum(hist.values())
        scores = None
        if results and all(r.scores is not None for r in results):
            scores = [s for r in results for s in r.scores]
        return DecodeResult(
            tokens=[t for r in results for t in r.tokens],
            calls=sum(r.calls for r in results),
            prefill_calls=sum(r.prefill_calls for r in results),
            mean_accepted=(sum(s * c for s, c in hist.items()) / steps) if steps else 1.0,
            accepted_hist=dict(sorted(hist.items())),
            scores=scores,
        )


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
        return {
            "calls": self.calls,
            "prefill_calls": self.prefill_calls,
            "mean_accepted": self.mean_accepted,
            "accepted_hist": {str(k): v for k, v in sorted(self.hist.items())},
            "sentences": self.sentences,
            "tokens": self.tokens,
        }
