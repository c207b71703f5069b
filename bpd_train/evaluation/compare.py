"""Greedy vs blockwise on the same batches, timed interleaved: the one comparison that evaluate.py
(evaluation/runner.py) and the in-training callback (evaluation/callback.py) both report from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from bpd_train.data.sampler import length_batches
from bpd_train.decoding import blockwise, greedy, sample, speculative_sample
from bpd_train.engine.weights import PackedWeights
from bpd_train.evaluation.metrics import DecodeStats, agreement, pad_batch, time_interleaved


@dataclass
class Decoded:
    tokens: list[list[int]]  # one per source, in the sources' order
    stats: DecodeStats
    seconds: float  # timed batches only (after warm-up), every timed pass
    passes: int = 1  # timed passes over the batches (stats and tokens: the first)


@dataclass
class Comparison:
    greedy: Decoded
    blockwise: Decoded | None  # None: greedy only (a model without heads, or k = 1)
    adaptive: Decoded | None = None  # blockwise with adaptive feeding too (compare(..., also_adaptive=True))

    @property
    def speedup(self) -> float:
        return self._over(self.blockwise)

    @property
    def adaptive_speedup(self) -> float | None:
        return None if self.adaptive is None else self._over(self.adaptive)

    def _over(self, d: Decoded | None) -> float:
        if d is None:
            return 1.0
        return self.greedy.seconds / d.seconds if d.seconds > 0 else float("nan")

    @property
    def agreement(self) -> float:
        """% of sentences where blockwise gave greedy's exact tokens (100 by definition without blockwise)."""
        return agreement((self.blockwise or self.greedy).tokens, self.greedy.tokens)


@dataclass
class Batches:
    """Sources grouped by length (decoding.length_batches) and padded once, reused by every decoder compared."""

    groups: list[list[int]]
    tensors: list
    n: int

    @classmethod
    def of(cls, src_ids: Sequence[Sequence[int]], batch_size: int, pad_id: int, device=None) -> "Batches":
        groups = length_batches([len(s) for s in src_ids], batch_size)
        return cls(groups, [pad_batch([src_ids[i] for i in g], pad_id, device) for g in groups], len(src_ids))

    def scatter(self, results: list) -> list[list[int]]:
        tokens: list = [None] * self.n
        for g, r in zip(self.groups, results):
            for i, t in zip(g, r.tokens):
                tokens[i] = [int(x) for x in t]
        return tokens


def compare(
    model,
    batches: Batches,
    *,
    k: int | None,
    rule,
    max_len,
    device=None,
    warmup: int = 1,
    adaptive: bool | float = False,
    also_adaptive: bool = False,
    on_batch: Callable[[], None] | None = None,
    min_seconds: float = 0.0,
    sampling: dict | None = None,
    weights: PackedWeights | None = None,
) -> Comparison:
    """Greedy and (when k > 1) blockwise with block size k and acceptance `rule` on every batch, alternating
    which runs first (metrics.time_interleaved), so the speedup is a ratio measured in one run. also_adaptive:
    blockwise with adaptive feeding as a third decoder in the same interleaved run (what the serving paths run on
    the CPU with exact acceptance: decoding/settings.py DecodeSettings.adaptive_on). min_seconds: timed passes over the batches
    until each decoder ran that long (metrics.time_interleaved).
    sampling: {temperature, top_k, top_p, seed, verify} with temperature > 0: plain sampling takes greedy's place
    and blockwise sampling blockwise's (decoding/speculative.py; the rule is not used), source i seeded seed + i in
    both; with verify "match" on the native loops their tokens are the same, with "speculative" they differ (the
    same distribution, other draws).
    weights: the decoder's packed-weight cache (decoding/serving.py Decoder.weights: its decode options), shared by
    every decoder compared (None: the model's default, fp32)."""
    if sampling:
        s = dict(sampling)
        return _compare_sampling(model, batches, k, max_len, device, warmup, on_batch, min_seconds, s, weights)
    fns = {"greedy": lambda src: greedy(model, src, max_len=max_len, weights=weights)}
    if k is not None and k > 1:
        fns["blockwise"] = lambda src: blockwise(
            model, src, block_size=k, accept=rule, max_len=max_len, adaptive=adaptive, weights=weights
        )
        if also_adaptive:
            fns["adaptive"] = lambda src: blockwise(
                model, src, block_size=k, accept=rule, max_len=max_len, adaptive=True, weights=weights
            )
    out = _timed(fns, batches, device, warmup, on_batch, min_seconds)
    return Comparison(out["greedy"], out.get("blockwise"), out.get("adaptive"))


def _timed(fns, batches, device, warmup, on_batch, min_seconds) -> dict:
    """name -> Decoded: the decoders timed interleaved over the batches, outputs back in input order."""
    timed = time_interleaved(fns, batches.tensors, device, warmup=warmup, on_batch=on_batch, min_seconds=min_seconds)
    out = {}
    for name, t in timed.items():
        stats = DecodeStats()
        for r in t.results:
            stats.add(r)
        out[name] = Decoded(batches.scatter(t.results), stats, t.seconds, t.passes)
    return out


def _compare_sampling(
    model, batches, k, max_len, device, warmup, on_batch, min_seconds, s: dict, weights
) -> Comparison:
    seed = int(s.pop("seed", 0))
    verify = s.pop("verify", "match")
    s["weights"] = weights
    seeds = {id(t): [seed + i for i in g] for g, t in zip(batches.groups, batches.tensors)}
    fns = {"greedy": lambda src: sample(model, src, max_len=max_len, row_seeds=seeds[id(src)], **s)}
    if k is not None and k > 1:
        fns["blockwise"] = lambda src: speculative_sample(
            model, src, block_size=k, max_len=max_len, row_seeds=seeds[id(src)], verify=verify, **s
        )
    out = _timed(fns, batches, device, warmup, on_batch, min_seconds)
    return Comparison(out["greedy"], out.get("blockwise"))


def greedy_tokens(
    model,
    batches: Batches,
    *,
    max_len,
    on_batch: Callable[[], None] | None = None,
    weights: PackedWeights | None = None,
) -> list[list[int]]:
    """Greedy decoding of every batch, untimed: the output whose BLEU evaluate.py reports over more sentences than
    it times (evaluate.bleu_sentences). Exact blockwise output is this output, token for token."""
    import torch

    results = []
    with torch.inference_mode():
        for src in batches.tensors:
            results.append(greedy(model, src, max_len=max_len, weights=weights))
            if on_batch is not None:
                on_batch()
    return batches.scatter(results)
