"""Prompt/response corpora for decoder-only language models (issue 15): reading, the bundled translation
corpus as a prompt-format task, tokenization with a context policy, and the training collate.

Rows (`datasets.Dataset`, one schema whatever the source): `id` (str), `prompt` (str), `response` (str).
Sources:
  * jsonl files, one object per line, either {"prompt": ..., "response": ...} or a chat
    {"messages": [{"role": ..., "content": ...}, ...]} whose LAST message is the assistant's response; the
    messages before it become the prompt through the tokenizer's chat template (add_generation_prompt).
  * a translation corpus (`load_corpus` schema) turned into prompts, e.g. "English: <src>\\nFrench:" ->
    " <tgt>" (`translation_prompts`), so everything runs offline on the bundled Bible.
Tokenized rows: `ids` (prompt ids + response ids + eos), `n_prompt`, `length` = len(ids). The loss covers the
response tokens and the final eos only (`collate_lm`'s `tgt_out`).

Bad input is never dropped silently: an empty response, a chat without a chat template, a malformed row, or a
row that does not fit the context under `overflow="refuse"` is a LMDataError (a ValueError: one line, the
CLIs exit 2) naming the row; under `overflow="truncate_left"` the prompt loses tokens from the left (after
its BOS), and a row whose response alone does not fit is dropped; both counts are logged and returned.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
from datasets import Dataset

log = logging.getLogger(__name__)

OVERFLOW = ("truncate_left", "refuse")
IGNORE_INDEX = -100  # targets the loss skips (torch.nn.functional.cross_entropy's default ignore_index)
_SHOW = 3  # rows quoted in an error message
LANGUAGE_NAMES = {"en": "English", "fr": "French", "de": "German", "es": "Spanish", "it": "Italian",
                  "pt": "Portuguese", "nl": "Dutch", "ro": "Romanian", "cs": "Czech", "ru": "Russian",
                  "zh": "Chinese", "ja": "Japanese"}


class LMDataError(ValueError):
    """Bad prompt/response data: one line saying which row and what to do."""


class TextTokenizer(Protocol):
    """What this module needs from a tokenizer (our spm Tokenizer and the LM tokenizer wrapper both have it)."""

    def encode(self, text: str) -> list[int]: ...


ChatRenderer = Callable[[list[dict]], str]  # messages -> prompt text ending with the assistant turn's opening


# ---- reading ----
def _where(path: Path, line: int) -> str:
    return f"{path}:{line}"


def _row_from_json(obj: Any, where: str, render_chat: ChatRenderer | None) -> tuple[str, str]:
    if not isinstance(obj, dict):
        raise LMDataError(f"{where}: expected a JSON object with prompt/response or messages, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if (not isinstance(msgs, list) or len(msgs) < 2
                or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                           for m in msgs)):
            raise LMDataError(f"{where}: 'messages' must be a list of at least two {{role, content}} objects")
        if msgs[-1]["role"] != "assistant":
            raise LMDataError(f"{where}: the last message must be the assistant's response "
                              f"(role 'assistant'), got role {msgs[-1]['role']!r}")
        if render_chat is None:
            raise LMDataError(f"{where}: this row is a chat but the tokenizer has no chat template; give the "
                              f"tokenizer one (tokenizer_config.json 'chat_template') or use prompt/response rows")
        return render_chat(msgs[:-1]), msgs[-1]["content"]
    p, r = obj.get("prompt"), obj.get("response")
    if not isinstance(p, str) or not isinstance(r, str):
        raise LMDataError(f"{where}: expected string fields 'prompt' and 'response' (or a chat 'messages' list)")
    return p, r


def read_jsonl(files: str | Path | Sequence[str | Path], render_chat: ChatRenderer | None = None) -> Dataset:
    """jsonl prompt/response or chat files -> Dataset(id, prompt, response). Ids are `<file name>:<line>`."""
    files = [files] if isinstance(files, (str, Path)) else list(files)
    ids, prompts, responses = [], [], []
    for f in map(Path, files):
        if not f.is_file():
            raise LMDataError(f"prompt/response file {f} does not exist")
        with f.open("rb") as fh:
            for n, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                where = _where(f, n)
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise LMDataError(f"{where}: not a JSON line ({e.__class__.__name__}: {e}); fix or remove it") from None
                p, r = _row_from_json(obj, where, render_chat)
                ids.append(str(obj.get("id", f"{f.name}:{n}")))
                prompts.append(p)
                responses.append(r)
    return Dataset.from_dict({"id": ids, "prompt": prompts, "response": responses})


def translation_prompts(ds: Dataset, src_lang: str, tgt_lang: str,
                        template: str = "{src_name}: {src}\n{tgt_name}:") -> Dataset:
    """A translation split (`translation` {src_lang, tgt_lang}, `id`) as prompt/response rows: the template
    filled with the source, the response " <target>" (a leading space, as the text would continue)."""
    names = {"src_name": LANGUAGE_NAMES.get(src_lang, src_lang), "tgt_name": LANGUAGE_NAMES.get(tgt_lang, tgt_lang)}

    def fn(batch):
        pairs = batch["translation"]
        return {"prompt": [template.format(src=p[src_lang], **names) for p in pairs],
                "response": [" " + p[tgt_lang] for p in pairs]}

    return ds.map(fn, batched=True, remove_columns=[c for c in ds.column_names if c != "id"],
                  desc="translation -> prompts")


# ---- tokenization ----
def encode_rows(ds: Dataset, tok: TextTokenizer, *, eos_id: int, bos_id: int | None, max_len: int,
                overflow: str = "truncate_left") -> tuple[Dataset, dict]:
    """Dataset(id, prompt, response) -> Dataset(id, ids, n_prompt, length) and stats {rows, truncated, dropped}.

    ids = [bos] + prompt + response + [eos]; at most `max_len` ids per row. The prompt and the response are
    tokenized separately, so the response ids are exactly what the model is asked to generate after the
    prompt ids (no merge across the boundary)."""
    if overflow not in OVERFLOW:
        raise LMDataError(f"overflow={overflow!r}; expected one of {OVERFLOW}")
    lead = [] if bos_id is None else [int(bos_id)]
    out_ids, n_prompt, truncated, empty, too_long = [], [], [], [], []
    for id_, p, r in zip(ds["id"], ds["prompt"], ds["response"]):
        if not r.strip():
            empty.append(id_)
            continue
        pi, ri = lead + list(tok.encode(p)), list(tok.encode(r)) + [int(eos_id)]
        over = len(pi) + len(ri) - max_len
        if over > 0:
            if overflow == "refuse" or len(ri) + len(lead) + 1 > max_len:  # keep >= 1 prompt token to condition on
                too_long.append((id_, len(pi) + len(ri)))
                continue
            pi = lead + pi[len(lead) + over:]
            truncated.append(id_)
        out_ids.append(pi + ri)
        n_prompt.append(len(pi))
    if empty:
        more = f" (and {len(empty) - _SHOW} more)" if len(empty) > _SHOW else ""
        raise LMDataError(f"{len(empty)} row(s) with an empty response: {', '.join(map(str, empty[:_SHOW]))}{more}; "
                          f"remove them (there is nothing to learn from an empty response)")
    if too_long and overflow == "refuse":
        shown = ", ".join(f"{i} ({n} tokens)" for i, n in too_long[:_SHOW])
        more = f" (and {len(too_long) - _SHOW} more)" if len(too_long) > _SHOW else ""
        raise LMDataError(f"{len(too_long)} row(s) longer than the context of {max_len} tokens: {shown}{more}; "
                          f"raise the context (data.lm.max_len) or set data.lm.overflow=truncate_left")
    if too_long:  # truncate_left, and the response alone does not fit: nothing to condition on, dropped (counted)
        log.warning("%d of %d rows dropped: their responses alone exceed the context of %d tokens (first: %s); "
                    "raise data.lm.max_len to keep them", len(too_long), len(ds), max_len,
                    ", ".join(str(i) for i, _ in too_long[:_SHOW]))
    if truncated:
        log.warning("%d of %d prompts truncated from the left to fit %d tokens (first: %s)",
                    len(truncated), len(ds), max_len, ", ".join(map(str, truncated[:_SHOW])))
    dropped = {i for i, _ in too_long}
    enc = Dataset.from_dict({"id": [i for i in ds["id"] if i not in dropped], "ids": out_ids, "n_prompt": n_prompt,
                             "length": [len(x) for x in out_ids]})
    return enc, {"rows": len(enc), "truncated": len(truncated), "dropped": len(too_long)}


# ---- batches ----
def collate_lm(rows: Iterable[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows with `ids`, `n_prompt` -> right-padded `inp` [B,T] (ids[:-1], pad_id after the end) and `tgt_out`
    [B,T] (ids[1:]) with IGNORE_INDEX wherever the loss must not look: prompt tokens and padding. T = longest
    row - 1. The training losses take IGNORE_INDEX as their ignore id for LMs, because an LLM's pad id is often
    a real token (Llama pads with eos, whose prediction must count)."""
    rows = list(rows)
    t = max(len(r["ids"]) for r in rows) - 1
    inp = torch.full((len(rows), t), pad_id, dtype=torch.long)
    tgt = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long)
    for b, r in enumerate(rows):
        ids = torch.as_tensor(r["ids"], dtype=torch.long)
        n, p = len(ids) - 1, int(r["n_prompt"])
        inp[b, :n] = ids[:-1]
        tgt[b, p - 1:n] = ids[p:]  # tgt[j] = ids[j+1]: the response starts at ids[n_prompt]
    return {"inp": inp, "tgt_out": tgt}


def prompt_ids(rows: Iterable[dict]) -> list[list[int]]:
    """The prompt part of tokenized rows (what a decoder is given at evaluation / self-distillation)."""
    return [list(r["ids"][: int(r["n_prompt"])]) for r in rows]

