"""Run a DecodeSettings over texts: the one decode path of Translator, the translate command line and the evaluator.

decoder = prepare(model, tokenizer, settings, device)   # block size checked, decode options and packed weights
out = decode_texts(decoder, text, sources)              # text: the family's adapter (decoding/text.py)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from bpd_train import decoding
from bpd_train.data.sampler import length_batches
from bpd_train.decoding.acceptance import AcceptanceRule
from bpd_train.decoding.common import stop_ids
from bpd_train.decoding.result import DecodeResult, DecodeStats
from bpd_train.decoding.settings import (
    DecodeError,
    DecodeSettings,
    decode_options,
    packed_weights,
    parse_rule,
    resolve_dtype,
)
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights


@dataclass(frozen=True)
class Decoder:
    """A DecodeSettings resolved for one model on one device (see `prepare`); call it on a padded source batch. It
    owns the decode state the model does not carry: the engine's DecodeOptions and the weights packed for them
    (`weights`, handed to greedy / blockwise / sampling on every call)."""

    model: torch.nn.Module
    settings: DecodeSettings
    device: torch.device
    k: int  # the block size blockwise decoding runs with
    adaptive: bool | float  # adaptive feeding as resolved for the device
    rule: AcceptanceRule  # the settings' acceptance rule
    weights: PackedWeights  # the decode options and the packed-weight cache
    precision: str | None = None  # where the settings' dtype was "auto": the line saying which precision and why

    @property
    def options(self) -> DecodeOptions:
        """The engine's DecodeOptions (derived from the settings for this tokenizer and device)."""
        return self.weights.options

    @property
    def blockwise(self) -> bool:
        """Blockwise decoding (a model with heads, method blockwise); else greedy."""
        return self.settings.method == "blockwise" and self.k > 1

    @property
    def label(self) -> str:
        """How it decodes, as reports and the command line's summary name it."""
        s = self.settings
        if s.sampling:
            how = f"T={s.temperature:g}" + (f" top_k={s.top_k}" if s.top_k else "")
            how += (f" top_p={s.top_p:g}" if s.top_p < 1 else "") + f" seed={s.seed}"
            if not self.blockwise:
                return f"sampling {how}"
            return f"blockwise sampling k={self.k} {how} verify={s.verify}" + (" adaptive" if self.adaptive else "")
        if not self.blockwise:
            return "greedy"
        return f"blockwise k={self.k} {self.settings.accept_label}{' adaptive' if self.adaptive else ''}"

    def __call__(self, src, row_seeds: Sequence[int] | None = None) -> DecodeResult:
        """Decode a padded source batch. row_seeds (sampling): each row's generator seed (default: the settings'
        seed + row index); decode_texts gives seed + each source's index among the inputs."""
        s = self.settings
        if s.sampling:  # blockwise sampling keeps plain sampling's distribution (decoding/speculative.py)
            kw = dict(max_len=s.max_len, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
            kw["weights"] = self.weights
            # match verification returns plain sampling's tokens, so adaptive feeding may sample a batch plainly:
            # blockwise sampling paid at batch 1 only (docs/decoder-only.md, "Sampling")
            plain_batch = s.verify == "match" and bool(self.adaptive) and src.shape[0] > 1
            if self.blockwise and not plain_batch:
                return decoding.speculative_sample(
                    self.model, src, block_size=self.k, row_seeds=row_seeds, verify=s.verify, **kw
                )
            return decoding.sample(self.model, src, row_seeds=row_seeds, **kw)
        if self.blockwise:  # (looked up on the package: tests watch the decoders there)
            return decoding.blockwise(
                self.model,
                src,
                block_size=self.k,
                accept=self.rule,
                max_len=s.max_len,
                adaptive=self.adaptive,
                weights=self.weights,
            )
        return decoding.greedy(self.model, src, max_len=s.max_len, weights=self.weights)


def prepare(
    model,
    tokenizer,
    settings: DecodeSettings,
    device,
    where: str = "this model",
    reuse: Decoder | None = None,
    weight_type: str | None = None,
) -> Decoder:
    """Check `settings` against the model (block size at most its k), resolve its decode options (dtype "auto" for
    the model's `weight_type` -- a GGUF file's, LoadedModel.weight_type -- and this device; draft vocabulary and
    proposal precision for this tokenizer and device) and pack the weights for them: the decoder of `model` that
    owns both. `where` names the model in errors. `reuse`: an earlier decoder of this model, whose packed weights
    are kept where the options are the same (a Translator's calls; the weights are checked against the model's
    parameters all the same)."""
    settings, precision = resolve_dtype(settings, weight_type, device)
    k = settings.k(int(model.config.block_size), where)
    options = decode_options(settings, tokenizer, stop_ids(model), device)
    if reuse is not None and reuse.model is model and reuse.options == options:
        weights = reuse.weights
    else:
        weights = packed_weights(model, options)
    adaptive = settings.adaptive_on(device)
    return Decoder(model, settings, torch.device(device), k, adaptive, parse_rule(settings.accept), weights, precision)


def answer(settings: DecodeSettings, text, ids: Sequence[int]) -> tuple[str, list[int]]:
    """One source's answer as every front end gives it (Translator, the translate command line, the evaluator's
    hypotheses): the adapter's text of the generated `ids`, its ends trimmed and its line breaks kept, and the ids;
    with `settings.stop`, the text ends before the first stop string and the ids at the token that completes it."""
    out = text.detok(ids)
    cut = min((i for i in (out.find(s) for s in settings.stop) if i >= 0), default=-1)
    if cut < 0:
        return out.strip(), list(ids)
    n = next((n for n in range(1, len(ids)) if any(s in text.detok(ids[:n]) for s in settings.stop)), len(ids))
    return out[:cut].strip(), list(ids[:n])


@dataclass
class Decoded:
    """decode_texts's answer: one text and one id list per source, in input order."""

    texts: list[str]
    tokens: list[list[int]]
    stats: DecodeStats  # decoder calls, k̂ and tokens over every batch
    seconds: float  # time spent decoding (CUDA synchronised), tokenizing excluded


def decode_texts(
    decoder: Decoder,
    text,
    sources: Sequence,
    stats: DecodeStats | None = None,
    where: Callable[[int], str] | None = None,
    first: int = 0,
) -> Decoded:
    """Decode `sources` (sentences, prompts or chats, as the text adapter reads them) in batches of the settings'
    batch size, grouped by length. None or a blank string gives an empty output. `stats`: added to (and returned);
    `where(i)`: names source i in the error a source that cannot be read gives (e.g. "line 3"). Sampling: source i
    draws from its own generator seeded settings.seed + first + i, whatever the batches (`first`: the index of
    sources[0] in a longer input that comes in parts, as the command line's chunks do)."""
    device = decoder.device
    ids = {}
    for i, s in enumerate(sources):
        if s is None or (isinstance(s, str) and not s.strip()):
            continue
        try:
            ids[i] = text.source_ids(s)
        except ValueError as e:
            if where is None:
                raise
            raise DecodeError(f"{where(i)}: {e}") from None
    todo = list(ids)
    out_text, out_tokens = [""] * len(sources), [[] for _ in sources]
    stats = DecodeStats() if stats is None else stats
    seconds = 0.0
    with torch.inference_mode():
        for group in length_batches([len(ids[i]) for i in todo], decoder.settings.batch_size):
            rows = [todo[j] for j in group]
            src = text.batch([ids[i] for i in rows], device)
            t0 = time.perf_counter()
            seeds = [decoder.settings.seed + first + i for i in rows] if decoder.settings.sampling else None
            r = decoder(src) if seeds is None else decoder(src, row_seeds=seeds)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds += time.perf_counter() - t0
            stats.add(r)
            for i, toks in zip(rows, r.tokens):  # line breaks kept (a line-per-input writer flattens)
                out_text[i], out_tokens[i] = answer(decoder.settings, text, toks)
    return Decoded(out_text, out_tokens, stats, seconds)
