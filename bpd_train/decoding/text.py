"""Texts in and out of the decoders: a family's text adapter turns a source (a sentence, a prompt or a chat) into
ids and generated ids back into text (SpmText: encoder-decoder models; LMText: decoder-only models)."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from bpd_train.data.lm.processing import CONTEXT_POLICIES, LMDataError, prompt_of, translation_prompt
from bpd_train.decoding.settings import DecodeError
from bpd_train.scoring import one_line  # noqa: F401 - re-exported: the decoders' callers import it here


def pad_batch(seqs: Iterable[Sequence[int]], pad_id: int, device=None) -> torch.Tensor:
    """Id lists -> a right-padded LongTensor [B, S] (S >= 1), on `device` when given."""
    seqs = [list(s) for s in seqs]
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), max(width, 1)), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device) if device is not None else out


class SpmText:
    """Source ids and detokenized output from a sentencepiece processor (what every checkpoint and bundle carries).
    Sources are the pieces followed by EOS, as bpd_train.data.encode_source makes them."""

    def __init__(self, sp, eos_id: int, pad_id: int, max_positions: int | None = None):
        self.sp, self.eos_id, self.pad_id, self.max_positions = sp, eos_id, pad_id, max_positions
        self.truncated = 0

    def source_ids(self, text: str) -> list[int]:
        ids = list(self.sp.encode(text, out_type=int))
        if self.max_positions is not None and len(ids) + 1 > self.max_positions:
            ids = ids[: self.max_positions - 1]
            self.truncated += 1
        return ids + [self.eos_id]

    def detok(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def batch(self, ids: Sequence[Sequence[int]], device=None):
        return pad_batch(ids, self.pad_id, device)


class LMText:
    """SpmText's interface for a decoder-only model. A source is a text or a chat:
      a text      its prompt-format translation prompt ("English: ...\nFrench:", data/lm/processing.py) when languages
                  are given, else the prompt itself (prompt/response records, the generate CLI)
      a chat      a list of {"role", "content"} messages (evaluation on `messages` records; the CLI's --chat),
                  rendered with the tokenizer's chat template (a trailing assistant message is the reference, not
                  prompted); no template: a DecodeError
    A prompt longer than the context (room for one generated token) keeps its newest tokens (after BOS), counted
    in `truncated`, or with context_policy="refuse" is a DecodeError."""

    def __init__(
        self, tok, src_lang: str | None, tgt_lang: str | None, max_positions: int, context_policy: str = "truncate_left"
    ):
        if context_policy not in CONTEXT_POLICIES:
            raise DecodeError(f"context policy must be one of {', '.join(CONTEXT_POLICIES)}, got {context_policy!r}")
        self.sp, self.src_lang, self.tgt_lang, self.max_positions = tok, src_lang, tgt_lang, max_positions
        self.context_policy = context_policy
        self.pad_id = -1
        self.truncated = 0

    def source_ids(self, source: str | Sequence[dict]) -> list[int]:
        if isinstance(source, str):
            prompt = (
                translation_prompt(source, self.src_lang, self.tgt_lang) if self.src_lang and self.tgt_lang else source
            )
            ids = list(self.sp.encode(prompt))
        else:
            try:
                prompt, _ = prompt_of({"messages": list(source)}, self.sp, where="chat")
            except LMDataError as e:
                raise DecodeError(str(e)) from None
            ids = list(self.sp.encode(prompt, add_special_tokens=False))  # the template wrote the specials
        room = self.max_positions - 1
        if len(ids) > room:
            if self.context_policy == "refuse":
                raise DecodeError(
                    f"a prompt of {len(ids)} tokens does not fit the context of {self.max_positions} "
                    "(with room for one generated token); shorten it or truncate it from the left "
                    "(context policy truncate_left)"
                )
            keep = 1 if self.sp.bos_id is not None and ids[0] == self.sp.bos_id else 0
            ids = ids[:keep] + ids[len(ids) - room + keep :]
            self.truncated += 1
        return ids

    def detok(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids]).strip()

    def batch(self, ids: Sequence[Sequence[int]], device=None):
        return pad_batch(ids, self.pad_id, device)
