"""Prompt/response data for decoder-only models: records -> token ids with a loss mask on the response.

A record is one of (detected by its keys):
  {"prompt": str, "response": str}              plain text
  {"messages": [{"role", "content"}, ...]}      a chat; the last message is the (assistant) response and the
                                                tokenizer's chat template renders it (no template: refused)
  {"translation": {src: str, tgt: str}}         this project's corpora as a prompt-format translation task:
                                                "English: <src>\nFrench:" -> " <tgt>", so everything runs offline
Token ids = the prompt's (with the tokenizer's own specials, e.g. Llama's BOS) + the response's + EOS (a chat
template writes its own end-of-turn token; EOS is added only where the rendered response does not already end
with it). The loss covers response tokens and that EOS only.

Bad input is never dropped silently: an empty response, a chat without a template or whose template does not
render the prompt as a prefix of the whole chat, a record of no known kind -> LMDataError naming the row. A
record longer than the context: `context_policy="truncate_left"` drops the prompt's oldest tokens (after a
leading BOS) and counts them (`LMEncoder.truncated`, logged once per call of `report()`), `"refuse"` raises.
A response that alone does not fit is always an error (truncating it would teach a cut-off answer).

`collate_lm` batches encoded records for training: `tokens` [B,T] (right-padded with the model's pad sentinel,
-1) and `targets` [B,T] (the next token where the loss applies, else -1: use ignore_index=-1), plus `prompts`
(id lists) for decoding evaluations.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from bpd_train.data.hf_tokenizer import TokenizerError

log = logging.getLogger(__name__)

LANGUAGE_NAMES = {"en": "English", "fr": "French", "de": "German", "es": "Spanish", "it": "Italian",
                  "pt": "Portuguese", "nl": "Dutch", "ro": "Romanian", "cs": "Czech", "ru": "Russian",
                  "zh": "Chinese", "ja": "Japanese"}
CONTEXT_POLICIES = ("truncate_left", "refuse")
IGNORE = -1  # targets without loss; equals LMConfig's pad sentinel


class LMDataError(ValueError):
    """A record or setting the user must fix (one line, naming the row)."""


class ResponseTooLong(LMDataError):
    """A record whose response alone does not fit the context (a translation corpus filters these, counted)."""


def translation_prompt(src_text: str, src_lang: str, tgt_lang: str) -> str:
    """The prompt of the prompt-format translation task ("English: ...\nFrench:"); the response is " <tgt>"."""
    s, t = (LANGUAGE_NAMES.get(x, x) for x in (src_lang, tgt_lang))
    return f"{s}: {src_text.strip()}\n{t}:"


def split_record(record: Mapping[str, Any], tok, src_lang: str | None = None,
                 tgt_lang: str | None = None, where: str = "record") -> tuple[str, str, bool]:
    """A record -> (prompt text, response text, prompt_has_specials). prompt_has_specials: the prompt text
    was rendered by a chat template (so encoding must not add the tokenizer's specials again)."""
    if "messages" in record and record["messages"] is not None:
        msgs = list(record["messages"])
        if not msgs or not isinstance(msgs[-1], Mapping) or not str(msgs[-1].get("content", "")).strip():
            raise LMDataError(f"{where}: the chat's last message (the response) is missing or empty")
        try:
            prompt = tok.render_chat(msgs[:-1], add_generation_prompt=True)
            full = tok.render_chat(msgs, add_generation_prompt=False)
        except TokenizerError as e:
            raise LMDataError(f"{where}: {e}") from None
        if not full.startswith(prompt):
            raise LMDataError(f"{where}: the chat template does not render the conversation so far as a prefix of the "
                              "whole chat; its response cannot be separated for the loss")
        return prompt, full[len(prompt):], True
    if "prompt" in record and "response" in record:
        prompt, response = record["prompt"], record["response"]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise LMDataError(f"{where}: prompt and response must be strings")
        if not response.strip():
            raise LMDataError(f"{where}: the response is empty")
        return prompt, response, False
    if "translation" in record and record["translation"] is not None:
        pair = record["translation"]
        if src_lang is None or tgt_lang is None:
            raise LMDataError(f"{where}: translation records need src_lang and tgt_lang")
        src, tgt = pair.get(src_lang), pair.get(tgt_lang)
        if not src or not str(src).strip() or not tgt or not str(tgt).strip():
            raise LMDataError(f"{where}: the translation pair lacks {src_lang} or {tgt_lang} text")
        return translation_prompt(str(src), src_lang, tgt_lang), " " + str(tgt).strip(), False
    raise LMDataError(f"{where}: a record needs prompt+response, messages, or translation (got keys "
                      f"{sorted(record)})")


def prompt_of(record: Mapping[str, Any], tok, src_lang: str | None = None, tgt_lang: str | None = None,
              where: str = "record") -> tuple[str, bool]:
    """The prompt text of a record that may lack its response (self-distillation prompts), and whether a chat
    template rendered it. A chat ending with an assistant message is prompted with the messages before it."""
    if record.get("messages") is not None:
        msgs = list(record["messages"])
        if msgs and isinstance(msgs[-1], Mapping) and msgs[-1].get("role") == "assistant":
            msgs = msgs[:-1]
        if not msgs:
            raise LMDataError(f"{where}: the chat has no messages before the response")
        try:
            return tok.render_chat(msgs, add_generation_prompt=True), True
        except TokenizerError as e:
            raise LMDataError(f"{where}: {e}") from None
    if record.get("prompt") is not None:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise LMDataError(f"{where}: the prompt is empty")
        return record["prompt"], False
    if record.get("translation") is not None:
        src = record["translation"].get(src_lang) if src_lang else None
        if not src or not str(src).strip():
            raise LMDataError(f"{where}: the translation pair lacks {src_lang} text (set src_lang and tgt_lang)")
        return translation_prompt(str(src), src_lang, tgt_lang), False
    raise LMDataError(f"{where}: a record needs a prompt, messages, or translation (got keys {sorted(record)})")


@dataclass
class LMEncoder:
    """Encodes records for a model's context; counts what truncation removed."""
    tok: Any
    max_positions: int
    context_policy: str = "truncate_left"
    src_lang: str | None = None
    tgt_lang: str | None = None
    truncated: int = 0              # records whose prompt lost tokens
    truncated_tokens: int = 0       # prompt tokens removed in all
    _reported: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.context_policy not in CONTEXT_POLICIES:
            raise LMDataError(f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, got "
                              f"{self.context_policy!r}")
        if self.tok.eos_id is None:
            raise LMDataError("the tokenizer has no eos_token: responses could never end")

    def encode(self, record: Mapping[str, Any], where: str = "record") -> dict[str, list[int]]:
        """-> {"ids": prompt + response + EOS, "prompt_len": n}: the loss covers ids[n:]."""
        prompt, response, rendered = split_record(record, self.tok, self.src_lang, self.tgt_lang, where)
        p = self.tok.encode(prompt, add_special_tokens=not rendered)
        r = self.tok.encode(response, add_special_tokens=False)
        if not r or r[-1] != self.tok.eos_id:
            r = r + [self.tok.eos_id]
        room = self.max_positions - len(r)
        if room < 1:
            raise ResponseTooLong(f"{where}: the response alone ({len(r)} tokens with EOS) does not fit the context "
                              f"of {self.max_positions} with at least one prompt token")
        if len(p) > room:
            if self.context_policy == "refuse":
                raise LMDataError(f"{where}: prompt + response ({len(p) + len(r)} tokens) exceed the context of "
                                  f"{self.max_positions} (context_policy=truncate_left keeps the prompt's end)")
            keep = 1 if p and self.tok.bos_id is not None and p[0] == self.tok.bos_id and not rendered else 0
            cut = len(p) - room
            p = p[:keep] + p[keep + cut:]
            self.truncated += 1
            self.truncated_tokens += cut
        return {"ids": p + r, "prompt_len": len(p)}

    def report(self) -> None:
        """Log what truncation removed since the last report (never silent)."""
        if self.truncated > self._reported:
            log.warning("%d record(s) longer than the context of %d: their prompts were truncated from the left "
                        "(%d tokens removed in all)", self.truncated - self._reported, self.max_positions,
                        self.truncated_tokens)
            self._reported = self.truncated


def collate_lm(batch: Sequence[Mapping[str, Any]], pad_id: int = IGNORE) -> dict[str, Any]:
    """Encoded records -> tokens [B,T] (ids without the last), targets [B,T] (next ids where the loss applies,
    else IGNORE), prompts (id lists, for decoding)."""
    if not batch:
        raise LMDataError("empty batch")
    t = max(len(e["ids"]) for e in batch) - 1
    tokens = torch.full((len(batch), t), pad_id, dtype=torch.long)
    targets = torch.full((len(batch), t), IGNORE, dtype=torch.long)
    for i, e in enumerate(batch):
        ids, n = list(e["ids"]), int(e["prompt_len"])
        tokens[i, :len(ids) - 1] = torch.tensor(ids[:-1])
        targets[i, n - 1:len(ids) - 1] = torch.tensor(ids[n:])   # position j predicts ids[j+1]
    return {"tokens": tokens, "targets": targets, "prompts": [list(e["ids"][:e["prompt_len"]]) for e in batch]}


def load_lm_jsonl(files: Mapping[str, str | Sequence[str]]):
    """{split: path(s)} of JSON-lines records -> datasets.DatasetDict (records as they are; encode them with
    LMEncoder). A file that is missing or holds no records is an LMDataError."""
    from pathlib import Path

    import datasets

    for split, paths in files.items():
        for p in [paths] if isinstance(paths, str) else paths:
            if not Path(p).is_file():
                raise LMDataError(f"{split} split: {p} not found")
    try:
        dd = datasets.load_dataset("json", data_files={k: v for k, v in files.items()})
    except Exception as e:  # datasets raises several types with long texts
        raise LMDataError(f"cannot read the JSON-lines files ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    for split, ds in dd.items():
        if len(ds) == 0:
            raise LMDataError(f"{split} split holds no records")
    return dd
